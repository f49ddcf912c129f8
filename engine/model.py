"""Llama-family decoder (Llama, Mistral, Qwen2) reading and writing a paged KV cache.

Parameter names follow Hugging Face checkpoints except that q/k/v and gate/up are fused into one
matmul each (`qkv_proj`, `gate_up_proj`); `engine.weights` stacks them at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBatch
from engine.config import ModelConfig
from engine.linear import PackedLinear, pack_linears
from engine.rope import RotaryEmbedding


class Linear(nn.Linear):
    """`nn.Linear` without its random initialization: the weights are always loaded from the
    checkpoint or drawn by `init_dummy_weights`, and drawing them on the meta device imports
    torch._dynamo (about a second of every worker's start, tests/engine/test_model_init.py)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """`nn.Embedding` without its random initialization (see `Linear`)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm (variance in float32) in one op, the same values bit for
        # bit (tests/engine/test_layers.py), where the six it spells out cost ~2 us each a layer.
        dtype = x.dtype
        if dtype == torch.float32:  # the weight's product inside the op: one op, the same bits
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.layer = layer  # the index the attention backend keys per-layer state by
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.rope = rope

    def forward(
        self,
        rotation: tuple[torch.Tensor, torch.Tensor],  # the step's RoPE cos, sin [T, 1, d]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, kvh, d], this layer's view
        meta: AttentionBatch,
    ) -> torch.Tensor:
        num_tokens, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        # q and k rotated in one pass, as heads of one view of the matmul's output
        qk = self.rope.rotate(qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, d), *rotation)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, d)
        meta.store(kv_cache, k, v)
        o = meta.attend(q, kv_cache, self.scale, k, v, self.layer)
        return self.o_proj(o.reshape(num_tokens, self.q_size))

    def forward_fused(self, positions, x, kv_cache, meta, ops) -> torch.Tensor:  # [T, hidden]
        """The GPU path: RoPE and the KV store in one kernel, q/k/v read as views of the qkv
        matmul's output (no split copies)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        ops.rope_store(qkv, positions, self.rope.cos, self.rope.sin, kv_cache, meta.slot_mapping,
                       self.num_heads)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        o = meta.attend(q, kv_cache, self.scale, k, v, self.layer)  # [T, h, d], contiguous
        return self.o_proj(o.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, rotation, x, kv_cache, meta):
        x = x + self.self_attn(rotation, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, positions, x, residual, kv_cache, meta, ops):
        """The GPU path, vLLM's layout: takes and returns (sublayer output, residual) so each
        residual add is fused into the next RMSNorm; five kernels here besides the matmuls and
        attention. `residual` is None at the first layer (x is the embedding)."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h, residual = ops.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        h = self.self_attn.forward_fused(positions, h, kv_cache, meta, ops)
        h, residual = ops.add_rms_norm(h, residual, norm2.weight, norm2.eps)
        return self.mlp.down_proj(ops.silu_mul(self.mlp.gate_up_proj(h))), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = RotaryEmbedding(cfg, max_positions)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rope, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """`forward` returns hidden states of all tokens; `compute_logits` projects selected rows."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, max_positions)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.packed_head: PackedLinear | None = None

    def pack_weights(self) -> None:
        """Reorder every matmul weight for oneDNN (CPU float32; see engine/linear.py). The
        embedding stays as it is for the lookup; a tied LM head gets a packed copy."""
        pack_linears(self)
        self.packed_head = (PackedLinear(self.model.embed_tokens.weight, None)
                            if self.lm_head is None else self.lm_head)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, kvh, d]
        meta: AttentionBatch,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.model.embed_tokens(input_ids)
        ops = meta.fused_ops  # engine.fused_ops on the Triton path, None on the SDPA path
        if ops is None:
            rotation = self.model.rope.rotation(positions, x.dtype)
            for i, layer in enumerate(self.model.layers):
                x = layer(rotation, x, kv_cache[:, i], meta)
            return self.model.norm(x)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer.forward_fused(positions, x, residual, kv_cache[:, i], meta, ops)
        norm = self.model.norm
        return ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

