"""The decoder: embedding -> N x (attention block, MLP block) -> final norm -> lm_head.

Module names mirror transformers' Qwen3ForCausalLM (model.embed_tokens, model.layers.0.self_attn.q_proj,
..., lm_head), so a Hugging Face checkpoint loads by name. Explained in chapters 2-5.

Shapes: B sequences, T new positions, C = hidden_size, D = head_dim, V = vocab_size (the article's model:
C = 4096, D = 128, V = 151936; 256 prompt positions in prefill, 1 per decode step).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attention import Attention
from .forward_batch import ForwardBatch
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

    def forward(self, x, cos, sin, cache, mask, per_row=False, last_only=False):  # x [B, T, C]
        """last_only: every position's K and V go to the cache, but only the last position goes on (-> [B, 1, C])."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, cache, mask, per_row, last_only)  # [B, T or 1, C]
        x = x[:, -attended.shape[1]:] + attended  # residual add
        return x + self.mlp(self.post_attention_layernorm(x))  # [B, T or 1, C]


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

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, batch=None,
                compute_dtype: torch.dtype | None = None, inputs_embeds: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """input_ids [1, T], positions [T] -> final-normed hidden states [1, T, C], or with last_only those of the
        last position [1, 1, C]: the last layer then computes its queries, attention output and MLP for that
        position alone (every position's K and V still go to the cache; no later layer reads the others' outputs).
        Chapter 4 shows it and measures what it saves.
        batch: a ForwardBatch (kvbook.model.forward_batch; a batched decode step's, input_ids [B, 1] and positions
        [B] with one per sequence, from kvbook.runtime.inputs.prepare_decode), a cache (which describes itself),
        or None (no cache).
        compute_dtype: the activations' dtype (default: the weights'); a product computes in the weights' dtype unless
        kvbook.kernels gave the layer a copy in this one.
        inputs_embeds [B, T, C]: the layers' input itself instead of input_ids' embeddings, as in transformers
        (chapter 5 feeds the layers a vector that is not a token's embedding, to show what that does)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Qwen3Model.forward: give input_ids or inputs_embeds, not both or neither")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, C]
        x = x.to(compute_dtype or x.dtype)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)  # [T, D]
        batch = ForwardBatch.of(batch, len(self.layers), x.shape[1], x.device)
        if batch.per_row:  # one position per sequence, each with its own angle: [B, 1, 1, D]
            cos, sin = cos[:, None, None], sin[:, None, None]
        last = len(self.layers) - 1
        for i, (layer, layer_cache) in enumerate(zip(self.layers, batch.layer_caches, strict=True)):
            x = layer(x, cos, sin, layer_cache, batch.mask, batch.per_row, last_only and i == last)  # [B, T, C]
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3Model(cfg, dtype, device)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, batch=None, last_only: bool = True,
                compute_dtype: torch.dtype | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """-> logits [B, 1, vocab] for the last position (what generation needs), or [B, T, vocab].
        batch, inputs_embeds: as Qwen3Model.forward takes them."""
        # last_only: lm_head (C x V parameters) runs on one position only, and so do the last layer's queries,
        # attention output and MLP (Qwen3Model.forward)
        hidden = self.model(input_ids, positions, batch, compute_dtype, inputs_embeds, last_only)  # [B, 1 or T, C]
        return self.lm_head(hidden)  # [B, 1 or T, V]
