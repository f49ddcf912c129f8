"""Runs one request's plan against the workers and yields its tokens: prefill leg, decode leg,
retries, fallbacks and mid-stream resume, so the client sees each token exactly once."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from common.protocol import SamplingOptions
from router.policy import Plan
from router.workers import WorkerDirectory, WorkerInfo

log = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A worker could not be reached or answered with a server error."""


class RequestRejected(RuntimeError):
    """A worker refused the request itself (4xx): retrying elsewhere would not help."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body.get("error", {}).get("message", str(body)))
        self.status, self.body = status, body


@dataclass
class TokenEvent:
    token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int | None = None
    timing: dict | None = None
    logprobs: list[dict] | None = None  # per token: {token_id, logprob, top: [[id, logprob]]}


@dataclass
class Trace:
    """What happened to one request, for metrics and the `tandem` response field."""

    plan: str
    prefill_worker: str | None = None
    decode_worker: str | None = None
    num_cached_tokens: int = 0
    prefill_s: float = 0.0
    retries: int = 0
    resumed: int = 0
    fallback: str | None = None
    worker_timing: dict = field(default_factory=dict)


class Dispatcher:
    def __init__(self, http: httpx.AsyncClient, directory: WorkerDirectory, token: str | None,
                 max_prefill_retries: int, retry_backoff_s: float) -> None:
        self.http = http
        self.directory = directory
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.max_prefill_retries = max_prefill_retries
        self.retry_backoff_s = retry_backoff_s

    async def run(self, plan: Plan, request_id: str, prompt: list[int], sampling: SamplingOptions,
                  trace: Trace) -> AsyncIterator[TokenEvent]:
        sent: list[int] = []
        kv_params = None
        decode = plan.decode
        if plan.kind == "disagg":
            pre = await self._prefill_with_retries(plan, request_id, prompt, sampling, trace)
            if pre is not None:
                first = pre["first_token_id"]
                sent.append(first)
                trace.num_cached_tokens = pre["num_cached_tokens"]
                lp = pre.get("first_token_logprob")
                yield TokenEvent([first], pre.get("finish_reason"), pre["num_cached_tokens"],
                                 logprobs=[lp] if lp else None)
                if pre.get("finish_reason"):
                    return
                kv_params = pre["kv_transfer_params"]
        tried: set[str] = set()
        while True:
            tried.add(decode.worker_id)
            trace.decode_worker = decode.worker_id
            try:
                async for ev in self._generate(decode, request_id, prompt, sent, sampling, kv_params):
                    sent.extend(ev.token_ids)
                    if ev.finish_reason is not None:
                        trace.worker_timing = ev.timing or {}
                        if trace.plan != "disagg" and ev.num_cached_tokens is not None:
                            trace.num_cached_tokens = ev.num_cached_tokens
                    yield ev
                    if ev.finish_reason is not None:
                        self.directory.record_success(decode)
                        return
                raise WorkerFailure(f"{decode.worker_id} ended the stream without a finish reason")
            except WorkerFailure as e:
                self.directory.record_failure(decode)
                # Resume elsewhere with every token the client has: no token lost or repeated.
                nxt = self._next_decoder(tried)
                if nxt is None:
                    raise
                log.warning("decode on %s failed (%s); resuming on %s after %d tokens",
                            decode.worker_id, e, nxt.worker_id, len(sent), extra={"request_id": request_id})
                trace.resumed += 1
                decode, kv_params = nxt, None  # local prefill of prompt + tokens so far
                request_id = f"{request_id}.r{trace.resumed}"

    def _next_decoder(self, tried: set[str]) -> WorkerInfo | None:
        pool = [w for w in self.directory.live() if w.role in ("decode", "colocated")
                and w.worker_id not in tried]
        return min(pool, key=lambda w: (w.inflight, w.running())) if pool else None

    async def _prefill_with_retries(self, plan: Plan, request_id, prompt, sampling, trace: Trace):
        tried: set[str] = set()
        p = plan.prefill
        for attempt in range(self.max_prefill_retries + 1):
            tried.add(p.worker_id)
            trace.prefill_worker = p.worker_id
            t0 = time.monotonic()
            uncached = len(prompt) - plan.cached_blocks * p.block_size
            p.inflight += 1
            p.inflight_tokens += max(uncached, 0)
            try:
                resp = await self._post(p, "/prefill", {"request_id": request_id,
                                                        "prompt_token_ids": prompt,
                                                        "sampling": sampling.model_dump()})
            except WorkerFailure as e:
                self.directory.record_failure(p)
                trace.retries += 1
                others = [w for w in self.directory.live("prefill") if w.worker_id not in tried]
                if not others or attempt == self.max_prefill_retries:
                    log.warning("prefill failed on %s (%s); decode worker prefills locally",
                                p.worker_id, e, extra={"request_id": request_id})
                    trace.fallback = "decode_local"
                    return None
                p = min(others, key=lambda w: (w.inflight, w.queued_tokens()))
                await asyncio.sleep(self.retry_backoff_s * (2 ** attempt))
                continue
            finally:
                p.inflight -= 1
                p.inflight_tokens -= max(uncached, 0)
            elapsed = time.monotonic() - t0
            trace.prefill_s = elapsed
            computed = len(prompt) - resp["num_cached_tokens"]
            if computed > 64 and elapsed > 0:  # learn the worker's prefill rate (EWMA)
                rate = computed / elapsed
                p.prefill_tokens_per_s = rate if p.prefill_tokens_per_s is None else \
                    0.8 * p.prefill_tokens_per_s + 0.2 * rate
            self.directory.record_success(p)
            return resp
        return None

    async def _post(self, w: WorkerInfo, path: str, body: dict) -> dict:
        try:
            r = await self.http.post(f"{w.url}{path}", json=body, headers=self.headers)
        except httpx.HTTPError as e:
            raise WorkerFailure(f"{w.worker_id}: {e!r}") from e
        if r.status_code >= 500 or r.status_code == 429:
            raise WorkerFailure(f"{w.worker_id}: HTTP {r.status_code}")
        if r.status_code >= 400:
            raise RequestRejected(r.status_code, _json(r.text))
        return r.json()

    async def _generate(self, w: WorkerInfo, request_id, prompt, sent, sampling, kv_params
                        ) -> AsyncIterator[TokenEvent]:
        body = {"request_id": request_id, "prompt_token_ids": prompt, "output_token_ids": list(sent),
                "sampling": sampling.model_dump()}
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
        w.inflight += 1
        try:
            async with self.http.stream("POST", f"{w.url}/generate", json=body,
                                        headers=self.headers) as r:
                if r.status_code >= 500 or r.status_code == 429:
                    raise WorkerFailure(f"{w.worker_id}: HTTP {r.status_code}")
                if r.status_code >= 400:
                    raise RequestRejected(r.status_code, _json((await r.aread()).decode()))
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    ev = json.loads(line)
                    if ev.get("error"):
                        raise WorkerFailure(f"{w.worker_id}: {ev['error']}")
                    yield TokenEvent(ev.get("token_ids", []), ev.get("finish_reason"),
                                     ev.get("num_cached_tokens"), ev.get("timing"), ev.get("logprobs"))
        except httpx.HTTPError as e:
            raise WorkerFailure(f"{w.worker_id}: {e!r}") from e
        finally:
            w.inflight -= 1

    async def abort(self, w: WorkerInfo | None, request_id: str) -> None:
        if w is None:
            return
        try:
            await self.http.post(f"{w.url}/abort/{request_id}", headers=self.headers, timeout=2.0)
        except httpx.HTTPError:
            pass


def _json(text: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"error": {"message": text[:500]}}
