"""Rotary position embedding (RoPE), rotate-half form, positions passed explicitly.

cos/sin are computed in float32 from the positions and cast to the activations' dtype, as in
transformers' Qwen3RotaryEmbedding. Explained in chapter 3 ("Inside layer 0")."""

from __future__ import annotations

import torch
from torch import nn


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [T] (int) -> cos, sin [T, head_dim] in dtype."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)  # [head_dim / 2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ApplyRope(nn.Module):
    """A module (not a bare function) so that the trace records its shapes like every other step."""

    def forward(self, q, k, cos, sin):  # q [B, H, Q, D] (the last Q of k's positions), k [B, KV, T, D], cos/sin [T, D]
        q_cos, q_sin = cos[..., -q.shape[-2]:, :], sin[..., -q.shape[-2]:, :]  # [Q, D]
        q_rotated = q * q_cos + rotate_half(q) * q_sin  # [B, H, Q, D]
        k_rotated = k * cos + rotate_half(k) * sin  # [B, KV, T, D]
        return q_rotated, k_rotated
