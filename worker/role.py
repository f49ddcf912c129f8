"""What a role package (`prefill_worker/`, `decode_worker/`) adds to the shared worker app.

The shared app (`worker/app.py`) mounts `routers`; the OpenAI endpoints and the generation path
call `prefill` (vLLM's `do_remote_decode` leg) and `importer` (pulling a prefill worker's blocks)
when the role has them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fastapi import APIRouter

if TYPE_CHECKING:
    from common.protocol import KVTransferParams, PrefillResponse
    from worker.state import WorkerState

RouterFactory = Callable[["WorkerState"], APIRouter]
PrefillFn = Callable[..., Awaitable["PrefillResponse"]]


class KVImporter(Protocol):
    """The decode side of a KV transfer."""

    def accepts(self, state: WorkerState, kvp: KVTransferParams, prompt: list[int], request_id: str) -> bool:
        """Whether this worker may pull with `kvp` for `prompt` (else it prefills locally)."""

    async def pull(self, state: WorkerState, kvp: KVTransferParams, request_id: str,
                   block_table: list[int], num_local: int, num_kv_tokens: int) -> tuple[bool, int]:
        """Pull the blocks past the `num_local` held here: (complete, bytes moved)."""


@dataclass(frozen=True)
class RoleParts:
    routers: tuple[RouterFactory, ...] = ()
    prefill: PrefillFn | None = None
    importer: KVImporter | None = None

    def __add__(self, other: RoleParts) -> RoleParts:
        return RoleParts(self.routers + other.routers, self.prefill or other.prefill,
                         self.importer or other.importer)


