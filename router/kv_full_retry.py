"""A decode leg whose worker refused the prompt's KV import for a full cache (503
`out_of_kv_blocks` with Retry-After: worker/generation.py). Nothing ran there, so the worker is
not failed for it and the request goes on: another decode worker not tried yet is tried at once;
once every one refused, the least busy again after the Retry-After (at most `MAX_WAIT_S`), at
most `max_waits` times (--kv-full-waits) and within the request's deadline. Past those,
`KVCacheFull`: the client gets a 503 `out_of_kv_blocks` with Retry-After (router/gateway.py), and
the dispatcher lets the prefill worker free the blocks it held for the import."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from common.errors import OUT_OF_KV_BLOCKS
from router.backend import KVCacheFull, WorkerFailure
from router.worker_info import WorkerInfo

log = logging.getLogger(__name__)

# The longest one wait for a full decode worker's blocks, whatever Retry-After it asked for.
MAX_WAIT_S = 5.0
_DEFAULT_WAIT_S = 1.0  # a refusal without a Retry-After


class Trace(Protocol):
    """What this reads of a request's trace (router/dispatch.py), and counts in it."""

    model: str
    decode_worker: str | None
    started: float  # time.monotonic() when the request came
    kv_full_retries: int
    kv_full_waits: int


def refused_for_kv(e: WorkerFailure) -> bool:
    """Whether `e` is a decode worker's refusal for a full KV cache."""
    return e.status == 503 and e.code == OUT_OF_KV_BLOCKS


class KVFullRetry:
    def __init__(self, next_decoder: Callable[[set[str], str], WorkerInfo | None],
                 max_waits: int, request_timeout_s: float) -> None:
        """`next_decoder(tried, model)`: the least busy live decode worker of `model` not in
        `tried`, or None."""
        self.next_decoder = next_decoder
        self.max_waits = max_waits
        self.request_timeout_s = request_timeout_s

    async def next_try(self, e: WorkerFailure, tried: set[str], trace: Trace
                       ) -> tuple[WorkerInfo, set[str]]:
        """After `e`, a refusal for a full KV cache by `trace.decode_worker`: the decode worker
        to try next and the workers tried since the last wait (counted in `trace`), or
        KVCacheFull."""
        nxt = self.next_decoder(tried, trace.model)
        if nxt is not None:
            log.info("%s refused the import (KV cache full); trying %s", trace.decode_worker,
                     nxt.worker_id)
            trace.kv_full_retries += 1
            return nxt, tried
        wait = min(e.retry_after_s if e.retry_after_s is not None else _DEFAULT_WAIT_S,
                   MAX_WAIT_S)
        deadline = trace.started + self.request_timeout_s
        if trace.kv_full_waits >= self.max_waits or time.monotonic() + wait >= deadline:
            raise KVCacheFull(f"every decode worker's KV cache is full ({e})", e.status, e.code,
                              e.retry_after_s) from e
        trace.kv_full_waits += 1
        log.info("every decode worker refused the import (KV cache full); trying again in "
                 "%.1f s", wait)
        await asyncio.sleep(wait)
        nxt = self.next_decoder(set(), trace.model)
        if nxt is None:
            raise KVCacheFull(f"no decode worker left to import the prompt into ({e})",
                              e.status, e.code, e.retry_after_s) from e
        trace.kv_full_retries += 1
        return nxt, set()
