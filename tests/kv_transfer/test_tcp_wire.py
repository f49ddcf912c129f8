"""The TCP transport's preamble and header caps (kv_transfer/tcp_wire.py), and the data port's
treatment of strangers (kv_transfer/tcp_server.py), in process: a golden vector pins the
preamble's bytes; a wrong preamble is refused after reading exactly its 36 bytes; a header's
declared length is checked against its cap before any of it is read; large headers are parsed
on a thread; strangers beyond `MAX_HANDSHAKES` close the oldest, and an honest pull still goes
through while they are held."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import struct
import threading

import pytest
import torch

from common.bounds import INT32_MAX, MAX_BLOCK_IDS, MAX_REQUEST_ID_CHARS
from kv_transfer import tcp_server
from kv_transfer import tcp_wire as wire
from kv_transfer.layout import KVLayout
from kv_transfer.tcp_transport import TcpTransport
from kv_transfer.transport import TransferError, TransportConfig

TOKEN = "internal-test-token"
CHALLENGE = wire.MAGIC + bytes(range(16))
# The preamble answering CHALLENGE: MAGIC + HMAC-SHA256(key, LABEL + nonce). Pinned: both ends of
# a cluster must compute exactly these bytes.
GOLDEN = bytes.fromhex("544b563115c371ff3fe5d4d5207fa879ff47b5ba442aeabcee67b72c5aa91b7a4612937b")
GOLDEN_NO_TOKEN = bytes.fromhex(
    "544b5631577586c8f1e37dbcc8f4ff270dfd801841586720235ffeaaa6d8795ad250fca1")


class Recorder:
    """A stream that serves `data` and records how many bytes each read asked for."""

    def __init__(self, data: bytes) -> None:
        self.data, self.reads, self.written = data, [], b""

    async def readexactly(self, n: int) -> bytes:
        self.reads.append(n)
        if n > len(self.data):
            raise asyncio.IncompleteReadError(self.data, n)
        out, self.data = self.data[:n], self.data[n:]
        return out

    def write(self, data: bytes) -> None:
        self.written += data

    async def drain(self) -> None:
        pass


def test_the_preamble_golden_vector():
    assert wire.preamble(TOKEN, CHALLENGE) == GOLDEN
    assert wire.preamble(None, CHALLENGE) == wire.preamble("", CHALLENGE) == GOLDEN_NO_TOKEN
    assert len(GOLDEN) == wire.PREAMBLE_BYTES == 36 and wire.CHALLENGE_BYTES == 20
    digest = hmac.new(TOKEN.encode(), b"tandem-kv-tcp preamble v1\x00" + bytes(range(16)),
                      hashlib.sha256).digest()
    assert GOLDEN == b"TKV1" + digest
    assert wire.preamble_ok(TOKEN, CHALLENGE, GOLDEN)
    assert not wire.preamble_ok("another", CHALLENGE, GOLDEN)
    assert not wire.preamble_ok(None, CHALLENGE, GOLDEN)  # no token: the empty one's digest only
    assert not wire.preamble_ok(TOKEN, wire.MAGIC + bytes(16), GOLDEN)  # another nonce
    assert not wire.preamble_ok(TOKEN, CHALLENGE, GOLDEN[:-1])
    assert wire.new_challenge() != wire.new_challenge()  # fresh per connection
    with pytest.raises(TransferError, match="version"):
        wire.preamble(TOKEN, b"TKV2" + bytes(16))


def test_a_wrong_preamble_is_refused_before_anything_else_is_read(monkeypatch):
    hostile = struct.pack(">I", 16 << 20) + b"x" * 100  # a 16 MiB length, then junk
    stream = Recorder(hostile)
    assert asyncio.run(wire.authenticate(stream, TOKEN)) is False
    assert stream.reads == [wire.PREAMBLE_BYTES]
    assert len(stream.written) == wire.CHALLENGE_BYTES and stream.written.startswith(wire.MAGIC)
    # The right preamble for the challenge it was given passes, and only it.
    monkeypatch.setattr(wire, "new_challenge", lambda: CHALLENGE)
    assert asyncio.run(wire.authenticate(Recorder(GOLDEN + hostile), TOKEN)) is True
    assert asyncio.run(wire.authenticate(Recorder(GOLDEN_NO_TOKEN), TOKEN)) is False
    assert asyncio.run(wire.authenticate(Recorder(GOLDEN_NO_TOKEN), None)) is True


def test_read_header_refuses_a_length_over_its_cap_before_reading_it():
    stream = Recorder(struct.pack(">I", 5000) + b"{" * 5000)
    with pytest.raises(TransferError, match="too large"):
        asyncio.run(wire.read_header(stream, wire.REQUEST, max_bytes=4999))
    assert stream.reads == [wire.HEADER.size]
    ok = json.dumps({"op": "notify", "request_id": "r1"}).encode()
    stream = Recorder(struct.pack(">I", len(ok)) + ok)
    req = asyncio.run(wire.read_header(stream, wire.REQUEST, len(ok)))
    assert req.request_id == "r1"


@pytest.mark.parametrize("num_blocks", [1, 10, 256, 100_000])
def test_the_header_cap_fits_every_honest_pull(num_blocks):
    """The cap is what an honest pull can need, computed from the bounds: every id of the
    cache, the largest ids, the longest request id, default JSON spacing."""
    header = {"op": "pull", "request_id": "r" * MAX_REQUEST_ID_CHARS,
              "block_ids": list(range(num_blocks))[::-1], "fp8": True}
    assert len(json.dumps(header).encode()) <= wire.max_request_bytes(num_blocks)
    assert wire.max_request_bytes(num_blocks) < 2 * len(json.dumps(header).encode()) + 2048
    widest = {**header, "block_ids": [INT32_MAX] * MAX_BLOCK_IDS}
    assert len(json.dumps(widest).encode()) <= wire.max_request_bytes() < 13 << 20


def test_large_headers_are_parsed_off_the_event_loop(monkeypatch):
    threads = []
    parse = wire.parse_header
    monkeypatch.setattr(wire, "parse_header",
                        lambda raw, schema: (threads.append(threading.current_thread()),
                                             parse(raw, schema))[1])
    small = json.dumps({"op": "pull", "request_id": "s", "block_ids": [1]}).encode()
    large = json.dumps({"op": "pull", "request_id": "l", "block_ids": [1] * 40_000}).encode()
    assert len(large) > wire.PARSE_OFF_LOOP_BYTES
    for raw in (small, large):
        asyncio.run(wire.read_header(Recorder(struct.pack(">I", len(raw)) + raw), wire.REQUEST,
                                     1 << 20))
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()


def _transport(engine_id: str, seed: int) -> TcpTransport:
    cache = torch.randn(16, 2, 2, 4, 2, 8, generator=torch.Generator().manual_seed(seed))
    return TcpTransport(cache, KVLayout.of_cache(cache, "m"),
                        TransportConfig(engine_id=engine_id, token=TOKEN, handshake_timeout_s=3.0))


async def _closed_after_challenge(reader: asyncio.StreamReader) -> bool:
    """The challenge arrives, then the end of the stream (or a reset) and nothing else."""
    challenge = await reader.readexactly(wire.CHALLENGE_BYTES)
    assert challenge.startswith(wire.MAGIC)
    try:
        return await asyncio.wait_for(reader.read(1), 2.0) == b""
    except ConnectionResetError:
        return True


def test_the_data_port_closes_strangers_and_caps_them_and_serves_honest_pulls():
    async def run() -> None:
        sender, receiver = _transport("P", 1), _transport("D", 2)
        await sender.start()
        await receiver.start()
        port = sender.port
        try:
            # A wrong preamble, and a bare 16 MiB length (the old attack): closed unanswered.
            wrong = wire.preamble("not-the-token", CHALLENGE)
            for first in (wrong, struct.pack(">I", 16 << 20) * 9):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(first + b"x" * 1000)
                assert await _closed_after_challenge(reader)
                writer.close()
            # Idle strangers past the cap close the oldest; the server holds at most the cap.
            idle = [await asyncio.open_connection("127.0.0.1", port)
                    for _ in range(tcp_server.MAX_HANDSHAKES + 8)]
            await asyncio.sleep(0.3)
            assert sender.server.num_connections <= tcp_server.MAX_HANDSHAKES
            for reader, _ in idle[:8]:
                assert await _closed_after_challenge(reader)
            # An authenticated header over the cap is refused without being read.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            challenge = await reader.readexactly(wire.CHALLENGE_BYTES)
            writer.write(wire.preamble(TOKEN, challenge)
                         + wire.HEADER.pack(sender.server.max_request_bytes + 1))
            answer = await wire.read_header(reader, wire.ANSWER, wire.MAX_ANSWER_BYTES)
            assert answer.ok is False and "too large" in answer.error
            writer.close()
            # An honest pull goes through while the strangers are held, bit-exact.
            stats = await receiver.pull(sender.metadata(), "r1", [3, 0, 7], [1, 2, 3])
            assert stats.num_blocks == 3
            assert torch.equal(receiver.kv_cache[[1, 2, 3]], sender.kv_cache[[3, 0, 7]])
            await asyncio.sleep(0.05)
            assert sender.completed() == ["r1"]
            await receiver.notify(sender.metadata(), "r2")
            await asyncio.sleep(0.05)
            assert sender.completed() == ["r2"]
            assert sender.errors.counter.labels("tcp_transport_server")._value.get() >= 8 + 2
            for _, writer in idle:
                writer.close()
        finally:
            await receiver.close()
            await sender.close()

    asyncio.run(run())


@pytest.mark.parametrize("sender_token, receiver_token, ok", [
    (TOKEN, "another-token", False), (TOKEN, None, False), (None, TOKEN, False),
    (None, None, True)])
def test_only_a_receiver_with_the_senders_token_pulls(sender_token, receiver_token, ok):
    """Without a token (a loopback development cluster) the preamble is still required, keyed
    by the empty token: a peer with any other key is refused too."""
    async def run() -> None:
        sender, receiver = _transport("P", 1), _transport("D", 2)
        sender.config.token, receiver.config.token = sender_token, receiver_token
        await sender.start()
        try:
            if ok:
                await receiver.pull(sender.metadata(), "r1", [5], [6])
                assert torch.equal(receiver.kv_cache[6], sender.kv_cache[5])
            else:
                with pytest.raises(TransferError):
                    await receiver.pull(sender.metadata(), "r1", [5], [6])
                assert not torch.equal(receiver.kv_cache[6], sender.kv_cache[5])
            await asyncio.sleep(0.05)
            assert sender.completed() == (["r1"] if ok else [])
        finally:
            await sender.close()

    asyncio.run(run())
