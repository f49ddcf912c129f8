"""Several workers in one process, for fleet tests on a small machine:

    python -m testing.worker_pack --count 8 decode --model tiny-random --redis-url ... [flags]

Each is a whole worker (its own engine and KV cache, HTTP server and port, registration, block
events and KV transfer endpoint); they share only the process, so torch and the libraries are
loaded once: one tiny-random worker process holds ~385 MiB, almost all of it imports, so 64
workers one per process would need ~25 GB on a 24 GiB machine. Ports are `--port`, `--port` + 1,
... (or, with `--port 0`, ports the kernel picks: each socket is bound before its worker is
built, so packs started together never race for a port); ids are the default `role-host-port`.
SIGTERM or SIGINT stops them all. Production runs one worker per process (`tandem prefill|decode`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys

import uvicorn


class _PackedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the pack handles the signals, for every server at once


def main(argv: list[str] | None = None) -> int:
    from tandem.cli import build_parser
    from tandem.settings import worker_settings

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "--count":
        print(__doc__, file=sys.stderr)
        return 2
    count = int(argv[1])
    args = build_parser().parse_args(argv[2:])
    base = worker_settings(args)
    sockets = [_listen(base.host, 0 if base.port == 0 else base.port + i) for i in range(count)]
    ports = [sock.getsockname()[1] for sock in sockets]
    apps = []
    for port in ports:
        settings = base.model_copy(update={"port": port, "worker_id": None})
        if settings.role == "prefill":
            import prefill_worker

            apps.append(prefill_worker.create_app(settings))
        else:
            import decode_worker

            apps.append(decode_worker.create_app(settings, colocated=settings.role == "colocated"))
    servers = [_PackedServer(uvicorn.Config(app, host=base.host, port=port, log_level="warning",
                                            timeout_graceful_shutdown=2, proxy_headers=False))
               for app, port in zip(apps, ports, strict=True)]
    asyncio.run(_serve(servers, sockets))
    return 0


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def _serve(servers: list[uvicorn.Server], sockets: list[socket.socket]) -> None:
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    await asyncio.gather(*(s.serve(sockets=[sock])
                           for s, sock in zip(servers, sockets, strict=True)))


if __name__ == "__main__":
    sys.exit(main())
