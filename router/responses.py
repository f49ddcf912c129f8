"""OpenAI responses from a request's stream of worker events: one JSON body (with `n` choices),
or SSE chunks with stop strings cut on text, logprobs, usage and the `tandem` timing field."""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import AsyncExitStack

import orjson
from fastapi import Response
from fastapi.responses import StreamingResponse

from common.errors import APIError
from common.openai_response import choice, chunk_choice, envelope, usage
from common.protocol import TokenLogprob
from common.streams import prepend
from router.gateway import Gateway
from router.models import ServedModel
from router.openai_format import (
    chat_logprobs,
    completion_logprobs,
    cut_stops,
    sse_data,
    timing_field,
    wants_logprobs,
)
from router.tool_calls import ToolCalls, ToolStream


async def complete(gw: Gateway, body, chat: bool, client_rid: str | None, api_key: str | None) -> Response:
    t_start = time.perf_counter()
    model = gw.model_for(body)
    gw.metrics.add_model(model.name)
    prompt = await gw.prompt_ids(model, body)
    max_tokens = body.requested_max_tokens() or gw.settings.max_tokens_default
    await gw.limiter.charge(api_key, (len(prompt) + max_tokens) * body.n)
    # The router names every request itself: a client's X-Request-Id is only a correlation id
    # (logs, the `tandem` field). Reused client ids once collided on the workers (500s, an open
    # circuit breaker, 503 for everyone).
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{os.urandom(12).hex()}"
    gw.metrics.prompt_tokens.labels(model.name).inc(len(prompt) * body.n)
    created = int(time.time())
    if body.stream and body.n != 1:
        raise APIError(400, "streaming supports n=1 only", "invalid_request", "n")
    async with AsyncExitStack() as admitted:
        await admitted.enter_async_context(gw.admission.slot(body.priority))
        if body.stream:
            gen = gw.run_one(body, model, prompt, 0, rid, client_rid)
            try:
                first = await anext(gen)
            except StopAsyncIteration:
                first = None
            # The stream holds the admission slot from here until it ends.
            slot = admitted.pop_all()
            return StreamingResponse(_sse(gw, model, first, gen, body, chat, rid, created, prompt,
                                          t_start, slot),
                                     media_type="text/event-stream")
        if body.n == 1:  # no task per choice for the common case
            results = [await _collect(gw, model, gw.run_one(body, model, prompt, 0, rid, client_rid),
                                      body, t_start)]
        else:
            results = await asyncio.gather(*[
                _collect(gw, model, gw.run_one(body, model, prompt, i, f"{rid}-{i}", client_rid),
                         body, t_start)
                for i in range(body.n)])
    return _json_response(gw, model, results, body, chat, rid, created, prompt, t_start)


def _tool_calls(gw: Gateway, body, chat: bool) -> ToolCalls | None:
    if not chat or not body.tools:
        return None
    tools = ToolCalls(body.tools, body.tool_choice, gw.settings.tool_call_parser)
    return tools if tools.active else None


def _token_text(model: ServedModel):
    return lambda token_id: model.tokenizer.decode([token_id], skip_special_tokens=False)


def _json_response(gw: Gateway, model: ServedModel, results, body, chat, rid, created, prompt,
                   t_start) -> Response:
    choices = []
    n_out = 0
    want_lp = wants_logprobs(body, chat)
    to_logprobs = chat_logprobs if chat else completion_logprobs
    tools = _tool_calls(gw, body, chat)
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
    timing = timing_field(results[0][4], t_start)
    trace = results[0][4]
    cached = trace.num_cached_tokens if trace is not None else None
    out = envelope(rid, chat, created, body.model, choices, usage_=usage(len(prompt), n_out, cached))
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


async def _sse(gw: Gateway, served: ServedModel, first, gen, body, chat, rid, created, prompt,
               t_start, slot: AsyncExitStack):
    metrics, model, label = gw.metrics, body.model, served.name
    stream = served.tokenizer.decode_stream()
    token_text = _token_text(served)
    stops = body.stop
    hold = max((len(s) for s in stops), default=1) - 1
    text_sent, text_all = 0, ""
    n_out = 0
    trace = None
    last_t = None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    want_lp = wants_logprobs(body, chat)
    tools = _tool_calls(gw, body, chat)
    tool_stream = ToolStream(tools) if tools is not None else None
    pending_lps: list[TokenLogprob] = []  # tokens whose logprobs go out with the next text chunk
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
        return envelope(rid, chat, created, model, [chunk_choice(delta, finish, chat, lp)], stream=True)

    try:
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
                    metrics.ttft.labels(label).observe(now - t_start)
                else:
                    metrics.itl.labels(label).observe(now - last_t)
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
                    piece, text_sent = text_all[text_sent:safe], safe
                    if tool_stream is None:
                        yield sse_data(chunk(piece, None))
                    else:
                        for data in _tool_chunks(chunk, tool_stream.feed(piece)):
                            yield data
                if finish:
                    break
            if tool_stream is not None:
                for data in _tool_chunks(chunk, tool_stream.finish()):
                    yield data
                if tool_stream.num_calls:
                    finish = "tool_calls"
            final = chunk("", finish or "stop")
            final["tandem"] = timing_field(trace, t_start)
            yield sse_data(final)
            if include_usage:
                yield sse_data(envelope(rid, chat, created, model, [], stream=True,
                                        usage_=usage(len(prompt), n_out,
                                                     trace.num_cached_tokens if trace else None)))
            yield b"data: [DONE]\n\n"
            metrics.count(200, label)
            metrics.completion_tokens.labels(label).inc(n_out)
            metrics.latency.labels(label).observe(time.perf_counter() - t_start)
            gw.observe_trace(trace)
        except APIError as e:
            metrics.count(e.status, label)
            yield sse_data({"error": {"message": e.message, "type": "server_error", "code": e.code}})
            yield b"data: [DONE]\n\n"
    finally:
        await gen.aclose()  # client gone: closing the worker stream aborts both legs
        await slot.aclose()


def _tool_chunks(chunk, out: tuple[str, list[dict]]):
    """SSE frames of one step of a ToolStream: its content, then its tool-call deltas."""
    content, deltas = out
    if content:
        yield sse_data(chunk(content, None))
    if deltas:
        frame = chunk("", None)
        frame["choices"][0]["delta"] = {"tool_calls": deltas}
        yield sse_data(frame)
