"""What the router knows of one worker: its registration, its last load report, its circuit
breaker and the rates measured on it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class WorkerInfo:
    worker_id: str
    role: str  # prefill | decode | colocated
    url: str
    model: str = ""
    block_size: int = 16
    capacity: int = 0
    max_model_len: int | None = None
    load: dict = field(default_factory=dict)
    static: bool = False
    backend: str = "tandem"  # router/backends.py
    block_bytes: int | None = None  # KV bytes of one block, as the worker published it
    # Circuit breaker and measured rates (kept across refreshes).
    failures: int = 0
    open_until: float = 0.0
    prefill_tokens_per_s: float | None = None
    transfer_bytes_per_s: float | None = None  # measured on this decode worker's KV pulls
    inflight: int = 0  # requests this router has on the worker now
    inflight_tokens: int = 0  # uncached prompt tokens of the prefills among them

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.open_until

    def queued_tokens(self) -> int:
        """Prompt tokens ahead of a new prefill: the worker's last report, or this router's own
        in-flight count when that is higher (reports lag by up to a heartbeat)."""
        return max(int(self.load.get("waiting_tokens", 0)), self.inflight_tokens)

    def running(self) -> int:
        return int(self.load.get("running", 0))
