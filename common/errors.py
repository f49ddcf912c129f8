"""OpenAI-format errors; only the API layer turns exceptions into HTTP codes."""

from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable"}

# The code of a decode worker's 502 when it could not pull a prompt's KV blocks and its policy
# is to fail rather than recompute (--kv-pull-failure-policy fail): the router retries no other
# decode worker on it.
KV_TRANSFER_FAILED = "kv_transfer_failed"
# The code of a decode worker's 503 (with Retry-After) when it has no free KV blocks to import a
# prompt's blocks into: the router tries another decode worker, or this one again after the
# Retry-After (router/dispatch.py), before it gives the client the same answer.
OUT_OF_KV_BLOCKS = "out_of_kv_blocks"


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(e: Exception, path: str = "") -> JSONResponse:
    """The OpenAI-format response for any exception a handler raised (500 for the unexpected)."""
    if isinstance(e, APIError):
        return JSONResponse(error_body(e.status, e.message, e.code, e.param), e.status,
                            headers=e.headers)
    if isinstance(e, RequestValidationError):
        msg, loc = _first_error(e.errors())
        return JSONResponse(error_body(400, msg, "invalid_request", loc), 400)
    if isinstance(e, StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), e.status_code,
                            headers=getattr(e, "headers", None))
    logging.getLogger(__name__).exception("unhandled error on %s", path, exc_info=e)
    return JSONResponse(error_body(500, "internal error", "internal_error"), 500)


def validation_detail(e) -> tuple[str, str | None]:
    """A pydantic ValidationError as a client may read it: `"<field>: <what is wrong>"` and the
    field, without pydantic's URL, input echo or type names."""
    return _first_error(e.errors(include_url=False))


def _first_error(errors: list) -> tuple[str, str | None]:
    first = errors[0] if errors else {}
    parts = [x for x in first.get("loc", ()) if x != "body"]
    # The first part is a request field; later ones may be a union member's tag.
    loc = ".".join(str(x) for i, x in enumerate(parts) if i == 0 or _is_field(x)) or None
    # Validating Python objects (FastAPI's bodies) names the model: "... or instance of Tool";
    # a validator's own ValueError comes as "Value error, <its text>".
    msg = _INSTANCE_OF.sub("", str(first.get("msg", "invalid request")))
    msg = msg.removeprefix("Value error, ")
    return (f"{loc}: {msg}" if loc else msg), loc


def _is_field(part) -> bool:
    """Whether a pydantic error location part names a field or an index, not a union member's
    tag (`dict[str,any]`, `literal['none','auto']`, `function-after[...]`, `[key]`, `str`),
    which are Python type names."""
    if isinstance(part, int):
        return True
    return not any(c in part for c in "[]()") and part not in _TYPE_TAGS


_INSTANCE_OF = re.compile(r",? or (?:an )?instance of [A-Za-z_][\w.]*")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes",
                        "tuple", "set", "frozenset", "any"})


def install_error_handlers(app) -> None:
    async def handle(request: Request, e: Exception):
        return error_response(e, request.url.path)

    for kind in (APIError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, handle)
