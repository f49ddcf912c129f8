"""Grammar masks computed on a helper thread, waited for with a real deadline.

A mask is llguidance's work in Rust (it releases the GIL); its cost is bounded by llguidance's
fuel limits (common/structured.py `parser_limits`), but fuel is work, not time: how long a
mask takes still depends on the machine and its load. Checking the time after the mask returned
(as the engine once did) let a slow mask hold the engine thread, and every request on it, for
as long as it took. Here the engine thread waits for each row at most `deadline_s`: a row whose
mask is not done by then is given up (the caller fails it), the helper that is still computing
it is left to finish on its own (the fuel limits end it) and a fresh helper computes the rows
after it. The step never waits longer than the deadline for one row.

One job per step, rows in order, and the engine thread wakes once when they are all done (or at
a deadline), so an ordinary step costs one hand-off between threads.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class _Job:
    """One step's rows, computed in order into `out` by one helper thread."""

    def __init__(self, matchers: list, width: int) -> None:
        self.matchers = matchers
        self.out = np.empty((len(matchers), width), dtype=np.int32)
        self.cond = threading.Condition()
        self.done = 0  # rows finished
        self.row_started = time.perf_counter()  # when the row in progress started
        self.abandoned = False  # the engine gave up on the row in progress
        self.failed: list[int] = []  # rows whose mask raised

    def run(self) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        for j, matcher in enumerate(self.matchers):
            try:
                if not matcher.is_error():
                    fill_next_token_bitmask(matcher, self.out, j)
            except Exception:  # noqa: BLE001 - that row fails; the step goes on
                self.failed.append(j)
            with self.cond:
                if self.abandoned:
                    return  # the rows after this one went to a fresh helper
                self.done = j + 1
                self.row_started = time.perf_counter()
                if self.done == len(self.matchers):
                    self.cond.notify()


class MaskWorker:
    """Computes a step's masks on a helper thread; `fill` waits at most `deadline_s` a row.
    Used by one thread (the engine's) at a time."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._helper: ThreadPoolExecutor | None = None
        self.num_abandoned = 0  # helpers left computing a row past its deadline

    def fill(self, matchers: list, bits: np.ndarray) -> list[int]:
        """Row j of `bits` gets `matchers[j]`'s mask (rows whose matcher is in error are left
        as they were); the rows given up at their deadline, or whose mask raised (left as they
        were too)."""
        given_up: list[int] = []
        start = 0
        while start < len(matchers):
            job = _Job(matchers[start:], bits.shape[1])
            self._executor().submit(job.run)
            with job.cond:
                finished = self._wait(job)
            n = job.done
            bits[start:start + n] = job.out[:n]
            given_up += [start + j for j in job.failed if j < n]
            start += n
            if not finished:  # row `start` ran past its deadline: given up, the rest go on
                given_up.append(start)
                start += 1
                self._abandon()
        return given_up

    def _wait(self, job: _Job) -> bool:
        """Under `job.cond`: until every row is done (True), or the row in progress has run
        `deadline_s` (False: the job is abandoned)."""
        while job.done < len(job.matchers):
            left = job.row_started + self.deadline_s - time.perf_counter()
            if left <= 0:
                job.abandoned = True
                return False
            job.cond.wait(left)
        return True

    def _executor(self) -> ThreadPoolExecutor:
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._helper

    def _abandon(self) -> None:
        """The helper is busy with a row given up: it ends after that row; a fresh one takes
        the next job."""
        if self._helper is not None:
            self._helper.shutdown(wait=False)
            self._helper = None
        self.num_abandoned += 1

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=False)
            self._helper = None
