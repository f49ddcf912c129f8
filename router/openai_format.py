"""The OpenAI wire format on the router's side: request bodies in, choices / logprobs / SSE
frames / the `tandem` timing field out. Pure functions; the app wires them to the tokenizer."""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from common.protocol import TokenLogprob
from common.stops import find_stop
from router.trace import Trace

TokenText = Callable[[int], str]


def parse_body(model, raw: bytes):
    """`model` validated from the raw JSON body; errors become FastAPI's (OpenAI-format) 400."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from e


def body_schema(model, served_model: str | None) -> dict:
    """OpenAPI `requestBody` for an endpoint that parses its body with `parse_body`; nested
    models are inlined (pydantic's `#/$defs/...` refs do not resolve inside an OpenAPI document)
    and `model` names the one model a `--model` router serves (any other is a 404)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    if served_model:
        schema["properties"]["model"]["enum"] = [served_model]

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": inline(schema)}}}}


def text_chars(body, variables: frozenset[str] = frozenset()) -> int:
    """Characters of text a body asks to render and tokenize: every string of its messages
    (contents, tool calls and their arguments, names) and, of the template's arguments (tools,
    documents, `chat_template_kwargs`), those the chat template reads (`variables`); or a
    completions prompt's strings. What the cheap context-length check counts: a template may
    leave out part of what it reads, so a body is refused on this only far past the limit."""
    if hasattr(body, "messages"):  # what ChatFields.template_args passes, counted in place
        n = _chars(body.messages)
        if body.tools and body.tool_choice != "none" and "tools" in variables:
            n += sum(len(t.function.name) + len(t.function.description or "")
                     + _chars(t.function.parameters) for t in body.tools)
        if body.documents and "documents" in variables:
            n += _chars(body.documents)
        return n + sum(_chars(v) for k, v in (body.chat_template_kwargs or {}).items()
                       if k in variables)
    p = body.prompt
    if isinstance(p, str):
        return len(p)
    return sum(len(x) for x in p if isinstance(x, str))


def _chars(value) -> int:
    """The characters of every string value in a JSON-like value."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return total


def correlation_id(value: str | None) -> str | None:
    """A client's X-Request-Id as it may appear in logs and the `tandem` field: printable ASCII,
    at most 128 characters (anything else is dropped, never echoed)."""
    if not value:
        return None
    value = value[:128]
    return value if value.isascii() and value.isprintable() else None


def wants_logprobs(body, chat: bool) -> bool:
    # Chat asks with `logprobs: true`; completions with `logprobs: N` (0 included).
    return bool(body.logprobs) if chat else body.logprobs is not None


def chat_logprobs(lps: list[TokenLogprob], token_text: TokenText) -> dict:
    def entry(tid, lp):
        text = token_text(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**entry(x.token_id, x.logprob),
                         "top_logprobs": [entry(t, v) for t, v in x.top]} for x in lps]}


def completion_logprobs(lps: list[TokenLogprob], token_text: TokenText, pos: int = 0) -> dict:
    """Completions-style logprobs; `pos` is the text offset of the first token (streams go on)."""
    tokens = [token_text(x.token_id) for x in lps]
    offsets = []
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{token_text(t): v for t, v in x.top} for x in lps],
            "text_offset": offsets}


def cut_stops(text: str, stops: list[str], finish):
    """`text` cut before the earliest stop string (finish becomes "stop"), else unchanged."""
    found = find_stop(text, stops)
    if found is None:
        return text, finish
    return text[:found[0]], "stop"


def timing_field(trace: Trace | None, t_start: float, expose_workers: bool = False) -> dict:
    """The `tandem` field of a response: plan, workers (their ids carry addresses: only with
    `expose_workers`, an operator's choice), cached tokens and where the time went."""
    if trace is None:
        return {}
    wt = trace.worker_timing
    workers = {"prefill_worker": trace.prefill_worker, "decode_worker": trace.decode_worker,
               "kv_source": trace.kv_source} if expose_workers else {}
    return {"plan": trace.plan, "client_request_id": trace.client_request_id, **workers,
            "num_cached_tokens": trace.num_cached_tokens,
            "num_cached_tokens_by_medium": trace.num_cached_tokens_by_medium,
            "num_pulled_tokens": trace.num_pulled_tokens,
            "handoff_held_tokens": trace.handoff_held_tokens,
            "handoff_pulled_tokens": trace.handoff_pulled_tokens,
            "handoff_cached_tokens": trace.handoff_cached_tokens, "queue_s": wt.queue_s,
            "prefill_s": trace.prefill_s, "transfer_s": wt.transfer_s,
            "transfer_bytes": wt.transfer_bytes,
            "decode_s": wt.decode_s, "total_s": time.perf_counter() - t_start,
            "retries": trace.retries, "resumed": trace.resumed, "fallback": trace.fallback,
            # When the router had the first token: the client may see it later (a token that is
            # part of a multi-byte character, or held back by a possible stop string, has no text).
            "first_token_s": None if trace.first_token_at is None
                             else trace.first_token_at - t_start}


def sse_data(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
