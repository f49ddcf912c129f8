"""Admission control: at most `max_running` choices in flight (a request with `n` choices counts
`n`), and at most `max_per_client` of one client's; the rest wait in a bounded queue,
interactive before batch, then fairly between clients (router/clients.py says who a client is);
a full queue answers 503 with Retry-After."""

from __future__ import annotations

import asyncio
import itertools
from contextlib import asynccontextmanager

from common.errors import APIError

PRIORITIES = {"interactive": 0, "batch": 1}


class Admission:
    """`max_running` choices at once; `max_per_client` (None: no limit) of one client's. A
    freed slot goes to the waiting request of the best class whose client runs the fewest
    choices (fair queuing: a client that queued a hundred requests does not make another's one
    wait behind them all), FIFO among equals."""

    def __init__(self, max_running: int, max_queued: int,
                 max_per_client: int | None = None) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_per_client = max_per_client
        self.running = 0  # choices holding a slot
        self._by_client: dict[str, int] = {}  # client -> choices holding a slot (none at 0)
        # (rank, order, weight, client, fut)
        self._waiting: list[tuple[int, int, int, str, asyncio.Future]] = []
        self._order = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @asynccontextmanager
    async def slot(self, priority: str | None, weight: int = 1, client: str = ""):
        """Hold `weight` slots (a request's `n`, capped at `max_running` and `max_per_client`)
        for `client` until the block ends."""
        weight = max(1, min(weight, self.max_running, self.max_per_client or weight))
        await self._acquire(PRIORITIES.get(priority or "interactive", 0), weight, client)
        try:
            yield
        finally:
            self._release(weight, client)

    def _fits(self, weight: int, client: str) -> bool:
        return self.running + weight <= self.max_running and (
            self.max_per_client is None
            or self._by_client.get(client, 0) + weight <= self.max_per_client)

    def _take(self, weight: int, client: str) -> None:
        self.running += weight
        self._by_client[client] = self._by_client.get(client, 0) + weight

    async def _acquire(self, rank: int, weight: int, client: str) -> None:
        if not self._waiting and self._fits(weight, client):
            self._take(weight, client)
            return
        if len(self._waiting) >= self.max_queued:
            raise APIError(503, "the router's queue is full", "overloaded",
                           headers={"Retry-After": "1"})
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((rank, next(self._order), weight, client, fut))
        self._grant()  # a client under its share may go ahead of others' waiters
        try:
            await fut  # the granter counted this waiter's weight before waking it
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(weight, client)  # got the slots just as the client left: pass them on
            else:
                self._waiting = [e for e in self._waiting if e[4] is not fut]
            raise

    def _release(self, weight: int, client: str) -> None:
        self.running -= weight
        left = self._by_client.get(client, 0) - weight
        if left > 0:
            self._by_client[client] = left
        else:
            self._by_client.pop(client, None)
        self._grant()

    def _grant(self) -> None:
        """Wake waiters while the best one fits. The best: lowest class, then the client with
        the fewest running choices, then the oldest; waiters of clients at their own limit are
        passed over (they wait for their own client's slots). The best one that does not fit
        stops the round: no lighter request overtakes it, so an n=8 request is not starved."""
        self._waiting = [e for e in self._waiting if not e[4].done()]
        while self._waiting:
            eligible = [e for e in self._waiting if self.max_per_client is None
                        or self._by_client.get(e[3], 0) + e[2] <= self.max_per_client]
            if not eligible:
                return
            best = min(eligible, key=lambda e: (e[0], self._by_client.get(e[3], 0), e[1]))
            _, _, weight, client, fut = best
            if self.running + weight > self.max_running:
                return
            self._waiting.remove(best)
            self._take(weight, client)
            fut.set_result(None)
