"""A non-blocking TCP socket driven by the event loop's `sock_*` calls, for the TCP transport's
bulk path: block bytes are received straight into their staging buffer (`recv_into`) and sent
from it without a copy, where asyncio's streams copied every byte two or three times (their
buffers, `readexactly`'s bytes) and held the fallback near 0.4 GB/s on loopback.

It offers what kv_transfer/tcp_wire.py's header functions use of a stream (`readexactly`,
`write`, `drain`), so headers keep one implementation. `readexactly` allocates as bytes arrive
(pieces of at most 64 KiB), never a length a peer declared before it sent it.
"""

from __future__ import annotations

import asyncio
import socket

SOCKET_BUFFER_BYTES = 4 << 20  # fewer wake-ups per megabyte on fast links
READ_PIECE_BYTES = 64 << 10


def enlarge_buffers(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass  # capped by the kernel: its default stays


class SocketStream:
    """`large_buffers=False` keeps the kernel's default socket buffers (a server's connection
    before its peer has authenticated: see `enlarge_buffers`)."""

    def __init__(self, sock: socket.socket, large_buffers: bool = True) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers are small and awaited
        if large_buffers:
            enlarge_buffers(sock)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._pending: list[bytes] = []

    @classmethod
    async def connect(cls, host: str, port: int) -> SocketStream:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            stream = cls(sock)
            await stream._loop.sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return stream

    async def read_into(self, view: memoryview) -> None:
        """Fill `view` exactly; IncompleteReadError if the peer closes first."""
        got, total = 0, len(view)
        while got < total:
            n = await self._loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise asyncio.IncompleteReadError(bytes(view[:got]), total)
            got += n

    async def readexactly(self, n: int) -> bytes:
        """Exactly `n` bytes; memory grows with what arrived, one piece ahead at most."""
        pieces = []
        for start in range(0, n, READ_PIECE_BYTES):
            piece = bytearray(min(READ_PIECE_BYTES, n - start))
            await self.read_into(memoryview(piece))
            pieces.append(piece)
        return b"".join(pieces)

    def write(self, data: bytes) -> None:
        self._pending.append(bytes(data))

    async def drain(self) -> None:
        if self._pending:
            data, self._pending = b"".join(self._pending), []
            await self._loop.sock_sendall(self.sock, data)

    async def send(self, view: memoryview) -> None:
        """Send `view` now (after anything written before), without copying it."""
        await self.drain()
        await self._loop.sock_sendall(self.sock, view)

    def close(self) -> None:
        self.sock.close()
