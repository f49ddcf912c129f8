"""Prefills that stop when nobody waits for them. A prefill runs as a task that
`POST /abort/{request_id}` cancels, and that is cancelled as soon as its HTTP client disconnects
(the router gave the leg up: its client left, or the leg timed out): nothing goes on computing,
or stays pinned under a lease, for a caller that is gone."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from worker.errors import APIError
from worker.state import WorkerState

T = TypeVar("T")


def aborted() -> APIError:
    return APIError(503, "the request was aborted", "aborted")


async def run_abortable(state: WorkerState, request: Request, request_id: str,
                        work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, or APIError 503 `aborted` once its client has disconnected or /abort
    named `request_id`. `work` must free what it holds when cancelled (run_prefill does); a
    result that came just as the client left has its export cancelled here (nobody will pull it)."""
    task = asyncio.ensure_future(work)
    own = state.abortable.setdefault(request_id, task) is task  # a duplicate id fails in the engine
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if own:
            state.abortable.pop(request_id, None)
        if not task.done():  # the client left (or this handler was cancelled): stop the work
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        client_gone = gone.done() and not gone.cancelled()
        gone.cancel()
    if task.cancelled():
        raise aborted()
    result = task.result()  # the work's own error, if it failed
    if client_gone:
        if state.connector is not None:
            state.connector.cancel_export(request_id)
        raise aborted()
    return result


async def _disconnected(request: Request) -> None:
    """Returns when the client has disconnected (the body is read already: the server's next
    message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # not expected after the body: never spin on it
