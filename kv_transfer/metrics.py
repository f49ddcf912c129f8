"""Prometheus metrics of KV transfer (docs/contract.md "Observability"), on a registry the service
owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes = Counter("tandem_kv_transfer_bytes", "KV bytes pulled from peers",
                             ["transport"], registry=registry)
        self.blocks = Counter("tandem_kv_transfer_blocks", "KV blocks pulled from peers",
                              ["transport"], registry=registry)
        self.seconds = Histogram("tandem_kv_transfer_seconds", "Time of one KV pull",
                                 ["transport"], buckets=_SECONDS_BUCKETS, registry=registry)
        self.failures = Counter("tandem_kv_transfer_failures", "Failed KV pulls",
                                ["transport", "reason"], registry=registry)
        self.leases = Counter("tandem_kv_leases", "Export leases by outcome",
                              ["outcome"], registry=registry)
        self.leased_blocks = Gauge("tandem_kv_leased_blocks", "Blocks pinned for export now",
                                   registry=registry)
        self.staging_slots = Gauge("tandem_kv_staging_slots", "Staging slots holding gathered "
                                   "exports now", registry=registry)
        self.plans = Counter("tandem_kv_pull_plans", "KV pulls by how they moved their blocks "
                             "(direct, staged_source, staged_local, staged_both)", ["plan"],
                             registry=registry)
