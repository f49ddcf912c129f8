"""`KVLayout`: what both ends of a transfer must agree on about the paged KV cache.

The cache is one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`: block
`b` (every layer, K and V) is one contiguous run of `bytes_per_block` at `b * bytes_per_block`
from the region's start, so a transfer needs one descriptor per run of consecutive blocks.

(A layer-major layout `[L, 2, NB, ...]` was measured first: it splits each block into 2·L runs of
6 KiB for SmolLM2, and the UCX per-descriptor cost held scattered pulls to ~26% of a raw
single-buffer read; see bench/kv_transfer.py.)
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from common.bounds import INT32_MAX

KV_ORDER = "block_layer_kv_nhd"  # the one layout of the cache (and of a disk tier's files)
_COMPARED = ("model_id", "dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "order")


class LayoutMismatch(ValueError):
    """The peer's KV cache is laid out differently; nothing may be copied."""


class KVLayout(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # A peer's layout arrives over the network: every field is bounded before it is compared.
    model_id: str = Field(max_length=512)
    dtype: Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
    num_layers: int = Field(ge=1, le=4096)
    block_size: int = Field(ge=1, le=1 << 16)
    num_kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=1 << 16)
    num_blocks: int = Field(ge=1, le=INT32_MAX)
    order: Literal["block_layer_kv_nhd"] = "block_layer_kv_nhd"

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor, model_id: str) -> KVLayout:
        num_blocks, num_layers, two, block_size, num_kv_heads, head_dim = kv_cache.shape
        if two != 2 or not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be a contiguous [NB, L, 2, BS, H, D] tensor")
        return cls(model_id=model_id, dtype=str(kv_cache.dtype).removeprefix("torch."),
                   num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, num_blocks=num_blocks)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def run_bytes(self) -> int:
        """Bytes of the K (or V) half of one block in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_block_per_layer(self) -> int:
        return 2 * self.run_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one whole block: the unit a transfer descriptor covers."""
        return self.num_layers * self.bytes_per_block_per_layer

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def block_offset(self, block_id: int) -> int:
        return block_id * self.bytes_per_block

    def run_offset(self, layer: int, kv: int, block_id: int) -> int:
        return self.block_offset(block_id) + (layer * 2 + kv) * self.run_bytes

    def differences(self, other: KVLayout) -> list[str]:
        """Human-readable list of the fields that make `other` incompatible (block count may
        differ)."""
        return [f"{f}: {getattr(self, f)!r} here vs {getattr(other, f)!r} at the peer"
                for f in _COMPARED if getattr(self, f) != getattr(other, f)]

    def check_compatible(self, other: KVLayout) -> None:
        diffs = self.differences(other)
        if diffs:
            raise LayoutMismatch("KV layouts differ: " + "; ".join(diffs))

    def check_block_ids(self, block_ids: list[int], side: str) -> None:
        """Refuse ids outside [0, num_blocks) before any memory is touched."""
        bad = [b for b in block_ids if not (isinstance(b, int) and 0 <= b < self.num_blocks)]
        if bad:
            raise BlockRangeError(
                f"{side} block ids out of range [0, {self.num_blocks}): {bad[:5]}"
                + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            )


class BlockRangeError(ValueError):
    """A block id from a peer (or for a peer) lies outside the registered region."""
