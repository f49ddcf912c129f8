"""OpenAI-format errors live in `common.errors` (shared with the router); the worker adds the
engine's own failures: a reused request id is the caller's fault (409), a dead engine is this
worker's (503, and the worker is on its way out: see WorkerState.on_engine_death)."""

from fastapi import Request

from common.errors import APIError, error_body, error_response
from common.errors import install_error_handlers as _install_common
from engine.engine_client import EngineDeadError
from engine.llm_engine import DuplicateRequestId

__all__ = ["APIError", "error_body", "install_error_handlers", "api_error"]


def api_error(e: Exception) -> APIError | None:
    """The HTTP meaning of an engine exception, or None if it has none (a bug: 500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, DuplicateRequestId):
        return APIError(409, str(e), "duplicate_request_id", "request_id")
    if isinstance(e, EngineDeadError):
        return APIError(503, "this worker's engine has failed; the worker is restarting",
                        "engine_dead", headers={"Retry-After": "1"})
    return None


def install_error_handlers(app) -> None:
    _install_common(app)

    async def handle(request: Request, e: Exception):
        return error_response(api_error(e) or e, request.url.path)

    for kind in (DuplicateRequestId, EngineDeadError):
        app.add_exception_handler(kind, handle)
