"""A peer prefix pull's engine calls (`MID_STEP_METHODS`: pin, reserve, commit) run while a step's
model forward runs, instead of waiting for the step to end (a long prefill step takes seconds on
a CPU, and a pull from a busy holder used to wait for it). Both engine clients are driven with a
forward held open on a gate, so "during the step" is certain, not a matter of timing: the pin and
the reservation answer while the gate is shut, and the step's request still gets the tokens of
an undisturbed run, with every block back in the pool afterwards."""

import asyncio
import threading
from multiprocessing import Pipe

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_core import EngineCoreLoop
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
HELD = [(7 * j) % 200 + 3 for j in range(40)]  # computed first: its blocks are cached
STEPPING = [(11 * j) % 190 + 5 for j in range(50)]  # in the step held open
PULLED = [(13 * j) % 180 + 9 for j in range(24)]  # blocks a pull would fill
WAIT_S = 30.0  # far beyond a call that does not wait for the step; the gate never opens alone


class Gate:
    """Holds the engine's next forward open until `open()`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()
        self.armed = False
        execute = engine.runner.execute

        def gated(*args, **kwargs):
            if self.armed:
                self.armed = False
                self.entered.set()
                assert self.opened.wait(WAIT_S), "the gate was never opened"
            return execute(*args, **kwargs)

        engine.runner.execute = gated

    def open(self) -> None:
        self.opened.set()


def engine(folder) -> LLMEngine:
    return LLMEngine(EngineConfig(str(folder), num_blocks=128, block_size=BLOCK))


def alone(folder, prompt: list[int]) -> list[int]:
    e = engine(folder)
    e.add_request("alone", prompt, GREEDY)
    tokens: list[int] = []
    while e.has_unfinished():
        for o in e.step():
            tokens.extend(o.new_token_ids)
    return tokens


def test_the_in_process_engine_pins_and_reserves_during_a_step(tiny_folder):
    want = alone(tiny_folder, STEPPING)
    e = engine(tiny_folder)
    held = e.hasher(HELD)

    async def main():
        client = AsyncEngine(e)
        await client.start()
        try:
            await collect(client, "held", HELD)
            gate = Gate(e)
            gate.armed = True
            stepping = asyncio.create_task(collect(client, "stepping", STEPPING))
            assert await asyncio.to_thread(gate.entered.wait, WAIT_S)
            # The forward is held open: these answer without the step ending.
            pinned = await asyncio.wait_for(client.call("pin_prefix", "lease", held), WAIT_S)
            num_here, fresh = await asyncio.wait_for(
                client.call("reserve_prefix", "pull", e.hasher(PULLED)), WAIT_S)
            assert not stepping.done()
            assert pinned == e.pool.lookup(held) and len(pinned) == len(held)
            assert num_here == 0 and len(fresh) == len(PULLED) // BLOCK
            assert await asyncio.wait_for(client.call("commit_prefix", "pull", 0), WAIT_S) == 0
            gate.open()
            assert await stepping == want
            assert await client.call("release", "lease")
        finally:
            await client.stop()

    asyncio.run(main())
    assert e.pool.num_free_blocks == e.num_blocks


async def collect(client: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    stream = client.open_stream(rid)
    await client.call("add_request", rid, prompt, GREEDY)
    return [t async for o in client.outputs(rid, stream) for t in o.new_token_ids]


def test_the_engine_core_process_loop_pins_and_reserves_during_a_step(tiny_folder):
    want = alone(tiny_folder, STEPPING)
    e = engine(tiny_folder)
    held = e.hasher(HELD)
    ours, theirs = Pipe()
    loop = threading.Thread(target=EngineCoreLoop(e, theirs).run, daemon=True)
    loop.start()
    try:
        tokens = core_request(ours, "held", HELD)
        assert len(tokens) == GREEDY.max_tokens
        gate = Gate(e)
        gate.armed = True
        ours.send(("call", 2, "add_request", ("stepping", STEPPING, GREEDY)))
        assert gate.entered.wait(WAIT_S)
        ours.send(("call", 3, "pin_prefix", ("lease", held)))
        ours.send(("call", 4, "reserve_prefix", ("pull", e.hasher(PULLED))))
        ours.send(("call", 5, "commit_prefix", ("pull", 0)))
        results = {}
        while len(results) < 4:  # the add's answer, then the three pull calls, gate shut
            assert ours.poll(WAIT_S), "a mid-step call waited for the step"
            msg = ours.recv()
            if msg[0] == "result":
                assert msg[2], msg[3]
                results[msg[1]] = msg[3]
            else:
                assert msg[0] == "step" and not msg[1], "the held step produced output"
        assert results[3] == e.pool.lookup(held) and len(results[3]) == len(held)
        assert results[4][0] == 0 and len(results[4][1]) == len(PULLED) // BLOCK
        assert results[5] == 0
        gate.open()
        assert read_tokens(ours, "stepping") == want
        ours.send(("post", "release", ("lease",)))
    finally:
        ours.send(None)
        loop.join(WAIT_S)
        ours.close()  # the reader thread's recv ends
    assert not loop.is_alive()
    assert e.pool.num_free_blocks == e.num_blocks


def core_request(conn, rid: str, prompt: list[int]) -> list[int]:
    conn.send(("call", 1, "add_request", (rid, prompt, GREEDY)))
    return read_tokens(conn, rid)


def read_tokens(conn, rid: str) -> list[int]:
    tokens: list[int] = []
    while True:
        assert conn.poll(WAIT_S)
        msg = conn.recv()
        if msg[0] == "result":
            assert msg[2], msg[3]
            continue
        assert msg[0] == "step", msg
        for o in msg[1]:
            if o.request_id == rid:
                tokens.extend(o.new_token_ids)
                if o.finished:
                    return tokens


@pytest.fixture(autouse=True)
def _no_leftover_threads():
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before and t.name == "engine"]
    assert not left, left
