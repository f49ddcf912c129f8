"""Admission control: at most `max_running` requests in flight; the rest wait in a bounded queue,
interactive before batch (FIFO within a class); a full queue answers 503 with Retry-After."""

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
        self.running = 0
        self._heap: list[tuple[int, int, asyncio.Future]] = []
        self._order = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._heap)

    @asynccontextmanager
    async def slot(self, priority: str | None):
        await self._acquire(PRIORITIES.get(priority or "interactive", 0))
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, rank: int) -> None:
        if self.running < self.max_running and not self._heap:
            self.running += 1
            return
        if len(self._heap) >= self.max_queued:
            raise APIError(503, "the router's queue is full", "overloaded", headers={"Retry-After": "1"})
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (rank, next(self._order), fut))
        try:
            await fut  # the releaser hands its slot over (running stays counted)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # got the slot just as the client left: pass it on
            else:
                self._heap = [e for e in self._heap if e[2] is not fut]
                heapq.heapify(self._heap)
            raise

    def _release(self) -> None:
        while self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1
