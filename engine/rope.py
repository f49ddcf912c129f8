"""Rotary position embeddings (HF's rotate-half convention) with Llama-3 / linear scaling."""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def init_tables(self, device: torch.device | str) -> None:
        """Build the cos/sin tables (float32) on `device`; call after moving the model."""
        inv_freq = inverse_frequencies(self.cfg)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, d]
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, signed sin: [T, 1, d] each
        """The tables at `positions`, in the model's dtype: once per step, for every layer. The
        sin table's first half is negated, so that `rotate` needs no negation of its own."""
        half = self.cos.shape[-1] // 2
        sin = self.sin[positions]
        return (self.cos[positions].unsqueeze(1).to(dtype),
                torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1).to(dtype))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
               ) -> torch.Tensor:  # x: [T, heads, d] -> [T, heads, d]
        """`x * cos + rotate_half(x) * sin` with rotate_half as a roll: the halves swap places
        and the signed sin carries rotate_half's minus sign, the same values bit for bit (a
        negation is exact) in one kernel fewer than a negation and a concatenation."""
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, h, d]
        k: torch.Tensor,  # [T, kvh, d]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotation(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
