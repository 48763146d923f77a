"""The reference implementation: transformers' Qwen3ForCausalLM for a kvbook ModelConfig.

Used by the parity tests, by `python -m kvbook bench --against transformers` and by chapter 6 ("Proof the
cache is right"). transformers is a test-and-book dependency, imported only here.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig


def hf_config(cfg: ModelConfig, attn_implementation: str | None = None):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                       num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                       rms_norm_eps=cfg.rms_norm_eps,
                       rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                       tie_word_embeddings=cfg.tie_word_embeddings, attn_implementation=attn_implementation)


def hf_random_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0,
                    attn_implementation: str | None = "eager"):
    """A randomly initialised Qwen3ForCausalLM, with its norm weights made non-trivial so that they matter."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM._from_config(hf_config(cfg, attn_implementation), dtype=dtype).eval()
    with torch.no_grad():  # transformers initialises norms to ones
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def hf_weights(model) -> dict[str, torch.Tensor]:
    """Its tensors under their Hugging Face names, for kvbook.model.weights.build_model (a tied lm_head left out)."""
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights
