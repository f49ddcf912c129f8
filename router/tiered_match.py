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
from itertools import filterfalse


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
    # Each pass a C-level map or filter: a 100k-token run is thousands of blocks per worker.
    below = list(filterfalse(device.__contains__, run))
    on_host = sum(map(host.__contains__, below))
    on_disk = sum(map(disk.__contains__, filterfalse(host.__contains__, below)))
    return MatchByMedium(len(run) - len(below), on_host, on_disk)


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
