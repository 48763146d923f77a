"""The decoder: embedding -> N x (attention block, MLP block) -> final norm -> lm_head.

Module names mirror transformers' Qwen3ForCausalLM (model.embed_tokens, model.layers.0.self_attn.q_proj,
..., lm_head), so a Hugging Face checkpoint loads by name. Explained in chapters 2-5.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache.contiguous import BucketedCache, KVCache
from ..config import ModelConfig
from .attention import Attention
from .linear import Linear
from .mlp import MLP
from .norm import RMSNorm
from .rope import rope_cos_sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(cfg, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, device=device)

    def forward(self, x, cos, sin, cache, mask):  # x [1, T, 4096]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask)  # residual add
        return x + self.mlp(self.post_attention_layernorm(x))  # [1, T, 4096]


def causal_mask(new: int, total: int, device) -> torch.Tensor | None:
    """True where a query may NOT look: new queries sit at the last `new` of `total` positions.
    None for a single new position, which may look at everything before it."""
    if new == 1:
        return None
    return torch.ones(new, total, dtype=torch.bool, device=device).triu(total - new + 1)  # [T, S]


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.cfg = cfg
        # _weight: no random init here, the weights come from kvbook.model.weights
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                                             device=device))
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | list | None,
                compute_dtype: torch.dtype | None = None) -> torch.Tensor:
        """input_ids [1, T], positions [T] -> final-normed hidden states [1, T, hidden].
        Batched decode: input_ids [B, 1], positions [B] (one per sequence) and cache a list of B caches.
        compute_dtype: the activations' dtype (default: the weights'); see kvbook.model.linear."""
        x = self.embed_tokens(input_ids)  # [1, T, 4096]
        x = x.to(compute_dtype or x.dtype)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)  # [T, 128]
        if isinstance(cache, list):  # one position per sequence, each with its own angle: [B, 1, 1, 128]
            cos, sin, mask = cos[:, None, None], sin[:, None, None], None
            layer_caches = [[sequence[i] for sequence in cache] for i in range(len(self.layers))]
        elif isinstance(cache, BucketedCache):  # a fixed-shape decode step (kvbook.runtime.cuda_graph)
            mask = cache.decode_mask()  # [S], S = the bucket of positions attention reads
            layer_caches = cache.layers
        else:
            history = cache.length if cache is not None else 0
            mask = causal_mask(input_ids.shape[1], history + input_ids.shape[1], x.device)  # [T, S]
            layer_caches = [cache[i] if cache is not None else None for i in range(len(self.layers))]
        for layer, layer_cache in zip(self.layers, layer_caches, strict=True):
            x = layer(x, cos, sin, layer_cache, mask)  # [1, T, 4096]
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3Model(cfg, dtype, device)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | list | None = None,
                last_only: bool = True, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> logits [B, 1, vocab] for the last position (what generation needs), or [B, T, vocab]."""
        hidden = self.model(input_ids, positions, cache, compute_dtype)  # [1, T, 4096]
        if last_only:
            hidden = hidden[:, -1:]  # [1, 1, 4096]: lm_head's 622M parameters run on one position only
        return self.lm_head(hidden)  # [1, 1, 151936]
