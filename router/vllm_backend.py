"""The `vllm` backend: stock vLLM OpenAI servers started with the NixlConnector
(`--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'`). The prefill leg
is a `/v1/completions` call with `max_tokens: 1` and `kv_transfer_params: {do_remote_decode:
true}`; its answer's `kv_transfer_params` go unchanged to the decode leg, which pulls the KV and
streams every token itself (vLLM's own proxy flow: the prefill's token is not used, so sampled
text stays one draw)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import orjson
from pydantic import ValidationError

from common.model_identity import is_name
from common.protocol import (
    KVTransferParams,
    PrefillResponse,
    SamplingOptions,
    StreamEvent,
    Tenant,
    TokenLogprob,
)
from router.backend import WorkerFailure
from router.worker_http import HTTPBackend, get_json, post_json, stalled, stream
from router.worker_info import WorkerInfo


class VLLMBackend(HTTPBackend):
    """A vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`) with the NixlConnector.
    """

    # --vllm-report-full-prefix: every request asks vLLM to publish its whole cached prefix as
    # KV events (`kv_cache_report_mode: full`, vLLM >= 0.32), which repairs a bridge's lost history
    # at the cost of the prefix's token ids in each event (set by the gateway).
    report_full_prefix = False

    def _body(self, w: WorkerInfo, prompt: list[int], sampling: SamplingOptions,
              tenant: Tenant | None = None) -> dict:
        body = {
            "model": w.model or self.model, "prompt": prompt, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "min_p": sampling.min_p, "seed": sampling.seed,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty, "ignore_eos": sampling.ignore_eos,
            "stop_token_ids": sampling.stop_token_ids,
            # Token ids back, not text: the router detokenizes, cuts stop strings and resumes.
            "return_token_ids": True, "skip_special_tokens": False,
        }
        if tenant is not None and tenant.cache_salt:
            body["cache_salt"] = tenant.cache_salt  # vLLM salts the request's blocks apart too
        if sampling.logprobs is not None:
            body.update(logprobs=sampling.logprobs, return_tokens_as_token_ids=True)
        if sampling.stop:
            # The router cuts stop strings on its own text; vLLM only needs to stop generating.
            body["stop"] = sampling.stop
            body["include_stop_str_in_output"] = True
        if sampling.top_k is not None:
            body["top_k"] = sampling.top_k
        if sampling.logit_bias:
            body["logit_bias"] = {str(t): v for t, v in sampling.logit_bias.items()}
        if sampling.min_tokens:
            body["min_tokens"] = sampling.min_tokens
        if self.report_full_prefix:
            body["vllm_xargs"] = {"kv_cache_report_mode": "full"}
        if sampling.structured is not None:  # vLLM's own field for the same constraint
            kind, spec = sampling.structured.kind, sampling.structured.spec
            body["structured_outputs"] = {kind: orjson.loads(spec)
                                                if kind in ("json", "choice") else spec}
        return body

    def _headers(self, request_id: str) -> dict:
        return {**self.headers, "X-Request-Id": request_id}

    async def prefill(self, w, request_id, prompt, sampling, tenant=None,
                      num_uncached=None) -> PrefillResponse:
        # tenant.client_tag: vLLM shares its batch first come, first served; nothing to pass it
        # to. Its cache_salt is vLLM's own field (_body).
        # No abort call: vLLM aborts a request whose connection closes (the router's does when
        # it gives the leg up); blocks it already holds for a decode side wait out its own timeout.
        body = self._body(w, prompt, sampling, tenant)
        body.update(max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        resp = await post_json(self.http, w, "/v1/completions", self._headers(request_id), body,
                               self.prefill_timeout(prompt, num_uncached))
        kvp = resp.get("kv_transfer_params")
        if not kvp:
            raise WorkerFailure(f"{w.worker_id}: no kv_transfer_params in the prefill answer "
                                "(is vLLM running with the NixlConnector?)")
        details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = kvp.get("remote_prefill_cached_tokens", details.get("cached_tokens"))
        if not isinstance(kvp, dict):
            raise WorkerFailure(f"{w.worker_id}: kv_transfer_params is not an object")
        # vLLM's own fields, passed on to its decode side unread: not validated as ours.
        return PrefillResponse(request_id=request_id, first_token_id=None,
                               kv_transfer_params=KVTransferParams.model_construct(**kvp),
                               num_cached_tokens=int(cached or 0))

    async def generate(self, w, request_id, prompt, sent, sampling, kv_params, tenant=None
                       ) -> AsyncIterator[StreamEvent]:
        body = self._body(w, prompt + list(sent), sampling, tenant)
        body.update(max_tokens=sampling.max_tokens - len(sent), stream=True,
                    stream_options={"include_usage": True})
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params.model_dump(mode="json", exclude_unset=True,
                                                              warnings=False)
        want_lp = sampling.logprobs is not None
        num_cached = None
        async with stream(self.http, w, "/v1/completions", self._headers(request_id), body,
                          self.stream_timeout(len(prompt) + len(sent))) as r:
            last = stall = None  # until the first chunk: the socket's limit (a prefill first)
            while line := await stalled(r.content.readline(), stall):  # SSE: "data: {...}"
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                stall = self.timeouts.stream_stall_s
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if chunk.get("error") or chunk.get("object") == "error":
                    raise WorkerFailure(f"{w.worker_id}: "
                                        f"{chunk.get('error') or chunk.get('message')}")
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    num_cached = int(details.get("cached_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    ids, lps = _vllm_tokens(choice.get("logprobs"), want_lp)
                    ids = choice.get("token_ids") or ids
                    reason = choice.get("finish_reason")
                    if reason is not None:  # held until the usage chunk and the stream's end
                        last = _event(w, request_id=request_id, token_ids=ids,
                                      finish_reason=reason, logprobs=lps)
                    elif ids:
                        yield _event(w, request_id=request_id, token_ids=ids, logprobs=lps)
        if last is None:
            raise WorkerFailure(f"{w.worker_id} ended the stream without a finish reason")
        last.num_cached_tokens = num_cached
        yield last

    async def probe(self, w) -> dict:
        await get_json(self.http, w, "/health", self.headers, parse=False)
        models = await get_json(self.http, w, "/v1/models", self.headers)
        data = [d for d in models.get("data") or [] if isinstance(d, dict)][:32]
        if not data:
            return {}
        # vLLM lists each --served-model-name alias as its own entry, all with the same root
        # (the model path): the root is its identity, as far as the router can know it.
        root = str(data[0].get("root") or data[0].get("id") or "")
        return {"model": data[0].get("id", ""),
                "served_model_names": [d["id"] for d in data if is_name(d.get("id"))],
                "model_digest": hashlib.sha256(root.encode()).hexdigest()[:16],
                "max_model_len": data[0].get("max_model_len")}


def _event(w: WorkerInfo, **fields) -> StreamEvent:
    try:
        return StreamEvent(**fields)
    except ValidationError as e:
        raise WorkerFailure(f"{w.worker_id}: unexpected stream chunk: {e.errors()[:1]}") from e


def _vllm_tokens(logprobs: dict | None,
                 want_lp: bool) -> tuple[list[int], list[TokenLogprob] | None]:
    """Token ids (and our logprob records) from a vLLM completions `logprobs` object whose tokens
    are written as `token_id:N` (`return_tokens_as_token_ids`)."""
    if not logprobs:
        return [], None
    ids = [_token_id(t) for t in logprobs.get("tokens") or []]
    if not want_lp:
        return ids, None
    out = []
    for i, tid in enumerate(ids):
        tops = (logprobs.get("top_logprobs") or [None] * len(ids))[i] or {}
        lp = (logprobs.get("token_logprobs") or [None] * len(ids))[i]
        try:
            out.append(TokenLogprob(token_id=tid, logprob=lp if lp is not None else 0.0,
                                    top=[(_token_id(t), v) for t, v in tops.items()]))
        except ValidationError as e:
            raise WorkerFailure(f"vLLM returned malformed logprobs: {e.errors()[:1]}") from e
    return ids, out


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise WorkerFailure(f"vLLM returned token {token!r}; expected token_id:N")
    return int(token[9:])
