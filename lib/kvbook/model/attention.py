"""Qwen3 self-attention: projections, per-head QK-norm, RoPE, cache write, grouped-query attention.

The order of operations follows transformers' Qwen3Attention with eager attention; the two attention
products and the softmax run in float32. Explained in chapter 3 ("Inside layer 0"); the cache write in chapters 4 and 5.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .linear import Linear
from .norm import RMSNorm
from .probe import Probe
from .rope import ApplyRope


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, KV, S, D] -> [B, KV * groups, S, D]: each K/V head serves `groups` query heads (GQA)."""
    if groups == 1:
        return x
    batch, kv_heads, length, head_dim = x.shape
    x = x[:, :, None].expand(batch, kv_heads, groups, length, head_dim)
    return x.reshape(batch, kv_heads * groups, length, head_dim)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scaling = cfg.head_dim ** -0.5
        q_width, kv_width = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, q_width, dtype=dtype, device=device)
        self.k_proj = Linear(cfg.hidden_size, kv_width, dtype=dtype, device=device)
        self.v_proj = Linear(cfg.hidden_size, kv_width, dtype=dtype, device=device)
        self.o_proj = Linear(q_width, cfg.hidden_size, dtype=dtype, device=device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)  # per head
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.rope = ApplyRope()
        self.k_cached = Probe()  # K of every position so far: [1, 32, 257, 128] at the first decode step
        self.v_cached = Probe()
        self.attn_weights = Probe()  # [1, 32, T, S], the softmax over positions

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache, mask: torch.Tensor | None, per_row: bool = False) -> torch.Tensor:
        """cache: this layer's cache (None: no cache), or with per_row (a batched decode step, x [B, 1, 4096]) a list
        with one per sequence, row b appending to and reading cache[b] (kvbook.model.forward_batch)."""
        batch, length, _ = x.shape  # x [1, T, 4096]; T = 256 in prefill, 1 in decode
        q = self.q_norm(self.q_proj(x).view(batch, length, self.num_heads, self.head_dim))  # [1, T, 32, 128]
        k = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim))  # [1, T, 32, 128]
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)  # [1, T, 32, 128]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, 32, T, 128]
        q, k = self.rope(q, k, cos, sin)  # RoPE before caching: the cache holds rotated keys
        if per_row:  # batched decode: each sequence appends to and reads its own history
            out = torch.cat([self._attend(q[b:b + 1], *layer_cache.append(k[b:b + 1], v[b:b + 1]), None)
                             for b, layer_cache in enumerate(cache)])  # [B, 32, 1, 128]
        else:
            if cache is not None:
                k, v = cache.append(k, v)  # [1, 32, S, 128], S = positions so far (257 at decode step 1)
            out = self._attend(q, self.k_cached(k), self.v_cached(v), mask)  # [1, 32, T, 128]
        out = out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)  # [1, T, 4096]
        return self.o_proj(out)  # [1, T, 4096]

    def _attend(self, q, k, v, mask):
        """q [1, 32, T, 128], k and v [1, KV, S, 128] -> [1, 32, T, 128]."""
        # The attention products run in float32, whatever the cache holds: softmax is float32 in transformers
        # too, and on a CPU without float16 arithmetic this is both faster and more exact (chapter 7).
        k = repeat_kv(k, self.num_heads // self.num_kv_heads).float()  # [1, 32, S, 128]
        v = repeat_kv(v, self.num_heads // self.num_kv_heads).float()
        scores = torch.matmul(q.float(), k.transpose(2, 3)) * self.scaling  # [1, 32, T, S]
        if mask is not None:
            scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        weights = self.attn_weights(torch.softmax(scores, dim=-1))  # [1, 32, T, S], each row sums to 1
        return torch.matmul(weights, v).to(q.dtype)  # [1, 32, T, 128]
