"""The HTTP plumbing every backend (router/backend.py) shares: `HTTPBackend`, their common base
(the session, headers and time limits), and the calls to a worker: a JSON POST or GET, a streamed
POST, and how an answer becomes a wire model or one of the backend's errors (a 5xx or a 429
WorkerFailure, a 4xx RequestRejected).
"""

from __future__ import annotations

import asyncio
import functools
import socket
from typing import TypeVar

import aiohttp
import orjson
import yarl
from pydantic import BaseModel, ValidationError

from common.errors import KV_TRANSFER_FAILED
from router.backend import RequestRejected, Timeouts, TransferFailed, WorkerFailure
from router.worker_info import WorkerInfo


class HTTPBackend:
    """Worker hops go through aiohttp: per request it costs about a third of httpx's CPU, which is
    most of what the router adds to a request on a small machine (bench/router_overhead.py)."""

    def __init__(self, http: aiohttp.ClientSession, token: str | None, model: str,
                 timeouts: Timeouts) -> None:
        self.http = http
        self.model = model
        self.timeouts = timeouts
        self.headers = {"Content-Type": "application/json"}
        if token:  # Tandem's internal token, or a vLLM server's --api-key
            self.headers["Authorization"] = f"Bearer {token}"

    def prefill_timeout(self, prompt: list[int], num_uncached: int | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.timeouts.prefill_for(
            len(prompt) if num_uncached is None else num_uncached))

    def stream_timeout(self, num_tokens: int) -> aiohttp.ClientTimeout:
        """A decode stream's: its socket may stay silent until the first event (a local prefill
        of up to `num_tokens`); `stall` bounds the gaps after that."""
        return aiohttp.ClientTimeout(total=self.timeouts.total_s,
                                     sock_read=self.timeouts.first_event_for(num_tokens))

    async def abort(self, w: WorkerInfo, request_id: str) -> None:
        return None  # a worker without an abort call ends a request whose connection closes


async def stalled(read, stall_s: float | None):
    """`await read`, within `stall_s` (None: the stream's own socket limit); TimeoutError past it.
    """
    if stall_s is None:
        return await read
    async with asyncio.timeout(stall_s):
        return await read


async def post_json(http, w: WorkerInfo, path: str, headers: dict, body: dict,
                    timeout: aiohttp.ClientTimeout, raw_answer: bool = False):
    """POST `body`; the answer's JSON (or its bytes with `raw_answer`)."""
    try:
        async with http.post(url(w.url, path), data=orjson.dumps(body), headers=headers,
                             timeout=timeout) as r:
            raw = await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise WorkerFailure(f"{w.worker_id}: {e!r}") from e
    check(w, r.status, raw)
    return raw if raw_answer else orjson.loads(raw)


Model = TypeVar("Model", bound=BaseModel)


def parse(w: WorkerInfo, model: type[Model], raw: bytes | str) -> Model:
    """A worker's answer as the wire model it must be; anything else is a failed worker."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise WorkerFailure(f"{w.worker_id}: malformed {model.__name__}: {e.errors()[:1]}") from e


async def get_json(http, w: WorkerInfo, path: str, headers: dict, parse: bool = True) -> dict:
    try:
        async with http.get(f"{w.url}{path}", headers=headers,
                            timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            raw = await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise WorkerFailure(f"{w.worker_id}: {e!r}") from e
    if r.status != 200:
        raise WorkerFailure(f"{w.worker_id}: {path} answered HTTP {r.status}")
    return orjson.loads(raw) if parse and raw else {}


def check(w: WorkerInfo, status: int, raw: bytes, retry_after: str | None = None) -> None:
    if status >= 500 or status == 429:
        code = _code(raw)
        if status == 502 and code == KV_TRANSFER_FAILED:
            raise TransferFailed(f"{w.worker_id}: could not pull the prompt's KV blocks")
        raise WorkerFailure(f"{w.worker_id}: HTTP {status}" + (f" {code}" if code else ""),
                            status, code, _seconds(retry_after))
    if status >= 400:
        raise RequestRejected(status, error_body(raw))


class stream:
    """`async with stream(...) as response`: a POST whose body is read as it arrives; connection
    errors and worker 5xx become WorkerFailure, 4xx RequestRejected, and the worker's in-flight
    count covers the whole stream."""

    def __init__(self, http, w: WorkerInfo, path: str, headers: dict, body: dict,
                 timeout: aiohttp.ClientTimeout, read_bufsize: int | None = None,
                 receive_buffer_bytes: int | None = None) -> None:
        self.http, self.w, self.path, self.headers, self.body = http, w, path, headers, body
        self.timeout = timeout
        # What aiohttp buffers of the body before it stops reading the socket (twice this):
        # the backpressure point when the router's consumer (a client) does not read.
        self.options = {"read_bufsize": read_bufsize} if read_bufsize else {}
        self.receive_buffer_bytes = receive_buffer_bytes
        self._cm = None

    async def __aenter__(self):
        self.w.inflight += 1
        try:
            self._cm = self.http.post(url(self.w.url, self.path), data=orjson.dumps(self.body),
                                      headers=self.headers, timeout=self.timeout, **self.options)
            r = await self._cm.__aenter__()
            if self.receive_buffer_bytes:
                _bound_receive_buffer(r, self.receive_buffer_bytes)
            if r.status >= 400:
                raw = await r.read()
                await self._cm.__aexit__(None, None, None)
                self._cm = None
                check(self.w, r.status, raw, r.headers.get("Retry-After"))
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


def _bound_receive_buffer(r: aiohttp.ClientResponse, size: int) -> None:
    """Fix the kernel receive buffer of the connection `r` is read from (the kernel doubles
    `size`). Autotuned, it grows to MBs while a stream is read quickly, and all of it fills
    before a worker's writes wait, so a worker would see a reader that stopped late: its
    unread tokens count only past every buffer on the way (engine/output_stream.py)."""
    transport = r.connection.transport if r.connection is not None else None
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


@functools.lru_cache(maxsize=4096)
def url(base: str, path: str) -> yarl.URL:
    # Parsed once per worker and path: aiohttp would parse the string again on every call.
    return yarl.URL(base + path)


def _code(raw: bytes) -> str | None:
    body = error_body(raw)
    err = body.get("error") if isinstance(body, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def _seconds(retry_after: str | None) -> float | None:
    """A Retry-After in seconds (the HTTP-date form, which no worker sends, reads as None)."""
    try:
        seconds = float(retry_after) if retry_after is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < float("inf") else None


def error_body(raw: bytes) -> dict:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"error": {"message": raw[:500].decode(errors="replace")}}
