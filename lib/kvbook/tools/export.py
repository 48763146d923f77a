"""The book's model in other engines' format: a Hugging Face Qwen3 directory (transformers, vLLM, SGLang read it).

    python -m kvbook export --format hf DIR [--checkpoint SRC [--num-layers N]]

kvbook's tensor names are transformers' already (kvbook.model.qwen3), so the export is the weights under their own
names, a config.json with Qwen3's keys and a generation_config.json. The directory is written beside its place
and renamed into it when complete: an interrupted export leaves nothing half-written.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ConfigError, ModelConfig
from ..tokenizer import ENDOFTEXT_ID, IM_END_ID

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def hf_config_json(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """transformers' Qwen3Config keys for this model."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
            "attention_bias": False, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": DTYPE_NAMES[dtype],
            "bos_token_id": ENDOFTEXT_ID, "eos_token_id": IM_END_ID}


def export_hf(cfg: ModelConfig, weights: dict[str, torch.Tensor], directory: str | Path) -> Path:
    """Write weights (kvbook's names, which are transformers') and cfg as a Hugging Face Qwen3 directory."""
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(f"{str(directory)!r} exists and is not an empty directory; export into a new one")
    if not directory.parent.is_dir():
        raise ConfigError(f"{str(directory.parent)!r} is not a directory; create it first")
    dtype = weights["model.embed_tokens.weight"].dtype
    tensors = {name: tensor.contiguous() for name, tensor in weights.items()
               if not (cfg.tie_word_embeddings and name == "lm_head.weight")}  # a tied lm_head is the embedding
    partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        (partial / "config.json").write_text(json.dumps(hf_config_json(cfg, dtype), indent=2) + "\n")
        generation = {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID]}
        (partial / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if directory.exists():
            directory.rmdir()  # empty: checked above
        partial.rename(directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return directory
