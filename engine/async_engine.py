"""The async edge of the engine, in-process: the synchronous `LLMEngine` runs on one dedicated
thread; coroutines hand it work through `call` (a method of the engine by name, run between
steps; one of `MID_STEP_METHODS` runs at once, under the engine's lock) and read a request's
outputs from an asyncio queue. Block events are passed to a callback after each step.
`engine/core_client.py` offers the same surface with the engine in its own process.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from common.block_events import BlockEvent
from engine.engine_client import EngineClient, EngineDeadError, InjectedFault
from engine.llm_engine import MID_STEP_METHODS, LLMEngine

log = logging.getLogger(__name__)


_TIER_POLL_S = 0.05


def _noop() -> None:
    pass


def _fail() -> None:
    raise InjectedFault("injected engine fault")


class AsyncEngine(EngineClient):
    """`on_death(error)` runs on the event loop once, after the engine thread died of `error` and
    every waiter (streams and pending calls) has been failed with `EngineDeadError`."""

    def __init__(self, engine: LLMEngine,
                 on_events: Callable[[list[BlockEvent]], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(engine.config.max_unread_tokens, engine.config.parked_timeout_s)
        self.engine = engine
        self._on_events = on_events
        self._on_death = on_death
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: set[asyncio.Future] = set()  # calls queued or running on the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        await asyncio.to_thread(self.engine.close)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not engine.scheduler.has_work() and not self._execute(self._idle_wait()):
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
                with engine.lock:
                    events = engine.drain_events()
                if events and self._on_events is not None:
                    self._on_events(events)
        except BaseException as e:  # noqa: BLE001 - surface to every waiter
            log.exception("engine thread died")
            self.error = e
            self._loop.call_soon_threadsafe(self._fail_all, e)

    def _idle_wait(self):
        """The next command; while the KV tiers copy, a no-op after a moment (their events are
        handed on from this thread)."""
        if not self.engine.background_busy:
            return self._commands.get()
        try:
            return self._commands.get(timeout=_TIER_POLL_S)
        except queue.Empty:
            return _noop

    def _execute(self, cmd) -> bool:
        if cmd is None:
            return False
        with self.engine.lock:  # a mid-step method may be running on another thread
            cmd()
        return True

    def _fail_all(self, error: BaseException) -> None:
        self._fail_streams(error)
        # A call queued behind the fatal step would never run: fail it rather than hang.
        for fut in list(self._calls):
            _set_exception(fut, EngineDeadError(f"engine failed: {error}"))
        self._calls.clear()
        if self._on_death is not None:
            self._on_death(error)

    # ---- calls --------------------------------------------------------------------------------

    @property
    def core(self) -> LLMEngine:
        """What the worker reads of the engine (model id, tokenizer, hasher, KV cache, sizes)."""
        return self.engine

    def stats(self) -> dict[str, int]:
        # Read from the event loop while the engine thread runs: figures, not invariants.
        return self.engine.stats()

    async def call(self, method: str, *args: Any) -> Any:
        """Run the engine's `method(*args)` between steps; return (or raise) its result."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error}")
        fn = getattr(self.engine, method)
        if method in MID_STEP_METHODS:  # not behind the step in progress
            try:
                return await asyncio.to_thread(self._locked, fn, args)
            finally:
                self._commands.put(_noop)  # an idle engine thread hands on what it cached
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

    def _locked(self, fn: Callable, args: tuple) -> Any:
        with self.engine.lock:
            return fn(*args)

    def post(self, method: str, *args: Any) -> None:
        """Fire and forget the engine's `method(*args)`."""
        fn = getattr(self.engine, method)
        self._commands.put(lambda: fn(*args))

    def inject_fault(self) -> None:
        """Make the engine loop fail as a bug in a model step would (fault-injection builds)."""
        self._commands.put(_fail)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
