"""The fixed costs of a pull, on CPU (issue 30, second pass): polling a transfer or a side-stream
event yields the event loop turn by turn instead of sleeping a millisecond, a handle's staged
slots are checked and converted once, block ids reach the kernels as int64."""

import asyncio
import time

import numpy as np
import pytest
import torch

from kv_transfer import kernels, nixl_agent
from kv_transfer.layout import BlockRangeError
from kv_transfer.nixl_peers import NixlParams, NixlPeer
from kv_transfer.side_stream import SideStream
from kv_transfer.transport import TransferError, TransferTimeout

pytestmark = pytest.mark.serial  # asserts wall-clock bounds: run alone (Makefile)


class FakeAgent:
    """A transfer that is DONE after `checks` status checks (or never, or ends in ERR)."""

    def __init__(self, checks: int, final: str = "DONE") -> None:
        self.left, self.final, self.num_checks = checks, final, 0

    def transfer(self, handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle) -> str:
        self.num_checks += 1
        if self.left is None:
            return "PROC"
        self.left -= 1
        return self.final if self.left <= 0 else "PROC"


async def ticker(counter: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        counter[0] += 1
        await asyncio.sleep(0)


def test_wait_xfer_spins_cooperatively_and_ends_in_time(monkeypatch):
    # A burst so short that the transfer needs many bursts: each one must hand the loop back.
    monkeypatch.setattr(nixl_agent, "BURST_S", 1e-6)

    async def main():
        ticks, stop = [0], asyncio.Event()
        other = asyncio.create_task(ticker(ticks, stop))
        agent = FakeAgent(checks=40)
        t0 = time.perf_counter()
        await nixl_agent.wait_xfer(agent, None, 5.0, 0.05, "read")
        took = time.perf_counter() - t0
        stop.set()
        await other
        return agent.num_checks, ticks[0], took

    checks, ticks, took = asyncio.run(main())
    assert checks == 40
    assert ticks > 0  # the other task ran while the transfer was polled
    assert took < 0.04  # never slept a poll interval (50 ms) inside the spin window


def test_wait_xfer_times_out_and_reports_errors():
    with pytest.raises(TransferTimeout, match="read"):
        asyncio.run(nixl_agent.wait_xfer(FakeAgent(checks=None), None, 0.01, 0.001, "read"))
    with pytest.raises(TransferError, match="state ERR"):
        asyncio.run(nixl_agent.wait_xfer(FakeAgent(checks=3, final="ERR"), None, 1.0,
                                         0.001, "read"))


class FakeEvent:
    def __init__(self, queries: int) -> None:
        self.left = queries

    def query(self) -> bool:
        self.left -= 1
        return self.left <= 0


def test_side_stream_wait_yields_without_sleeping():
    async def main():
        ticks, stop = [0], asyncio.Event()
        other = asyncio.create_task(ticker(ticks, stop))
        t0 = time.perf_counter()
        await SideStream.wait(FakeEvent(20), poll_interval_s=0.05)
        took = time.perf_counter() - t0
        stop.set()
        await other
        return ticks[0], took

    ticks, took = asyncio.run(main())
    assert ticks >= 5 and took < 0.04
    asyncio.run(SideStream.wait(None))  # CPU: nothing to wait for


def peer(staging_num_blocks: int) -> NixlPeer:
    params = NixlParams(agent_metadata="", base_address=0, mem_type="VRAM",
                        staging_num_blocks=staging_num_blocks)
    return NixlPeer("p", params)


def test_staged_slots_checked_once_into_an_int32_array():
    slots = peer(64).check_slots(list(range(8, 24)), 16)
    assert slots.dtype == np.int32 and slots.tolist() == list(range(8, 24))
    assert peer(64).check_slots(np.arange(4), 4).tolist() == [0, 1, 2, 3]
    for bad in ([63, 64], [-1, 0], [2**70, 1]):
        with pytest.raises(BlockRangeError):
            peer(64).check_slots(bad, 2)
    with pytest.raises(ValueError, match="differ in length"):
        peer(64).check_slots([1, 2, 3], 2)


def test_block_ids_reach_the_kernels_as_int64_from_lists_arrays_and_tensors():
    cache = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    for ids in ([5, 0, 3], np.array([5, 0, 3], dtype=np.int32),
                torch.tensor([5, 0, 3], dtype=torch.int32)):
        got = kernels._ids(ids, cache.device)
        assert got.dtype == torch.int64 and got.tolist() == [5, 0, 3]
        out = kernels.gather_blocks(cache, ids)
        assert torch.equal(out, cache[[5, 0, 3]])
