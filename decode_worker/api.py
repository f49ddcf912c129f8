"""`POST /generate` (docs/contract.md "Worker <-> router API"): NDJSON, or SSE with
`Accept: text/event-stream`, of `StreamEvent`s."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from common.auth import require_internal_token
from common.protocol import GenerateRequest, StreamEvent, TokenLogprob
from common.streams import prepend
from engine.engine_client import EngineDeadError
from engine.llm_engine import RequestOutput
from engine.output_stream import StreamEnded
from worker.errors import APIError, api_error
from worker.generation import stream_generate
from worker.handoff import handoff_event
from worker.internal_api import sampling_params
from worker.state import WorkerState


def generate_router(state: WorkerState) -> APIRouter:
    router = APIRouter(
        dependencies=[Depends(require_internal_token(state.settings.internal_token))])

    @router.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> StreamingResponse:
        params = sampling_params(req.sampling)
        sse = "text/event-stream" in request.headers.get("accept", "")
        items = stream_generate(state, req, params, handoff=True)
        # Surface request errors (400/503) as HTTP errors, before the stream starts.
        handed_off = False
        try:
            first = await anext(items)
        except StopAsyncIteration:
            first = None
        except StreamEnded:  # handed off before its first token
            first, handed_off = None, True
        except (APIError, EngineDeadError) as e:
            state.metrics.requests.labels("generate", str(api_error(e).status)).inc()
            raise

        async def body():
            emitted: list[int] = []
            try:
                if handed_off:
                    raise StreamEnded(req.request_id)
                async for out, timing in prepend([first] if first else [], items):
                    emitted.extend(out.new_token_ids)
                    ev = _event(req.request_id, out, params.logprobs is not None)
                    ev.timing = timing
                    if timing is not None and timing.num_pulled_tokens:
                        _uncount_pulled(ev, timing.num_pulled_tokens)
                    yield _frame(ev, sse, final=ev.finish_reason is not None)
                state.metrics.requests.labels("generate", "200").inc()
            except StreamEnded:
                # A drain hands the stream over: the router resumes it elsewhere, pulling these
                # blocks from here (worker/handoff.py).
                state.metrics.requests.labels("generate", "200").inc()
                core = state.core
                yield _frame(handoff_event(req, emitted, core.hasher, core.block_size), sse)
            except EngineDeadError as e:
                # Headers are sent: end the stream with an error event (the router resumes
                # the request elsewhere), not a cut connection.
                state.metrics.requests.labels("generate", "503").inc()
                yield _frame(StreamEvent(request_id=req.request_id, error=str(e)), sse)
            finally:
                await items.aclose()

        media = "text/event-stream" if sse else "application/x-ndjson"
        return StreamingResponse(body(), media_type=media)

    return router


def _event(rid: str, out: RequestOutput, with_logprobs: bool) -> StreamEvent:
    lps = None
    if with_logprobs and out.logprobs:
        lps = [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=lp.top)
               for lp in out.logprobs[-len(out.new_token_ids):]] if out.new_token_ids else []
    return StreamEvent(request_id=rid, token_ids=out.new_token_ids, logprobs=lps,
                       finish_reason=out.finish_reason,
                       num_cached_tokens=out.num_cached_tokens if out.finished else None,
                       num_cached_tokens_by_medium=(out.num_cached_tokens_by_medium
                                                    if out.finished else None))


def _uncount_pulled(ev: StreamEvent, num_pulled: int) -> None:
    """`num_cached_tokens` says what was here already: the tokens pulled from a peer (into the
    device tier) are the timing's `num_pulled_tokens` instead."""
    if ev.num_cached_tokens is not None:
        ev.num_cached_tokens = max(ev.num_cached_tokens - num_pulled, 0)
    if ev.num_cached_tokens_by_medium:
        by = dict(ev.num_cached_tokens_by_medium)
        by["device"] = max(by.get("device", 0) - num_pulled, 0)
        ev.num_cached_tokens_by_medium = by


def _frame(ev: StreamEvent, sse: bool, final: bool = False) -> bytes:
    data = ev.model_dump_json(exclude_none=True)
    if sse:
        return f"data: {data}\n\n".encode() + (b"data: [DONE]\n\n" if final else b"")
    return (data + "\n").encode()
