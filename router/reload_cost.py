"""What a worker's hits in its lower KV tiers cost: a block held on the host or on disk is
reloaded into the device before the prompt is prefilled, at the rate that worker measured for
that tier (its load's `reload_tokens_per_s`, common/registry.py `ReloadRates`), or, until it has
measured one, at a multiple of its prefill rate (`host_reload_vs_prefill`,
`disk_reload_vs_prefill`). A tier's hits count only where reloading them is faster than
recomputing them: otherwise they are priced as the uncached tokens they then are.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.settings import RouterSettings
from router.tiered_match import MatchByMedium
from router.worker_info import WorkerInfo


@dataclass(frozen=True, slots=True)
class PricedHit:
    """A worker's match as priced: the blocks counted as cached (by tier) and the seconds
    reloading the lower tiers' among them takes."""

    counted: MatchByMedium
    reload_s: float = 0.0

    @property
    def blocks(self) -> int:
        return self.counted.total


def reload_rate(w: WorkerInfo, medium: str, prefill_rate: float, s: RouterSettings) -> float:
    """Tokens per second `w` reloads from tier `medium`: measured, or the seeded multiple."""
    measured = w.reload_tokens_per_s(medium)
    if measured:
        return measured
    factor = s.host_reload_vs_prefill if medium == "host" else s.disk_reload_vs_prefill
    return factor * prefill_rate


def price_hit(w: WorkerInfo, held: int, media: MatchByMedium | None, prefill_rate: float,
              s: RouterSettings) -> PricedHit:
    """`held` leading blocks of a prompt on `w` (in any tier; `media` their split, None: all on
    the device), as counted at `prefill_rate`, the rate `w` recomputes the rest at."""
    if media is None or not (media.host or media.disk):
        return PricedHit(MatchByMedium(held))
    host, disk = min(media.host, held), min(media.disk, max(held - media.host, 0))
    counted, reload_s = {"host": 0, "disk": 0}, 0.0
    for medium, n in (("host", host), ("disk", disk)):
        rate = reload_rate(w, medium, prefill_rate, s)
        if n and rate > prefill_rate:
            counted[medium] = n
            reload_s += n * w.block_size / rate
    return PricedHit(MatchByMedium(held - host - disk, counted["host"], counted["disk"]),
                     reload_s)
