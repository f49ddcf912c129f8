"""The TCP transport's wire: a fixed-size authentication preamble, then length-prefixed JSON
headers, each capped in size and validated against its schema (a peer's JSON is never indexed
blindly), and the framing constants.

    challenge (sender -> receiver, on accept): MAGIC, 16 random bytes (the nonce)
    preamble  (receiver -> sender): MAGIC, HMAC-SHA256(internal token, LABEL + nonce)
    request   (receiver -> sender): PullHeader, or NotifyHeader (nothing to pull)
    response  (sender -> receiver): Accepted then chunks of [8-byte xxh3_64 LE][bytes]; or Refused
    done      (receiver -> sender): DoneHeader

A header is a 4-byte big-endian length then that many bytes of JSON. The sender reads nothing
but the 36-byte preamble from a connection until it matches (compared in constant time; a
mismatch closes the connection without another read), so a stranger to the token can make it
hold 36 bytes, never a length it declares. The nonce is fresh per connection, so a preamble seen
on the wire cannot be replayed, and the token itself never travels. Without a token (a loopback
development cluster) the preamble is still sent and checked, keyed by the empty token.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import struct
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from common.bounds import (
    INT32_MAX,
    MAX_BLOCK_IDS,
    MAX_REQUEST_ID_CHARS,
    BlockIds,
    Host,
    Port,
    RequestId,
)
from kv_transfer.transport import TransferError

HEADER = struct.Struct(">I")
CHECKSUM = struct.Struct("<Q")
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 1 << 12, 1 << 28

MAGIC = b"TKV1"  # the wire's name and version: a peer of another version fails at once
NONCE_BYTES = 16
LABEL = b"tandem-kv-tcp preamble v1\x00"  # HMAC domain: no other message under the token starts so
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES
PREAMBLE_BYTES = len(MAGIC) + hashlib.sha256().digest_size

# Header caps. A request's envelope (op, request_id, fp8, keys) needs well under 1 KiB; its
# block ids at most ", " plus the digits of the largest id each.
_ENVELOPE_BYTES = 1024 + MAX_REQUEST_ID_CHARS
MAX_ANSWER_BYTES = 32 << 10  # Refused.error: 4,096 characters, \u-escaped at worst
MAX_DONE_BYTES = _ENVELOPE_BYTES
PARSE_OFF_LOOP_BYTES = 64 << 10  # larger headers are validated on a thread, not the event loop


def max_request_bytes(num_blocks: int = INT32_MAX + 1) -> int:
    """The largest request header an honest pull from a cache of `num_blocks` blocks can need:
    at most `num_blocks` ids (and never more than the BlockIds bound), each below `num_blocks`.
    By default the BlockIds bound of common/bounds.py itself (about 12 MiB); a sender passes its
    own cache's size (a few KiB for a CPU worker's 256 blocks)."""
    count = min(num_blocks, MAX_BLOCK_IDS)
    digits = len(str(min(num_blocks - 1, INT32_MAX)))
    return _ENVELOPE_BYTES + count * (digits + 2)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PullHeader(_Strict):
    op: Literal["pull"]
    request_id: RequestId
    block_ids: BlockIds = Field(min_length=1)
    fp8: bool = False


class NotifyHeader(_Strict):
    op: Literal["notify"]
    request_id: RequestId


class DoneHeader(_Strict):
    op: Literal["done"]
    request_id: RequestId


class Accepted(_Strict):
    ok: Literal[True]
    num_bytes: int = Field(ge=0, le=1 << 40)
    chunk_bytes: int = Field(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES)


class Refused(_Strict):
    ok: Literal[False]
    error: str = Field(max_length=4096)


class TcpParams(BaseModel):
    host: Host
    port: Port


REQUEST = TypeAdapter(PullHeader | NotifyHeader)
ANSWER = TypeAdapter(Accepted | Refused)


# ---- the preamble ---------------------------------------------------------------------------

def new_challenge() -> bytes:
    """What the sender writes first on every connection it accepts: MAGIC and a fresh nonce."""
    return MAGIC + os.urandom(NONCE_BYTES)


def preamble(token: str | None, challenge: bytes) -> bytes:
    """The receiver's answer to `challenge`: MAGIC and HMAC-SHA256 under the token (the empty
    one without a token) of LABEL + nonce. TransferError if `challenge` is not one."""
    if len(challenge) != CHALLENGE_BYTES or not challenge.startswith(MAGIC):
        raise TransferError("the peer does not speak this version of the tcp transport")
    key = (token or "").encode("utf-8", "surrogateescape")
    return MAGIC + hmac.new(key, LABEL + challenge[len(MAGIC):], hashlib.sha256).digest()


def preamble_ok(token: str | None, challenge: bytes, given: bytes) -> bool:
    """Whether `given` answers `challenge` under `token`, compared in constant time."""
    return len(given) == PREAMBLE_BYTES and hmac.compare_digest(given, preamble(token, challenge))


async def authenticate(stream, token: str | None) -> bool:
    """Sender side: write a challenge, read exactly the fixed-size preamble, check it. Nothing
    else is read from `stream` before this returns True."""
    challenge = new_challenge()
    stream.write(challenge)
    await stream.drain()
    return preamble_ok(token, challenge, await stream.readexactly(PREAMBLE_BYTES))


async def answer_challenge(stream, token: str | None) -> None:
    """Receiver side: read the sender's challenge and queue the preamble (sent with the header
    that follows, in one write)."""
    stream.write(preamble(token, await stream.readexactly(CHALLENGE_BYTES)))


# ---- headers --------------------------------------------------------------------------------

async def write_header(writer, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    writer.write(HEADER.pack(len(data)) + data)
    await writer.drain()


def parse_header(raw: bytes, schema):
    """`raw` validated by `schema` (a model or TypeAdapter); TransferError naming the first
    problem (never pydantic's text, which quotes the input) if it is not JSON of the schema."""
    try:
        if isinstance(schema, TypeAdapter):
            return schema.validate_json(raw)
        return schema.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        where = ".".join(map(str, first["loc"]))
        raise TransferError(f"invalid header: {where}: {first['msg']}") from e


async def read_header(reader, schema, max_bytes: int):
    """The next header, validated by `schema`; TransferError if it is longer than `max_bytes`
    (before any of it is read), not JSON, or not of the schema. Headers above
    PARSE_OFF_LOOP_BYTES are parsed on a thread, so no header stalls the event loop."""
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if n > max_bytes:
        raise TransferError(f"header of {n} bytes is too large (at most {max_bytes})")
    raw = await reader.readexactly(n)
    if n > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_header, raw, schema)
    return parse_header(raw, schema)


def check_size(resp: Accepted, expected: int) -> None:
    # Only exactly the bytes asked for, in bounded chunks (a chunk size of -1 once skipped the
    # read loop and scattered uninitialised staging memory into the cache).
    if resp.num_bytes != expected:
        raise TransferError(f"peer sent {resp.num_bytes} bytes, expected {expected}")


def check_digest(digest, want: int, start: int, size: int) -> None:
    """A chunk's xxh3_64 against the one sent before it (written blocks are the request's own;
    the caller frees them on failure)."""
    if digest.intdigest() != want:
        raise TransferError(f"checksum mismatch in bytes {start}..{start + size}")
