"""The router's open SSE streams, so that a drain that runs out ends each with an OpenAI error
event and `[DONE]` (router/sse.py `DeadlineStreamingResponse`). Left to uvicorn's graceful
shutdown, a stream still open at its timeout was cancelled and its connection closed with
neither: a silent cut for the client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from router.openai_format import sse_data

# What a stream still open when the router's drain ends gets, before it closes.
DRAIN_ENDED = (sse_data({"error": {"message": "the router is shutting down: its drain ended "
                                              "before this stream did",
                                   "type": "server_error", "code": "draining"}})
               + b"data: [DONE]\n\n")

# How long the streams ended at the drain's end have to write that event before uvicorn's
# graceful shutdown (at --drain-timeout-s plus this) cancels what is left.
END_GRACE_S = 2.0


class OpenStreams:
    def __init__(self) -> None:
        self._open: set[asyncio.Timeout] = set()
        self.ended = False

    @contextmanager
    def track(self, until_ended: asyncio.Timeout) -> Iterator[None]:
        """While inside: `end_all` expires `until_ended` (an entered `asyncio.timeout(None)`
        around the stream's writes); one opened after `end_all` expires at once."""
        if self.ended:
            until_ended.reschedule(asyncio.get_running_loop().time())
        self._open.add(until_ended)
        try:
            yield
        finally:
            self._open.discard(until_ended)

    def end_all(self) -> None:
        """The drain is over: every stream still open ends now (TimeoutError in its writer)."""
        self.ended = True
        now = asyncio.get_running_loop().time()
        for t in list(self._open):
            if not t.expired():
                t.reschedule(now)
