"""The Triton KV-store and paged decode kernels against the SDPA path (engine/attention.py) on
tiny shapes: under TRITON_INTERPRET=1 on CPU (float32), compiled on a GPU (float32 and bf16).
Without a GPU the kernels are also compiled ahead of time for sm_90 (Triton ships ptxas), so a
kernel that would not build or would spill registers on the H200 fails here first."""


import pytest
import torch

from engine.attention import AttentionMetadata, paged_attention, write_kv
from tests.engine.sm90 import register_use

BLOCK_SIZE = 4


def make_cache(num_blocks=24, num_layers=3, kv_heads=2, head_dim=16, dtype=torch.float32,
               device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, num_layers, 2, BLOCK_SIZE, kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def sdpa_decode(q, layer, tables, lens, scale):
    """The CPU path's decode attention over the same cache (gather + masked SDPA)."""
    lens_t = torch.tensor(lens, device=q.device)
    width = tables.shape[1] * BLOCK_SIZE
    attended = (torch.arange(width, device=q.device)[None, :] < lens_t[:, None])[:, None, None, :]
    # a float mask, as the model runner builds it
    mask = torch.zeros(attended.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~attended, float("-inf"))
    meta = AttentionMetadata(slot_blocks=None, slot_offsets=None, num_decode_tokens=len(lens),
                             decode_block_tables=tables.long(), decode_context_lens=lens_t,
                             decode_mask=mask, prefills=[])
    return paged_attention(q, layer, meta, scale, None, None)


def tables_for(lens, num_blocks, seed=1):
    """Distinct random blocks per sequence, 0-padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK_SIZE) for n in lens)
    needed = sum(-(-n // BLOCK_SIZE) for n in lens)
    if needed > num_blocks:
        raise ValueError(f"lens {lens} need {needed} blocks of {BLOCK_SIZE}, "
                         f"the cache has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=g).tolist()
    rows = []
    for n in lens:
        used = -(-n // BLOCK_SIZE)
        rows.append(perm[:used] + [0] * (width - used))
        perm = perm[used:]
    return torch.tensor(rows, dtype=torch.int32)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,kv_heads", [(4, 2), (2, 2), (32, 2)])
@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (3, None)])
def test_decode_matches_sdpa(triton_kernels, device, num_heads, kv_heads, num_splits, block_n):
    cache = make_cache(kv_heads=kv_heads, device=device)
    layer = cache[:, 1]  # the strided per-layer view, read in place
    lens = [1, 5, 19, 40]  # one token, a partial block, several blocks, several BLOCK_N tiles
    tables = tables_for(lens, cache.shape[0]).to(device)
    q = torch.randn(len(lens), num_heads, 16, generator=torch.Generator().manual_seed(2)).to(device)
    out = triton_kernels.decode_attention(q, layer, tables, torch.tensor(lens, dtype=torch.int32,
                                          device=device), 0.25, num_splits, block_n=block_n)
    want = sdpa_decode(q, layer, tables, lens, 0.25)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_padded_rows_output_zeros_and_others_are_unaffected(triton_kernels, device):
    cache = make_cache(device=device)
    layer = cache[:, 0]
    lens = [7, 0, 12, 0]  # rows 1 and 3: a CUDA-graph bucket's padding
    tables = tables_for([7, 1, 12, 1], cache.shape[0]).to(device)
    q = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(3)).to(device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    out = triton_kernels.decode_attention(q, layer, tables, lens_t, 0.25, 2, block_n=16)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() and (out[3] == 0).all()
    keep = [0, 2]
    want = sdpa_decode(q[keep], layer, tables[keep], [7, 12], 0.25)
    torch.testing.assert_close(out[keep], want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_decode_bf16_within_tolerance_of_sdpa(triton_kernels):
    cache = make_cache(num_blocks=300, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                       device="cuda")
    layer = cache[:, 2]
    lens = [1, 17, 300, 700]
    tables = tables_for(lens, cache.shape[0]).cuda()
    q = torch.randn(4, 32, 128, device="cuda").bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for splits in (1, 8, 16):
        out = triton_kernels.decode_attention(q, layer, tables, lens_t, 128**-0.5, splits)
        want = sdpa_decode(q.float(), layer.float(), tables, lens, 128**-0.5)
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_store_writes_slots_like_write_kv_and_skips_padding(triton_kernels, device):
    cache = make_cache(device=device)
    ours, ref = cache.clone(), cache.clone()
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 3, 2, 16, generator=g).to(device)  # v is a strided view, as in the model
    k, v = qkv[:, 0], qkv[:, 1]
    slots = torch.tensor([9, -1, 40, 3, -1], device=device)  # block * 4 + offset
    triton_kernels.store_kv(ours[:, 2], k, v, slots)
    keep = slots >= 0
    meta = AttentionMetadata(slot_blocks=slots[keep] // BLOCK_SIZE,
                             slot_offsets=slots[keep] % BLOCK_SIZE, num_decode_tokens=0,
                             decode_block_tables=None, decode_context_lens=None, decode_mask=None,
                             prefills=[])
    write_kv(ref[:, 2], k[keep], v[keep], meta)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, cache)  # something was written


def test_bad_inputs_are_refused(triton_kernels):
    cache = make_cache()
    q = torch.randn(1, 4, 16)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        triton_kernels.decode_attention(q, cache[:, 0], torch.zeros(1, 1, dtype=torch.long), lens,
                                        1.0, 1)
    with pytest.raises(ValueError, match="kv heads"):
        triton_kernels.decode_attention(torch.randn(1, 3, 16), cache[:, 0],
                                        torch.zeros(1, 1, dtype=torch.int32), lens, 1.0, 1)
    with pytest.raises(ValueError, match="layer's view"):
        triton_kernels.store_kv(cache, q[:, :2], q[:, :2], torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="num_splits"):
        triton_kernels.decode_attention(q, cache[:, 0], torch.zeros(1, 1, dtype=torch.int32),
                                        lens, 1.0, 99)


def test_split_count_fills_the_gpu_and_stays_bounded(triton_kernels):
    assert triton_kernels.num_kv_splits(1, 8, 132) == triton_kernels.MAX_SPLITS
    assert triton_kernels.num_kv_splits(64, 32, 132) == 1
    assert triton_kernels.num_kv_splits(1, 32, 132) == 9  # 2 * 132 programs / 32
    assert triton_kernels.num_kv_splits(0, 8, 4) >= 1


_SPECS = """
import engine.triton_kernels as K

SPECS = []
types = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
         "out_ptr": "*bf16", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
         "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "slot_ptr": "*i64",
         "scale_log2": "fp32"}
for shape, (heads, kv_heads, dim) in {"smollm2": (32, 32, 64), "llama3": (32, 8, 128)}.items():
    group = heads // kv_heads
    block_d = max(16, dim)
    block_n = max(16, min(64, K._TILE_ELEMENTS // block_d))
    kernels = {
        "stage1": (K._decode_stage1, dict(NUM_HEADS=heads, GROUP=group, HEAD_DIM=dim,
                   BLOCK_H=max(16, group), BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=16,
                   DOT_PRECISION="tf32"), 8),
        "stage2": (K._decode_stage2, dict(NUM_HEADS=heads, HEAD_DIM=dim, BLOCK_D=dim,
                   BLOCK_S=K.MAX_SPLITS), 4),
        "store": (K._store_kv_kernel, dict(NUM_KV_HEADS=kv_heads, HEAD_DIM=dim,
                  BLOCK_H=kv_heads, BLOCK_D=dim, PAGE_SIZE=16), 4),
    }
    SPECS += [(f"{shape}-{name}", fn, consts, warps, types, {"num_stages": 1})
              for name, (fn, consts, warps) in kernels.items()]
"""


def test_kernels_build_for_sm90_without_spills(triton_kernels, tmp_path):
    """The bf16 kernels of both benchmark shapes, compiled for an H200 by Triton's own ptxas."""
    report = register_use(_SPECS, tmp_path)
    assert len(report) == 6
    for name, usage in report.items():
        assert usage["STACK"] == 0, f"{name} spills: {usage}"
        assert usage["REG"] <= 168, f"{name} needs {usage['REG']} registers"
