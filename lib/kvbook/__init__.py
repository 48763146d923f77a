"""kvbook: the engine behind the book. A Qwen3-style decoder that prefills and decodes with a KV cache.

    from kvbook import load_config, Engine, build_prompt_ids
    engine = Engine(load_config("config.toml"))
    run = engine.generate(build_prompt_ids(256), 128, ignore_eos=True)

The package in layers, each importing only those before it: config (and device, tokenizer) -> model -> cache ->
kernels (the one place that chooses how a device computes faster) -> runtime -> serving -> tools. Importing kvbook
has no side effect; see kvbook.kernels.enable_huge_pages.
"""

from .cache.contiguous import CacheFullError, KVCache
from .cache.memory import kv_cache_bytes
from .config import Config, ConfigError, ConfigWarning, ModelConfig, load_config
from .model.qwen3 import Qwen3ForCausalLM
from .runtime.engine import Engine
from .runtime.sequence import Generation, Step
from .tokenizer import Tokenizer, build_prompt_ids, get_default_tokenizer
from .tools.trace import Tracer, checklist

__all__ = [
    "CacheFullError", "Config", "ConfigError", "ConfigWarning", "Engine", "Generation", "KVCache", "ModelConfig",
    "Qwen3ForCausalLM", "Step", "Tokenizer", "Tracer", "build_prompt_ids", "checklist", "get_default_tokenizer",
    "kv_cache_bytes", "load_config",
]
