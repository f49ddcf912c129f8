"""Background tasks that never die of bad data (DESIGN.md "Contract additions").

A loop over input from peers, Redis or a transport (the lease watcher, worker discovery, the
heartbeat, health probes) hands each failure to `BackgroundErrors.record`: it is logged, counted
in `tandem_background_errors_total{task}`, and the loop goes on with the next item. A loop that
died silently once left a prefill worker's leases unreleased and every pull from it timing out.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)


class BackgroundErrors:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.counter = Counter("tandem_background_errors", "Bad items and failures that a "
                               "background task skipped", ["task"], registry=registry)

    def record(self, task: str, error: BaseException | str) -> None:
        self.counter.labels(task).inc()
        if isinstance(error, BaseException):
            log.warning("%s: skipped after %s: %s", task, type(error).__name__, error,
                        exc_info=not isinstance(error, ValueError | KeyError | TypeError))
        else:
            log.warning("%s: skipped: %s", task, error)
