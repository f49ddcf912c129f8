"""The fused layer kernels (engine/fused_ops.py) against the torch code they replace
(engine/model.py's RMSNorm and MLP, engine/rope.py, engine/attention.py's write_kv): under
TRITON_INTERPRET=1 on CPU, compiled on a GPU; and built ahead of time for sm_90 here."""


import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, write_kv
from engine.config import ModelConfig
from engine.model import RMSNorm
from engine.rope import RotaryEmbedding
from tests.engine.sm90 import register_use

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="session")
def fused(triton_kernels):  # triton_kernels: the interpreter set up on CPU
    import engine.fused_ops as ops

    return ops


def rand(*shape, seed=0, dtype=torch.float32, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype=dtype, device=device)


def tolerance(dtype, device="cpu"):
    # float32: the kernel's sum order differs from torch's. bf16: the kernels round where torch
    # does (to nearest even on a GPU), but Triton's CPU interpreter truncates float32 -> bf16,
    # so its results may sit a bf16 step (2^-8 relative) away for each rounding.
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=1e-2, atol=1e-2) if device == "cuda" else dict(rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 48])  # a power of two, and one that masks
def test_add_rms_norm_is_residual_add_then_rmsnorm(fused, device, dtype, hidden):
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(rand(hidden, seed=1) + 1.0)
    norm = norm.to(dtype=dtype, device=device)
    x, residual = rand(5, hidden, seed=2, dtype=dtype, device=device), rand(
        5, hidden, seed=3, dtype=dtype, device=device, scale=3.0)
    want_residual = x + residual
    want = norm(want_residual)
    out, new_residual = fused.add_rms_norm(x, residual.clone(), norm.weight, norm.eps)
    torch.testing.assert_close(new_residual, want_residual, **tolerance(dtype, device))
    torch.testing.assert_close(out, want, **tolerance(dtype, device))
    first, copy = fused.add_rms_norm(x, None, norm.weight, norm.eps)  # the first layer
    assert torch.equal(copy, x) and copy.data_ptr() != x.data_ptr()
    torch.testing.assert_close(first, norm(x), **tolerance(dtype, device))


def rope_config(num_heads, num_kv_heads, head_dim):
    return ModelConfig(model_type="llama", vocab_size=32, hidden_size=num_heads * head_dim,
                       intermediate_size=8, num_layers=1, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
                       rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                       tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (2, 2, 24)])
def test_rope_store_rotates_in_place_and_stores_like_write_kv(fused, device, dtype, num_heads,
                                                             num_kv_heads, head_dim):
    rope = RotaryEmbedding(rope_config(num_heads, num_kv_heads, head_dim), max_positions=64)
    rope.init_tables(device)
    num_tokens, q_size, kv_size = 5, num_heads * head_dim, num_kv_heads * head_dim
    qkv = rand(num_tokens, q_size + 2 * kv_size, seed=4, dtype=dtype, device=device)
    positions = torch.tensor([0, 7, 63, 1, 30], device=device)
    slots = torch.tensor([9, -1, 40, 3, 17], device=device)  # block * 4 + offset; -1 padding
    cache = rand(12, 2, 2, 4, num_kv_heads, head_dim, seed=5, dtype=dtype, device=device)
    ours, ref = cache.clone(), cache.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    want_q, want_k = rope(positions, q.reshape(num_tokens, num_heads, head_dim),
                          k.reshape(num_tokens, num_kv_heads, head_dim))
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    keep = slots >= 0
    meta = AttentionMetadata(slot_blocks=slots[keep] // 4, slot_offsets=slots[keep] % 4,
                             num_decode_tokens=0, decode_block_tables=None,
                             decode_context_lens=None, decode_mask=None, prefills=[])
    write_kv(ref[:, 1], want_k[keep], v[keep], meta)
    out = qkv.clone()
    fused.rope_store(out, positions, rope.cos, rope.sin, ours[:, 1], slots, num_heads)
    got_q = out[:, :q_size].view(num_tokens, num_heads, head_dim)
    got_k = out[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    tol = tolerance(dtype, device)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    assert torch.equal(out[:, q_size + kv_size :], qkv[:, q_size + kv_size :])  # v untouched
    torch.testing.assert_close(ours, ref, **tol)
    assert not torch.equal(ours, cache)
    assert torch.equal(ours[:, 0], cache[:, 0])  # other layers untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 2048])  # masked; more than one program a row
def test_silu_mul_is_silu_of_gate_times_up(fused, device, dtype, inter):
    gate_up = rand(3, 2 * inter, seed=6, dtype=dtype, device=device, scale=4.0)
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up
    got = fused.silu_mul(gate_up)
    torch.testing.assert_close(got, want, **tolerance(dtype, device))


def test_bad_shapes_are_refused(fused):
    with pytest.raises(ValueError, match="contiguous rows"):
        fused.add_rms_norm(torch.zeros(2, 8), None, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)
    cache = torch.zeros(4, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="does not fit"):
        fused.rope_store(torch.zeros(3, 40), torch.zeros(3, dtype=torch.long), torch.zeros(9, 8),
                         torch.zeros(9, 8), cache, torch.zeros(3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="gate_up"):
        fused.silu_mul(torch.zeros(2, 7))


_SPECS = """
import triton
import engine.fused_ops as K

SPECS = []
types = {"positions_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
         "eps": "fp32"}
for shape, (hidden, inter, heads, kv_heads, dim) in {"smollm2": (2048, 8192, 32, 32, 64),
                                                     "llama3": (4096, 14336, 32, 8, 128)}.items():
    block = triton.next_power_of_2(hidden)
    kernels = {
        "norm": (K._add_rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=block),
                 max(1, min(16, block // 256))),
        "norm_first": (K._add_rms_norm_kernel, dict(HAS_RESIDUAL=False, BLOCK=block),
                       max(1, min(16, block // 256))),
        "rope_store": (K._rope_store_kernel, dict(NUM_HEADS=heads, NUM_KV_HEADS=kv_heads,
                       HEAD_DIM=dim, HALF=dim // 2, BLOCK_HALF=dim // 2, PAGE_SIZE=16), 1),
        "silu_mul": (K._silu_mul_kernel, dict(BLOCK=1024), 4),
    }
    SPECS += [(f"{shape}-{name}", fn, consts, warps, types, {})
              for name, (fn, consts, warps) in kernels.items()]
"""


def test_fused_kernels_build_for_sm90_without_spills(fused, tmp_path):
    """The bf16 kernels of both benchmark shapes, compiled for an H200 by Triton's own ptxas."""
    report = register_use(_SPECS, tmp_path)
    assert len(report) == 8
    for name, usage in report.items():
        assert usage["STACK"] == 0, f"{name} spills: {usage}"
