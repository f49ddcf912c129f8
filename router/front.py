"""The hot path: `POST /v1/completions` and `/v1/chat/completions` answered before FastAPI's stack.

FastAPI's middleware, routing, dependency solving and exception layers cost a noticeable share of
the router's per-request CPU (bench/router_overhead.py); these two endpoints validate their own
body anyway, so `FrontedAPI` hands them straight to their handler, with the same errors
(common/errors.py) and body limit. The FastAPI routes of the same paths stay declared: they are
what the OpenAPI schema describes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.responses import Response

from common.body_limit import too_large
from common.errors import APIError, error_response

Handler = Callable[[Headers, bytes, str | None], Awaitable[Response]]  # headers, body, peer host
log = logging.getLogger(__name__)


class FrontedAPI(FastAPI):
    """A FastAPI app where POSTs to a path given to `serve_directly` skip the framework: the
    body is read whole (refused with 413 past `max_body_bytes`, declared or chunked) and goes
    to `handler(headers, body, peer host)`, whose response or error is sent as is."""

    def __init__(self, *args, max_body_bytes: int, body_timeout_s: float = 30.0,
                 on_error: Callable[[int], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s  # the whole body must arrive within this
        self.on_error = on_error  # told the status of every error answered here
        self._direct: dict[str, Handler] = {}

    def serve_directly(self, path: str, handler: Handler) -> None:
        self._direct[path] = handler

    async def __call__(self, scope, receive, send) -> None:
        handler = self._direct.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    body = await self._body(headers, receive)
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within "
                               f"{self.body_timeout_s:g} s", "request_timeout") from None
            peer = scope.get("client")
            response = await self._unless_gone(handler(headers, body, peer[0] if peer else None),
                                               receive)
            if response is None:  # the client left: its request was cancelled, nobody to answer
                if self.on_error is not None:
                    self.on_error(499)
                return
        except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI-format answer
            response = error_response(e, scope["path"])
            if self.on_error is not None:
                self.on_error(response.status_code)
        await response(scope, receive, send)

    @staticmethod
    async def _unless_gone(work: Awaitable[Response], receive) -> Response | None:
        """`work`'s response, or None when the client disconnects first: then `work` is
        cancelled, which closes its worker streams (the workers abort the generation)."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                log.info("client disconnected: request cancelled")
        return task.result() if not task.cancelled() else None

    async def _body(self, headers: Headers, receive) -> bytes:
        limit = self.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise APIError(400, "the client closed the request", "client_disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _disconnect(receive) -> None:
    """Returns when the client has gone (the body is read: nothing else can arrive)."""
    while (await receive())["type"] != "http.disconnect":
        pass
