"""Leases on exported blocks (sending side).

An exported request's blocks stay pinned until the receiver says it is done (notification) or
the lease deadline passes; either way the release callback runs exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    deadline: float  # monotonic seconds


class LeaseTable:
    def __init__(
        self,
        release: Callable[[str], None],
        default_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        max_seconds: float | None = None,
    ) -> None:
        if default_seconds <= 0:
            raise ValueError("lease length must be positive")
        if max_seconds is not None and default_seconds > max_seconds:
            raise ValueError(f"lease length {default_seconds} s exceeds the cap of {max_seconds} s")
        self.max_seconds = max_seconds
        self._release = release
        self.default_seconds = default_seconds
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self.num_granted = 0
        self.num_notified = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def grant(self, request_id: str, block_ids: list[int], seconds: float | None = None) -> float:
        """Pin `block_ids` for `request_id`; returns the deadline as wall-clock time (for peers)."""
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} already holds a lease")
        seconds = self.default_seconds if seconds is None else seconds
        if not 0 < seconds < float("inf"):
            raise ValueError("lease length must be positive and finite")
        if self.max_seconds is not None and seconds > self.max_seconds:
            # Pinned blocks are capacity taken from everyone else: no caller pins them for long.
            raise ValueError(f"lease of {seconds} s exceeds this worker's cap of "
                             f"{self.max_seconds} s")
        self._leases[request_id] = Lease(request_id, list(block_ids), self._clock() + seconds)
        self.num_granted += 1
        return time.time() + seconds

    @property
    def num_leased_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self._leases.values())

    def block_ids(self, request_id: str) -> list[int] | None:
        lease = self._leases.get(request_id)
        return None if lease is None else lease.block_ids

    def complete(self, request_id: str) -> bool:
        """The receiver is done: release now. False if unknown (already expired or released)."""
        if self._leases.pop(request_id, None) is None:
            return False
        self.num_notified += 1
        self._release(request_id)
        return True

    def cancel(self, request_id: str) -> bool:
        """Release without counting a notification (e.g. the request was aborted)."""
        if self._leases.pop(request_id, None) is None:
            return False
        self._release(request_id)
        return True

    def expire(self) -> list[str]:
        """Release every lease past its deadline; returns their request ids."""
        now = self._clock()
        expired = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
        for rid in expired:
            del self._leases[rid]
            self.num_expired += 1
            self._release(rid)
        return expired

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self._leases.values()), default=None)
