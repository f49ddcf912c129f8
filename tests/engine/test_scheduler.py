"""The scheduler's step plans: long prompts are prefilled one after another (short ones still
share a step), and the outputs do not depend on it."""

from engine import LLM, SamplingParams
from engine.scheduler import Scheduler
from tests.engine.scheduling import add, make_scheduler, plan


def scheduler(threshold: int | None, budget: int = 2048) -> Scheduler:
    return make_scheduler(budget=budget, threshold=threshold)


def test_long_prompts_are_prefilled_one_after_another():
    s = scheduler(threshold=512)
    for rid in ("a", "b", "c"):
        add(s, rid, 1000)
    assert plan(s) == {"a": 1000}
    assert plan(s) == {"a": 1, "b": 1000}  # a decodes while b prefills
    assert plan(s) == {"a": 1, "b": 1, "c": 1000}


def test_short_prompts_still_share_a_step_and_pass_a_waiting_long_one():
    s = scheduler(threshold=512)
    add(s, "long1", 1000)
    add(s, "long2", 1000)
    add(s, "short1", 200)
    add(s, "short2", 200)
    # long2 waits for long1; the short prompts behind it are not held up by it.
    assert plan(s) == {"long1": 1000, "short1": 200, "short2": 200}
    assert [q.request_id for q in s.waiting] == ["long2"]
    assert plan(s) == {"long1": 1, "short1": 1, "short2": 1, "long2": 1000}


def test_a_long_prompt_in_chunks_keeps_the_slot_until_done():
    s = scheduler(threshold=512, budget=600)
    add(s, "a", 1500)
    add(s, "b", 700)
    assert plan(s) == {"a": 600}
    assert plan(s) == {"a": 600}  # b (long) waits while a is still prefilling
    assert plan(s) == {"a": 300, "b": 300}  # a's last chunk is short: b may start


def test_without_a_threshold_prompts_share_the_budget():
    s = scheduler(threshold=None)
    for rid in ("a", "b", "c"):
        add(s, rid, 1000)
    assert plan(s) == {"a": 1000, "b": 1000, "c": 48}


def test_outputs_do_not_depend_on_the_prefill_order(tiny_folder):
    prompts = [[(13 * (i + 1) * (j + 3)) % 256 for j in range(60 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one_by_one = LLM(str(tiny_folder), num_blocks=512, block_size=4,
                     long_prefill_token_threshold=32)
    packed = LLM(str(tiny_folder), num_blocks=512, block_size=4, long_prefill_token_threshold=None)
    a = [o.token_ids for o in one_by_one.generate(prompts, params)]
    b = [o.token_ids for o in packed.generate(prompts, params)]
    assert a == b and all(len(t) == 12 for t in a)
