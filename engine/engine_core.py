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
"""

from __future__ import annotations

import logging
import pickle
import signal
from multiprocessing.connection import Connection
from typing import Any

from engine.config import EngineConfig
from engine.engine_client import InjectedFault
from engine.llm_engine import LLMEngine

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


class EngineCoreLoop:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            if not engine.scheduler.has_work():
                # idle: sleep until a message arrives (or, while the KV tiers copy, a moment:
                # their events are published from here)
                conn.poll(_TIER_POLL_S if engine.background_busy else None)
            posted = False
            while conn.poll(0):  # everything queued runs before the next step
                msg = conn.recv()
                if not self._handle(msg):
                    return
                posted = posted or msg[0] == "post"
            outputs = engine.step() if engine.scheduler.has_work() else []
            events = engine.drain_events()
            # A posted release or abort changes the load figures without a reply to carry them.
            if outputs or events or posted:
                _send(conn, ("step", outputs, events, engine.stats()))

    def _handle(self, msg: tuple | None) -> bool:
        if msg is None:
            return False
        kind = msg[0]
        if kind == "call":
            _, call_id, method, args = msg
            try:
                value, ok = self._run(method, args), True
            except Exception as e:  # noqa: BLE001 - raised again in the caller
                value, ok = e, False
            _send(self.conn, ("result", call_id, ok, value, self.engine.stats()))
        elif kind == "post":
            _, method, args = msg
            try:
                self._run(method, args)
            except Exception:  # noqa: BLE001 - fire and forget: nobody waits for it
                log.exception("posted %s failed", method)
        elif kind == "fault":
            raise InjectedFault("injected engine fault")
        else:
            raise ValueError(f"unknown engine-core message {kind!r}")
        return True

    def _run(self, method: str, args: tuple) -> Any:
        if method not in REMOTE_METHODS:
            raise ValueError(f"engine method {method!r} cannot be called remotely")
        return getattr(self.engine, method)(*args)


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
