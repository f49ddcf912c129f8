"""OpenAI responses from a request's stream of worker events: one JSON body (with `n` choices),
or SSE chunks with stop strings cut on text, logprobs, usage and the `tandem` timing field."""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import AsyncExitStack

import orjson
from fastapi import Response

from common.openai_response import choice, envelope, usage
from common.protocol import Tenant, TokenLogprob
from common.tool_calls import ToolCalls
from router.clients import cache_salt, client_tag
from router.gateway import Gateway
from router.models import ServedModel
from router.openai_format import (
    chat_logprobs,
    completion_logprobs,
    cut_stops,
    timing_field,
    wants_logprobs,
)
from router.sse import DeadlineStreamingResponse, sse


async def complete(gw: Gateway, body, chat: bool, client_rid: str | None, api_key: str | None,
                   client: str = "", body_bytes: int = 0) -> Response:
    t_start = time.perf_counter()
    model = gw.model_for(body)
    gw.metrics.add_model(model.name)
    prompt = await gw.prompt_ids(model, body, body_bytes)
    max_tokens = body.requested_max_tokens() or gw.settings.max_tokens_default
    await gw.limiter.charge(api_key, (len(prompt) + max_tokens) * body.n)
    # The router names every request itself: a client's X-Request-Id is only a correlation id
    # (logs, the `tandem` field). Reused client ids once collided on the workers (500s, an open
    # circuit breaker, 503 for everyone).
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{os.urandom(12).hex()}"
    gw.metrics.prompt_tokens.labels(model.name).inc(len(prompt) * body.n)
    created = int(time.time())
    # Every choice is validated before any starts (and before an admission slot is taken).
    opts = await gw.choices.options(body, model, client)  # grammar checks: clients in turn
    # Who sent it, as workers act on it: they share their batch fairly between clients, and
    # its blocks are salted apart from other keys' (and by the request's own cache_salt).
    s = gw.settings
    tag = Tenant(client_tag(client), cache_salt(api_key, body.cache_salt, s.hash_salt,
                                                s.cache_salt_per_key))
    async with AsyncExitStack() as admitted:
        await admitted.enter_async_context(gw.admission.slot(body.priority, body.n, client))
        if body.stream:
            gens = [gw.run_one(body, model, prompt, opts[i], rid if body.n == 1 else f"{rid}-{i}",
                               client_rid, tag) for i in range(body.n)]
            for gen in gens:  # closed with the stream, or here if a choice fails to start
                admitted.push_async_callback(gen.aclose)
            # Errors before the first token are HTTP errors (the headers are not sent yet). Every
            # choice's start is awaited before one error is raised: a generator still running
            # cannot be closed.
            firsts = await asyncio.gather(*[anext(gen, None) for gen in gens],
                                          return_exceptions=True)
            for first in firsts:
                if isinstance(first, BaseException):
                    raise first
            # The stream holds the admission slot (and its worker streams) until it ends.
            slot = admitted.pop_all()
            return DeadlineStreamingResponse(
                sse(gw, model, list(zip(firsts, gens, strict=True)), body, chat, rid, created,
                    prompt, t_start, slot),
                write_timeout_s=gw.settings.stream_write_timeout_s,
                open_streams=gw.open_streams, media_type="text/event-stream")
        if body.n == 1:  # no task per choice for the common case
            one = gw.run_one(body, model, prompt, opts[0], rid, client_rid, tag)
            results = [await _collect(gw, model, one, body, t_start)]
        else:
            results = await _all_or_none([
                _collect(gw, model, gw.run_one(body, model, prompt, opts[i],
                                               f"{rid}-{i}", client_rid, tag),
                         body, t_start)
                for i in range(body.n)])
    return _json_response(gw, model, results, body, chat, rid, created, prompt, t_start)


async def _all_or_none(coros) -> list:
    """Every result, or the first error with the other choices cancelled (their worker streams
    closed, which aborts them on the workers): one failed choice fails the request, and nothing
    keeps generating for a client that already has its 4xx."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _token_text(model: ServedModel):
    return lambda token_id: model.tokenizer.decode([token_id], skip_special_tokens=False)


def _json_response(gw: Gateway, model: ServedModel, results, body, chat, rid, created, prompt,
                   t_start) -> Response:
    choices = []
    n_out = 0
    want_lp = wants_logprobs(body, chat)
    to_logprobs = chat_logprobs if chat else completion_logprobs
    tools = ToolCalls.for_request(body, chat, gw.settings.tool_call_parser)
    for i, (tokens, text, finish, lps, _trace) in enumerate(results):
        n_out += len(tokens)
        c = choice(i, text, finish, chat, to_logprobs(lps, _token_text(model)) if want_lp else None)
        if tools is not None:
            content, calls = tools.split(text)
            if calls:
                c["message"] = {"role": "assistant", "content": content,
                                "tool_calls": [call.message() for call in calls]}
                c["finish_reason"] = "tool_calls"
        choices.append(c)
    gw.metrics.count(200, model.name)
    timing = timing_field(results[0][4], t_start, gw.settings.expose_worker_ids)
    trace = results[0][4]
    cached = trace.num_cached_tokens if trace is not None else None
    out = envelope(rid, chat, created, body.model, choices,
                   usage_=usage(len(prompt), n_out, cached))
    out["tandem"] = timing
    return Response(orjson.dumps(out), media_type="application/json",
                    headers={"x-tandem-timing": orjson.dumps(timing).decode()})


async def _collect(gw: Gateway, model: ServedModel, gen, body, t_start):
    tokens: list[int] = []
    lps: list[TokenLogprob] = []
    finish, trace = None, None
    first = True
    async for ev, trace in gen:  # noqa: B007 - the last trace is kept
        if first:
            gw.metrics.ttft.labels(model.name).observe(time.perf_counter() - t_start)
            first = False
        tokens.extend(ev.token_ids)
        lps.extend(ev.logprobs or [])
        finish = ev.finish_reason or finish
    # Same incremental detokenizer as the stream (and the engine): identical text either way.
    stream = model.tokenizer.decode_stream()
    text, finish = cut_stops("".join(stream.step(t) for t in tokens), body.stop, finish)
    gw.metrics.completion_tokens.labels(model.name).inc(len(tokens))
    gw.metrics.latency.labels(model.name).observe(time.perf_counter() - t_start)
    gw.observe_trace(trace)
    return tokens, text, finish, lps, trace
