"""Qwen3 self-attention: projections, per-head QK-norm, RoPE, cache write, grouped-query attention.

The order of operations follows transformers' Qwen3Attention with eager attention; the two attention
products and the softmax run in float32. Explained in chapter 3 ("Inside layer 0"); the cache write in chapters 4 and 5;
grouped-query attention at full size in chapter 14.

Shapes: B sequences, T new positions (the prompt's 256 in prefill, 1 in decode), Q of them that ask (T, but 1 in the
last layer of a prefill, whose other positions' outputs nothing reads), S positions attention reads (the
history plus the new ones: 257 at the first decode step), H query heads, KV key/value heads, D = head_dim, C = H x D
(the article's model: H = KV = 32, D = 128, C = hidden = 4096).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .linear import Linear
from .norm import RMSNorm
from .probe import Probe
from .rope import ApplyRope
from .tensor_parallel import sum_over_ranks


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
        self.k_cached = Probe()  # K of every position so far: [B, KV, S, D]
        self.v_cached = Probe()
        self.attn_weights = Probe()  # [B, H, Q, S], the softmax over positions

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache, mask: torch.Tensor | None, per_row: bool = False, last_only: bool = False) -> torch.Tensor:
        """cache: this layer's cache (None: no cache), or with per_row (a batched decode step, x [B, 1, C]) a list
        with one per sequence, row b appending to and reading cache[b] (kvbook.model.forward_batch).
        last_only: K and V of every position, the query of the last one only (-> [B, 1, C]): the last layer's, when
        nothing reads the other positions' outputs (kvbook.model.qwen3)."""
        batch, length, _ = x.shape  # x [B, T, C]
        queries = 1 if last_only else length  # Q: the last `queries` positions
        if mask is not None and mask.dim() == 2:
            mask = mask[-queries:]  # [Q, S]: the last position's row masks nothing
        q = self.q_proj(x[:, -queries:]).view(batch, queries, self.num_heads, self.head_dim)  # [B, Q, H, D]
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim))  # [B, T, KV, D]
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)  # [B, T, KV, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # q [B, H, Q, D], k and v [B, KV, T, D]
        q, k = self.rope(q, k, cos, sin)  # RoPE before caching: the cache holds rotated keys
        if per_row:  # batched decode: each sequence appends to and reads its own history
            out = torch.cat([self._attend(q[b:b + 1], *layer_cache.append(k[b:b + 1], v[b:b + 1]), None)
                             for b, layer_cache in enumerate(cache)])  # [B, H, 1, D]
        else:
            if cache is not None:
                k, v = cache.append(k, v)  # [B, KV, S, D], S = positions so far
            out = self._attend(q, self.k_cached(k), self.v_cached(v), mask)  # [B, H, Q, D]
        out = out.transpose(1, 2).reshape(batch, queries, self.num_heads * self.head_dim)  # [B, Q, C]
        # under tensor parallelism (kvbook.model.tensor_parallel) a rank's o_proj adds up its own heads only
        return sum_over_ranks(self.o_proj(out))  # [B, Q, C]

    def _attend(self, q, k, v, mask):
        """q [B, H, Q, D], k and v [B, KV, S, D] -> [B, H, Q, D]."""
        batch, heads, queries, head_dim = q.shape
        groups = heads // self.num_kv_heads  # query heads per K/V head (GQA; 1 in the article's model)
        # The query heads h = kv * groups + g of one K/V head become rows of one product with it: K and V are read
        # once per K/V head, never copied per query head (transformers' repeat_kv copies them; the same numbers).
        q = q.reshape(batch, self.num_kv_heads, groups * queries, head_dim)  # [B, KV, G*Q, D]
        if mask is not None and mask.dim() == 2:
            mask = mask.repeat(groups, 1)  # [G*Q, S]: each group member's rows take the same causal mask
        # the two products and the softmax run in float32, whatever the cache holds, as transformers' softmax does
        scores = torch.matmul(q.float(), k.float().transpose(2, 3)) * self.scaling  # [B, KV, G*Q, S]
        if mask is not None:
            scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        weights = self.attn_weights(torch.softmax(scores, dim=-1).view(batch, heads, queries, -1))  # [B, H, Q, S]
        out = torch.matmul(weights.view(scores.shape), v.float())  # [B, KV, G*Q, D]
        return out.view(batch, heads, queries, head_dim).to(q.dtype)  # [B, H, Q, D]
