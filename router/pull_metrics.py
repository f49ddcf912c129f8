"""What the router's peer pulls did, learned and exported (docs/contract.md "Observability"): each
pull's bytes and seconds (the puller's side) teach the fabric its (source, destination) locality
pair (router/fabric.py), and count on `/metrics` by that pair; the holder's export teaches what
exports take (router/export_time.py); the prompt tokens a peer held that were computed again anyway
(no pull planned, or the pull fell through) are counted per model.

Locality labels come from workers' registrations, bounded in form (common/locality.py) but not
in number: the first `MAX_PAIR_SERIES` pairs get series of their own, later ones count under
"other", so Redis cannot mint unbounded series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.fabric import Fabric, endpoint
from router.worker_info import WorkerInfo

MAX_PAIR_SERIES = 64
OTHER = "other"


class PullMetrics:
    def __init__(self, registry: CollectorRegistry, fabric: Fabric) -> None:
        self.fabric = fabric
        pair = ["src_locality", "dst_locality"]
        self.tokens = Counter("tandem_router_peer_pulled_tokens", "Prompt tokens pulled from a "
                              "peer's cache, by locality pair", pair, registry=registry)
        self.bytes = Counter("tandem_router_peer_pulled_bytes", "KV bytes pulled from a peer's "
                             "cache, by locality pair", pair, registry=registry)
        self.rate = Gauge("tandem_router_link_bytes_per_second", "KV pull bandwidth learned per "
                          "locality pair (router/fabric.py)", pair, registry=registry)
        self.recomputed = Counter("tandem_router_peer_held_recomputed_tokens", "Prompt tokens "
                                  "computed again that a peer held (no pull planned, or it fell "
                                  "through)", ["model"], registry=registry)
        self._pairs: set[tuple[str, str]] = set()

    def _labels(self, src: str, dst: str) -> tuple[str, str]:
        pair = (src or "unknown", dst or "unknown")
        if pair not in self._pairs and len(self._pairs) >= MAX_PAIR_SERIES:
            return OTHER, OTHER
        self._pairs.add(pair)
        return pair

    def record(self, source: WorkerInfo, puller: WorkerInfo, num_tokens: int, num_bytes: int,
               seconds: float) -> None:
        """One pull from `source` into `puller`, as the puller reported it."""
        if num_tokens <= 0:
            return
        labels = self._learn(source, puller, endpoint(source), endpoint(puller), num_bytes,
                             seconds)
        self.tokens.labels(*labels).inc(num_tokens)
        self.bytes.labels(*labels).inc(num_bytes)

    def transfer(self, prefill: WorkerInfo, decode: WorkerInfo, num_bytes: int,
                 seconds: float) -> None:
        """A disaggregated plan's KV transfer, as the decode worker timed it: a pull like any
        other for the fabric (the policy prices P/D transfers per locality pair too), but not
        a peer pull for the counters. Learned per locality pair only: the policy prices a P/D
        transfer from a prefill locality, and one without a locality by the decode worker's own
        measured rate (router/leg_outcomes.py)."""
        if num_bytes > 0:
            self._learn(prefill, decode, prefill.locality, decode.locality, num_bytes, seconds)

    def _learn(self, src: WorkerInfo, dst: WorkerInfo, src_key: str, dst_key: str,
               num_bytes: int, seconds: float) -> tuple[str, str]:
        link = self.fabric.learn(src_key, dst_key, num_bytes, seconds)
        labels = self._labels(src.locality, dst.locality)
        # A worker pair without localities is learned, but the gauge is by locality pair.
        if link is not None and link.bytes_per_s is not None and labels[0] != OTHER \
                and src.locality and dst.locality:
            self.rate.labels(*labels).set(link.bytes_per_s)
        return labels

    def leg(self, plan, puller: WorkerInfo, model: str, num_tokens: int, num_bytes: int,
            seconds: float, export_s: float = 0.0) -> None:
        """The compute leg of `plan` ran on `puller` and pulled `num_tokens` (0: none) in
        `seconds` (the puller's side), after the holder's export took `export_s`: learn and
        count the pull (the link from the puller's side alone; the export apart:
        router/export_time.py), and the tokens a peer held that it computed
        anyway."""
        if plan.kv_source is not None:
            if export_s > 0:
                self.fabric.export.learn(export_s)
            self.record(plan.kv_source, puller, num_tokens, num_bytes, seconds)
        held = plan.peer_held_blocks * puller.block_size - num_tokens
        if held > 0:
            self.recomputed.labels(model).inc(held)
