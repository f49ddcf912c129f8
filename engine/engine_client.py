"""`EngineClient`: what the worker's async code sees of an engine, wherever it runs.

Two implementations: `AsyncEngine` (engine/async_engine.py) steps the engine on a thread of this
process; `ProcessEngine` (engine/core_client.py) steps it in its own process. Both run engine
methods by name between steps (`call`, `post`) and deliver each request's outputs to an asyncio
queue opened with `open_stream`; the streaming half below is shared, including parking a
request whose reader has fallen behind (engine/output_stream.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from common.protocol import Tenant
from engine.llm_engine import DuplicateRequestId, RequestOutput
from engine.output_stream import OutputStream, StreamEnded
from engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine (its thread or process) has failed; nothing more will come from it."""


class InjectedFault(RuntimeError):
    """Raised inside the engine loop by `inject_fault` (fault-injection test builds)."""


class EngineClient:
    """`max_unread_tokens`, `parked_timeout_s`: when a request whose reader is behind is parked,
    and when it is aborted (engine/output_stream.py); None: never parked."""

    def __init__(self, max_unread_tokens: int | None = None,
                 parked_timeout_s: float = 30.0) -> None:
        self._streams: dict[str, OutputStream] = {}
        self.max_unread_tokens = max_unread_tokens
        self.parked_timeout_s = parked_timeout_s

    # Implemented by both engines:
    @property
    def alive(self) -> bool:
        raise NotImplementedError

    async def call(self, method: str, *args: Any) -> Any:
        """Run the engine's `method(*args)` between steps; return (or raise) its result."""
        raise NotImplementedError

    def post(self, method: str, *args: Any) -> None:
        """Fire and forget the engine's `method(*args)`."""
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """Load figures: running, waiting, free_blocks, num_blocks, held, importing,
        waiting_tokens."""
        raise NotImplementedError

    def inject_fault(self) -> None:
        """Make the engine fail as a bug in a model step would (fault-injection builds)."""
        raise NotImplementedError

    # ---- streams ------------------------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _fail_streams(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(error)

    def open_stream(self, request_id: str) -> OutputStream:
        if request_id in self._streams:
            raise DuplicateRequestId(f"request id {request_id!r} is already in use")
        stream = OutputStream(request_id, self.post, self.max_unread_tokens, self.parked_timeout_s)
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.close()

    async def outputs(self, request_id: str, stream: OutputStream) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; aborts it if the consumer goes away."""
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, StreamEnded):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine failed: {item}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.close_stream(request_id)
            if not finished and self.alive:
                self.post("abort_request", request_id)

    def end_stream(self, request_id: str) -> bool:
        """End a request's stream early on purpose: its reader gets `StreamEnded` after what is
        queued, and the request is aborted. False: no such stream."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.put(StreamEnded(request_id))
        return True

    async def abort(self, request_id: str) -> bool:
        """Abort a request (waiting, running, importing or held); its stream ends with 'abort'."""
        out = await self.call("abort_request", request_id)
        if out is None:
            return False
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(out)
        return True

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
        hold_blocks: bool = False,
        tenant: Tenant | None = None,
    ) -> AsyncIterator[RequestOutput]:
        stream = self.open_stream(request_id)
        try:
            await self.call("add_request", request_id, prompt_token_ids, params,
                            output_token_ids, hold_blocks, tenant)
        except BaseException:
            self.close_stream(request_id)
            raise
        async for out in self.outputs(request_id, stream):
            yield out
