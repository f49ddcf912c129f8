"""One request's generation on this worker, shared by `/generate` and the OpenAI endpoints:
with a KV handle the role's importer pulls the prompt's blocks first (local prefill if the worker
has no importer; if the pull fails, local prefill or an error by --kv-pull-failure-policy), then
the request joins the batch and streams."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from common.errors import KV_TRANSFER_FAILED, OUT_OF_KV_BLOCKS
from common.protocol import GenerateRequest, RequestTiming
from engine.llm_engine import DuplicateRequestId, RequestOutput
from engine.sampling_params import SamplingParams
from worker.errors import APIError, api_error
from worker.peer_pull import Pulled, pull_prefix
from worker.state import WorkerState


async def stream_generate(
    state: WorkerState, req: GenerateRequest, params: SamplingParams, handoff: bool = False
) -> AsyncIterator[tuple[RequestOutput, RequestTiming | None]]:
    """Outputs of one request, the last one with its timing. `handoff`: a drain may end it
    early with `StreamEnded` (worker/handoff.py; the router's streams, not a client's)."""
    state.admit()
    engine, importer = state.engine, state.parts.importer
    rid = req.request_id
    kvp = req.kv_transfer_params
    t0 = time.monotonic()
    transfer_s, transfer_bytes = 0.0, 0
    pulled = Pulled()
    try:
        q = engine.open_stream(rid)
    except DuplicateRequestId as e:
        raise api_error(e) from e
    added = False
    state.num_streams += 1
    if handoff:
        state.handoff.track(rid)
    try:
        # An invalid handle means a local prefill: nothing is pulled, nothing foreign is cached.
        remote = (kvp is not None and kvp.do_remote_prefill and state.connector is not None
                  and importer is not None
                  and importer.accepts(state, kvp, req.prompt_token_ids, rid, req.cache_salt))
        if not remote:
            kvp = None
        if remote:
            try:
                block_table, num_local = await engine.call(
                    "import_request", rid, req.prompt_token_ids, params, req.output_token_ids,
                    req.tenant())
            except MemoryError as e:
                raise APIError(503, str(e), OUT_OF_KV_BLOCKS, headers={"Retry-After": "1"}) from e
            except ValueError as e:
                raise api_error(e) or APIError(400, str(e), "invalid_prompt") from e
            added = True
            num_kv_tokens = len(req.prompt_token_ids) + len(req.output_token_ids) - 1
            ok, transfer_bytes = await importer.pull(state, kvp, rid, block_table, num_local,
                                                     num_kv_tokens)
            transfer_s = time.monotonic() - t0
            if not ok:
                policy = state.settings.kv_pull_failure_policy
                state.metrics.pull_failures.labels(policy).inc()
                if policy == "fail":  # its blocks are freed below (the request is aborted)
                    raise APIError(502, "the prompt's KV blocks could not be pulled from the "
                                   "prefill worker", KV_TRANSFER_FAILED)
            if not await engine.call("finish_import", rid, ok):
                return  # aborted while pulling
        else:
            # A peer's prefix first, if the router found one (worker/peer_pull.py).
            # A resume's blocks cover its tokens so far too (a drain's hand-off).
            pulled = await pull_prefix(state, req.prefix_kv_params, rid,
                                       [*req.prompt_token_ids, *req.output_token_ids],
                                       req.cache_salt)
            try:
                await engine.call("add_request", rid, req.prompt_token_ids, params,
                                  req.output_token_ids, False, req.tenant())
            except ValueError as e:
                raise api_error(e) or APIError(400, str(e), "invalid_prompt") from e
            added = True
        last_t = None
        metrics = state.metrics
        async for out in engine.outputs(rid, q):
            now = time.monotonic()
            if last_t is None:
                if kvp is None:
                    metrics.observe_first_token(out, "decode")
                metrics.generated_tokens.inc(len(out.new_token_ids))
            else:
                metrics.observe_tokens(len(out.new_token_ids), now - last_t)
            last_t = now
            timing = None
            if out.finished:
                metrics.observe_finish(out.finish_reason)
                added = False
                # An imported request is created before its pull; the pull is not queueing.
                queue_s = (out.first_scheduled_time - out.arrival_time - transfer_s
                           if out.first_scheduled_time else 0.0)
                timing = RequestTiming(queue_s=max(queue_s, 0.0),
                                       transfer_s=transfer_s, transfer_bytes=transfer_bytes,
                                       num_pulled_tokens=pulled.num_tokens,
                                       pull_bytes=pulled.num_bytes, pull_s=pulled.seconds,
                                       decode_s=time.monotonic() - t0 - transfer_s
                                       - pulled.seconds)
            yield out, timing
    finally:
        state.num_streams -= 1
        state.handoff.untrack(rid)
        engine.close_stream(rid)
        if added and engine.alive:
            engine.post("abort_request", rid)
