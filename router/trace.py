"""What happened to one request, across its legs and workers: the dispatcher records it
(router/dispatch.py), the metrics and the `tandem` response field read it
(router/openai_format.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.protocol import RequestTiming


@dataclass
class Trace:
    """What happened to one request, for metrics and the `tandem` response field."""

    plan: str
    model: str = ""  # the served model name (metric label; resumes stay within the model)
    client_request_id: str | None = None  # the client's X-Request-Id, for correlation only
    prefill_worker: str | None = None
    decode_worker: str | None = None
    num_cached_tokens: int = 0
    # num_cached_tokens by the KV tier its blocks came from ({"device", "host", "disk"}); None
    # when the worker that computed the prompt cached some but did not split them (a vLLM backend)
    num_cached_tokens_by_medium: dict[str, int] | None = None
    prefill_s: float = 0.0
    retries: int = 0
    resumed: int = 0
    kv_full_retries: int = 0  # decode legs tried again after a refusal for a full KV cache
    kv_full_waits: int = 0  # ... of which after waiting, every decode worker having refused
    started: float = field(default_factory=time.monotonic)
    fallback: str | None = None
    first_token_at: float | None = None  # perf_counter() when the router had the first token
    kv_source: str | None = None  # the peer whose prefix was pulled (router/peer_pull.py)
    num_pulled_tokens: int = 0  # prompt tokens pulled from it (not in num_cached_tokens)
    export_s: float = 0.0  # how long the holder took to lease them (router/peer_pull.py)
    handoff_held_tokens: int = 0  # what a drained worker said it held for the resume leg
    handoff_pulled_tokens: int = 0  # ... what that leg pulled from it
    handoff_cached_tokens: int = 0  # ... and what its worker had cached already
    worker_timing: RequestTiming = field(default_factory=RequestTiming)

    def record_cached(self, num_cached_tokens: int, by_medium: dict[str, int] | None) -> None:
        """The cached prompt tokens that the worker which computed the prompt reported, and
        their split by tier (a worker sends none when nothing was cached: all zeros then)."""
        self.num_cached_tokens = num_cached_tokens
        if by_medium is None and num_cached_tokens == 0:
            by_medium = {"device": 0, "host": 0, "disk": 0}
        self.num_cached_tokens_by_medium = dict(by_medium) if by_medium is not None else None
