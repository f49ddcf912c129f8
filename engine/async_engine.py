"""The async edge of the engine: the synchronous `LLMEngine` runs on one dedicated thread;
coroutines hand it work through `call` (any function of the engine, run between steps) and read
a request's outputs from an asyncio queue. Block events are passed to a callback after each step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.block_pool import KVEvent
from engine.llm_engine import DuplicateRequestId, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    """`on_death(error)` runs on the event loop once, after the engine thread died of `error` and
    every waiter (streams and pending calls) has been failed with `EngineDeadError`."""

    def __init__(self, engine: LLMEngine, on_events: Callable[[list[KVEvent]], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self._on_events = on_events
        self._on_death = on_death
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: set[asyncio.Future] = set()  # calls queued or running on the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not engine.scheduler.has_work() and not self._execute(self._commands.get()):
                    return  # idle: sleep until a command arrives
                while True:  # run everything queued before the next step
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._execute(cmd):
                        return
                if engine.scheduler.has_work():
                    outputs = engine.step()
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, outputs)
                events = engine.drain_events()
                if events and self._on_events is not None:
                    self._on_events(events)
        except BaseException as e:  # noqa: BLE001 - surface to every waiter
            log.exception("engine thread died")
            self.error = e
            self._loop.call_soon_threadsafe(self._fail_all, e)

    @staticmethod
    def _execute(cmd) -> bool:
        if cmd is None:
            return False
        cmd()
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for q in self._streams.values():
            q.put_nowait(error)
        # A call queued behind the fatal step would never run: fail it rather than hang.
        for fut in list(self._calls):
            _set_exception(fut, EngineDeadError(f"engine failed: {error}"))
        self._calls.clear()
        if self._on_death is not None:
            self._on_death(error)

    # ---- calls --------------------------------------------------------------------------------

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the engine thread between steps; return (or raise) its result."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error}")
        fut = self._loop.create_future()
        self._calls.add(fut)
        fut.add_done_callback(self._calls.discard)

        def run() -> None:
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self._loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        return await fut

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget `fn(*args)` on the engine thread."""
        self._commands.put(lambda: fn(*args))

    def open_stream(self, request_id: str) -> asyncio.Queue:
        if request_id in self._streams:
            raise DuplicateRequestId(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def outputs(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; aborts it if the consumer goes away."""
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine failed: {item}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.close_stream(request_id)
            if not finished and self.alive:
                self.post(self.engine.abort_request, request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request (waiting, running, importing or held); its stream ends with 'abort'."""
        out = await self.call(self.engine.abort_request, request_id)
        if out is None:
            return False
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(out)
        return True

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
        hold_blocks: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        q = self.open_stream(request_id)
        try:
            await self.call(self.engine.add_request, request_id, prompt_token_ids, params,
                            output_token_ids, hold_blocks)
        except BaseException:
            self.close_stream(request_id)
            raise
        async for out in self.outputs(request_id, q):
            yield out


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
