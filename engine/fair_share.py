"""Sharing the batch between clients (max-min fairness over running sequences).

Each sequence may carry a `client` tag (the router's opaque digest of who sent it; None for
requests without one). The scheduler asks this module three things:

- which waiting sequence goes next: the one whose client runs the fewest sequences, oldest first
  among equals (FIFO when every sequence has the same client, as with one client or none);
- which running sequence gives way when blocks run short: the newest of the client that runs
  the most (the newest of all, as before, when there is one client);
- whether a waiting sequence may take a place from a running one when the batch is full (or
  blocks are short): only from a client that runs at least two more sequences than its own.

Without this the batch is first come, first served: one client holding every sequence slot with
long generations (64 streams of 1,500 tokens, once) kept another's 8-token request waiting for
22 s. With it the newcomer's request joins the next step; the price is a recomputation (from the
prefix cache) of the sequence that gave way. Within one client nothing changes, so a single
tenant's throughput is what it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from engine.sequence import Sequence


class FairShare:
    """Running sequences per client, kept up to date by the scheduler as it plans one step."""

    def __init__(self, running: Iterable[Sequence]) -> None:
        self.counts: Counter[str | None] = Counter(s.client for s in running)

    def add(self, seq: Sequence) -> None:
        self.counts[seq.client] += 1

    def remove(self, seq: Sequence) -> None:
        self.counts[seq.client] -= 1

    def next_waiting(self, waiting: Seq[Sequence]) -> int:
        """Index in `waiting` of the sequence to admit next."""
        first = waiting[0].client
        if all(s.client == first for s in waiting):
            return 0  # one client waiting: plain FIFO, whatever runs
        return min(range(len(waiting)), key=lambda i: (self.counts[waiting[i].client], i))

    def donor(self, running: Seq[Sequence], newcomer: Sequence) -> Sequence | None:
        """The running sequence that gives its place to `newcomer`: the newest of the client
        with the most running sequences, if that client runs at least two more than
        `newcomer`'s (taking from a client with one more would only swap the imbalance)."""
        client, most = max(self.counts.items(), key=lambda kv: kv[1], default=(None, 0))
        if most < self.counts[newcomer.client] + 2:
            return None
        return next((s for s in reversed(running) if s.client == client), None)

    def victim(self, candidates: Seq[Sequence]) -> Sequence:
        """The sequence preempted when blocks run short, among `candidates` (running ones not
        yet planned this step, in admission order): the newest of the client that runs most."""
        top = max(self.counts[s.client] for s in candidates)
        return next(s for s in reversed(candidates) if self.counts[s.client] == top)
