"""Admission control: at most `max_running` choices in flight (a request with `n` choices counts
`n`); the rest wait in a bounded queue, interactive before batch (FIFO within a class); a full
queue answers 503 with Retry-After."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from contextlib import asynccontextmanager

from common.errors import APIError

PRIORITIES = {"interactive": 0, "batch": 1}


class Admission:
    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.running = 0  # choices holding a slot
        self._heap: list[tuple[int, int, int, asyncio.Future]] = []  # (rank, order, weight, fut)
        self._order = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._heap)

    @asynccontextmanager
    async def slot(self, priority: str | None, weight: int = 1):
        """Hold `weight` slots (a request's `n`, capped at `max_running`) until the block ends."""
        weight = max(1, min(weight, self.max_running))
        await self._acquire(PRIORITIES.get(priority or "interactive", 0), weight)
        try:
            yield
        finally:
            self._release(weight)

    async def _acquire(self, rank: int, weight: int) -> None:
        if self.running + weight <= self.max_running and not self._heap:
            self.running += weight
            return
        if len(self._heap) >= self.max_queued:
            raise APIError(503, "the router's queue is full", "overloaded", headers={"Retry-After": "1"})
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (rank, next(self._order), weight, fut))
        try:
            await fut  # the releaser counted this waiter's weight in `running` before waking it
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(weight)  # got the slots just as the client left: pass them on
            else:
                self._heap = [e for e in self._heap if e[3] is not fut]
                heapq.heapify(self._heap)
            raise

    def _release(self, weight: int) -> None:
        self.running -= weight
        # The head of the queue goes first (no overtaking by lighter requests: a request with
        # n=8 is not starved by a stream of n=1 ones).
        while self._heap:
            _, _, w, fut = self._heap[0]
            if fut.done():
                heapq.heappop(self._heap)
                continue
            if self.running + w > self.max_running:
                return
            heapq.heappop(self._heap)
            self.running += w
            fut.set_result(None)
