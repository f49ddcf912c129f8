"""Fused Triton kernels of a decoder layer on the GPU path: fewer, larger kernels per layer.

- `add_rms_norm`: residual add + RMSNorm in one pass (vLLM's fused_add_rms_norm): returns the
  normed output and the new residual.
- `rope_store`: rotary embedding of q and k in place in the fused qkv matmul's output, and the
  rotated k and the v of each token written into its cache slot, in one kernel.
- `silu_mul`: SiLU(gate) * up over the fused gate_up matmul's output.

Each rounds exactly where the torch code it replaces does (engine/model.py's RMSNorm, MLP;
engine/rope.py), so in float32 they agree to float32 rounding and in bf16 they give the same
bf16 values up to the order of a float32 sum. The CPU path never imports this module; tests run
it under TRITON_INTERPRET=1 on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, hidden] the sublayer's output (or the embeddings when HAS_RESIDUAL is False)
    residual_ptr,  # [T, hidden] the running residual; overwritten with x + residual
    weight_ptr,  # [hidden]
    out_ptr,  # [T, hidden] the normed output
    stride_x, stride_r, stride_o,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The add rounds to the model's dtype, as `x + attn(...)` does in torch.
        r = tl.load(residual_ptr + t * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(residual_ptr + t * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / hidden
    normed = (xf * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)  # x.to(dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)  # weight * x, rounded once below
    tl.store(out_ptr + t * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,  # [T, hidden]
    residual: torch.Tensor | None,  # [T, hidden], None: x is the first residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden], new residual [T, hidden])
    """`residual = x + residual; return RMSNorm(residual), residual` in one kernel. With
    `residual=None` the new residual is a copy of x (the first layer's input)."""
    num_tokens, hidden = x.shape
    if x.stride(-1) != 1 or weight.shape != (hidden,):
        raise ValueError(f"x must be [T, {weight.shape[0]}] with contiguous rows, got "
                         f"{tuple(x.shape)}")
    out = torch.empty_like(x)
    if residual is None:
        new_residual = torch.empty_like(x)
    else:
        if residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype:
            raise ValueError("residual must match x")
        new_residual = residual
    if num_tokens == 0:
        return out, new_residual
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(num_tokens,)](
        x, new_residual, weight, out, x.stride(0), new_residual.stride(0), out.stride(0),
        hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=max(1, min(16, block // 256)),
    )
    return out, new_residual


@triton.jit
def _rope_store_kernel(
    qkv_ptr,  # [T, (num_heads + 2 * kv_heads) * head_dim]; q and k rotated in place
    positions_ptr,  # [T] int64
    cos_ptr, sin_ptr,  # [max_positions, head_dim] float32 (the second half repeats the first)
    cache_ptr,  # one layer's view [num_blocks, 2, block_size, kv_heads, head_dim]
    slot_ptr,  # [T] int64, block * block_size + offset; -1: store nothing (a padded row)
    stride_qkv, stride_pos,
    stride_cb, stride_ckv, stride_ct, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then k heads (each also stores its v head)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    pos = tl.load(positions_ptr + t * stride_pos).to(tl.int64)
    dtype = qkv_ptr.dtype.element_ty
    # engine/rope.py casts the tables to the model's dtype before multiplying.
    cos = tl.load(cos_ptr + pos * HEAD_DIM + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * HEAD_DIM + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    row = qkv_ptr + t * stride_qkv + head * HEAD_DIM  # k heads follow the q heads in a row
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HALF]
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # q * cos + rotate_half(q) * sin with torch's roundings: each product, then the sum.
    y1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(row + offs, y1, mask=mask)
    tl.store(row + HALF + offs, y2, mask=mask)
    if head >= NUM_HEADS:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            kv_head = head - NUM_HEADS
            dst = (cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_ct
                   + kv_head * stride_ch)
            out_ty = cache_ptr.dtype.element_ty
            tl.store(dst + offs, y1.to(out_ty), mask=mask)
            tl.store(dst + HALF + offs, y2.to(out_ty), mask=mask)
            v_row = row + NUM_KV_HEADS * HEAD_DIM  # this kv head's v
            v1 = tl.load(v_row + offs, mask=mask, other=0.0)
            v2 = tl.load(v_row + HALF + offs, mask=mask, other=0.0)
            tl.store(dst + stride_ckv + offs, v1.to(out_ty), mask=mask)
            tl.store(dst + stride_ckv + HALF + offs, v2.to(out_ty), mask=mask)


def rope_store(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * kv_heads) * head_dim], rows contiguous
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_positions, head_dim] float32
    sin: torch.Tensor,  # [max_positions, head_dim] float32
    kv_layer: torch.Tensor,  # [num_blocks, 2, block_size, kv_heads, head_dim], one layer's view
    slot_mapping: torch.Tensor,  # [T] int64; -1 stores nothing
    num_heads: int,
) -> None:
    """Rotate q and k in place in `qkv` (HF rotate-half) and write each token's rotated k and
    its v into the cache slot; rows with slot -1 are rotated but not stored."""
    num_tokens = qkv.shape[0]
    _, two, page_size, num_kv_heads, head_dim = kv_layer.shape
    if (two != 2 or kv_layer.stride(-1) != 1 or qkv.stride(-1) != 1
            or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2
            or cos.shape[-1] != head_dim or cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {num_heads} heads and a cache "
                         f"{tuple(kv_layer.shape)}")
    if num_tokens == 0:
        return
    _rope_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, kv_layer, slot_mapping, qkv.stride(0), positions.stride(0),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), PAGE_SIZE=page_size, num_warps=1,
    )


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 * inter]: gate, then up
    out_ptr,  # [T, inter]
    stride_in, stride_out, inter,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + t * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_in + inter + offs, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # F.silu rounds to the dtype
    tl.store(out_ptr + t * stride_out + offs, (act.to(tl.float32) * up.to(tl.float32)).to(dtype),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * inter] -> [T, inter]
    """`F.silu(gate) * up` of the halves of the fused gate_up output, in one kernel."""
    num_tokens, width = gate_up.shape
    if width % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be [T, 2 * inter] with contiguous rows, got "
                         f"{tuple(gate_up.shape)}")
    inter = width // 2
    out = gate_up.new_empty(num_tokens, inter)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out
