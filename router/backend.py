"""How the router talks to one kind of worker (docs/contract.md "Worker <-> router API"): the
`Backend` Protocol every kind implements, its errors and its time limits. The HTTP plumbing the
kinds share is router/worker_http.py; the kinds, by name, are in router/backends.py.

Every backend speaks in token ids: prompts go out as ids (the router tokenized them) and tokens
come back as ids, so routing, stop strings, resume and detokenization are the same for both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from common.protocol import (
    KVTransferParams,
    PrefillResponse,
    SamplingOptions,
    StreamEvent,
    Tenant,
)
from router.worker_info import WorkerInfo


class WorkerFailure(RuntimeError):
    """A worker could not be reached or answered with a server error (`status`, if it
    answered: a 503 before any token is a refusal, as from a draining worker; `code`, the
    error's code, and `retry_after_s`, its Retry-After, where it gave them)."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.retry_after_s = status, code, retry_after_s


class KVCacheFull(WorkerFailure):
    """Every decode worker refused the prompt's KV import for a full cache (503
    `out_of_kv_blocks`), through every retry the router allows: the client is told to retry."""


class TransferFailed(RuntimeError):
    """The decode worker could not pull the prompt's KV blocks from the prefill worker (it died
    or stalled mid-transfer) and its policy is to fail rather than recompute the prompt
    (`--kv-pull-failure-policy fail`): no other decode worker is tried with the same handle, and
    none recomputes it either. The client is told to retry."""


class RequestRejected(RuntimeError):
    """A worker refused the request itself (4xx): retrying elsewhere would not help."""

    def __init__(self, status: int, body: dict) -> None:
        err = body.get("error")
        msg = err.get("message") if isinstance(err, dict) else body.get("message", str(body))
        super().__init__(msg or str(body))
        self.status, self.body = status, body


@dataclass
class Timeouts:
    """Per-hop limits (seconds). A stalled worker (SIGSTOPped, swapping, wedged) still accepts
    connections and never answers, so only a timeout turns it into a failure the dispatcher can
    route around: prefill is retried elsewhere, a decode stream resumes on another worker."""

    prefill_s: float = 60.0
    stream_stall_s: float = 30.0  # longest gap between two chunks of a decode stream
    total_s: float = 300.0
    # The slowest rate a healthy worker prefills at (a long prompt on a small CPU): a leg that
    # computes a prompt gets this long per token on top of its base limit.
    prefill_min_tokens_per_s: float = 50.0

    def prefill_for(self, num_uncached: int) -> float:
        """The prefill leg's limit when `num_uncached` tokens are to be computed (the prompt's,
        and those queued ahead of it on that worker)."""
        return self.prefill_s + max(num_uncached, 0) / self.prefill_min_tokens_per_s

    def first_event_for(self, num_tokens: int) -> float:
        """How long a decode stream may wait for its first event: it may have to prefill
        `num_tokens` locally first (a failed pull, decode_local, a resume)."""
        return self.stream_stall_s + max(num_tokens, 0) / self.prefill_min_tokens_per_s


class Backend(Protocol):
    def __init__(self, http: aiohttp.ClientSession, token: str | None, model: str,
                 timeouts: Timeouts) -> None: ...

    async def prefill(self, w: WorkerInfo, request_id: str, prompt: list[int],
                      sampling: SamplingOptions, tenant: Tenant | None = None,
                      num_uncached: int | None = None) -> PrefillResponse:
        """The prefill leg's answer (common/protocol.py); `first_token_id` is None when the
        decode leg produces every token (vLLM). `tenant` says who sent the request (a worker
        shares its batch fairly between clients) and salts its blocks apart. The leg's time limit
        grows with `num_uncached`, the tokens the worker computes before it answers (default: the
        whole prompt). Raises WorkerFailure or RequestRejected."""

    async def abort(self, w: WorkerInfo, request_id: str) -> None:
        """Tell the worker to drop `request_id` (prefilling, or its blocks held for export):
        the router gave up on that leg. Best effort, within about a second; raises nothing."""

    def generate(self, w: WorkerInfo, request_id: str, prompt: list[int], sent: list[int],
                 sampling: SamplingOptions, kv_params: KVTransferParams | None,
                 tenant: Tenant | None = None) -> AsyncIterator[StreamEvent]:
        """Tokens after `prompt + sent`; the last event has a finish reason. Closing the
        iterator closes the HTTP stream, which aborts the request on the worker."""

    async def probe(self, w: WorkerInfo) -> dict:
        """Health check of a statically listed worker; returns what it learned (model,
        max_model_len). Raises WorkerFailure when the worker is not healthy."""
