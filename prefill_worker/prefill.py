"""The prefill role's logic: compute a prompt to its first token, then keep and export its
blocks under a lease for a decode worker to pull (docs/contract.md request path, step 4)."""

from __future__ import annotations

from common.hashing import hash_tokens
from common.protocol import KVTransferParams, PrefillResponse, Tenant, TokenLogprob
from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams
from kv_transfer import handle
from worker.errors import APIError, api_error
from worker.peer_pull import pull_prefix
from worker.state import WorkerState


async def run_prefill(state: WorkerState, request_id: str, prompt: list[int],
                      params: SamplingParams, lease_seconds: float | None,
                      always_export: bool = False, tenant: Tenant | None = None,
                      prefix_kv: KVTransferParams | None = None) -> PrefillResponse:
    """Prefill to the first token; keep and export the prompt's blocks unless already finished.

    `tenant`: who sent it (the batch is shared fairly between clients; the blocks' cache salt).
    Cancelled (its caller gone: worker/abortable.py), it holds nothing: a request still computing
    is aborted in the engine, a finished one's blocks are released unless already exported (then
    the lease is the caller's to cancel).
    `prefix_kv`: a peer's prefix handle, pulled from before computing (worker/peer_pull.py).
    `always_export` is vLLM's semantics: the proxy caps the prefill leg at `max_tokens: 1` and the
    decode side recomputes the last prompt token, so the blocks are kept whatever the first token.
    """
    s = state.settings
    state.admit()
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
        # A peer's prefix first, if the router found one (worker/peer_pull.py).
        pulled = await pull_prefix(state, prefix_kv, request_id, prompt,
                                   tenant and tenant.cache_salt)
        try:
            async for out in engine.generate(  # noqa: B007
                    request_id, prompt, params, hold_blocks=True, tenant=tenant):
                pass
        except ValueError as e:
            raise api_error(e) or APIError(400, str(e), "invalid_prompt") from e
    finally:
        state.num_prefill_inflight -= 1
    assert out is not None and out.finished
    if out.finish_reason == "abort":
        raise APIError(503, "request was aborted", "aborted")
    state.metrics.observe_first_token(out, "prefill")
    done = not always_export and (out.finish_reason == "stop" or params.max_tokens <= 1)
    if done:
        state.metrics.observe_finish(out.finish_reason)
    kv = KVTransferParams()
    if done or state.connector is None:
        await engine.call("release", request_id)  # runs even if this is cancelled meanwhile
    else:
        try:
            block_ids = await engine.call("block_table", request_id)
        except BaseException as e:
            # Cancelled (nobody waits for it), or aborted since its first token: nothing is
            # exported, so nothing may stay held.
            engine.post("release", request_id)
            if isinstance(e, KeyError):
                raise APIError(503, "request was aborted", "aborted") from e
            raise
        # No await from here to the answer: a cancellation cannot land between export and reply.
        exported = state.connector.export(request_id, block_ids, lease_seconds)
        fields = dict(do_remote_prefill=True, remote_host=s.public_host, remote_port=s.port,
                      block_hashes=core.hasher(prompt, cache_salt=tenant and tenant.cache_salt),
                      num_tokens=len(prompt), prompt_hash=hash_tokens(prompt),
                      expires_at=exported["lease_expires_at"], **exported)
        kv = KVTransferParams(**handle.sign(fields, s.internal_token))
    lp = out.logprobs[0] if out.logprobs else None
    return PrefillResponse(
        request_id=request_id,
        first_token_id=out.token_ids[0],
        num_cached_tokens=max(out.num_cached_tokens - pulled.num_tokens, 0),
        num_cached_tokens_by_medium=_uncount(out.num_cached_tokens_by_medium, pulled.num_tokens),
        num_pulled_tokens=pulled.num_tokens, pull_bytes=pulled.num_bytes, pull_s=pulled.seconds,
        kv_transfer_params=kv,
        first_token_logprob=TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=lp.top)
                            if lp else None,
        finish_reason=out.finish_reason if done else None,
    )


def _uncount(by_medium: dict[str, int] | None, num_pulled: int) -> dict[str, int] | None:
    """Cached tokens by tier without those pulled from a peer (they landed on the device)."""
    if not by_medium or not num_pulled:
        return by_medium
    return {**by_medium, "device": max(by_medium.get("device", 0) - num_pulled, 0)}
