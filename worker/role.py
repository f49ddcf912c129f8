"""What a role package (`prefill_worker/`, `decode_worker/`) adds to the shared worker app.

The shared app (`worker/app.py`) mounts `routers`; the OpenAI endpoints and the generation path
call `prefill` (vLLM's `do_remote_decode` leg) and `importer` (pulling a prefill worker's blocks)
when the role has them.

Every part is handed the worker's state (worker/state.py's `WorkerState`, which holds the parts):
a type parameter here, so this module needs nothing of worker/state.py, which imports it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from fastapi import APIRouter

if TYPE_CHECKING:
    from common.protocol import KVTransferParams, PrefillResponse

State = TypeVar("State")  # the worker's state the parts are handed
State_contra = TypeVar("State_contra", contravariant=True)
PrefillFn = Callable[..., Awaitable["PrefillResponse"]]


class KVImporter(Protocol[State_contra]):
    """The decode side of a KV transfer."""

    def accepts(self, state: State_contra, kvp: KVTransferParams, prompt: list[int],
                request_id: str, cache_salt: str | None = None) -> bool:
        """Whether this worker may pull with `kvp` for `prompt` (else it prefills locally)."""

    async def pull(self, state: State_contra, kvp: KVTransferParams, request_id: str,
                   block_table: list[int], num_local: int, num_kv_tokens: int) -> tuple[bool, int]:
        """Pull the blocks past the `num_local` held here: (complete, bytes moved)."""


@dataclass(frozen=True)
class RoleParts(Generic[State]):
    routers: tuple[Callable[[State], APIRouter], ...] = ()
    prefill: PrefillFn | None = None
    importer: KVImporter[State] | None = None

    def __add__(self, other: RoleParts[State]) -> RoleParts[State]:
        return RoleParts(self.routers + other.routers, self.prefill or other.prefill,
                         self.importer or other.importer)


