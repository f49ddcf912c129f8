"""OpenAI endpoints on the workers, with vLLM NixlConnector semantics for P/D routers.

- prefill worker, `kv_transfer_params: {"do_remote_decode": true}` (and `max_tokens: 1`): prefill,
  keep the blocks under a lease, answer with the first token and a top-level `kv_transfer_params`
  (`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`,
  `remote_request_id`, ...).
- decode worker given those params: pull the blocks (all prompt tokens but the last, which it
  recomputes, as vLLM's decode side does), then generate as usual.
- `/v1/completions/render` and `/v1/chat/completions/render` tokenize (vllm-router's cache-aware
  policy calls them).
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.auth import require_internal_token
from common.bounds import (
    MaxTokens,
    PromptTokenIds,
    is_request_id,
)
from common.chat_messages import ChatFields
from common.errors import validation_detail
from common.openai_request import OpenAISampling, prompt_token_ids
from common.openai_response import choice, chunk_choice, envelope, usage
from common.protocol import GenerateRequest, KVTransferParams, Tenant
from common.streams import prepend
from common.tool_calls import ToolCalls, ToolStream, constrain_tools
from engine.engine_client import EngineDeadError
from engine.sampling_params import SamplingParams
from worker.abortable import run_abortable
from worker.errors import APIError
from worker.generation import stream_generate
from worker.state import WorkerState


class _StreamOptions(BaseModel):
    include_usage: bool = False


class _OpenAIBase(OpenAISampling):
    # vLLM clients send fields we ignore (return_token_ids, tp_size, ...): allowed, but every
    # field we read is bounded by common/bounds.py, like the router's and the internal API's.
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, max_length=256)
    max_completion_tokens: MaxTokens | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    kv_transfer_params: KVTransferParams | None = None


class CompletionBody(_OpenAIBase):
    prompt: str | PromptTokenIds | list[str] | list[PromptTokenIds]


class ChatBody(_OpenAIBase, ChatFields):
    pass


def _params(body: _OpenAIBase) -> SamplingParams:
    try:
        opts = body.sampling_options(default_max_tokens=16)
    except ValidationError as e:  # pydantic's own text (its URL, class names) is not for callers
        message, field = validation_detail(e)
        raise APIError(400, message, "invalid_sampling_params", field) from e
    except ValueError as e:  # common/structured.py StructuredError: "<field>: ..."
        raise APIError(400, str(e), "invalid_sampling_params", getattr(e, "param", None)) from e
    if isinstance(body, ChatBody):
        try:
            opts = constrain_tools(body, opts)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_sampling_params",
                           getattr(e, "param", "tool_choice")) from e
    return SamplingParams.from_options(opts)


def openai_router(state: WorkerState) -> APIRouter:
    router = APIRouter(
        dependencies=[Depends(require_internal_token(state.settings.internal_token))])
    core = state.core
    tok = core.tokenizer

    def prompt_ids(body: CompletionBody | ChatBody) -> list[int]:
        return prompt_token_ids(tok, body)

    names = state.served_names

    async def handle(body: CompletionBody | ChatBody, request: Request, chat: bool):
        if body.model is not None and body.model not in names:
            raise APIError(404, f"model {body.model!r} does not exist; this worker serves "
                           f"{', '.join(map(repr, names))}", "model_not_found", "model")
        model = body.model or names[0]
        ids = prompt_ids(body)
        params = _params(body)
        tools = ToolCalls.for_request(body, chat, "hermes")
        rid = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        if not is_request_id(rid):
            raise APIError(400, "X-Request-Id must be 1-256 characters of [A-Za-z0-9._:-]",
                           "invalid_request_id")
        created = int(time.time())
        kvp = body.kv_transfer_params
        run_prefill = state.parts.prefill
        if kvp is not None and kvp.do_remote_decode and run_prefill is not None:
            resp = await run_abortable(state, request, rid, run_prefill(
                state, rid, ids, params, None, always_export=True,
                tenant=Tenant(cache_salt=body.cache_salt)))
            state.metrics.requests.labels("openai_prefill", "200").inc()
            text = tok.decode([resp.first_token_id])
            out_kvp = (resp.kv_transfer_params.model_dump()
                       if resp.kv_transfer_params.do_remote_prefill else None)
            if out_kvp is not None:
                out_kvp["tp_size"] = 1
            return JSONResponse(_body(rid, created, model, text, [resp.first_token_id],
                                      resp.finish_reason or "length", len(ids), 1, chat, out_kvp))
        output_ids: list[int] = []
        if kvp is not None and kvp.do_remote_prefill and state.settings.role == "prefill":
            raise APIError(400, "this is a prefill worker; send the decode leg to a decode worker")
        req = GenerateRequest(request_id=rid, prompt_token_ids=ids, output_token_ids=output_ids,
                              sampling=params.to_options(), kv_transfer_params=kvp,
                              cache_salt=body.cache_salt)
        items = stream_generate(state, req, params)
        state.metrics.requests.labels("openai_decode" if kvp else "openai", "200").inc()
        if body.stream:
            first = await anext(items)

            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def sse():
                sent = ""  # cumulative text: deltas never split a multi-byte character
                num_output, cached = 0, None
                calls = ToolStream(tools) if tools is not None else None
                try:
                    async for out, _ in prepend([first], items):
                        delta, sent = out.text[len(sent):], out.text
                        num_output, cached = len(out.token_ids), out.num_cached_tokens
                        if calls is None:
                            yield _sse_chunk(rid, created, model, delta,
                                             out.new_token_ids, out.finish_reason, chat)
                            continue
                        for frame in _tool_frames(rid, created, model, calls.feed(delta),
                                                  out.new_token_ids):
                            yield frame
                        if out.finish_reason is not None:
                            for frame in _tool_frames(rid, created, model, calls.finish(), []):
                                yield frame
                            finish = "tool_calls" if calls.num_calls else out.finish_reason
                            yield _sse_chunk(rid, created, model, "", [], finish, chat)
                except EngineDeadError as e:
                    # Headers are sent: end the stream with an error event, not a cut connection.
                    yield _sse_json({"error": {"message": str(e), "type": "server_error",
                                               "param": None, "code": 503}})
                    return
                if include_usage:
                    yield _sse_json(envelope(rid, chat, created, model, [], stream=True,
                                             usage_=usage(len(ids), num_output, cached)))
                yield b"data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        last = None
        async for last, _ in items:  # noqa: B007
            pass
        body_out = _body(rid, created, model, last.text, last.token_ids, last.finish_reason,
                         len(ids), len(last.token_ids), chat, None, last.num_cached_tokens)
        content, calls = tools.split(last.text) if tools is not None else (last.text, [])
        if calls:
            c = body_out["choices"][0]
            c["message"] = {"role": "assistant", "content": content,
                            "tool_calls": [call.message() for call in calls]}
            c["finish_reason"] = "tool_calls"
        return JSONResponse(body_out)

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "tandem", "root": str(core.folder),
             "max_model_len": core.max_model_len} for name in names]}

    @router.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        return await handle(body, request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        return await handle(body, request, chat=True)

    @router.post("/v1/completions/render")
    async def render_completion(body: CompletionBody) -> dict:
        ids = prompt_ids(body)
        return {"prompt_token_ids": ids, "token_ids": ids, "num_tokens": len(ids)}

    @router.post("/v1/chat/completions/render")
    async def render_chat(body: ChatBody) -> dict:
        ids = prompt_ids(body)
        gen = body.add_generation_prompt and not body.continue_final_message
        return {"prompt": tok.apply_chat_template(body.messages, gen, **body.template_args()),
                "prompt_token_ids": ids,
                "token_ids": ids, "num_tokens": len(ids)}

    return router



def _body(rid, created, model, text, token_ids, finish, n_prompt, n_out, chat, kvp,
          cached: int | None = None) -> dict:
    c = choice(0, text, finish, chat)
    c["token_ids"] = token_ids  # vLLM's return_token_ids: P/D proxies read them
    body = envelope(rid, chat, created, model, [c], usage_=usage(n_prompt, n_out, cached))
    if kvp is not None:
        body["kv_transfer_params"] = kvp
    return body


def _sse_json(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _sse_chunk(rid, created, model, delta, token_ids, finish, chat) -> bytes:
    c = chunk_choice(delta, finish, chat)
    c["token_ids"] = token_ids
    return _sse_json(envelope(rid, chat, created, model, [c], stream=True))


def _tool_frames(rid, created, model, out: tuple[str, list[dict]], token_ids: list[int]):
    """SSE frames of one ToolStream step: its content, then its tool-call deltas."""
    content, deltas = out
    if content:
        yield _sse_chunk(rid, created, model, content, token_ids, None, True)
    if deltas:
        c = chunk_choice("", None, True)
        c["delta"] = {"tool_calls": deltas}
        yield _sse_json(envelope(rid, True, created, model, [c], stream=True))
