"""What the router knows of one worker: its registration, its last load report, its circuit
breaker and the rates measured on it."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

# What makes workers interchangeable for a served name: (model digest, block size); the hash
# seed is derived from it (and the salt). See router/models.py.
Identity = tuple[str, int]

MAX_PLACEMENTS = 4096  # placements remembered per worker (their sum stays exact; see below)


@dataclass
class WorkerInfo:
    worker_id: str
    role: str  # prefill | decode | colocated
    url: str
    model: str = ""  # the name the worker itself knows its model by (vLLM's `model` field)
    served_names: tuple[str, ...] = ()  # the names it registered (or its static entry gives)
    digest: str = ""  # common/model_identity.py; "" where the worker publishes none
    hash_seed: int | None = None
    tokenizer_path: str | None = None  # where the worker's tokenizer is (if on this machine)
    started_at: float = 0.0
    accepted: frozenset[str] = frozenset()  # the served names the router routes here (models.py)
    block_size: int = 16
    capacity: int = 0
    max_model_len: int | None = None
    vocab_size: int | None = None  # its model's (config.json), as it reported it
    load: dict = field(default_factory=dict)
    static: bool = False
    backend: str = "tandem"  # router/backends.py
    block_bytes: int | None = None  # KV bytes of one block, as the worker published it
    events: str = ""  # "epoch:seq" of its last block event (common/block_events.py)
    locality: str = ""  # where it runs, "zone/rack/node" (common/locality.py); "": not said
    # Circuit breaker and measured rates (kept across refreshes).
    failures: int = 0
    open_until: float = 0.0
    prefill_tokens_per_s: float | None = None
    transfer_bytes_per_s: float | None = None  # measured on this decode worker's KV pulls
    # Its model's decode step line (base_s, per_seq_s), as the SLO planner fitted it
    # (router/planner_loop.py); None until then. Priced by router/decode_growth.py.
    decode_step: tuple[float, float] | None = None
    inflight: int = 0  # requests this router has on the worker now
    inflight_tokens: int = 0  # uncached prompt tokens of the prefills among them
    # Blocks this router sent here that its reports may not show yet, as (sent at, forgotten
    # at, blocks), and their sum: a report lags by up to a heartbeat (`headroom`).
    placements: deque[tuple[float, float, int]] = field(default_factory=deque)
    placed_blocks: int = 0
    load_read_at: float = 0.0  # when this router last read its registration (`report`)

    @property
    def identity(self) -> Identity:
        return (self.digest, self.block_size)

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.accepted

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.open_until

    def queued_tokens(self) -> int:
        """Prompt tokens ahead of a new prefill: the worker's last report, or this router's own
        in-flight count when that is higher (reports lag by up to a heartbeat)."""
        return max(int(self.load.get("waiting_tokens", 0)), self.inflight_tokens)

    def running(self) -> int:
        return int(self.load.get("running", 0))

    def reload_tokens_per_s(self, medium: str) -> float | None:
        """Prompt tokens per second this worker measured reloading from its `medium` tier
        (host, disk), as its last load report said (bounded by common/registry.py
        `ReloadRates`); None until measured."""
        rates = self.load.get("reload_tokens_per_s")
        return rates.get(medium) if isinstance(rates, dict) else None

    def report(self, load: dict, now: float | None = None) -> None:
        """Its registration's `load`, as just read. A report that differs from the last one
        read was written since that read, so it shows the placements sent here before that
        read (a request's blocks are taken moments after it is sent): those are forgotten."""
        now = time.monotonic() if now is None else now
        if load != self.load:
            self._forget(now, sent_before=self.load_read_at)
        self.load, self.load_read_at = load, now

    def note_placed(self, num_blocks: int, memory_s: float, now: float | None = None) -> None:
        """This router just sent `num_blocks` new blocks here (a prompt's blocks the worker did
        not hold): they count against its reported headroom until a report shows them
        (`report`), or for `memory_s` at most."""
        if num_blocks <= 0 or memory_s <= 0:
            return
        now = time.monotonic() if now is None else now
        self._forget(now)
        if len(self.placements) >= MAX_PLACEMENTS:
            self.placed_blocks -= self.placements.popleft()[2]
        self.placements.append((now, now + memory_s, num_blocks))
        self.placed_blocks += num_blocks

    def _forget(self, now: float, sent_before: float = -math.inf) -> None:
        # Sent in order, with one memory: both conditions hold for a prefix of the deque.
        while self.placements and (self.placements[0][1] <= now
                                   or self.placements[0][0] < sent_before):
            self.placed_blocks -= self.placements.popleft()[2]

    def headroom(self, now: float | None = None) -> tuple[int, int]:
        """(empty, evictable) KV blocks: those it can hand out without evicting anything, and
        those it can hand out by evicting a cached block (its last report's `free_blocks` and
        `evictable_blocks`, less what this router sent here since: those blocks are cached now,
        evictable once their requests end). (0, 0) for a worker that reports neither."""
        if self.placements:
            self._forget(time.monotonic() if now is None else now)
        free = int(self.load.get("free_blocks", 0))
        evictable = min(int(self.load.get("evictable_blocks") or 0), free)
        empty = max(free - evictable - self.placed_blocks, 0)
        return empty, free - empty
