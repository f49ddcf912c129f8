"""What the KV tiers count (engine/kv_tiers.py): per tier, blocks found, offloaded and reloaded
with their bytes and seconds, offloads dropped; and the measured reload rate of each tier (an
EWMA over real reloads, None until one happened), which the worker reports in its load so the
router can price a hit in that tier against recomputing it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.disk_tier import DiskTier
    from engine.host_tier import HostTier

MEDIA = ("host", "disk")
_EWMA_WEIGHT = 0.2  # of the newest reload


@dataclass
class TierCounters:
    hit_blocks: int = 0  # found at admission, past the device prefix
    offload_blocks: int = 0  # copied into this tier (host: from the device; disk: from host)
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    reload_blocks: int = 0  # copied from this tier into device blocks
    reload_bytes: int = 0
    reload_seconds: float = 0.0
    dropped_offloads: int = 0  # offloads into this tier given up (evicted first, full, error)


@dataclass
class TierStats:
    block_bytes: int
    block_size: int  # tokens per block
    counters: dict[str, TierCounters] = field(
        default_factory=lambda: {m: TierCounters() for m in MEDIA})
    reload_bytes_per_s: dict[str, float | None] = field(
        default_factory=lambda: dict.fromkeys(MEDIA))

    def offloaded(self, medium: str, num_blocks: int, seconds: float) -> None:
        c = self.counters[medium]
        c.offload_blocks += num_blocks
        c.offload_bytes += num_blocks * self.block_bytes
        c.offload_seconds += seconds

    def dropped(self, medium: str, num_blocks: int = 1) -> None:
        self.counters[medium].dropped_offloads += num_blocks

    def reloaded(self, medium: str, num_blocks: int, seconds: float) -> None:
        if num_blocks <= 0:
            return
        c = self.counters[medium]
        num_bytes = num_blocks * self.block_bytes
        c.reload_blocks += num_blocks
        c.reload_bytes += num_bytes
        c.reload_seconds += seconds
        rate = num_bytes / max(seconds, 1e-9)
        old = self.reload_bytes_per_s[medium]
        self.reload_bytes_per_s[medium] = (rate if old is None
                                           else old + _EWMA_WEIGHT * (rate - old))

    def reload_seconds(self, media: list[str]) -> float:
        """How long reloading one block from each of `media` takes at the measured rates (inf
        while a tier's rate is not measured)."""
        seconds = 0.0
        for medium in media:
            rate = self.reload_bytes_per_s[medium]
            seconds += self.block_bytes / rate if rate else float("inf")
        return seconds

    def reload_tokens_per_s(self) -> dict[str, float | None]:
        tokens_per_byte = self.block_size / self.block_bytes
        return {m: None if r is None else r * tokens_per_byte
                for m, r in self.reload_bytes_per_s.items()}

    def report(self, host: HostTier, disk: DiskTier | None) -> dict:
        """The engine's `stats()` entries: `kv_tiers` (per tier: the counters, what it holds;
        the disk's state and the files it rejected) and `reload_tokens_per_s` by tier."""
        tiers: dict = {m: asdict(c) for m, c in self.counters.items()}
        tiers["host"].update(blocks=len(host), bytes=host.used_bytes,
                             capacity_bytes=host.capacity_bytes)
        if disk is not None:
            tiers["disk"].update(blocks=len(disk), bytes=disk.used_bytes,
                                 capacity_bytes=disk.capacity_bytes,
                                 stopped=int(disk.stopped is not None),
                                 write_errors=disk.num_write_errors)
            tiers["files_rejected"] = dict(disk.num_rejected)
        return {"kv_tiers": tiers, "reload_tokens_per_s": self.reload_tokens_per_s()}
