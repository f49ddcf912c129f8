"""`SideStream`: where the transfer layer's own copies run (gather, scatter, host <-> device), and
how the event loop waits for them without blocking.

On a GPU the copies go on a stream of their own, so they neither wait behind nor delay the
engine's step on the default stream. (The blocks they touch are safe to read or write: an
export's blocks were written by a finished prefill and stay pinned under its lease, and a pull's
local blocks belong to a request that does not run until the pull returns.) On a CPU cache the
same calls run the copies synchronously and waiting is free, so one code path serves both.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import torch

SPIN_S = 0.005  # poll between single turns of the event loop this long, then sleep between polls


class SideStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __enter__(self):
        self._ctx = (torch.cuda.stream(self.stream) if self.stream is not None
                     else contextlib.nullcontext())
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    def record(self) -> torch.cuda.Event | None:
        """An event after everything queued on this stream so far (None on CPU: all done)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    @staticmethod
    async def wait(event: torch.cuda.Event | None, poll_interval_s: float = 0.0002) -> None:
        """Until `event` has happened. For the first `SPIN_S` the loop is yielded one turn at a
        time (`sleep(0)`: other tasks and sockets still run) rather than slept: an asyncio sleep
        under a millisecond sleeps a whole one (epoll's timeout is in ms), which cost the TCP
        fallback ~0.9 ms a pull from VRAM (issue 30, H200)."""
        if event is None or event.query():
            return
        spin_until = time.monotonic() + SPIN_S
        while not event.query():
            await asyncio.sleep(0 if time.monotonic() < spin_until else poll_interval_s)
