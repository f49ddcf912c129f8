"""Triton kernels over the block-major paged KV cache: the KV store for a step's new tokens and
split-KV paged decode attention (one query token per sequence, GQA).

Both read one layer's strided view `kv_cache[:, layer]` = [num_blocks, 2, block_size, kv_heads,
head_dim] in place (no gather, no copy): the layout stays block-major so a block is one contiguous
run for the KV transfer. Block tables [num_seqs, max_blocks] and context lengths [num_seqs] are
int32 device tensors read by the kernel, and every grid depends only on the number of rows and on
`num_splits`, never on a length, so one CUDA-graph capture serves every context length.

Decode attention runs in two stages, like SGLang's `decode_attention.py` (written anew here):
stage 1 gives each program (sequence, kv head, split) one slice of the context and all query
heads of that kv head (GQA), and writes a partial output with its log-sum-exp; stage 2 merges the
splits. A row with context length 0 (a padded row of a CUDA-graph bucket) outputs zeros.

On a machine without a GPU the same kernels run under `TRITON_INTERPRET=1` on CPU tensors (the
tests do); the engine's CPU path never imports this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
# Stage 1 reads K and V tiles of BLOCK_N tokens x head_dim; 4096 elements a tile with 8 warps
# kept sm_90 builds at 128 registers and no spills (cuobjdump of AOT builds: head_dim 128 with
# 64-token tiles and 4 warps spilled 168 bytes).
_TILE_ELEMENTS = 4096


@triton.jit
def _split_range(context_len, split, num_splits, BLOCK_N: tl.constexpr):
    # Splits are whole BLOCK_N tiles; short contexts use fewer splits and leave the rest empty.
    per_split = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    start = per_split * split
    end = tl.minimum(start + per_split, context_len)
    return start, end


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # [T, kv_heads, head_dim] each (strided)
    cache_ptr,  # one layer's view [num_blocks, 2, block_size, kv_heads, head_dim]
    slot_ptr,  # [T] int64, block * block_size + offset; -1: write nothing (a padded row)
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_ct, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = ((slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_ct
           + offs_h[:, None] * stride_ch + offs_d[None, :])
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_ckv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


# num_splits is a runtime argument (not specialised even when 1), so one compiled kernel serves
# every batch bucket: fewer JIT compiles before CUDA-graph capture.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_stage1(
    q_ptr,  # [num_seqs, num_heads, head_dim] (strided rows)
    cache_ptr,  # one layer's view [num_blocks, 2, block_size, kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    mid_o_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    mid_lse_ptr,  # [num_seqs, num_heads, num_splits] float32, log2 domain
    scale_log2,  # softmax scale * log2(e)
    num_splits,
    stride_qt, stride_qh,
    stride_cb, stride_ckv, stride_ct, stride_ch,
    stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start, end = _split_range(context_len, split, num_splits, BLOCK_N)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h  # the query heads sharing this kv head
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blocks = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        # [BLOCK_N]
        tok = blocks * stride_cb + (offs_n % PAGE_SIZE) * stride_ct + kv_head * stride_ch
        k = tl.load(cache_ptr + tok[None, :] + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(cache_ptr + stride_ckv + tok[:, None] + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # An empty split (past the context, or a padded row) stores lse -inf, which stage 2 weighs 0.
    nonempty = l_i > 0
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    row = (seq * NUM_HEADS + heads) * num_splits + split  # [BLOCK_H]
    tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o,
             mask=mask_h[:, None] & mask_d[None, :])
    tl.store(mid_lse_ptr + row, lse, mask=mask_h)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_stage2(
    mid_o_ptr, mid_lse_ptr,  # as stage 1 wrote them
    out_ptr,  # [num_seqs, num_heads, head_dim] (strided rows)
    num_splits,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * num_splits + offs_s  # [BLOCK_S]
    lse = tl.load(mid_lse_ptr + row, mask=mask_s, other=float("-inf"))
    o = tl.load(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights 0, output 0
    w = tl.exp2(lse - m)  # [BLOCK_S]
    total = tl.sum(w, 0)
    merged = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d,
             merged.to(out_ptr.dtype.element_ty), mask=mask_d)


def _check_layer_view(kv_layer: torch.Tensor) -> None:
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2 or kv_layer.stride(-1) != 1:
        raise ValueError("expected one layer's view [num_blocks, 2, block_size, kv_heads, "
                         f"head_dim] with contiguous head_dim, got {tuple(kv_layer.shape)}")


def store_kv(
    kv_layer: torch.Tensor,  # [num_blocks, 2, block_size, kv_heads, head_dim], one layer's view
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64; -1 writes nothing
) -> None:
    """Write each token's K and V into its slot of the cache; rows with slot -1 are skipped."""
    _check_layer_view(kv_layer)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or v.shape != k.shape:
        raise ValueError("k and v must be [T, kv_heads, head_dim] with contiguous head_dim")
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_layer, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=kv_layer.shape[2],
    )


def num_kv_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """How many slices to cut each context into: enough programs to fill the GPU about twice,
    at most MAX_SPLITS (a batch of 64 x 32 kv heads needs no split at all)."""
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(MAX_SPLITS, -(-2 * num_sms // programs)))


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_layer: torch.Tensor,  # [num_blocks, 2, block_size, kv_heads, head_dim], one layer's view
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, 0 for a padded row
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    block_n: int | None = None,  # tokens per stage-1 tile (default: 4096 elements' worth)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one new query token per sequence over its whole paged context (the context
    includes the token itself: store its KV first)."""
    _check_layer_view(kv_layer)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    if num_heads % num_kv_heads or kv_layer.shape[4] != head_dim or q.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {num_kv_heads} kv heads "
                         f"of dim {kv_layer.shape[4]}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16
    block_n = block_n or max(16, min(64, _TILE_ELEMENTS // block_d))
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError("block_n must be a power of two >= 16")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    mid_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                        device=q.device)
    mid_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # no TF32 rounding for fp32
    _decode_stage1[(num_seqs, num_kv_heads, num_splits)](
        q, kv_layer, block_tables, context_lens, mid_o, mid_lse, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        PAGE_SIZE=kv_layer.shape[2], DOT_PRECISION=precision,
        num_warps=8 if block_n * block_d >= _TILE_ELEMENTS else 4, num_stages=1,
    )
    _decode_stage2[(num_seqs, num_heads)](
        mid_o, mid_lse, out, num_splits, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=MAX_SPLITS,
        num_warps=4,
    )
    return out


def fix_interpreter_scalars() -> None:
    """Make Triton's CPU interpreter (TRITON_INTERPRET=1) run these kernels under numpy >= 2.4.

    Triton 3.6's interpreter turns a scalar into a Python int with `int(array)` on a 1-element
    array, which numpy >= 2.4 refuses; a runtime loop bound such as `range(start, end, BLOCK_N)`
    needs it. This takes the element instead. Called by the CPU tests and the CPU quick bench;
    compiled kernels on a GPU never go through it.
    """
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "tandem_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.tandem_fixed = True
    interpreter._patch_lang_tensor = patched
