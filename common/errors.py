"""OpenAI-format errors; only the API layer turns exceptions into HTTP codes."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 408: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(e: Exception, path: str = "") -> JSONResponse:
    """The OpenAI-format response for any exception a handler raised (500 for the unexpected)."""
    if isinstance(e, APIError):
        return JSONResponse(error_body(e.status, e.message, e.code, e.param), e.status, headers=e.headers)
    if isinstance(e, RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
        return JSONResponse(error_body(400, msg, "invalid_request", loc or None), 400)
    if isinstance(e, StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), e.status_code,
                            headers=getattr(e, "headers", None))
    logging.getLogger(__name__).exception("unhandled error on %s", path, exc_info=e)
    return JSONResponse(error_body(500, "internal error", "internal_error"), 500)


def install_error_handlers(app) -> None:
    async def handle(request: Request, e: Exception):
        return error_response(e, request.url.path)

    for kind in (APIError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, handle)
