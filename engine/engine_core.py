"""The engine-core process: one `LLMEngine` stepping in its own process, driven over a pipe by
`engine/core_client.py` in the worker's API process.

Why a process: the API process's event loop (HTTP, SSE, JSON, Redis, KV-transfer notifications)
and the engine's Python work between kernels no longer take turns on one GIL.

Wire (pickled tuples over a `multiprocessing` pipe, a Unix socketpair; both ends are this
program, spawned by the client, so nothing foreign ever reaches `recv`):

client -> core                          core -> client
  ("call", call_id, method, args)         ("ready", info)           once, after loading
  ("post", method, args)                  ("result", call_id, ok, value, stats)
  ("fault",)                              ("step", outputs, events, stats)   per step, batched
  None: stop                              ("dead", message)         the loop failed; it exits

A reader thread receives every message. A call or post of one of `MID_STEP_METHODS` (a peer
prefix pull's pin, reserve and commit) runs there at once, under the engine's lock, even while a
step's model forward runs; the rest queue, in order, for the loop to run between steps.
"""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from engine.config import EngineConfig
from engine.engine_client import InjectedFault
from engine.llm_engine import MID_STEP_METHODS, LLMEngine

log = logging.getLogger(__name__)

# What the API process may run here: the engine's request methods, nothing else.
_TIER_POLL_S = 0.05
REMOTE_METHODS = frozenset({
    "add_request", "import_request", "finish_import", "abort_request", "park_request", "release",
    "block_table", "cached_hashes", "cached_hashes_by_medium", "stats",
    "pin_prefix", "reserve_prefix", "commit_prefix",  # a peer prefix pull (engine/prefix_pins.py)
})


def describe(engine: LLMEngine) -> dict[str, Any]:
    """What the API process needs to know of the engine to serve without calling it."""
    return {
        "model_id": engine.model_id, "model_digest": engine.model_digest,
        "folder": str(engine.folder), "block_size": engine.block_size,
        "num_blocks": engine.num_blocks, "max_model_len": engine.max_model_len,
        "vocab_size": engine.model_config.vocab_size, "kv_shape": tuple(engine.kv_cache.shape),
        "kv_dtype": str(engine.kv_cache.dtype), "stats": engine.stats(),
    }


def run_engine_core(config: EngineConfig, conn: Connection, log_level: int = logging.INFO) -> None:
    """Process entry point: load the engine, report ready, then serve until told to stop or
    until the API process goes away (its end of the pipe closes)."""
    # The terminal's Ctrl-C reaches the whole process group: the API process decides when the
    # core stops (it sends None after draining), so the core ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s engine-core: %(message)s")
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - reported to the client, which raises it
        log.exception("engine failed to load")
        _send(conn, ("dead", f"{type(e).__name__}: {e}"))
        return
    _send(conn, ("ready", describe(engine)))
    try:
        EngineCoreLoop(engine, conn).run()
        engine.close()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.warning("API process went away; engine core exits")
    except BaseException as e:  # noqa: BLE001 - the client fails every waiter with it
        log.exception("engine core died")
        try:
            _send(conn, ("dead", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        raise SystemExit(1) from e


_EOF = ("eof",)  # the reader's last message to the loop: the API process went away
_WAKE = ("wake",)  # the reader ran a mid-step method: the loop sends its events and figures


class EngineCoreLoop:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # what runs between steps
        self.send_lock = threading.Lock()  # the loop and the reader both reply

    def run(self) -> None:
        engine = self.engine
        threading.Thread(target=self._read, name="engine-core-reader", daemon=True).start()
        while True:
            msgs = []
            if not engine.scheduler.has_work():
                # idle: sleep until a message arrives (or, while the KV tiers copy, a moment:
                # their events are published from here)
                try:
                    msgs.append(self.inbox.get(
                        timeout=_TIER_POLL_S if engine.background_busy else None))
                except queue.Empty:
                    pass
            while True:  # everything queued runs before the next step
                try:
                    msgs.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            posted = False
            for msg in msgs:
                if not self._handle(msg):
                    return
                posted = posted or msg[0] in ("post", "wake")
            outputs = engine.step() if engine.scheduler.has_work() else []
            with engine.lock:
                events, stats = engine.drain_events(), engine.stats()
            # A posted release or abort changes the load figures without a reply to carry them.
            if outputs or events or posted:
                self._send(("step", outputs, events, stats))

    def _read(self) -> None:
        """The reader thread: mid-step methods here and now, the rest to the loop."""
        try:
            while True:
                msg = self.conn.recv()
                method = msg[-2] if msg is not None and msg[0] in ("call", "post") else None
                if method in MID_STEP_METHODS:
                    self._handle(msg)
                    self.inbox.put(_WAKE)  # an idle loop publishes what it cached
                else:
                    self.inbox.put(msg)
        except (EOFError, OSError):
            self.inbox.put(_EOF)
        except BaseException as e:  # noqa: BLE001 - the loop dies of it, as of its own
            self.inbox.put(("error", e))

    def _handle(self, msg: tuple | None) -> bool:
        if msg is None:
            return False
        kind = msg[0]
        if kind == "call":
            _, call_id, method, args = msg
            with self.engine.lock:
                try:
                    value, ok = self._run(method, args), True
                except Exception as e:  # noqa: BLE001 - raised again in the caller
                    value, ok = e, False
                stats = self.engine.stats()
            self._send(("result", call_id, ok, value, stats))
        elif kind == "post":
            _, method, args = msg
            with self.engine.lock:
                try:
                    self._run(method, args)
                except Exception:  # noqa: BLE001 - fire and forget: nobody waits for it
                    log.exception("posted %s failed", method)
        elif kind == "fault":
            raise InjectedFault("injected engine fault")
        elif kind == "wake":
            pass
        elif kind == "eof":
            raise EOFError("the API process closed the pipe")
        elif kind == "error":
            raise msg[1]
        else:
            raise ValueError(f"unknown engine-core message {kind!r}")
        return True

    def _run(self, method: str, args: tuple) -> Any:
        if method not in REMOTE_METHODS:
            raise ValueError(f"engine method {method!r} cannot be called remotely")
        return getattr(self.engine, method)(*args)

    def _send(self, msg: tuple) -> None:
        with self.send_lock:
            _send(self.conn, msg)


def _send(conn: Connection, msg: tuple) -> None:
    try:
        conn.send(msg)
    except (pickle.PicklingError, TypeError, AttributeError):
        if msg[0] != "result" or msg[2]:
            raise
        # An exception that does not pickle still reaches the caller, as its text.
        error = msg[3]
        conn.send(("result", msg[1], False,
                   RuntimeError(f"{type(error).__name__}: {error}"), msg[4]))
