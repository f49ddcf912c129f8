"""How every Tandem service stops: the same on SIGTERM (kill, systemd, a container stop, `tandem
up`) and SIGINT (Ctrl-C). The first signal starts a drain (a worker stops taking work,
deregisters and lets in-flight requests finish; see WorkerState.drain), then uvicorn's graceful
shutdown, and the process exits 0. A second signal exits at once.

uvicorn alone stops listening and waits, but it deregisters nothing until its lifespan ends, and
it re-raises the signal after shutdown (exit status 143 for SIGTERM, a traceback for SIGINT).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable

import uvicorn

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config,
                 drain: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None
        self.signalled = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Not recorded in uvicorn's _captured_signals: nothing is re-raised after shutdown.
        if self.signalled or self.drain is None or self._loop is None:
            if self.signalled:
                self.force_exit = True
            self.should_exit = True
            self.signalled = True
            return
        self.signalled = True
        log.info("%s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain()
        except Exception:  # noqa: BLE001 - a failed drain must still end in an exit
            log.exception("drain failed; shutting down anyway")
        self.should_exit = True


class BindError(OSError):
    """The service's address cannot be bound (in use, or not an address of this host)."""


def bind(host: str, port: int, send_buffer_bytes: int | None = None) -> socket.socket:
    """The listening socket, bound before anything else starts (Redis, background loops, the
    engine): a service that cannot bind says so and exits non-zero at once. uvicorn binds after
    the app's startup, and a router whose bind failed there never exited. `send_buffer_bytes`:
    the kernel send buffer of every connection accepted on it (Linux: inherited from the
    listener; none: the kernel's autotuning, which lets a client that reads nothing absorb MBs
    before a write blocks and a write deadline can start counting)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        try:
            sock.bind(addr)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise BindError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def run(server: DrainingServer, sockets: list[socket.socket] | None = None) -> None:
    """Serve until stopped. A signal that arrives before uvicorn takes the signals over (while
    the app is imported and built) ends the process at once, with status 0; from then on each
    goes to `DrainingServer.handle_exit`, and after the server stops they are ignored."""
    for sig in SIGNALS:
        signal.signal(sig, lambda *_: os._exit(0) if not server.started else None)
    server.run(sockets)


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """Linux: a `subprocess.Popen(preexec_fn=...)` that makes the child get `sig` when this
    process dies (even by SIGKILL), so nothing a launcher started outlives it. A no-op where
    prctl is missing."""
    parent = os.getpid()

    def preexec() -> None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(0)

    return preexec


def timed_http_protocol(header_timeout_s: float, write_buffer_bytes: int | None = None):
    """uvicorn's httptools protocol with a deadline on each request's headers: a connection
    that has not sent a complete request head within `header_timeout_s` of opening (or of its
    previous response, on keep-alive) is closed. uvicorn has none (slowloris: partial headers
    held a connection forever); the body's own deadline is router/front.py's.
    `write_buffer_bytes`: what a response may queue in the process beyond the kernel's send
    buffer before its writes wait (asyncio's default is 64 KiB)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if write_buffer_bytes is not None:
                transport.set_write_buffer_limits(high=write_buffer_bytes)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                log.info("closed a connection that sent no complete request head in %.0f s",
                         header_timeout_s)
                self.transport.close()

    return TimedHttpToolsProtocol
