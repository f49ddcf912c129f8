"""Runs one request's plan against the workers and yields its tokens: prefill leg, decode leg,
retries, fallbacks and mid-stream resume, so the client sees each token exactly once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import aiohttp
import orjson

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
    """Worker hops go through aiohttp: per request it costs about a third of httpx's CPU, which is
    most of what the router adds to a request on a small machine (bench/router_overhead.py)."""

    def __init__(self, http: aiohttp.ClientSession, directory: WorkerDirectory, token: str | None,
                 max_prefill_retries: int, retry_backoff_s: float) -> None:
        self.http = http
        self.directory = directory
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
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
                # aclosing: a client that leaves closes the worker stream now, not at GC time.
                async with aclosing(self._generate(decode, request_id, prompt, sent, sampling,
                                                   kv_params)) as events:
                    async for ev in events:
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
            async with self.http.post(f"{w.url}{path}", data=orjson.dumps(body), headers=self.headers) as r:
                raw = await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise WorkerFailure(f"{w.worker_id}: {e!r}") from e
        if r.status >= 500 or r.status == 429:
            raise WorkerFailure(f"{w.worker_id}: HTTP {r.status}")
        if r.status >= 400:
            raise RequestRejected(r.status, _json(raw))
        return orjson.loads(raw)

    async def _generate(self, w: WorkerInfo, request_id, prompt, sent, sampling, kv_params
                        ) -> AsyncIterator[TokenEvent]:
        body = {"request_id": request_id, "prompt_token_ids": prompt, "output_token_ids": list(sent),
                "sampling": sampling.model_dump()}
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
        w.inflight += 1
        try:
            async with self.http.post(f"{w.url}/generate", data=orjson.dumps(body),
                                      headers=self.headers) as r:
                if r.status >= 500 or r.status == 429:
                    raise WorkerFailure(f"{w.worker_id}: HTTP {r.status}")
                if r.status >= 400:
                    raise RequestRejected(r.status, _json(await r.read()))
                last = None
                async for line in r.content:  # NDJSON: one event per line
                    line = line.strip()
                    if not line:
                        continue
                    ev = orjson.loads(line)
                    if ev.get("error"):
                        raise WorkerFailure(f"{w.worker_id}: {ev['error']}")
                    tev = TokenEvent(ev.get("token_ids", []), ev.get("finish_reason"),
                                     ev.get("num_cached_tokens"), ev.get("timing"), ev.get("logprobs"))
                    if tev.finish_reason is not None:
                        # Hold the last event until the body's end: a response read to EOF goes
                        # back to the pool; one closed early costs a new TCP connection next time.
                        last = tev
                        continue
                    yield tev
                if last is not None:
                    yield last
        except (aiohttp.ClientError, TimeoutError) as e:
            raise WorkerFailure(f"{w.worker_id}: {e!r}") from e
        finally:
            w.inflight -= 1

    async def abort(self, w: WorkerInfo | None, request_id: str) -> None:
        if w is None:
            return
        try:
            async with self.http.post(f"{w.url}/abort/{request_id}", headers=self.headers,
                                      timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError):
            pass


def _json(raw: bytes) -> dict:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"error": {"message": raw[:500].decode(errors="replace")}}
