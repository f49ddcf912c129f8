"""Parking (engine/scheduler.py, engine/output_stream.py): a request whose reader is behind
leaves the batch, keeps its blocks until blocks run short, resumes with the tokens it would have
had, and is aborted when parked too long."""

import asyncio

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.core_client import ProcessEngine
from engine.output import RequestOutput
from engine.output_stream import OutputStream
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from tests.engine.scheduling import BLOCK, make_scheduler, plan
from tests.engine.scheduling import add as add_sequence

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = {"a": [5, 9, 13, 17, 21, 25], "b": [7, 11, 19, 23, 29], "c": [3, 6, 12, 24, 48, 96, 192]}


# ---- the scheduler -----------------------------------------------------------------------------


def scheduler(num_blocks: int = 256, max_num_seqs: int = 16) -> Scheduler:
    return make_scheduler(num_blocks, max_num_seqs)


def add(s: Scheduler, rid: str, num_tokens: int) -> Sequence:
    return add_sequence(s, rid, num_tokens, max_tokens=64)


def test_a_parked_sequence_is_not_scheduled_and_keeps_its_blocks():
    s = scheduler()
    a = add(s, "a", 10)
    add(s, "b", 6)
    assert plan(s) == {"a": 10, "b": 6}
    blocks = list(a.block_table)
    assert s.park(a) and a.status is SequenceStatus.PARKED
    assert not s.park(a)  # parked already
    assert plan(s) == {"b": 1} and plan(s) == {"b": 1}
    assert a.block_table == blocks
    assert s.stats()["parked"] == 1 and s.stats()["running"] == 1
    assert s.unpark(a) and not s.unpark(a)
    assert plan(s) == {"b": 1, "a": 1}  # back with its blocks: only its last token is computed
    assert a.block_table[:len(blocks)] == blocks and a.num_preemptions == 0


def test_nothing_parked_is_work():
    s = scheduler()
    a = add(s, "a", 5)
    plan(s)
    s.park(a)
    assert not s.has_work()  # the engine's loop sleeps instead of stepping an empty batch
    s.remove(a)  # an abort while parked
    assert s.parked == [] and not s.unpark(a)


def test_blocks_short_take_the_parked_blocks_before_preempting():
    s = scheduler(num_blocks=8)
    a, b = add(s, "a", 15), add(s, "b", 11)  # 4 + 3 of 8 blocks
    plan(s)
    s.park(a)
    c = add(s, "c", 12)  # needs 3 blocks, 1 is free: a's are taken, nothing running is preempted
    assert plan(s) == {"b": 1, "c": 12}
    assert a.block_table == [] and a.num_computed_tokens == 0 and s.num_preemptions == 1
    assert b.num_preemptions == 0 and c.status is SequenceStatus.RUNNING
    s.remove(b)
    s.kv.free(b)
    s.unpark(a)
    assert plan(s) == {"c": 1, "a": 16}  # recomputed from the start (prompt + its token)


def test_a_resumed_sequence_waits_for_a_free_slot():
    s = scheduler(max_num_seqs=1)
    a = add(s, "a", 5)
    plan(s)
    s.park(a)
    b = add(s, "b", 5)
    assert plan(s) == {"b": 5}
    s.unpark(a)
    assert plan(s) == {"b": 1}  # the batch is full: a waits in front of the queue
    assert s.waiting[0] is a
    s.remove(b)
    assert plan(s) == {"a": 1}


# ---- the engine: same tokens ---------------------------------------------------------------------


def engine(folder, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(str(folder), num_blocks=kw.pop("num_blocks", 256),
                                  block_size=BLOCK, **kw))


def run(e: LLMEngine,
        park: dict[int, list[tuple[str, bool]]] | None = None) -> dict[str, list[int]]:
    """Every request's tokens; `park[k]`: (request, parked) changes before step k."""
    for rid, prompt in PROMPTS.items():
        e.add_request(rid, prompt, GREEDY)
    out: dict[str, list[int]] = {}
    for k in range(400):
        for rid, parked in (park or {}).get(k, []):
            assert e.park_request(rid, parked)
        for o in e.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not e.has_unfinished() and k >= max(park or {0: 0}):
            break
    assert e.pool.num_free_blocks == e.num_blocks  # every block back
    return out


def test_parked_and_resumed_requests_get_the_tokens_of_an_unparked_run(tiny_folder):
    want = run(engine(tiny_folder))
    e = engine(tiny_folder)
    got = run(e, {3: [("a", True)], 5: [("b", True)], 12: [("a", False)], 30: [("b", False)]})
    assert got == want and all(len(t) == 24 for t in got.values())


def test_a_parked_request_whose_blocks_were_taken_is_recomputed_to_the_same_tokens(tiny_folder):
    want = run(engine(tiny_folder, num_blocks=64))
    e = engine(tiny_folder, num_blocks=16)  # three requests of 30 tokens do not fit side by side
    got = run(e, {4: [("a", True)], 60: [("a", False)]})
    assert got == want
    assert e.scheduler.num_preemptions >= 1


def test_parking_while_a_step_is_in_flight(tiny_folder):
    want = run(engine(tiny_folder))
    e = engine(tiny_folder, async_scheduling=True)
    got = run(e, {4: [("a", True), ("c", True)], 9: [("a", False)], 20: [("c", False)]})
    assert got == want and e.pipeline.num_overlapped_steps > 0


def test_an_abort_while_parked_frees_the_blocks(tiny_folder):
    e = engine(tiny_folder)
    e.add_request("a", PROMPTS["a"], GREEDY)
    e.step()
    assert e.park_request("a") and e.stats()["parked"] == 1
    assert not e.park_request("unknown")
    assert e.abort_request("a").finish_reason == "abort"
    assert e.stats()["parked"] == 0 and e.pool.num_free_blocks == e.num_blocks


# ---- the output stream -------------------------------------------------------------------------


def output(n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [1], list(range(n)), [n], "", "length" if finished else None, None,
                         0, None)


def test_the_stream_parks_past_the_bound_and_resumes_at_half():
    async def main():
        posted = []
        s = OutputStream("r", lambda *a: posted.append(a), max_unread_tokens=4, parked_timeout_s=60)
        for i in range(5):
            s.put(output(i + 1))
        assert posted == [("park_request", "r", True)] and s.parked
        s.put(output(6))  # one more in flight: parked once
        for _ in range(3):
            await s.get()
        assert posted == [("park_request", "r", True)]  # 3 unread: more than half
        await s.get()
        assert posted[-1] == ("park_request", "r", False) and not s.parked
        s.close()

    asyncio.run(main())


def test_a_stream_parked_too_long_is_aborted_and_ended():
    async def main():
        posted = []
        s = OutputStream("r", lambda *a: posted.append(a), max_unread_tokens=2,
                         parked_timeout_s=0.05)
        for i in range(3):
            s.put(output(i + 1))
        while posted[-1][0] != "abort_request":
            await asyncio.sleep(0.01)
        got = [await s.get() for _ in range(4)]
        assert [o.finish_reason for o in got] == [None, None, None, "abort"]
        assert got[-1].token_ids == [0, 1, 2] and got[-1].new_token_ids == []
        s.put(output(4, finished=True))  # what the engine had in flight is dropped
        assert s.queue.empty()

    asyncio.run(main())


def test_an_unbounded_stream_never_parks():
    posted = []
    s = OutputStream("r", lambda *a: posted.append(a), max_unread_tokens=None, parked_timeout_s=1)
    for i in range(100):
        s.put(output(i + 1))
    assert posted == [] and s.num_unread_tokens == 100


def reference(folder, prompt: list[int], params: SamplingParams) -> list[int]:
    e = engine(folder)
    e.add_request("r", prompt, params)
    tokens = []
    while e.has_unfinished():
        tokens += [t for o in e.step() for t in o.new_token_ids]
    return tokens


@pytest.mark.parametrize("kind,reads_again", [("thread", True), ("thread", False),
                                               ("process", True)])
def test_a_reader_that_stops_parks_its_request(tiny_folder, kind, reads_again):
    """The async engines: the reader takes 3 outputs and stops; the request leaves the batch and
    the engine goes idle. Reading again resumes it to the tokens of an unparked run; never
    reading again, it is aborted after the timeout with its blocks freed."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    want = reference(tiny_folder, PROMPTS["a"], params)
    config = EngineConfig(str(tiny_folder), num_blocks=256, block_size=BLOCK, max_unread_tokens=4,
                          parked_timeout_s=60 if reads_again else 0.5)

    async def main():
        e = AsyncEngine(LLMEngine(config)) if kind == "thread" else ProcessEngine(config)
        await e.start()
        try:
            outs = e.generate("a", PROMPTS["a"], params)
            tokens = [t for _ in range(3) for t in (await anext(outs)).new_token_ids]
            async with asyncio.timeout(60):
                while e.stats()["parked"] == 0:
                    await asyncio.sleep(0.01)
            assert e.stats()["running"] == 0 and e.stats()["waiting"] == 0
            if kind == "thread":
                seq = e.engine.requests["a"]
                produced = len(seq.output_token_ids)
                assert produced < 200
                await asyncio.sleep(0.2)
                assert len(seq.output_token_ids) == produced  # parked: no step computes it
            if not reads_again:
                async with asyncio.timeout(60):
                    while e.stats()["free_blocks"] != 256:
                        await asyncio.sleep(0.05)
                rest = [o async for o in outs]
                assert rest[-1].finish_reason == "abort" and e.stats()["parked"] == 0
                tokens += [t for o in rest for t in o.new_token_ids]
                assert 3 <= len(tokens) < 200 and tokens == want[:len(tokens)]
                return
            async for o in outs:
                tokens.extend(o.new_token_ids)
            assert tokens == want and e.stats()["parked"] == 0
        finally:
            await e.stop()

    asyncio.run(main())
