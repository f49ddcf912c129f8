"""The TCP transport's wire: length-prefixed JSON headers, each validated against its schema
(a peer's JSON is never indexed blindly), and the framing constants.

    request  (receiver -> sender): PullHeader, or NotifyHeader (nothing to pull)
    response (sender -> receiver): Accepted then chunks of [8-byte xxh3_64 LE][bytes]; or Refused
    done     (receiver -> sender): DoneHeader
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from common.bounds import BlockIds, Host, Port, RequestId
from kv_transfer.transport import TransferError

HEADER = struct.Struct(">I")
CHECKSUM = struct.Struct("<Q")
_MAX_HEADER = 16 << 20  # a pull of the largest BlockIds list fits
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 1 << 12, 1 << 28


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PullHeader(_Strict):
    op: Literal["pull"]
    request_id: RequestId
    block_ids: BlockIds = Field(min_length=1)
    token: str = Field("", max_length=4096)
    fp8: bool = False


class NotifyHeader(_Strict):
    op: Literal["notify"]
    request_id: RequestId
    token: str = Field("", max_length=4096)


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


async def write_header(writer: asyncio.StreamWriter, obj: dict) -> None:
    data = json.dumps(obj).encode()
    writer.write(HEADER.pack(len(data)) + data)
    await writer.drain()


async def read_header(reader: asyncio.StreamReader, schema):
    """The next header, validated by `schema` (a model or TypeAdapter); TransferError if it is
    too large, not JSON, or not of the schema."""
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if n > _MAX_HEADER:
        raise TransferError(f"header of {n} bytes is too large")
    raw = await reader.readexactly(n)
    try:
        if isinstance(schema, TypeAdapter):
            return schema.validate_json(raw)
        return schema.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        raise TransferError(f"invalid header: {'.'.join(map(str, first['loc']))}: {first['msg']}") from e


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
