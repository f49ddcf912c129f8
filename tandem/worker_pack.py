"""Several workers in one process, for fleet tests on a small machine:

    python -m tandem.worker_pack --count 8 decode --model tiny-random --redis-url ... [worker flags]

Each is a whole worker (its own engine and KV cache, HTTP server and port, registration, block
events and KV transfer endpoint); they share only the process, so torch and the libraries are
loaded once: one tiny-random worker process holds ~385 MiB, almost all of it imports, so 64
workers one per process would need ~25 GB on a 24 GiB machine. Ports are `--port`, `--port` + 1,
... (or free ones with `--port 0`); ids are the default `role-host-port`. SIGTERM or SIGINT
stops them all. Production runs one worker per process (`tandem prefill|decode`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import uvicorn

from tandem.cluster import free_port


class _PackedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the pack handles the signals, for every server at once


def main(argv: list[str] | None = None) -> int:
    from tandem.cli import build_parser
    from tandem.commands import worker_settings

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "--count":
        print(__doc__, file=sys.stderr)
        return 2
    count = int(argv[1])
    args = build_parser().parse_args(argv[2:])
    base = worker_settings(args)
    ports = [free_port() if base.port == 0 else base.port + i for i in range(count)]
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
                                            timeout_graceful_shutdown=2))
               for app, port in zip(apps, ports, strict=True)]
    asyncio.run(_serve(servers))
    return 0


async def _serve(servers: list[uvicorn.Server]) -> None:
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    await asyncio.gather(*(s.serve() for s in servers))


if __name__ == "__main__":
    sys.exit(main())
