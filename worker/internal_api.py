"""Tandem's internal worker API (DESIGN.md "Worker <-> router API"): /prefill, /generate, /abort."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from common.auth import require_internal_token
from common.hashing import hash_tokens
from common.protocol import (
    GenerateRequest,
    KVTransferParams,
    PrefillRequest,
    PrefillResponse,
    RequestTiming,
    StreamEvent,
    TokenLogprob,
)
from common.streams import prepend
from engine.engine_client import EngineDeadError
from engine.llm_engine import DuplicateRequestId, RequestOutput
from engine.sampling_params import SamplingParams
from kv_transfer import handle
from kv_transfer.layout import BlockRangeError, LayoutMismatch
from kv_transfer.transport import TransferError, TransferTimeout
from worker.errors import APIError, api_error
from worker.state import WorkerState

log = logging.getLogger(__name__)


def sampling_params(options) -> SamplingParams:
    try:
        return SamplingParams.from_options(options)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_sampling_params") from e


async def run_prefill(state: WorkerState, request_id: str, prompt: list[int],
                      params: SamplingParams, lease_seconds: float | None,
                      always_export: bool = False) -> PrefillResponse:
    """Prefill to the first token; keep and export the prompt's blocks unless already finished.

    `always_export` is vLLM's semantics: the proxy caps the prefill leg at `max_tokens: 1` and the
    decode side recomputes the last prompt token, so the blocks are kept whatever the first token.
    """
    s = state.settings
    if lease_seconds is not None and lease_seconds > s.max_lease_seconds:
        raise APIError(400, f"lease_seconds must be at most {s.max_lease_seconds}", "invalid_lease",
                       "lease_seconds")
    if state.num_prefill_inflight >= s.max_queue:
        state.metrics.shed.inc()
        raise APIError(503, "prefill queue is full", "overloaded", headers={"Retry-After": "1"})
    state.num_prefill_inflight += 1
    engine, core = state.engine, state.core
    try:
        out: RequestOutput | None = None
        try:
            async for out in engine.generate(request_id, prompt, params, hold_blocks=True):  # noqa: B007
                pass
        except ValueError as e:
            raise api_error(e) or APIError(400, str(e), "invalid_prompt") from e
    finally:
        state.num_prefill_inflight -= 1
    assert out is not None and out.finished
    if out.finish_reason == "abort":
        raise APIError(503, "request was aborted", "aborted")
    _observe_first_token(state, out, "prefill")
    done = not always_export and (out.finish_reason == "stop" or params.max_tokens <= 1)
    kv = KVTransferParams()
    if done or state.connector is None:
        await engine.call("release", request_id)
    else:
        block_ids = await engine.call("block_table", request_id)
        exported = state.connector.export(request_id, block_ids, lease_seconds)
        fields = dict(do_remote_prefill=True, remote_host=s.public_host, remote_port=s.port,
                      block_hashes=core.hasher(prompt), num_tokens=len(prompt),
                      prompt_hash=hash_tokens(prompt), expires_at=exported["lease_expires_at"],
                      **exported)
        kv = KVTransferParams(**handle.sign(fields, s.internal_token))
    lp = out.logprobs[0] if out.logprobs else None
    return PrefillResponse(
        request_id=request_id,
        first_token_id=out.token_ids[0],
        num_cached_tokens=out.num_cached_tokens,
        kv_transfer_params=kv,
        first_token_logprob=TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=lp.top) if lp else None,
        finish_reason=out.finish_reason if done else None,
    )


def _observe_first_token(state: WorkerState, out: RequestOutput, pool: str) -> None:
    m = state.metrics
    m.prompt_tokens.inc(len(out.prompt_token_ids))
    m.cache_hit_tokens.labels(pool).inc(out.num_cached_tokens)
    if out.first_scheduled_time is not None:
        m.queue_time.observe(out.first_scheduled_time - out.arrival_time)
    if out.first_token_time is not None:
        m.prefill_time.observe(out.first_token_time - out.arrival_time)


async def stream_generate(
    state: WorkerState, req: GenerateRequest, params: SamplingParams
) -> AsyncIterator[tuple[RequestOutput, RequestTiming | None]]:
    """Outputs of one decode request, the last one with its timing; with remote KV it imports
    first, falling back to local prefill if the pull fails."""
    engine = state.engine
    rid = req.request_id
    kvp = req.kv_transfer_params
    t0 = time.monotonic()
    transfer_s, transfer_bytes = 0.0, 0
    try:
        q = engine.open_stream(rid)
    except DuplicateRequestId as e:
        raise api_error(e) from e
    added = False
    try:
        # An invalid handle means a local prefill: nothing is pulled, nothing foreign is cached.
        remote = (kvp is not None and kvp.do_remote_prefill and state.connector is not None
                  and _handle_ok(state, kvp, req.prompt_token_ids, rid))
        if not remote:
            kvp = None
        if remote:
            try:
                block_table, num_local = await engine.call(
                    "import_request", rid, req.prompt_token_ids, params, req.output_token_ids)
            except MemoryError as e:
                raise APIError(503, str(e), "out_of_kv_blocks", headers={"Retry-After": "1"}) from e
            except ValueError as e:
                raise api_error(e) or APIError(400, str(e), "invalid_prompt") from e
            added = True
            ok, transfer_bytes = await _pull(state, kvp, rid, block_table, num_local,
                                             len(req.prompt_token_ids) + len(req.output_token_ids) - 1)
            transfer_s = time.monotonic() - t0
            if not await engine.call("finish_import", rid, ok):
                return  # aborted while pulling
        else:
            try:
                await engine.call("add_request", rid, req.prompt_token_ids, params,
                                  req.output_token_ids)
            except ValueError as e:
                raise api_error(e) or APIError(400, str(e), "invalid_prompt") from e
            added = True
        first = True
        async for out in engine.outputs(rid, q):
            if first and kvp is None:
                _observe_first_token(state, out, "decode")
            first = False
            state.metrics.generated_tokens.inc(len(out.new_token_ids))
            timing = None
            if out.finished:
                added = False
                # An imported request is created before its pull; the pull is not queueing.
                queue_s = (out.first_scheduled_time - out.arrival_time - transfer_s
                           if out.first_scheduled_time else 0.0)
                timing = RequestTiming(queue_s=max(queue_s, 0.0), transfer_s=transfer_s,
                                       transfer_bytes=transfer_bytes,
                                       decode_s=time.monotonic() - t0 - transfer_s)
            yield out, timing
    finally:
        engine.close_stream(rid)
        if added and engine.alive:
            engine.post("abort_request", rid)


def _handle_ok(state: WorkerState, kvp: KVTransferParams, prompt: list[int], rid: str) -> bool:
    """Whether this worker may pull with `kvp` for `prompt` (kv_transfer/handle.py): signed by a
    holder of the internal token, unexpired, and issued for exactly this prompt."""
    s = state.settings
    try:
        handle.verify(kvp, s.internal_token, prompt, state.core.hasher(prompt),
                      s.require_signed_handles)
    except handle.InvalidHandle as e:
        state.metrics.pull_fallbacks.labels("invalid_handle").inc()
        log.warning("refused a KV handle (%s); prefilling locally", e, extra={"request_id": rid})
        return False
    return True


async def _pull(state: WorkerState, kvp: KVTransferParams, rid: str, block_table: list[int],
                num_local: int, num_kv_tokens: int) -> tuple[bool, int]:
    """(pulled or held everything, bytes moved)."""
    connector, core = state.connector, state.core
    num_kv_blocks = -(-num_kv_tokens // core.block_size)
    remote = kvp.remote_block_ids or []
    remote_rid = kvp.remote_request_id or rid
    try:
        if len(remote) < num_kv_blocks or not kvp.remote_host or kvp.remote_port is None:
            raise TransferError(f"kv_transfer_params name {len(remote)} blocks and "
                                f"{kvp.remote_host}:{kvp.remote_port}; {num_kv_blocks} blocks needed")
        peer = await connector.peer(kvp.remote_engine_id, f"http://{kvp.remote_host}:{kvp.remote_port}")
        if num_local >= num_kv_blocks:
            await connector.notify(peer, remote_rid)
            return True, 0
        stats = await connector.fetch(peer, remote_rid, remote[num_local:num_kv_blocks],
                                      block_table[num_local:num_kv_blocks])
        return True, stats.num_bytes
    except (TransferError, LayoutMismatch, BlockRangeError, ValueError) as e:
        reason = "timeout" if isinstance(e, TransferTimeout) or "timed out" in str(e) else type(e).__name__
        state.metrics.pull_fallbacks.labels(reason).inc()
        log.warning("KV pull failed (%s); prefilling locally", e, extra={"request_id": rid})
        return False, 0
    except Exception as e:  # noqa: BLE001 - whatever a peer sent, the request falls back
        state.metrics.pull_fallbacks.labels("error").inc()
        log.exception("KV pull failed unexpectedly (%s); prefilling locally", e,
                      extra={"request_id": rid})
        return False, 0


def _event(rid: str, out: RequestOutput, with_logprobs: bool) -> StreamEvent:
    lps = None
    if with_logprobs and out.logprobs:
        lps = [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=lp.top)
               for lp in out.logprobs[-len(out.new_token_ids):]] if out.new_token_ids else []
    return StreamEvent(request_id=rid, token_ids=out.new_token_ids, logprobs=lps,
                       finish_reason=out.finish_reason,
                       num_cached_tokens=out.num_cached_tokens if out.finished else None)


def internal_router(state: WorkerState) -> APIRouter:
    auth = [Depends(require_internal_token(state.settings.internal_token))]
    router = APIRouter(dependencies=auth)
    role = state.settings.role

    if role in ("prefill", "colocated"):
        @router.post("/prefill", response_model=PrefillResponse)
        async def prefill(req: PrefillRequest) -> PrefillResponse:
            params = sampling_params(req.sampling)
            try:
                resp = await run_prefill(state, req.request_id, req.prompt_token_ids, params,
                                         req.lease_seconds)
            except APIError as e:
                state.metrics.requests.labels("prefill", str(e.status)).inc()
                raise
            state.metrics.requests.labels("prefill", "200").inc()
            return resp

    if role in ("decode", "colocated"):
        @router.post("/generate")
        async def generate(req: GenerateRequest, request: Request) -> StreamingResponse:
            params = sampling_params(req.sampling)
            sse = "text/event-stream" in request.headers.get("accept", "")
            items = stream_generate(state, req, params)
            # Surface request errors (400/503) as HTTP errors, before the stream starts.
            try:
                first = await anext(items)
            except StopAsyncIteration:
                first = None
            except (APIError, EngineDeadError) as e:
                status = api_error(e).status
                state.metrics.requests.labels("generate", str(status)).inc()
                raise

            async def body():
                try:
                    async for out, timing in prepend([first] if first else [], items):
                        ev = _event(req.request_id, out, params.logprobs is not None)
                        ev.timing = timing
                        yield _frame(ev, sse, final=ev.finish_reason is not None)
                    state.metrics.requests.labels("generate", "200").inc()
                except EngineDeadError as e:
                    # Headers are sent: end the stream with an error event (the router resumes
                    # the request elsewhere), not a cut connection.
                    state.metrics.requests.labels("generate", "503").inc()
                    yield _frame(StreamEvent(request_id=req.request_id, error=str(e)), sse)
                finally:
                    await items.aclose()

            media = "text/event-stream" if sse else "application/x-ndjson"
            return StreamingResponse(body(), media_type=media)

    @router.post("/abort/{request_id}")
    async def abort(request_id: str) -> dict:
        cancelled = state.connector.cancel_export(request_id) if state.connector else False
        aborted = await state.engine.abort(request_id)
        return {"request_id": request_id, "aborted": aborted or cancelled}

    return router



def _frame(ev: StreamEvent, sse: bool, final: bool = False) -> bytes:
    data = ev.model_dump_json(exclude_none=True)
    if sse:
        return f"data: {data}\n\n".encode() + (b"data: [DONE]\n\n" if final else b"")
    return (data + "\n").encode()

