"""Background tasks that never die of bad data (docs/contract.md "Contract additions").

A loop over input from peers, Redis or a transport (the lease watcher, worker discovery, the
heartbeat, health probes) hands each failure to `BackgroundErrors.record`: it is logged, counted
in `tandem_background_errors_total{task}`, and the loop goes on with the next item. A loop that
died silently once left a prefill worker's leases unreleased and every pull from it timing out.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)


class BackgroundErrors:
    LOG_EVERY_S = 600.0  # a repeated error (same `key`) is logged this often, counted always

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.counter = Counter("tandem_background_errors", "Bad items and failures that a "
                               "background task skipped", ["task"], registry=registry)
        self._logged: dict[str, float] = {}  # key -> when it was last logged

    def record(self, task: str, error: BaseException | str, key: str | None = None) -> None:
        """Count `error` and log it; with `key`, log it once per `LOG_EVERY_S` (a foreign
        registration refused every refresh logged ~350k lines a day)."""
        self.counter.labels(task).inc()
        if key is not None:
            now = time.monotonic()
            if now - self._logged.get(key, -self.LOG_EVERY_S) < self.LOG_EVERY_S:
                return
            if len(self._logged) > 10_000:  # bounded: keys come from Redis
                self._logged.clear()
            self._logged[key] = now
        if isinstance(error, BaseException):
            log.warning("%s: skipped after %s: %s", task, type(error).__name__, error,
                        exc_info=not isinstance(error, ValueError | KeyError | TypeError))
        else:
            log.warning("%s: skipped: %s", task, error)


def cancelling() -> bool:
    """Whether the running task has been asked to stop. redis-py's asyncio client can swallow a
    cancellation (it returned normally from 26 of 40 in a measurement), so a background loop
    that only waits for CancelledError may never end (a router whose bind failed never
    exited): every loop checks this each round too."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
