"""How the router talks to one kind of worker: a small Protocol plus a name table (`BACKENDS`).

- `tandem`: Tandem workers' internal API (`POST /prefill`, NDJSON `POST /generate`); the prefill
  leg returns the first token, which the client gets before the decode leg starts.
- `vllm`: stock vLLM OpenAI servers started with the NixlConnector (`--kv-transfer-config
  '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'`). The prefill leg is a `/v1/completions`
  call with `max_tokens: 1` and `kv_transfer_params: {do_remote_decode: true}`; its answer's
  `kv_transfer_params` go unchanged to the decode leg, which pulls the KV and streams every token
  itself (vLLM's own proxy flow: the prefill's token is not used, so sampled text stays one draw).

Every backend speaks in token ids: prompts go out as ids (the router tokenized them) and tokens
come back as ids, so routing, stop strings, resume and detokenization are the same for both.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import aiohttp
import orjson
import yarl

from common.protocol import SamplingOptions

if TYPE_CHECKING:  # router.workers validates backend names against BACKENDS below
    from router.workers import WorkerInfo


class WorkerFailure(RuntimeError):
    """A worker could not be reached or answered with a server error."""


class RequestRejected(RuntimeError):
    """A worker refused the request itself (4xx): retrying elsewhere would not help."""

    def __init__(self, status: int, body: dict) -> None:
        err = body.get("error")
        msg = err.get("message") if isinstance(err, dict) else body.get("message", str(body))
        super().__init__(msg or str(body))
        self.status, self.body = status, body


@dataclass
class Timeouts:
    """Per-hop limits (seconds). A stalled worker (SIGSTOPped, swapping, wedged) still accepts
    connections and never answers, so only a timeout turns it into a failure the dispatcher can
    route around: prefill is retried elsewhere, a decode stream resumes on another worker."""

    prefill_s: float = 60.0
    stream_stall_s: float = 30.0  # longest gap between two chunks of a decode stream
    total_s: float = 300.0


@dataclass
class TokenEvent:
    token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int | None = None
    timing: dict | None = None
    logprobs: list[dict] | None = None  # per token: {token_id, logprob, top: [[id, logprob]]}


class Backend(Protocol):
    def __init__(self, http: aiohttp.ClientSession, token: str | None, model: str,
                 timeouts: Timeouts) -> None: ...

    async def prefill(self, w: WorkerInfo, request_id: str, prompt: list[int],
                      sampling: SamplingOptions) -> dict:
        """`{first_token_id, num_cached_tokens, kv_transfer_params, finish_reason?,
        first_token_logprob?}`; `first_token_id` is None when the decode leg produces every token
        (vLLM). Raises WorkerFailure or RequestRejected."""

    def generate(self, w: WorkerInfo, request_id: str, prompt: list[int], sent: list[int],
                 sampling: SamplingOptions, kv_params: dict | None) -> AsyncIterator[TokenEvent]:
        """Tokens after `prompt + sent`; the last event has a finish reason."""

    async def abort(self, w: WorkerInfo, request_id: str) -> None: ...

    async def probe(self, w: WorkerInfo) -> dict:
        """Health check of a statically listed worker; returns what it learned (model,
        max_model_len). Raises WorkerFailure when the worker is not healthy."""


class _HTTPBackend:
    """Worker hops go through aiohttp: per request it costs about a third of httpx's CPU, which is
    most of what the router adds to a request on a small machine (bench/router_overhead.py)."""

    def __init__(self, http: aiohttp.ClientSession, token: str | None, model: str,
                 timeouts: Timeouts) -> None:
        self.http = http
        self.model = model
        self.prefill_timeout = aiohttp.ClientTimeout(total=timeouts.prefill_s)
        self.stream_timeout = aiohttp.ClientTimeout(total=timeouts.total_s, sock_read=timeouts.stream_stall_s)
        self.headers = {"Content-Type": "application/json"}
        if token:  # Tandem's internal token, or a vLLM server's --api-key
            self.headers["Authorization"] = f"Bearer {token}"


class TandemBackend(_HTTPBackend):
    """Tandem workers' internal API."""

    async def prefill(self, w, request_id, prompt, sampling) -> dict:
        return await _post_json(self.http, w, "/prefill", self.headers, {
            "request_id": request_id, "prompt_token_ids": prompt, "sampling": sampling.model_dump()},
            self.prefill_timeout)

    async def generate(self, w, request_id, prompt, sent, sampling, kv_params
                       ) -> AsyncIterator[TokenEvent]:
        body = {"request_id": request_id, "prompt_token_ids": prompt, "output_token_ids": list(sent),
                "sampling": sampling.model_dump()}
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
        async with _stream(self.http, w, "/generate", self.headers, body, self.stream_timeout) as r:
            last = None
            async for line in r.content:  # NDJSON: one event per line
                line = line.strip()
                if not line:
                    continue
                ev = orjson.loads(line)
                if ev.get("error"):
                    raise WorkerFailure(f"{w.worker_id}: {ev['error']}")
                tev = TokenEvent(ev.get("token_ids", []), ev.get("finish_reason"),
                                 ev.get("num_cached_tokens"), ev.get("timing"), ev.get("logprobs"))
                if tev.finish_reason is not None:
                    # Hold the last event until the body's end: a response read to EOF goes
                    # back to the pool; one closed early costs a new TCP connection next time.
                    last = tev
                    continue
                yield tev
            if last is not None:
                yield last

    async def abort(self, w, request_id) -> None:
        try:
            async with self.http.post(f"{w.url}/abort/{request_id}", headers=self.headers,
                                      timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError):
            pass

    async def probe(self, w) -> dict:
        # /ready, not /health: a worker that is up but cannot serve (engine failed, still
        # starting, shutting down) answers 503 there and is taken out of routing at once.
        await _get_json(self.http, w, "/ready", self.headers)
        return {}


class VLLMBackend(_HTTPBackend):
    """A vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`) with the NixlConnector."""

    def _body(self, w: WorkerInfo, prompt: list[int], sampling: SamplingOptions) -> dict:
        body = {
            "model": w.model or self.model, "prompt": prompt, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "min_p": sampling.min_p, "seed": sampling.seed,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty, "ignore_eos": sampling.ignore_eos,
            "stop_token_ids": sampling.stop_token_ids,
            # Token ids back, not text: the router detokenizes, cuts stop strings and resumes.
            "return_token_ids": True, "skip_special_tokens": False,
        }
        if sampling.logprobs is not None:
            body.update(logprobs=sampling.logprobs, return_tokens_as_token_ids=True)
        if sampling.stop:
            # The router cuts stop strings on its own text; vLLM only needs to stop generating.
            body["stop"] = sampling.stop
            body["include_stop_str_in_output"] = True
        if sampling.top_k is not None:
            body["top_k"] = sampling.top_k
        return body

    def _headers(self, request_id: str) -> dict:
        return {**self.headers, "X-Request-Id": request_id}

    async def prefill(self, w, request_id, prompt, sampling) -> dict:
        body = self._body(w, prompt, sampling)
        body.update(max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        resp = await _post_json(self.http, w, "/v1/completions", self._headers(request_id), body,
                                self.prefill_timeout)
        kvp = resp.get("kv_transfer_params")
        if not kvp:
            raise WorkerFailure(f"{w.worker_id}: no kv_transfer_params in the prefill answer "
                                "(is vLLM running with the NixlConnector?)")
        details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = kvp.get("remote_prefill_cached_tokens", details.get("cached_tokens"))
        return {"first_token_id": None, "kv_transfer_params": kvp, "num_cached_tokens": int(cached or 0)}

    async def generate(self, w, request_id, prompt, sent, sampling, kv_params
                       ) -> AsyncIterator[TokenEvent]:
        body = self._body(w, prompt + list(sent), sampling)
        body.update(max_tokens=sampling.max_tokens - len(sent), stream=True,
                    stream_options={"include_usage": True})
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
        want_lp = sampling.logprobs is not None
        num_cached = None
        async with _stream(self.http, w, "/v1/completions", self._headers(request_id), body,
                           self.stream_timeout) as r:
            last = None
            async for line in r.content:  # SSE: "data: {...}" lines
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if chunk.get("error") or chunk.get("object") == "error":
                    raise WorkerFailure(f"{w.worker_id}: {chunk.get('error') or chunk.get('message')}")
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    num_cached = int(details.get("cached_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    ids, lps = _vllm_tokens(choice.get("logprobs"), want_lp)
                    ids = choice.get("token_ids") or ids
                    reason = choice.get("finish_reason")
                    if reason is not None:  # held until the usage chunk and the stream's end
                        last = TokenEvent(ids, reason, logprobs=lps)
                    elif ids:
                        yield TokenEvent(ids, None, logprobs=lps)
        if last is None:
            raise WorkerFailure(f"{w.worker_id} ended the stream without a finish reason")
        last.num_cached_tokens = num_cached
        yield last

    async def abort(self, w, request_id) -> None:
        pass  # vLLM aborts a request when its HTTP stream closes, which the dispatcher does

    async def probe(self, w) -> dict:
        await _get_json(self.http, w, "/health", self.headers, parse=False)
        models = await _get_json(self.http, w, "/v1/models", self.headers)
        data = (models.get("data") or [{}])[0]
        return {"model": data.get("id", ""), "max_model_len": data.get("max_model_len")}


def _vllm_tokens(logprobs: dict | None, want_lp: bool) -> tuple[list[int], list[dict] | None]:
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
        out.append({"token_id": tid, "logprob": lp if lp is not None else 0.0,
                    "top": [[_token_id(t), v] for t, v in tops.items()]})
    return ids, out


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise WorkerFailure(f"vLLM returned token {token!r}; expected token_id:N")
    return int(token[9:])


async def _post_json(http, w: WorkerInfo, path: str, headers: dict, body: dict,
                     timeout: aiohttp.ClientTimeout) -> dict:
    try:
        async with http.post(_url(w.url, path), data=orjson.dumps(body), headers=headers,
                             timeout=timeout) as r:
            raw = await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise WorkerFailure(f"{w.worker_id}: {e!r}") from e
    _check(w, r.status, raw)
    return orjson.loads(raw)


async def _get_json(http, w: WorkerInfo, path: str, headers: dict, parse: bool = True) -> dict:
    try:
        async with http.get(f"{w.url}{path}", headers=headers,
                            timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            raw = await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise WorkerFailure(f"{w.worker_id}: {e!r}") from e
    if r.status != 200:
        raise WorkerFailure(f"{w.worker_id}: {path} answered HTTP {r.status}")
    return orjson.loads(raw) if parse and raw else {}


def _check(w: WorkerInfo, status: int, raw: bytes) -> None:
    if status >= 500 or status == 429:
        raise WorkerFailure(f"{w.worker_id}: HTTP {status}")
    if status >= 400:
        raise RequestRejected(status, _json(raw))


class _stream:
    """`async with _stream(...) as response`: a POST whose body is read as it arrives; connection
    errors and worker 5xx become WorkerFailure, 4xx RequestRejected, and the worker's in-flight
    count covers the whole stream."""

    def __init__(self, http, w: WorkerInfo, path: str, headers: dict, body: dict,
                 timeout: aiohttp.ClientTimeout) -> None:
        self.http, self.w, self.path, self.headers, self.body = http, w, path, headers, body
        self.timeout = timeout
        self._cm = None

    async def __aenter__(self):
        self.w.inflight += 1
        try:
            self._cm = self.http.post(_url(self.w.url, self.path), data=orjson.dumps(self.body),
                                      headers=self.headers, timeout=self.timeout)
            r = await self._cm.__aenter__()
            if r.status >= 400:
                raw = await r.read()
                await self._cm.__aexit__(None, None, None)
                self._cm = None
                _check(self.w, r.status, raw)
            return r
        except (aiohttp.ClientError, TimeoutError) as e:
            self.w.inflight -= 1
            raise WorkerFailure(f"{self.w.worker_id}: {e!r}") from e
        except BaseException:
            self.w.inflight -= 1
            raise

    async def __aexit__(self, et, e, tb):
        self.w.inflight -= 1
        if self._cm is not None:
            await self._cm.__aexit__(et, e, tb)
        if isinstance(e, aiohttp.ClientError | TimeoutError):
            raise WorkerFailure(f"{self.w.worker_id}: {e!r}") from e
        return False


@functools.lru_cache(maxsize=4096)
def _url(base: str, path: str) -> yarl.URL:
    # Parsed once per worker and path: aiohttp would parse the string again on every call.
    return yarl.URL(base + path)


def _json(raw: bytes) -> dict:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"error": {"message": raw[:500].decode(errors="replace")}}


BACKENDS: dict[str, type] = {"tandem": TandemBackend, "vllm": VLLMBackend}
