"""Hostile peers for the security tests, on loopback in a thread of the test process: an HTTP
server that answers `GET /kv/metadata` the way it is told (counting every hit), and a raw TCP
data port that answers the tcp transport's pull header the way it is told (after its challenge
and the receiver's preamble, which it reads but does not check: it stands for a peer that does)."""

from __future__ import annotations

import asyncio
import json
import threading

from kv_transfer import tcp_wire
from kv_transfer.tcp_wire import HEADER as _HEADER


class FakePeer:
    """`metadata`: the JSON document served at /kv/metadata (None: 404). `trickle`: send the
    response one byte a second instead. `tcp_answer`: the header sent back to a pull (a dict, or
    raw bytes sent as the header's JSON), followed by `tcp_payload` bytes."""

    def __init__(self) -> None:
        # Bound to port 0 and read back: a port chosen free beforehand can be taken by another
        # process before the bind (seen in CI: "address already in use").
        self.http_port = self.tcp_port = 0
        self.metadata: dict | None = None
        self.trickle = False
        self.tcp_answer: dict | bytes | None = None
        self.tcp_payload = b""
        self.hits: list[str] = []
        self.tcp_requests: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or not self.http_port:
            raise RuntimeError("the fake peer did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start():
            self._servers = [await asyncio.start_server(self._http, "127.0.0.1", 0),
                             await asyncio.start_server(self._tcp, "127.0.0.1", 0)]
            self.http_port, self.tcp_port = (srv.sockets[0].getsockname()[1]
                                             for srv in self._servers)
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.hits.append(head.split(b" ")[1].decode(errors="replace"))
            if self.metadata is None:
                body, status = b'{"detail": "not found"}', "404 Not Found"
            else:
                body, status = json.dumps(self.metadata).encode(), "200 OK"
            response = (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
            if self.trickle:
                for i in range(len(response)):
                    writer.write(response[i:i + 1])
                    await writer.drain()
                    await asyncio.sleep(1.0)
            else:
                writer.write(response)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(tcp_wire.new_challenge())
            await reader.readexactly(tcp_wire.PREAMBLE_BYTES)
            (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
            self.tcp_requests.append(json.loads(await reader.readexactly(n)))
            answer = self.tcp_answer
            data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
            writer.write(_HEADER.pack(len(data)) + data + self.tcp_payload)
            await writer.drain()
            await asyncio.sleep(0.5)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        async def shutdown():
            for s in self._servers:
                s.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
