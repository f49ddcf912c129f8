"""A step's attention through the Triton kernels (engine/triton_kernels.py): the GPU path.

The model's layers use this backend's fused kernels (`fused_ops`: engine/fused_ops.py), so every
token's K and V go into the cache through the RoPE + store kernel (slot -1: a padded row, written
nowhere); `store` is the plain store kernel for K and V already rotated. Decode rows attend with
the paged split-KV kernel straight from the cache; prefill chunks keep SDPA (engine/attention.py's
`prefill_attention`). The decode rows' tensors may be views of the CUDA-graph runner's static
buffers (engine/input_buffers.py), so nothing here depends on a length known on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

import engine.fused_ops
from engine.attention import PrefillChunk, prefill_attention
from engine.triton_kernels import decode_attention, store_kv


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, block * block_size + offset; -1: padded row
    num_decode_tokens: int  # the first rows of the batch, one token per sequence
    block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    context_lens: torch.Tensor | None  # [num_decodes] int32, 0 for a padded row
    num_splits: int  # split-KV slices per context (triton_kernels.num_kv_splits)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The model's layers use the fused kernels (add+RMSNorm, RoPE+KV store, SiLU*up) with this
    # backend: ~10 kernels a layer instead of ~42.
    fused_ops: ClassVar = engine.fused_ops

    def store(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        store_kv(kv_cache, k, v, self.slot_mapping)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, k_new: torch.Tensor,
               v_new: torch.Tensor, layer: int = 0) -> torch.Tensor:  # q: [T, h, d] -> [T, h, d]
        out = torch.empty_like(q)
        nd = self.num_decode_tokens
        if nd:
            assert self.block_tables is not None and self.context_lens is not None
            decode_attention(q[:nd], kv_cache, self.block_tables, self.context_lens, scale,
                             self.num_splits, out=out[:nd])
        prefill_attention(q, kv_cache, self.prefills, scale, k_new, v_new, out)
        return out
