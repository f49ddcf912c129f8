"""What the bridge counts, in its logs and as Prometheus metrics read at scrape time from the
counts its parts keep (the subscriber's, the chain's, its own), so nothing is counted twice:

    tandem_vllm_bridge_events_total{kind}   batches, duplicates, gaps, replays, replay_timeouts,
                                            malformed, dropped (past the byte budget),
                                            reconnects, reset_<reason> (subscriber.py)
    tandem_vllm_bridge_blocks_total{kind}   stored, removed, cleared and the blocks left out, by
                                            why (chain.py)
    tandem_vllm_bridge_total{kind}          registrations, deregistrations, bad_payloads,
                                            unknown_events, subscriber_failures
    tandem_vllm_bridge_registered           1 while the vLLM server is registered
    tandem_vllm_bridge_mapped_blocks        vLLM blocks held as Tandem hashes now
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vllm_bridge.chain import COUNT_KEYS as CHAIN_KEYS
from vllm_bridge.subscriber import COUNT_KEYS as EVENT_KEYS

log = logging.getLogger(__name__)

Counts = dict[str, dict[str, int]]  # group (events, blocks, bridge) -> kind -> count
BRIDGE_KEYS = ("registrations", "deregistrations", "bad_payloads", "unknown_events",
               "subscriber_failures")
LOG_EVERY_S = 60.0

GROUPS = {
    "events": ("tandem_vllm_bridge_events", "vLLM event batches and what the subscriber did "
               "with them"),
    "blocks": ("tandem_vllm_bridge_blocks", "Blocks published as Tandem hashes, and those left "
               "out, by why"),
    "bridge": ("tandem_vllm_bridge", "Registrations and batches the bridge skipped"),
}


class BridgeCounts:
    """The counts of parts that have ended (`totals`); `read` adds those of the live ones."""

    def __init__(self) -> None:
        self.totals: Counts = {"events": dict.fromkeys(EVENT_KEYS, 0),
                               "blocks": dict.fromkeys(CHAIN_KEYS, 0),
                               "bridge": dict.fromkeys(BRIDGE_KEYS, 0)}
        self._logged: tuple = ()
        self._next_log = 0.0

    def add(self, group: str, counts: dict[str, int]) -> None:
        _add(self.totals[group], counts)

    def read(self, live: dict[str, dict[str, int]]) -> Counts:
        out = {group: dict(values) for group, values in self.totals.items()}
        for group, counts in live.items():
            _add(out[group], counts)
        return out

    def log(self, counts: Counts) -> None:
        """Log what is not zero, once a minute at most and only when it changed."""
        now = time.monotonic()
        if now < self._next_log:
            return
        self._next_log = now + LOG_EVERY_S
        shown = tuple((g, k, v) for g, kinds in counts.items() for k, v in kinds.items() if v)
        if shown != self._logged:
            self._logged = shown
            log.info("vllm bridge counts: %s", ", ".join(f"{g}.{k}={v}" for g, k, v in shown))


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for kind, value in counts.items():
        into[kind] = into.get(kind, 0) + value


class BridgeCollector:
    """A Prometheus collector over `counts()`, `registered()` and `mapped()` of a bridge."""

    def __init__(self, counts: Callable[[], Counts], registered: Callable[[], bool],
                 mapped: Callable[[], int]) -> None:
        self._counts, self._registered, self._mapped = counts, registered, mapped

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        for group, (name, text) in GROUPS.items():
            family = CounterMetricFamily(name, text, labels=["kind"])
            for kind, value in counts.get(group, {}).items():
                family.add_metric([kind], value)
            yield family
        yield GaugeMetricFamily("tandem_vllm_bridge_registered", "1 while the vLLM server is "
                                "registered in Redis", value=int(self._registered()))
        yield GaugeMetricFamily("tandem_vllm_bridge_mapped_blocks", "vLLM blocks held as "
                                "Tandem block hashes now", value=self._mapped())

    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected only when scraped
