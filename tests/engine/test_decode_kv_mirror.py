"""The decode rows' KV kept between steps (engine/decode_kv_mirror.py): the engine's tokens with
it equal those without it, through staggered arrivals, shared prefixes, aborts and preemption;
rows are kept only from the step just before, with the same blocks.

Attention reads the same values (bit for bit: the same attention on the same keys), but the decode
rows run in the mirror's order, and a CPU matmul's last bits depend on a row's place in the
batch, as they depend on the batch's size: logprobs agree to float32 rounding."""

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.decode_kv_mirror import DecodeKVMirror
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

BLOCK = 4


def run(folder, mirror_bytes: int, num_blocks: int) -> tuple[dict, LLMEngine]:
    engine = LLMEngine(EngineConfig(str(folder), num_blocks=num_blocks, block_size=BLOCK,
                                    decode_kv_mirror_bytes=mirror_bytes))
    base = [(5 * j + 3) % 250 for j in range(30)]
    arrivals = {3 * i: (f"r{i}", [(11 * (i + 1) * (j + 2)) % 250 for j in range(4 + 7 * i)])
                for i in range(8)}
    arrivals[2] = ("shared-a", base + [1, 2])
    arrivals[7] = ("shared-b", base + [9])
    out: dict = {}
    for step in range(300):
        if step in arrivals:
            rid, prompt = arrivals[step]
            engine.add_request(rid, prompt, SamplingParams(
                temperature=0, max_tokens=10 + len(prompt) % 17, ignore_eos=True, logprobs=1))
        if step == 12:
            engine.abort_request("r1")
        for o in engine.step():
            if o.finished:
                out[o.request_id] = (o.token_ids, [(lp.token_id, lp.logprob)
                                                   for lp in o.logprobs or []])
        if step > max(arrivals) and not engine.has_unfinished():
            break
    assert engine.pool.num_free_blocks == engine.num_blocks
    return out, engine


@pytest.mark.parametrize("num_blocks", [512, 24])  # 24: sequences are preempted and resumed
def test_same_tokens_and_logprobs_as_gathering(tiny_folder, num_blocks):
    want, plain = run(tiny_folder, 0, num_blocks)
    got, engine = run(tiny_folder, 64 << 20, num_blocks)
    assert plain.runner.decode_kv is None
    assert got.keys() == want.keys() and len(got) >= 8
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens
        assert [t for t, _ in got[rid][1]] == [t for t, _ in logprobs]
        assert [lp for _, lp in got[rid][1]] == pytest.approx([lp for _, lp in logprobs],
                                                              abs=1e-5)
    mirror = engine.runner.decode_kv
    assert mirror.num_rows_kept > 3 * mirror.num_rows_gathered > 0
    assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 24)


def seq(rid: str, num_computed: int, blocks: list[int]) -> Sequence:
    s = Sequence(rid, list(range(num_computed + 1)), SamplingParams())
    s.num_computed_tokens, s.block_table = num_computed, blocks
    return s


def mirror(max_bytes: int = 1 << 20) -> DecodeKVMirror:
    return DecodeKVMirror(2, 1, 4, BLOCK, torch.float32, torch.device("cpu"), max_bytes)


def rows(step) -> list[int]:
    return sorted(row for row, _ in step.refresh)


def test_rows_are_kept_from_the_step_just_before_with_the_same_blocks():
    m = mirror()
    a, b, c = seq("a", 5, [7, 8]), seq("b", 2, [3]), seq("c", 9, [1, 2, 4])
    order, step = m.plan([ScheduledSeq(x, 1, True) for x in (a, b, c)])
    assert rows(step) == [0, 1, 2] and [o.seq for o in order] == [a, b, c]
    m.commit()
    for x in (a, b, c):
        x.num_computed_tokens += 1
    b.block_table = [3, 6]  # a new block for its next position: the old one is unchanged
    # The batch in another order: each row keeps its place, none is gathered.
    order, step = m.plan([ScheduledSeq(x, 1, True) for x in (c, b, a)])
    assert [o.seq for o in order] == [a, b, c] and rows(step) == []
    assert step.positions.tolist() == [6, 3, 10]
    m.commit()
    # b leaves; a's blocks change (a resumed elsewhere); c is not advanced (not a decode of
    # one more token): a and c are gathered again, into rows 0 and 1.
    a.num_computed_tokens += 1
    a.block_table = [9, 8]
    order, step = m.plan([ScheduledSeq(x, 1, True) for x in (a, c)])
    assert rows(step) == [0, 1] and [o.seq for o in order] == [a, c]
    m.commit()


def test_a_step_that_did_not_complete_or_skipped_keeps_nothing():
    m = mirror()
    a = seq("a", 5, [7, 8])
    m.plan([ScheduledSeq(a, 1, True)])  # no commit: the step failed
    a.num_computed_tokens += 1
    _, step = m.plan([ScheduledSeq(a, 1, True)])
    assert rows(step) == [0]
    m.commit()
    a.num_computed_tokens += 1
    assert m.plan([]) == ([], None)  # a step without decodes: a is not a decode row of it
    m.commit()
    _, step = m.plan([ScheduledSeq(a, 1, True)])
    assert rows(step) == [0]
    # A new sequence object under the same id and counts is not the kept row.
    m.commit()
    twin = seq("a", a.num_computed_tokens + 1, list(a.block_table))
    _, step = m.plan([ScheduledSeq(twin, 1, True)])
    assert rows(step) == [0]


def test_past_its_budget_the_mirror_steps_aside():
    per_token = 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, 1 head of 4 floats
    m = mirror(max_bytes=per_token * 16)
    small = [ScheduledSeq(seq("a", 10, [1, 2, 3]), 1, True)]
    _, step = m.plan(small)
    assert step is not None and m.num_bytes <= per_token * 16
    big = [ScheduledSeq(seq(f"b{i}", 10, [1, 2, 3]), 1, True) for i in range(2)]
    order, step = m.plan(big)
    assert step is None and order == big


def test_buffers_grow_by_doubling_and_up_to_the_budget():
    per_key_row = 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, 1 head of 4 floats
    m = mirror(max_bytes=per_key_row * 8 * 610)
    shapes = []
    for n in range(1, 8):  # one more row each step
        m.plan([ScheduledSeq(seq(f"s{i}", 10, [1, 2, 3]), 1, True) for i in range(n)])
        shapes.append(tuple(m.k.shape[1::2]))  # (rows, keys)
    assert shapes == [(1, 256), (2, 256), (4, 256), (4, 256), (8, 256), (8, 256), (8, 256)]
    # 8 rows of 1024 keys would pass the budget: the keys grow to what it allows (610 keys,
    # 608 in whole blocks), not to exactly what this step needs (544).
    m.plan([ScheduledSeq(seq(f"s{i}", 540, list(range(136))), 1, True) for i in range(8)])
    assert tuple(m.k.shape[1::2]) == (8, 608) and m.num_bytes <= m.max_bytes
