"""Paged attention over the KV cache, in plain torch (the CPU path and the CUDA fallback).

A batch is a flat run of tokens: first the decode tokens (one per sequence), then each prefill
chunk contiguously. Decode sequences are attended in one padded, masked SDPA call; prefill chunks
one call per sequence (they are few and long).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.decode_kv_mirror import DecodeKVStep


@dataclass
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the flat batch
    num_query_tokens: int
    context_len: int  # tokens of this sequence in the cache after this step (cached + chunk)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


class AttentionBatch(Protocol):
    """What a layer asks of a step's attention metadata: this backend's (SDPA here, Triton in
    engine/triton_attention.py) KV store and attention over the paged cache. `fused_ops` is the
    module of fused layer kernels the model uses with this backend (engine/fused_ops.py), or
    None for plain torch ops."""

    fused_ops: Any

    def store(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, k_new: torch.Tensor,
               v_new: torch.Tensor, layer: int) -> torch.Tensor: ...


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [num_tokens] int64, the block each new token's KV goes to
    slot_offsets: torch.Tensor  # [num_tokens] int64, its position inside that block
    num_decode_tokens: int
    # [num_decodes, max_blocks] int64, padded with 0; None with decode_kv (it gathers its rows)
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64
    # [num_decodes, 1, 1, max_blocks * block_size]: 0 where a key is attended, -inf past the
    # row's length (a float mask: a bool one is converted in every layer's SDPA call)
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    # The decode rows' keys and values kept between steps (engine/decode_kv_mirror.py); None:
    # gathered from the blocks in each layer
    decode_kv: DecodeKVStep | None = None
    # The fused layer ops the model runs with (engine/cpu_ops.py), or None: plain torch ops
    fused_ops: Any = None
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, block * block_size + offset

    def store(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(kv_cache, k, v, self)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, k_new: torch.Tensor,
               v_new: torch.Tensor, layer: int) -> torch.Tensor:
        return paged_attention(q, kv_cache, self, scale, k_new, v_new, layer)


def write_kv(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim], one layer
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    kv_cache[meta.slot_blocks, 0, meta.slot_offsets] = k
    kv_cache[meta.slot_blocks, 1, meta.slot_offsets] = v


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim], one layer
    meta: AttentionMetadata,
    scale: float,
    k_new: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this step's keys
    v_new: torch.Tensor,
    layer: int = 0,  # the layer's index: its rows in meta.decode_kv
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(q)
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    nd = meta.num_decode_tokens
    if nd:
        assert meta.decode_mask is not None
        if meta.decode_kv is not None:
            k, v = meta.decode_kv.keys_values(kv_cache, layer, k_new, v_new)
        else:
            assert meta.decode_block_tables is not None
            # [nd * max_blocks, block_size, kvh, d] -> [nd, kvh, L, d]. index_select over whole
            # blocks is 3-5x faster than advanced indexing of this strided view
            # (bench/cpu_ops.py).
            flat = meta.decode_block_tables.view(-1)
            k = _gather_blocks(kv_cache[:, 0], flat).view(nd, -1, num_kv_heads,
                                                          head_dim).transpose(1, 2)
            v = _gather_blocks(kv_cache[:, 1], flat).view(nd, -1, num_kv_heads,
                                                          head_dim).transpose(1, 2)
        out[:nd] = decode_attention(q[:nd], k, v, meta.decode_mask, scale)
    prefill_attention(q, kv_cache, meta.prefills, scale, k_new, v_new, out)
    return out


def decode_attention(
    q: torch.Tensor,  # [nd, num_heads, head_dim], one query per row
    k: torch.Tensor,  # [nd, kvh, L, d]
    v: torch.Tensor,  # [nd, kvh, L, d]
    mask: torch.Tensor,  # [nd, 1, 1, L] float: 0 where a key is attended, -inf past the row
    scale: float,
) -> torch.Tensor:  # [nd, num_heads, head_dim]
    """One query per row against its keys, the query heads of a KV head as the rows of one
    matmul, each row's keys and values read once: faster than CPU SDPA's flash kernel with
    `enable_gqa` at decode shapes (`bench/cpu_ops.py --sections attention`). The softmax is
    exact where SDPA's is online: the two agree to float32 rounding."""
    nd, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    qg = q.view(nd, num_kv_heads, num_heads // num_kv_heads, d)  # head j reads KV head j // g
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).add_(mask)  # [nd, kvh, g, L]
    return torch.matmul(torch.softmax(scores, dim=-1), v).view(nd, num_heads, d)


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim], one layer
    chunks: list[PrefillChunk],
    scale: float,
    k_new: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this step's keys
    v_new: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], the chunks' rows are written
) -> None:
    """Causal SDPA of each prefill chunk over its cached context and itself (both backends)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    for chunk in chunks:
        s, n, ctx = chunk.query_start, chunk.num_query_tokens, chunk.context_len
        qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
        if ctx == n:
            # No earlier context: attend to this step's keys directly, causal.
            k = k_new[s : s + n].transpose(0, 1).unsqueeze(0)
            v = v_new[s : s + n].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale,
                                                enable_gqa=True)
        else:
            k = _gather_blocks(kv_cache[:, 0],
                               chunk.block_table).view(-1, num_kv_heads, head_dim)[:ctx]
            v = _gather_blocks(kv_cache[:, 1],
                               chunk.block_table).view(-1, num_kv_heads, head_dim)[:ctx]
            k = k.transpose(0, 1).unsqueeze(0)  # [1, kvh, ctx, d]
            v = v.transpose(0, 1).unsqueeze(0)
            # Query i sits at absolute position ctx - n + i and sees keys 0..ctx - n + i.
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            k_pos = torch.arange(ctx, device=q.device)[None, :]
            mask = (k_pos <= q_pos)[None, None]
            op = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale,
                                                enable_gqa=True)
        out[s : s + n] = op.squeeze(0).transpose(0, 1)


def _gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, kvh, d], one layer's K or V (strided view)
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, block_size, kvh, d], contiguous
    return torch.index_select(cache, 0, block_ids)
