"""The CPU path's layer ops against the formulas they stand for: RMSNorm and RoPE give
transformers' Llama values bit for bit (the reference the engine's greedy tokens are held to),
and decode attention agrees with SDPA to float32 rounding."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine.attention import decode_attention
from engine.model import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    ours, theirs = RMSNorm(96, 1e-5).to(dtype), LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        weight = torch.randn(96, generator=g).to(dtype)
        ours.weight.copy_(weight)
        theirs.weight.data = weight.clone()
        assert torch.equal(ours(x), theirs(x))


def test_rope_is_transformers_bit_for_bit(rope_512):
    rope = rope_512
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 5, 17, 300, 511])
    q = torch.randn(5, 4, 64, generator=g)
    k = torch.randn(5, 2, 64, generator=g)
    got_q, got_k = rope(positions, q, k)
    # transformers' [batch, heads, T, d] with the tables at each position
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          rope.cos[positions][None], rope.sin[positions][None])
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_decode_attention_agrees_with_sdpa(num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(num_heads)
    nd, keys, d = 4, 48, 64
    q = torch.randn(nd, num_heads, d, generator=g)
    k = torch.randn(nd, num_kv_heads, keys, d, generator=g)
    v = torch.randn(nd, num_kv_heads, keys, d, generator=g)
    lengths = torch.tensor([48, 1, 17, 30])
    past = torch.arange(keys)[None, :] >= lengths[:, None]  # [nd, keys]
    mask = torch.zeros(nd, keys).masked_fill(past, float("-inf")).view(nd, 1, 1, keys)
    got = decode_attention(q, k, v, mask, d**-0.5)
    want = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=d**-0.5,
                                          enable_gqa=True).squeeze(2)
    assert got.shape == (nd, num_heads, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the one-key row attends to its first key only: its output is that key's value
    torch.testing.assert_close(got[1], v[1, torch.arange(num_heads) // (num_heads // num_kv_heads),
                                        0])
