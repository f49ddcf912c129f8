"""One request's outputs on their way from the engine to whoever streams them (the worker's HTTP
response), and that reader's backlog: the tokens queued here that it has not taken yet.

A reader falls behind when the client at the end of the chain stops reading: the router cuts
its own client only after a write deadline, and until then stops reading the worker's stream,
so the worker's socket fills, its writes wait, and outputs pile up here. Past
`max_unread_tokens` the request is parked in the engine (engine/scheduler.py): it leaves the
batch, so a reader that does not read costs the other requests no compute. It is resumed once
the reader has taken the backlog down to half the bound, and aborted (its blocks freed, the
reader's stream ended with finish reason `abort`) if it stays parked for `parked_timeout_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from engine.output import RequestOutput

log = logging.getLogger(__name__)


class StreamEnded(Exception):
    """Put into a stream by its worker to end it early on purpose (a drain's hand-off,
    worker/handoff.py): the reader gets it after the outputs queued before it, and the request
    is aborted (its computed blocks stay cached). Not an engine failure."""


class OutputStream:
    """`post(method, *args)` runs an engine method between steps (`EngineClient.post`);
    `max_unread_tokens` None: never parked."""

    def __init__(self, request_id: str, post: Callable[..., None],
                 max_unread_tokens: int | None, parked_timeout_s: float) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_unread_tokens = 0
        self.parked = False
        self._post = post
        self._max_unread = max_unread_tokens
        self._parked_timeout_s = parked_timeout_s
        self._expiry: asyncio.TimerHandle | None = None
        self._last: RequestOutput | None = None
        self._ended = False  # a finished output (or an error) is queued: nothing more to decide

    def put(self, item: RequestOutput | BaseException) -> None:
        """An output of the engine (or the error that ended it) for the reader."""
        if self._ended:
            return
        self.queue.put_nowait(item)
        if not isinstance(item, RequestOutput) or item.finished:
            self._ended = True
            self._cancel_expiry()
            return
        self._last = item
        self.num_unread_tokens += len(item.new_token_ids)
        if (self._max_unread is not None and not self.parked
                and self.num_unread_tokens > self._max_unread):
            self.parked = True
            self._post("park_request", self.request_id, True)
            self._expiry = asyncio.get_running_loop().call_later(
                self._parked_timeout_s, self._expire)

    async def get(self) -> RequestOutput | BaseException:
        """The next item for the reader, resuming the request once it has caught up."""
        item = await self.queue.get()
        if isinstance(item, RequestOutput):
            self.num_unread_tokens -= len(item.new_token_ids)
            if self.parked and not self._ended and self.num_unread_tokens <= self._max_unread // 2:
                self.parked = False
                self._cancel_expiry()
                self._post("park_request", self.request_id, False)
        return item

    def close(self) -> None:
        """The reader has gone (the caller aborts the request if it had not finished)."""
        self._ended = True
        self._cancel_expiry()

    def _expire(self) -> None:
        """Parked too long: the engine frees the request now; the reader, if it ever reads
        again, gets what was queued and then the end."""
        self._expiry = None
        log.info("request %s: its reader took nothing for %.0f s while parked; aborted",
                 self.request_id, self._parked_timeout_s)
        self._post("abort_request", self.request_id)
        self.put(dataclasses.replace(self._last, new_token_ids=[], finish_reason="abort",
                                     stop_reason=None))

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
