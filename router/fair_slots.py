"""A few slots shared fairly between clients (router/clients.py `client_id` says who a client
is): the router's grammar checks (router/choices.py) run two at a time, and a freed slot goes to
the next client in turn, not to the oldest waiter. One client queueing a hundred checks (grammar
bombs salted past the refusal cache) then delays another client's check by at most one check
per slot, not by its whole queue."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from contextlib import asynccontextmanager


class FairSlots:
    """`capacity` holders at once; waiters are served round robin between clients, FIFO within
    a client. Work-conserving: a client alone may hold every slot."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        # client -> its waiters, oldest first; clients in turn order (the next served first)
        self._waiting: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()

    @property
    def num_waiting(self) -> int:
        return sum(len(line) for line in self._waiting.values())

    @asynccontextmanager
    async def slot(self, client: str):
        await self._acquire(client)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, client: str) -> None:
        if self.held < self.capacity and not self._waiting:
            self.held += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(client, deque()).append(fut)
        self._grant()
        try:
            await fut  # the granter counted this waiter in `held` before waking it
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # got a slot just as its request went: pass it on
            else:
                line = self._waiting.get(client)
                if line is not None and fut in line:
                    line.remove(fut)
                    if not line:
                        del self._waiting[client]
            raise

    def _release(self) -> None:
        self.held -= 1
        self._grant()

    def _grant(self) -> None:
        """While a slot is free: the first client in turn gets it for its oldest waiter, and
        goes to the back of the turn if it has more."""
        while self.held < self.capacity and self._waiting:
            client, line = next(iter(self._waiting.items()))
            fut = line.popleft()
            if line:
                self._waiting.move_to_end(client)
            else:
                del self._waiting[client]
            if not fut.done():
                self.held += 1
                fut.set_result(None)
