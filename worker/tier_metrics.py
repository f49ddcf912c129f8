"""Prometheus metrics of a worker's KV tiers (engine/kv_tiers.py), from the running totals in the
engine's `stats()["kv_tiers"]` (docs/contract.md "Observability"):

    tandem_worker_kv_tier_hit_blocks_total{medium}        found below the device at admission
    tandem_worker_kv_tier_offload_blocks_total{medium}    copied into the tier (and _bytes_total,
                                                          _seconds_total)
    tandem_worker_kv_tier_reload_blocks_total{medium}     copied from the tier into device blocks
                                                          (and _bytes_total, _seconds_total)
    tandem_worker_kv_tier_dropped_offloads_total{medium}  copies into the tier given up
    tandem_worker_kv_tier_files_rejected_total{reason}    disk files deleted unserved
    tandem_worker_kv_tier_blocks{medium}, _bytes{medium}  what the tier holds now
    tandem_worker_kv_tier_disk_stopped                    1 once the disk tier stopped writing
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

_COUNTED = ("hit_blocks", "offload_blocks", "offload_bytes", "offload_seconds", "reload_blocks",
            "reload_bytes", "reload_seconds", "dropped_offloads")
_HELP = {
    "hit_blocks": "Blocks of a prompt's prefix found in the tier at admission",
    "offload_blocks": "Blocks copied into the tier",
    "offload_bytes": "Bytes copied into the tier",
    "offload_seconds": "Seconds spent copying blocks into the tier",
    "reload_blocks": "Blocks copied from the tier into device blocks",
    "reload_bytes": "Bytes copied from the tier into device blocks",
    "reload_seconds": "Seconds spent reloading blocks from the tier",
    "dropped_offloads": "Copies into the tier given up (block reused first, disk full or failing)",
}
MEDIA = ("host", "disk")


class TierMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.counters = {name: Counter(f"tandem_worker_kv_tier_{name}", _HELP[name], ["medium"],
                                       registry=r) for name in _COUNTED}
        self.rejected = Counter("tandem_worker_kv_tier_files_rejected", "Disk tier files "
                                "deleted unserved (corrupt, truncated, foreign, stale)",
                                ["reason"], registry=r)
        self.blocks = Gauge("tandem_worker_kv_tier_blocks", "Blocks the tier holds", ["medium"],
                            registry=r)
        self.bytes = Gauge("tandem_worker_kv_tier_bytes", "Bytes the tier holds", ["medium"],
                           registry=r)
        self.disk_stopped = Gauge("tandem_worker_kv_tier_disk_stopped", "1 once the disk tier "
                                  "stopped writing (disk full or failing)", registry=r)
        self._last: dict[tuple[str, str], float] = {}

    def sample(self, tiers: dict | None) -> None:
        """Counters moved on by the engine's running totals, gauges set; no tiers: nothing."""
        if not tiers:
            return
        for medium in MEDIA:
            figures = tiers.get(medium) or {}
            for name in _COUNTED:
                self._advance(self.counters[name].labels(medium), (medium, name),
                              figures.get(name, 0))
            if "blocks" in figures:
                self.blocks.labels(medium).set(figures["blocks"])
                self.bytes.labels(medium).set(figures.get("bytes", 0))
        for reason, num in (tiers.get("files_rejected") or {}).items():
            self._advance(self.rejected.labels(reason), ("rejected", reason), num)
        self.disk_stopped.set((tiers.get("disk") or {}).get("stopped", 0))

    def _advance(self, counter, key: tuple[str, str], total: float) -> None:
        last = self._last.get(key, 0)
        if total > last:
            counter.inc(total - last)
            self._last[key] = total
