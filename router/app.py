"""`create_app(settings)`: the OpenAI-compatible gateway.

Per request: validate, apply the chat template, tokenize, hash the blocks, one Redis round trip
for every live worker's leading match, pick a plan (policy), run it (dispatch), relay tokens as
OpenAI JSON or SSE. The router never imports torch.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from contextlib import aclosing, asynccontextmanager

import aiohttp
import orjson
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.background import BackgroundErrors
from common.body_limit import BodyLimit
from common.errors import APIError, install_error_handlers
from common.hashing import BlockHasher
from common.protocol import SamplingOptions
from common.registry import RedisKeys
from common.streams import prepend
from common.tokenizer import ChatTemplateError, Tokenizer
from router.admission import Admission
from router.backends import BACKENDS, RequestRejected, Timeouts, WorkerFailure
from router.dispatch import Dispatcher, Trace
from router.front import FrontedAPI
from router.index import MemoryPrefixIndex, RedisPrefixIndex
from router.limits import KeyAuth, RateLimiter, load_keys
from router.metrics import RouterMetrics
from router.openai_format import (
    body_schema,
    chat_logprobs,
    completion_logprobs,
    correlation_id,
    cut_stops,
    parse_body,
    requested_max_tokens,
    sse_data,
    text_chars,
    timing_field,
    wants_logprobs,
)
from router.openai_models import ChatCompletionRequest, CompletionRequest
from router.policy import NoWorkers, RouteContext, make_policy
from router.settings import RouterSettings
from router.workers import WorkerDirectory

log = logging.getLogger(__name__)


def create_app(settings: RouterSettings) -> FastAPI:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    errors = BackgroundErrors(registry)
    tokenizer = Tokenizer(settings.tokenizer_folder)
    vocab_size = tokenizer.vocab_size
    max_token_bytes = tokenizer.max_token_bytes
    hasher = BlockHasher(settings.model, settings.block_size, settings.hash_salt)
    keys = RedisKeys(settings.namespace)
    directory = WorkerDirectory(keys, settings.workers, settings.breaker_failures,
                                settings.breaker_cooldown_s, settings.redis_restart_grace_s, errors,
                                settings.internal_token)
    policy = make_policy(settings.policy, settings)
    auth = KeyAuth(load_keys(settings.api_keys, settings.api_keys_file))
    admission = Admission(settings.max_running, settings.max_queued)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=settings.request_timeout_s, connect=2.0),
            connector=aiohttp.TCPConnector(limit=1000, limit_per_host=0, keepalive_timeout=60),
            auto_decompress=False, read_bufsize=1 << 20)  # one NDJSON event must fit a line
        tokens = {"tandem": settings.internal_token, "vllm": settings.vllm_api_key}
        timeouts = Timeouts(settings.prefill_timeout_s, settings.stream_stall_timeout_s,
                            settings.request_timeout_s)
        backends = {name: cls(http, tokens[name], settings.model, timeouts)
                    for name, cls in BACKENDS.items()}
        state["dispatch"] = Dispatcher(backends, directory, settings.max_prefill_retries,
                                       settings.retry_backoff_s)
        def probe(w):
            return backends[w.backend].probe(w)

        await directory.probe_all(probe)
        # Every worker is health-checked, Redis-discovered ones too (a heartbeat is not readiness).
        tasks = [asyncio.create_task(directory.run_probes(probe, settings.probe_interval_s))]
        if settings.redis_url:
            import redis.asyncio as aioredis

            redis = aioredis.from_url(settings.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
            state["index"] = RedisPrefixIndex(redis, keys, settings.index_search)
            state["limiter"] = RateLimiter(redis, keys, settings.rate_limit_rpm, settings.rate_limit_tpm)
            await directory.refresh(redis)
            tasks.append(asyncio.create_task(directory.run(redis, settings.refresh_interval_s)))
        else:
            log.warning("no Redis configured: in-process prefix index (learns from routing only)")
            redis = None
            state["index"] = MemoryPrefixIndex()
            state["limiter"] = RateLimiter(None, keys, settings.rate_limit_rpm, settings.rate_limit_tpm)
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await http.close()
            if redis is not None:
                await redis.aclose()

    app = FrontedAPI(title="Tandem router", lifespan=lifespan, max_body_bytes=settings.max_body_bytes)
    install_error_handlers(app)

    # vLLM backends publish no block sets to our Redis: for them the router remembers what it
    # sent where (approximate, like the SGLang router's cache_aware tree).
    approx_index = MemoryPrefixIndex()

    async def route(prompt: list[int]):
        t0 = time.perf_counter()
        hashes = hasher(prompt)
        prefill, decode = directory.live("prefill"), directory.live("decode")
        colocated = directory.live("colocated")
        ids, approx_ids = [], []
        for w in prefill + decode + colocated:
            (ids if w.backend == "tandem" else approx_ids).append(w.worker_id)
        try:
            matches = await state["index"].match(hashes, ids) if ids else {}
            metrics.redis_up.set(1)
        except Exception as e:  # noqa: BLE001 - Redis down: route on load alone
            log.warning("prefix index unavailable (%s): load-only routing", e)
            metrics.redis_up.set(0)
            matches = dict.fromkeys(ids, 0)
        if approx_ids:
            matches.update(await approx_index.match(hashes, approx_ids))
        ctx = RouteContext(len(prompt), len(hashes), matches, prefill, decode, colocated,
                           settings.block_size)
        try:
            plan = policy.choose(ctx)
        except NoWorkers as e:
            raise APIError(503, str(e), "no_workers", headers={"Retry-After": "1"}) from e
        # Both legs end up holding the prompt's blocks (the decode side after its pull).
        for w in {w.worker_id: w for w in (plan.decode, plan.prefill or plan.decode)}.values():
            (state["index"] if w.backend == "tandem" else approx_index).record(w.worker_id, hashes)
        metrics.route.labels(plan.kind).inc()
        metrics.overhead.observe(time.perf_counter() - t0)
        return plan

    def sampling(body, n_index: int) -> SamplingOptions:
        max_tokens = requested_max_tokens(body) or settings.max_tokens_default
        lp = (body.top_logprobs or 0) if isinstance(body, ChatCompletionRequest) and body.logprobs else None
        if isinstance(body, CompletionRequest):
            lp = body.logprobs
        try:
            return SamplingOptions(
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                seed=None if body.seed is None else body.seed + n_index, max_tokens=max_tokens,
                stop=body.stop, ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, logprobs=lp)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_request") from e

    def encode(body) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            try:
                return tokenizer.encode_chat(body.messages)
            except (ChatTemplateError, TypeError, KeyError, ValueError) as e:
                raise APIError(400, f"messages: {e}", "invalid_messages", "messages") from e
        try:
            return tokenizer.encode_prompt(body.prompt)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_prompt", "prompt") from e

    async def prompt_ids(body) -> list[int]:
        if body.model != settings.model:
            raise APIError(404, f"model {body.model!r} does not exist; this router serves {settings.model!r}",
                           "model_not_found", "model")
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        limit = directory.max_model_len(settings.max_model_len_default)
        max_tokens = requested_max_tokens(body) or 0
        chars = text_chars(body)
        # Cheap checks first: a text longer than `limit` tokens could ever cover is refused
        # before any tokenizing, and a large one is tokenized off the event loop, so a few
        # multi-megabyte bodies cannot stall every other request (and /health).
        if max_token_bytes and chars > max_token_bytes * limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                           f"request's {chars} characters of text are longer than that",
                           "context_length_exceeded", param)
        ids = await asyncio.to_thread(encode, body) if chars > settings.offload_chars else encode(body)
        if not ids:
            raise APIError(400, "the prompt is empty", "invalid_prompt", "prompt")
        if min(ids) < 0 or max(ids) >= vocab_size:  # also keeps them hashable as uint32
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", "invalid_prompt", "prompt")
        if len(ids) + max(max_tokens, 1) > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the request "
                           f"has {len(ids)} prompt tokens and asks for {max_tokens} more",
                           "context_length_exceeded", param)
        return ids

    async def run_one(body, prompt: list[int], idx: int, rid: str, client_rid: str | None):
        """Yields (token_ids, finish_reason, trace) as they come; applies stop strings on text."""
        opts = sampling(body, idx)
        plan = await route(prompt)
        trace = Trace(plan.kind, client_request_id=client_rid)
        dispatch: Dispatcher = state["dispatch"]
        try:
            async with aclosing(dispatch.run(plan, rid, prompt, opts, trace)) as events:
                async for ev in events:
                    yield ev, trace
        except RequestRejected as e:
            raise APIError(e.status, str(e), "rejected_by_worker") from e
        except WorkerFailure as e:
            metrics.requests.labels("503").inc()
            raise APIError(503, f"no worker could serve the request: {e}", "worker_failure",
                           headers={"Retry-After": "1"}) from e

    async def complete(body, chat: bool, client_rid: str | None, api_key: str | None):
        t_start = time.perf_counter()
        prompt = await prompt_ids(body)
        max_tokens = requested_max_tokens(body) or settings.max_tokens_default
        await state["limiter"].charge(api_key, (len(prompt) + max_tokens) * body.n)
        # The router names every request itself: a client's X-Request-Id is only a correlation
        # id (logs, the `tandem` field). Reused client ids once collided on the workers (500s,
        # an open circuit breaker, 503 for everyone).
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{os.urandom(12).hex()}"
        metrics.prompt_tokens.inc(len(prompt) * body.n)
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        if body.stream and body.n != 1:
            raise APIError(400, "streaming supports n=1 only", "invalid_request", "n")
        slot = admission.slot(body.priority)
        await slot.__aenter__()  # held until the response ends (the stream's end, if streaming)
        if body.stream:
            gen = run_one(body, prompt, 0, rid, client_rid)
            try:
                first = await anext(gen)
            except StopAsyncIteration:
                first = None
            except BaseException:
                await slot.__aexit__(None, None, None)
                raise
            return StreamingResponse(_sse(first, gen, body, chat, rid, created, prompt, t_start, slot),
                                     media_type="text/event-stream")
        try:
            if body.n == 1:  # no task per choice for the common case
                results = [await _collect(run_one(body, prompt, 0, rid, client_rid), body, t_start)]
            else:
                results = await asyncio.gather(*[
                    _collect(run_one(body, prompt, i, f"{rid}-{i}", client_rid), body, t_start)
                    for i in range(body.n)])
        finally:
            await slot.__aexit__(None, None, None)
        choices = []
        n_out = 0
        want_lp = wants_logprobs(body, chat)
        for i, (tokens, text, finish, lps, _trace) in enumerate(results):
            n_out += len(tokens)
            c = {"index": i, "finish_reason": finish}
            if chat:
                c["message"] = {"role": "assistant", "content": text}
                c["logprobs"] = chat_logprobs(lps, token_text) if want_lp else None
            else:
                c["text"] = text
                c["logprobs"] = completion_logprobs(lps, token_text) if want_lp else None
            choices.append(c)
        metrics.requests.labels("200").inc()
        timing = timing_field(results[0][4], t_start)
        out = {"id": rid, "object": obj, "created": created, "model": settings.model, "choices": choices,
               "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                         "total_tokens": len(prompt) + n_out}, "tandem": timing}
        return Response(orjson.dumps(out), media_type="application/json",
                        headers={"x-tandem-timing": orjson.dumps(timing).decode()})

    async def _collect(gen, body, t_start):
        tokens: list[int] = []
        lps: list[dict] = []
        finish, trace = None, None
        first = True
        async for ev, trace in gen:  # noqa: B007 - the last trace is kept
            if first:
                metrics.ttft.observe(time.perf_counter() - t_start)
                first = False
            tokens.extend(ev.token_ids)
            lps.extend(ev.logprobs or [])
            finish = ev.finish_reason or finish
        # Same incremental detokenizer as the stream (and the engine): identical text either way.
        stream = tokenizer.decode_stream()
        text, finish = cut_stops("".join(stream.step(t) for t in tokens), body.stop, finish)
        metrics.completion_tokens.inc(len(tokens))
        metrics.latency.observe(time.perf_counter() - t_start)
        _observe_trace(trace)
        return tokens, text, finish, lps, trace

    def _observe_trace(trace: Trace | None) -> None:
        if trace is None:
            return
        pool = "prefill" if trace.plan == "disagg" else "decode"
        metrics.hit_tokens.labels(pool).inc(trace.num_cached_tokens)
        if trace.prefill_s:
            metrics.prefill.observe(trace.prefill_s)
        if trace.retries:
            metrics.retries.labels("prefill").inc(trace.retries)
        if trace.resumed:
            metrics.retries.labels("resume").inc(trace.resumed)

    async def _sse(first, gen, body, chat, rid, created, prompt, t_start, slot):
        obj = "chat.completion.chunk" if chat else "text_completion"
        stream = tokenizer.decode_stream()
        stops = body.stop
        hold = max((len(s) for s in stops), default=1) - 1
        text_sent, text_all = 0, ""
        n_out = 0
        trace = None
        last_t = None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        want_lp = wants_logprobs(body, chat)
        pending_lps: list[dict] = []  # tokens whose logprobs go out with the next text chunk
        lp_offset = 0  # completions' text_offset runs on across chunks

        def chunk(delta: str, finish):
            nonlocal lp_offset
            lp = None
            if want_lp and pending_lps:
                lp = (chat_logprobs(pending_lps, token_text) if chat
                      else completion_logprobs(pending_lps, token_text, lp_offset))
                if not chat:
                    lp_offset += sum(len(t) for t in lp["tokens"])
                pending_lps.clear()
            if chat:
                choice = {"index": 0, "delta": {"content": delta} if delta or finish is None else {},
                          "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": lp}
            return {"id": rid, "object": obj, "created": created, "model": settings.model, "choices": [choice]}

        if chat:
            role = chunk("", None)
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield sse_data(role)
        finish = None
        try:
            items = [] if first is None else [first]
            async for ev, trace in prepend(items, gen):  # noqa: B007 - the last trace is kept
                now = time.perf_counter()
                if last_t is None:
                    metrics.ttft.observe(now - t_start)
                else:
                    metrics.itl.observe(now - last_t)
                last_t = now
                n_out += len(ev.token_ids)
                pending_lps.extend(ev.logprobs or [])
                for t in ev.token_ids:
                    text_all += stream.step(t)
                cut, reason = cut_stops(text_all, stops, ev.finish_reason)
                if reason == "stop" and len(cut) < len(text_all):
                    text_all, finish = cut, "stop"
                else:
                    finish = ev.finish_reason
                safe = len(text_all) if finish else max(text_sent, len(text_all) - hold)
                if safe > text_sent:
                    yield sse_data(chunk(text_all[text_sent:safe], None))
                    text_sent = safe
                if finish:
                    break
            final = chunk("", finish or "stop")
            final["tandem"] = timing_field(trace, t_start)
            yield sse_data(final)
            if include_usage:
                usage = {"id": rid, "object": obj, "created": created, "model": settings.model, "choices": [],
                         "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                                   "total_tokens": len(prompt) + n_out}}
                yield sse_data(usage)
            yield b"data: [DONE]\n\n"
            metrics.requests.labels("200").inc()
            metrics.completion_tokens.inc(n_out)
            metrics.latency.observe(time.perf_counter() - t_start)
            _observe_trace(trace)
        except APIError as e:
            yield sse_data({"error": {"message": e.message, "type": "server_error", "code": e.code}})
            yield b"data: [DONE]\n\n"
        finally:
            await gen.aclose()  # client gone: closing the worker stream aborts both legs
            await slot.__aexit__(None, None, None)

    async def serve(chat: bool, headers, raw: bytes) -> Response:
        api_key = auth.check(headers.get("authorization"))  # 401 before any 400
        await state["limiter"].admit(api_key)  # 429 before any parsing or tokenizing
        body = parse_body(ChatCompletionRequest if chat else CompletionRequest, raw)
        return await complete(body, chat, correlation_id(headers.get("x-request-id")), api_key)

    # Served by FrontedAPI.serve_directly (router/front.py) below; declared here for the OpenAPI schema.
    # The body is validated by `parse_body` rather than FastAPI's dependency layer: the same
    # pydantic models and the same 400s, for about a third of the per-request cost.
    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest, settings.model))
    async def chat_completions(request: Request):
        return await serve(True, request.headers, await request.body())

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest, settings.model))
    async def completions(request: Request):
        return await serve(False, request.headers, await request.body())

    app.serve_directly("/v1/chat/completions", functools.partial(serve, True))
    app.serve_directly("/v1/completions", functools.partial(serve, False))
    # Every other route: a plain ASGI wrapper, not @app.middleware: Starlette's BaseHTTPMiddleware costs ~1 ms a call.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        auth.check(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": 0,
                                            "owned_by": "tandem"}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        live = directory.live()
        ok = any(w.role in ("decode", "colocated") for w in live)
        return JSONResponse({"ready": ok, "workers": {w.worker_id: w.role for w in live},
                             "redis": directory.redis_ok}, 200 if ok else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        for role in ("prefill", "decode", "colocated"):
            metrics.workers.labels(role).set(len(directory.live(role)))
        metrics.inflight.set(admission.running + admission.queued)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    app.state.directory = directory
    return app


