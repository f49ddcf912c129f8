"""The `tandem` backend: Tandem workers' internal API (`POST /prefill`, NDJSON `POST /generate`);
the prefill leg returns the first token, which the client gets before the decode leg starts.
Answers are parsed into common/protocol.py's models, the ones the workers send."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
import yarl

from common.protocol import PrefillResponse, StreamEvent
from router.backend import WorkerFailure
from router.worker_http import HTTPBackend, get_json, parse, post_json, stalled, stream

log = logging.getLogger(__name__)

# A decode stream's read buffer: aiohttp stops reading the worker's socket past twice this,
# so a client that does not read holds ~32 KiB per choice in the router (with 1 MiB, an
# unread n=8 request with top_logprobs grew the router by 9 MB), and the worker's writes wait.
# The socket's own kernel buffer is fixed too (autotuned, MBs): the worker parks a generation
# whose stream is not read only once every buffer between it and the client is full.
STREAM_READ_BUFSIZE = 16 << 10
STREAM_RECEIVE_BUFFER = 16 << 10
MAX_EVENT_LINE = 2 << 20  # one NDJSON event may be longer than the buffer (read on demand)
# An abort is sent from the path that gives a leg up (a client gone, a timeout): it must not
# hold that path, nor linger when the worker is the reason the leg was given up.
ABORT_TIMEOUT = aiohttp.ClientTimeout(total=1.0)


class TandemBackend(HTTPBackend):
    """Tandem workers' internal API."""

    async def prefill(self, w, request_id, prompt, sampling, tenant=None,
                      num_uncached=None, prefix_kv=None) -> PrefillResponse:
        body = {"request_id": request_id, "prompt_token_ids": prompt,
                "sampling": sampling.model_dump(mode="json"), **_tenant_fields(tenant),
                **_prefix_fields(prefix_kv)}
        raw = await post_json(self.http, w, "/prefill", self.headers, body,
                              self.prefill_timeout(prompt, num_uncached), raw_answer=True)
        return parse(w, PrefillResponse, raw)

    async def abort(self, w, request_id) -> None:
        # The worker drops the request wherever it is: prefilling, or its blocks exported under
        # a lease (worker/internal_api.py).
        try:
            async with self.http.post(yarl.URL(f"{w.url}/abort/{request_id}"),
                                      headers=self.headers, timeout=ABORT_TIMEOUT) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.info("abort of %s on %s failed: %r", request_id, w.worker_id, e)

    async def generate(self, w, request_id, prompt, sent, sampling, kv_params, tenant=None,
                       prefix_kv=None) -> AsyncIterator[StreamEvent]:
        body = {"request_id": request_id, "prompt_token_ids": prompt,
                "output_token_ids": list(sent), "sampling": sampling.model_dump(mode="json"),
                **_tenant_fields(tenant), **_prefix_fields(prefix_kv)}
        if kv_params is not None:
            # Opaque to the router: exactly the fields the prefill worker signed.
            body["kv_transfer_params"] = kv_params.model_dump(mode="json", exclude_unset=True,
                                                              warnings=False)
        async with stream(self.http, w, "/generate", self.headers, body,
                          self.stream_timeout(len(prompt) + len(sent)),
                          STREAM_READ_BUFSIZE, STREAM_RECEIVE_BUFFER) as r:
            last = stall = None  # until the first event: the socket's limit (a prefill first)
            # NDJSON: one event per line
            while line := await stalled(_next_line(w, r.content), stall):
                line = line.strip()
                if not line:
                    continue
                stall = self.timeouts.stream_stall_s
                ev = parse(w, StreamEvent, line)
                if ev.error:
                    raise WorkerFailure(f"{w.worker_id}: {ev.error}")
                if ev.finish_reason is not None:
                    # Hold the last event until the body's end: a response read to EOF goes
                    # back to the pool; one closed early costs a new TCP connection next time.
                    last = ev
                    continue
                yield ev
            if last is not None:
                yield last

    async def probe(self, w) -> dict:
        # /ready, not /health: a worker that is up but cannot serve (engine failed, still
        # starting, shutting down) answers 503 there and is taken out of routing at once.
        return await get_json(self.http, w, "/ready", self.headers)


def _tenant_fields(tenant) -> dict:
    """`client_tag` and `cache_salt` of the wire models, where set."""
    if tenant is None:
        return {}
    return {k: v for k, v in (("client_tag", tenant.client_tag),
                              ("cache_salt", tenant.cache_salt)) if v is not None}


def _prefix_fields(prefix_kv) -> dict:
    """A peer's prefix handle (router/peer_pull.py), exactly as its holder signed it."""
    if prefix_kv is None:
        return {}
    return {"prefix_kv_params": prefix_kv.model_dump(mode="json", exclude_unset=True,
                                                     warnings=False)}


async def _next_line(w, content) -> bytes:
    try:
        return await content.readline(max_line_length=MAX_EVENT_LINE)
    except ValueError as e:  # a line past MAX_EVENT_LINE: no honest worker sends one
        raise WorkerFailure(f"{w.worker_id}: stream event too long ({e})") from e
