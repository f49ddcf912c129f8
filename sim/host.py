"""The simulated machine: a discrete-event `Clock`, a `Host` whose cores are shared by every
running job (processor sharing), and `Thread`s, single-threaded processes on a host."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float | None = None) -> None:
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            if until is not None and t > until:
                heapq.heappush(self._events, (t, 0, fn, args))
                return
            self.now = t
            fn(*args)


class Host:
    """Processor sharing: every running job (single-threaded) progresses at min(1, cores / n)
    while n jobs run; finish times are recomputed whenever a job starts or ends."""

    def __init__(self, clock: Clock, cores: float) -> None:
        self.clock, self.cores = clock, cores
        self._jobs: dict[int, list] = {}  # job id -> [work left (s at full speed), fn, args]
        self._ids = itertools.count()
        self._last = 0.0
        self._version = 0

    def run(self, work_s: float, fn: Callable, *args) -> None:
        self._advance()
        self._jobs[next(self._ids)] = [work_s, fn, args]
        self._schedule()

    def _speed(self) -> float:
        return min(1.0, self.cores / len(self._jobs)) if self._jobs else 1.0

    def _advance(self) -> None:
        done = (self.clock.now - self._last) * self._speed()
        self._last = self.clock.now
        for job in self._jobs.values():
            job[0] -= done

    def _schedule(self) -> None:
        self._version += 1
        if self._jobs:
            left = min(job[0] for job in self._jobs.values())
            self.clock.after(max(left, 0.0) / self._speed(), self._finish, self._version)

    def _finish(self, version: int) -> None:
        if version != self._version:
            return  # superseded: a job started or ended since this was scheduled
        self._advance()
        finished = [k for k, job in self._jobs.items() if job[0] <= 1e-12]
        calls = [self._jobs.pop(k) for k in finished]
        self._schedule()
        for _, fn, args in calls:
            fn(*args)


class Thread:
    """One single-threaded process on a `Host` (the router, the load generator): its jobs run
    one after another, so it never takes more than one core, however much work is queued."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._queue: deque = deque()
        self._busy = False
        self.busy_s = 0.0  # all the work it was given (its CPU time)

    def run(self, work_s: float, fn: Callable, *args) -> None:
        self.busy_s += work_s
        self._queue.append((work_s, fn, args))
        if not self._busy:
            self._next()

    def _next(self) -> None:
        if not self._queue:
            self._busy = False
            return
        self._busy = True
        work_s, fn, args = self._queue.popleft()
        self.host.run(work_s, self._done, fn, args)

    def _done(self, fn: Callable, args: tuple) -> None:
        self._next()
        fn(*args)
