"""kvbook: the engine behind the book. A Qwen3-style decoder that prefills and decodes with a KV cache.

    from kvbook import load_config, Engine, build_prompt_ids
    engine = Engine(load_config("config.toml"))
    run = engine.generate(build_prompt_ids(256), 128, ignore_eos=True)
"""

import os

# Large tensors in transparent huge pages: drawing the 1.85B random weights is ~1.7x faster (fewer page faults).
# Read by PyTorch's CPU allocator; set before anything allocates, and only if the user has not chosen.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .config import Config, ConfigError, ConfigWarning, ModelConfig, kv_cache_bytes, load_config
from .engine import Engine, Generation, Step
from .kv_cache import CacheFullError, KVCache
from .model import Qwen3ForCausalLM
from .tokenizer import Tokenizer, build_prompt_ids, get_default_tokenizer
from .trace import Tracer, checklist

__all__ = [
    "CacheFullError", "Config", "ConfigError", "ConfigWarning", "Engine", "Generation", "KVCache", "ModelConfig",
    "Qwen3ForCausalLM", "Step", "Tokenizer", "Tracer", "build_prompt_ids", "checklist", "get_default_tokenizer",
    "kv_cache_bytes", "load_config",
]
