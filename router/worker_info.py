"""What the router knows of one worker: its registration, its last load report, its circuit
breaker and the rates measured on it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# What makes workers interchangeable for a served name: (model digest, block size); the hash
# seed is derived from it (and the salt). See router/models.py.
Identity = tuple[str, int]


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
    # Circuit breaker and measured rates (kept across refreshes).
    failures: int = 0
    open_until: float = 0.0
    prefill_tokens_per_s: float | None = None
    transfer_bytes_per_s: float | None = None  # measured on this decode worker's KV pulls
    inflight: int = 0  # requests this router has on the worker now
    inflight_tokens: int = 0  # uncached prompt tokens of the prefills among them

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
