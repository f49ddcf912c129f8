"""A worker's leading match by tier: how many leading blocks of a prompt it holds in any of its
KV tiers (device, host memory, disk; common/block_events.py `Medium`), and in which.

The leading run counts a block held in any tier; each block of it is counted once, in the
fastest tier holding it (device, then host, then disk), so a run may mix tiers. Every prefix index
answers `match_by_medium` with these (router/index.py); the policy prices the lower tiers at the
worker's reload rates (router/policy.py).
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MatchByMedium:
    """Blocks of one worker's leading run, by the fastest tier holding each."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        """The leading run's length in blocks."""
        return self.device + self.host + self.disk


NO_MATCH = MatchByMedium()


def split_run(run: list[int], device: Container[int], host: Container[int],
              disk: Container[int]) -> MatchByMedium:
    """A leading run split by the fastest tier holding each block; a block no tier holds (a
    galloping search may count one, router/replica.py) is left out."""
    on_device = sum(map(device.__contains__, run))
    on_host = on_disk = 0
    for h in run:
        if h in device:
            continue
        if h in host:
            on_host += 1
        elif h in disk:
            on_disk += 1
    return MatchByMedium(on_device, on_host, on_disk)


def leading_by_medium(block_hashes: list[int], held: Mapping[str, Container[int]]
                      ) -> MatchByMedium:
    """The leading run of `block_hashes` in `held` (medium -> the hashes that tier holds),
    stopping at the first block no tier holds."""
    device, host, disk = (held.get(m, ()) for m in ("device", "host", "disk"))
    counts = [0, 0, 0]
    for h in block_hashes:
        if h in device:
            counts[0] += 1
        elif h in host:
            counts[1] += 1
        elif h in disk:
            counts[2] += 1
        else:
            break
    return MatchByMedium(*counts)
