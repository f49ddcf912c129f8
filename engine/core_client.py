"""`ProcessEngine`: the async edge of an engine that runs in its own process
(`engine/engine_core.py`), with the same surface as the in-process `AsyncEngine`: `call` and
`post` run an engine method by name between steps, `generate` / `outputs` stream a request's
outputs, `stats` gives the latest load figures, `core` what the worker reads of the engine.

The KV cache is a shared file mapping (created in /dev/shm, unlinked once both processes have
mapped it): the engine core computes into it, and this process registers the same memory with
the KV transport, so a transfer moves blocks without copying them through the pipe. CPU only;
a CUDA worker keeps the engine on a thread of its process.

The core's outputs arrive once per step for every request it advanced, read on the event loop
as the pipe becomes readable; when the core process exits or its pipe closes, every waiter
fails with `EngineDeadError` and `on_death` runs, as when the engine thread dies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import socket
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from common.block_events import BlockEvent
from common.hashing import BlockHasher
from engine.config import EngineConfig
from engine.engine_client import EngineClient, EngineDeadError
from engine.engine_core import run_engine_core
from engine.kv_cache import map_kv_cache
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading and packing a large model on a busy CPU is slow
STOP_TIMEOUT_S = 30.0


@dataclass
class CoreView:
    """What the API process knows of an engine in another process (the same attributes the
    worker reads of an in-process `LLMEngine`)."""

    model_id: str
    model_digest: str
    folder: Path
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    kv_cache: torch.Tensor  # the shared mapping of the core's cache
    tokenizer: Tokenizer
    hasher: BlockHasher


class ProcessEngine(EngineClient):
    """`on_death(error)` runs on the event loop once, after the core process died and every
    waiter has been failed with `EngineDeadError`."""

    def __init__(self, config: EngineConfig,
                 on_events: Callable[[list[BlockEvent]], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None,
                 log_level: int = logging.INFO) -> None:
        if not config.device.startswith("cpu"):
            raise ValueError("the engine-core process needs the CPU device (its KV cache is a "
                             "shared file mapping)")
        super().__init__(config.max_unread_tokens, config.parked_timeout_s)
        self.config = config
        self._on_events = on_events
        self._on_death = on_death
        self._log_level = log_level
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stats: dict[str, int] = {}
        self._stopping = False
        self.core: CoreView | None = None
        self.error: BaseException | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the core, wait until it has loaded the model, map its KV cache."""
        self._loop = asyncio.get_running_loop()
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        kv_dir = tempfile.mkdtemp(prefix="tandem-kv-", dir=shm)
        kv_path = os.path.join(kv_dir, "kv_cache")
        try:
            ctx = multiprocessing.get_context("spawn")  # no forked torch thread pools
            parent, child = ctx.Pipe(duplex=True)  # a Unix socketpair
            self._process = ctx.Process(
                target=run_engine_core, name="tandem-engine-core", daemon=True,
                args=(replace(self.config, kv_cache_path=kv_path), child, self._log_level))
            self._process.start()
            child.close()  # the core's end lives in the core: EOF here when it dies
            # This end is read and written by the event loop (asyncio streams, never blocking
            # it), with the framing of multiprocessing's Connection, which the core uses.
            sock = socket.socket(fileno=os.dup(parent.fileno()))
            parent.close()
            self._reader, self._writer = await asyncio.open_unix_connection(sock=sock)
            try:
                msg = await asyncio.wait_for(_read_frame(self._reader), STARTUP_TIMEOUT_S)
            except asyncio.IncompleteReadError:
                msg = ("dead", f"exit code {await self._exit_code()}")
            except TimeoutError:
                msg = ("dead", f"not ready within {STARTUP_TIMEOUT_S:.0f} s")
            if msg[0] != "ready":
                raise RuntimeError(f"engine core failed to start: {msg[1]}")
            self.core = self._view(msg[1], kv_path)
        except BaseException:
            if self._process is not None and self._process.is_alive():
                self._process.kill()
            await self._reap()
            raise
        finally:
            shutil.rmtree(kv_dir, ignore_errors=True)  # both processes hold their mapping
        self._stats = msg[1]["stats"]
        self._reading = self._loop.create_task(self._read_loop(), name="engine-core-reader")
        log.info("engine core process %d ready (%d KV blocks)", self._process.pid,
                 self.core.num_blocks)

    def _view(self, info: dict, kv_path: str) -> CoreView:
        dtype = getattr(torch, info["kv_dtype"].removeprefix("torch."))
        return CoreView(
            model_id=info["model_id"], model_digest=info["model_digest"],
            folder=Path(info["folder"]), block_size=info["block_size"],
            num_blocks=info["num_blocks"], max_model_len=info["max_model_len"],
            vocab_size=info["vocab_size"],
            kv_cache=map_kv_cache(kv_path, tuple(info["kv_shape"]), dtype),
            tokenizer=Tokenizer(Path(info["folder"])),
            hasher=BlockHasher(info["model_digest"], info["block_size"], self.config.hash_salt),
        )

    async def stop(self) -> None:
        self._stopping = True
        if self.alive:
            self._writer.write(_frame(None))
        await self._reap()

    async def _reap(self) -> None:
        p = self._process
        if p is not None:
            await asyncio.to_thread(p.join, STOP_TIMEOUT_S)
            if p.is_alive():
                log.warning("engine core did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
                p.kill()
                await asyncio.to_thread(p.join, 5)
        if self._reading is not None:
            self._reading.cancel()
            await asyncio.gather(self._reading, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def _exit_code(self) -> int | None:
        await asyncio.to_thread(self._process.join, 5)
        return self._process.exitcode

    @property
    def alive(self) -> bool:
        return (self.error is None and self._writer is not None and self._process is not None
                and self._process.is_alive())

    # ---- the pipe -----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                self._dispatch(await _read_frame(self._reader))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._died(EngineDeadError(f"engine core process exited ({e or 'pipe closed'})"))

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            _, outputs, events, self._stats = msg
            self._deliver(outputs)
            if events and self._on_events is not None:
                self._on_events(events)
        elif kind == "result":
            _, call_id, ok, value, self._stats = msg
            fut = self._calls.pop(call_id, None)
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        elif kind == "dead":
            self._died(EngineDeadError(f"engine failed: {msg[1]}"))

    def _died(self, error: BaseException) -> None:
        if self.error is not None:
            return
        self.error = error
        if not self._stopping:
            log.error("%s", error)
        self._fail_streams(error)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(str(error)))
        self._calls.clear()
        if self._on_death is not None and not self._stopping:
            self._on_death(error)

    def _send(self, msg: tuple) -> None:
        if self._writer is None or self._writer.is_closing():
            raise EngineDeadError(f"engine is not running: {self.error}")
        self._writer.write(_frame(msg))

    # ---- calls --------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The core's load figures as of its last step or call."""
        return dict(self._stats)

    async def call(self, method: str, *args: Any) -> Any:
        """Run the engine's `method(*args)` in the core between steps; return (or raise) its
        result."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error}")
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        try:
            self._send(("call", call_id, method, args))
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def post(self, method: str, *args: Any) -> None:
        """Fire and forget the engine's `method(*args)`."""
        if self.alive:
            try:
                self._send(("post", method, args))
            except EngineDeadError:
                pass

    def inject_fault(self) -> None:
        """Make the core's loop fail as a bug in a model step would (fault-injection builds)."""
        self._send(("fault",))


def _frame(msg: tuple | None) -> bytes:
    """`msg` as multiprocessing's `Connection.send` frames it (the core reads with `recv`)."""
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    n = len(body)
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return head + body


async def _read_frame(reader: asyncio.StreamReader) -> tuple:
    """One message the core sent with `Connection.send`."""
    (n,) = struct.unpack("!i", await reader.readexactly(4))
    if n == -1:
        (n,) = struct.unpack("!Q", await reader.readexactly(8))
    return pickle.loads(await reader.readexactly(n))
