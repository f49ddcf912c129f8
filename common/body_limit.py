"""ASGI middleware refusing bodies over a size limit before they are read.

A plain ASGI wrapper, not @app.middleware: Starlette's BaseHTTPMiddleware costs ~1 ms a call."""

from __future__ import annotations

from common.errors import APIError, error_response


def too_large(max_bytes: int) -> APIError:
    """The 413 for a body over the limit (declared or found while reading it)."""
    return APIError(413, f"request body over {max_bytes} bytes", "request_too_large")


class BodyLimit:
    """Refuse requests whose body exceeds `max_bytes` with an OpenAI-format 413: at once when the
    declared length is over, else while reading (a chunked body): `receive` raises the 413, which
    the app's error handlers answer."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await error_response(too_large(self.max_bytes))(scope, receive, send)
                return
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise too_large(self.max_bytes)
            return message

        await self.app(scope, counted, send)
