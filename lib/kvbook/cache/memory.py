"""The KV cache's memory, written once: bytes per position and blocks per budget. Explained in chapters 4 and 9.

A leaf module (it imports nothing of kvbook), so that kvbook.config can check a budget with it.
"""

from __future__ import annotations

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# a quantized KV cache ([kv_cache] cache_dtype, kvbook.cache.kv_quant): 1 byte per element plus one float16 scale
# per position and head (head_dim elements share it)
QUANTIZED_CACHE_DTYPES = {"int8": 1, "float8_e4m3fn": 1}
CACHE_SCALE_BYTES = 2


def kv_cache_bytes(model, positions: int, dtype: str, batch_size: int = 1) -> int:
    """model: a kvbook.config.ModelConfig. K and V for every layer: 2 x layers x kv_heads x head_dim x positions x
    bytes per element; a quantized cache (int8, float8_e4m3fn) adds one float16 scale per position and head:
    2 x layers x kv_heads x positions x (head_dim x 1 + 2)."""
    if dtype in QUANTIZED_CACHE_DTYPES:
        per_head = model.head_dim * QUANTIZED_CACHE_DTYPES[dtype] + CACHE_SCALE_BYTES
    else:
        per_head = model.head_dim * DTYPE_BYTES[dtype]
    return 2 * model.num_hidden_layers * batch_size * model.num_key_value_heads * positions * per_head


def blocks_for_budget(model, kv) -> int:
    """model, kv: kvbook.config's ModelConfig and KVCacheConfig. pool_mib of memory in blocks; 0 means the
    contiguous cache's budget (max_cache_len positions)."""
    per_block = kv_cache_bytes(model, kv.block_size, kv.cache_dtype)  # an int8 cache: about half a float16 one
    if kv.pool_mib:
        return max(1, kv.pool_mib * 2**20 // per_block)
    return -(-kv.max_cache_len // kv.block_size)
