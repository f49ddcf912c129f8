"""A client that stops reading its stream: the request goes out on a socket with a 4 KiB receive
buffer, the first bytes of the answer are read, then nothing more until the test says so."""

from __future__ import annotations

import json
import socket

MODEL = "tiny-random"


class UnreadStream:
    """`body` POSTed to `path` with `Connection: close` (the answer ends with the connection)."""

    def __init__(self, port: int, body: dict, path: str = "/v1/chat/completions",
                 headers: dict[str, str] | None = None) -> None:
        data = json.dumps({"model": MODEL, "stream": True, **body}).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.sock = socket.socket()
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            self.sock.connect(("127.0.0.1", port))
            self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}"
                              f"Content-Type: application/json\r\nContent-Length: {len(data)}"
                              "\r\n\r\n".encode() + data)
            self.received = self.sock.recv(1024)  # the stream started; then never read again
        except BaseException:
            self.sock.close()
            raise

    def read_to_end(self, timeout: float = 120.0) -> list[dict]:
        """Read the rest of the answer; the data of its SSE events before `[DONE]`."""
        self.sock.settimeout(timeout)
        raw = [self.received]
        while chunk := self.sock.recv(1 << 16):
            raw.append(chunk)
        head, _, body = b"".join(raw).partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            body = _dechunk(body)
        events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", body[-300:]
        return [json.loads(e) for e in events[:-1]]

    def close(self) -> None:
        self.sock.close()


def _dechunk(body: bytes) -> bytes:
    out, i = [], 0
    while True:
        j = body.index(b"\r\n", i)
        size = int(body[i:j].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[j + 2:j + 2 + size])
        i = j + 2 + size + 2
