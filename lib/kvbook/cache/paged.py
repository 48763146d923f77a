"""The paged KV cache ([kv_cache] layout = "paged"), vLLM's idea with vLLM's names.

One pool of fixed-size blocks (block_size positions each, 16 here) serves every sequence. A sequence holds a
block table — the ids of its blocks, in order — and position p lives in slot
    slot = block_table[p // block_size] * block_size + p % block_size
of every layer's K and V storage. Blocks are allocated on demand, one more exactly when a position crosses a
block boundary (positions 256, 272, ... start a new block: 16 blocks after a 256-token prefill, 24 at 383
positions), and returned to the pool when the sequence is freed. Attention reads through the block table.
Explained in chapter 9 ("Memory").

Prefix caching ([kv_cache] prefix_caching, vLLM's automatic prefix caching): a full block is keyed by a hash
of its tokens and of every token before it, so equal keys mean equal K and V. A new prompt that starts with
blocks already in the pool takes them (their reference count goes up) and prefills only the rest. A freed
block keeps its key, and can be found again, until the pool hands it out for new positions; then the key is
dropped, so a refilled block is never mistaken for its old contents. Explained in chapter 11a.
"""

from __future__ import annotations

import hashlib
from collections import deque

import torch

from ..config import KVCacheConfig, ModelConfig
from . import kv_quant
from .contiguous import CacheFullError, LayeredCache, storage_dtype
from .memory import blocks_for_budget, kv_cache_bytes


class PoolExhaustedError(CacheFullError):
    """Every block of the pool is held by some sequence."""


class BlockPool:
    """K and V storage for num_blocks blocks, per layer: [num_blocks * block_size slots, kv_heads, head_dim]."""

    def __init__(self, model: ModelConfig, kv: KVCacheConfig, device: torch.device):
        self.block_size = kv.block_size
        self.num_blocks = blocks_for_budget(model, kv)
        slots = self.num_blocks * self.block_size
        shape = (slots, model.num_key_value_heads, model.head_dim)  # [slots, H, D]
        dtype = storage_dtype(kv.cache_dtype)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(model.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(model.num_hidden_layers)]
        # a quantized cache (kvbook.cache.kv_quant): one float16 scale per slot and head, [slots, KV, 1]
        self.quantized = kv.cache_dtype if kv_quant.is_quantized_cache(kv.cache_dtype) else None
        self.k_scale = self.v_scale = None
        if self.quantized:
            scales = (slots, model.num_key_value_heads, 1)
            self.k_scale = [torch.zeros(scales, dtype=kv_quant.KV_SCALE_DTYPE, device=device)
                            for _ in range(model.num_hidden_layers)]
            self.v_scale = [torch.zeros(scales, dtype=kv_quant.KV_SCALE_DTYPE, device=device)
                            for _ in range(model.num_hidden_layers)]
        self._block_bytes = kv_cache_bytes(model, self.block_size, kv.cache_dtype)
        # least recently freed first: a freed block that still has a key is reused for new positions last
        self.free_blocks: deque[int] = deque(range(self.num_blocks))
        self.ref_count = [0] * self.num_blocks  # sequences holding each block
        self.block_key: dict[int, bytes] = {}  # block -> key of the full block it holds (prefix caching)
        self.cached_block: dict[bytes, int] = {}  # key -> block

    def allocate(self) -> int:
        """A block for new positions: its old key, if any, is forgotten."""
        if not self.free_blocks:
            raise PoolExhaustedError(
                f"KV block pool exhausted: all {self.num_blocks} blocks of {self.block_size} positions are held by "
                "running sequences; raise [kv_cache] pool_mib (or max_cache_len), or wait for sequences to finish")
        block = self.free_blocks.popleft()
        key = self.block_key.pop(block, None)
        if key is not None:
            del self.cached_block[key]
        self.ref_count[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks.append(block)  # keeps its key until allocate() hands it out again

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The blocks holding the longest run of these keys from the first."""
        blocks = []
        for key in keys:
            if key not in self.cached_block:
                break
            blocks.append(self.cached_block[key])
        return blocks

    def share(self, block: int) -> None:
        """One more sequence holds this full block (taken back from the free list if nobody held it)."""
        if self.ref_count[block] == 0:
            self.free_blocks.remove(block)
        self.ref_count[block] += 1

    def register(self, block: int, key: bytes) -> None:
        """A block just became full: later prompts with the same key may share it (the first holder of a key
        keeps it)."""
        if key not in self.cached_block and block not in self.block_key:
            self.cached_block[key] = block
            self.block_key[block] = key

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V (and their scales): kvbook.cache.memory.kv_cache_bytes."""
        return self._block_bytes

    def reserved_bytes(self) -> int:
        return self.num_blocks * self.block_bytes()


def block_keys(token_ids: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """Key of every full block of token_ids: a hash of the block's tokens chained to the key before it."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in block), digest_size=16).digest()
        keys.append(parent)
    return keys


class PagedLayerCache:
    """One layer's view of a sequence: the same append/keys/values as kvbook.cache.contiguous.LayerKVCache."""

    def __init__(self, sequence: PagedKVCache, layer: int):
        self.sequence, self.layer = sequence, layer
        self.length = 0

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k_new, v_new [1, KV, T, D] -> K and V of every position so far [1, KV, length + T, D]."""
        start, end = self.length, self.length + k_new.shape[2]
        self.sequence.ensure_blocks(end)  # the first layer allocates; the others find the blocks there
        slots = self.sequence.slot_mapping(start, end)  # [T]
        pool = self.sequence.pool
        storage_k, storage_v = pool.k[self.layer], pool.v[self.layer]
        if pool.quantized:
            storage_k[slots], pool.k_scale[self.layer][slots] = kv_quant.quantize_kv(k_new[0].transpose(0, 1),
                                                                                  pool.quantized)
            storage_v[slots], pool.v_scale[self.layer][slots] = kv_quant.quantize_kv(v_new[0].transpose(0, 1),
                                                                                  pool.quantized)
        else:
            storage_k[slots] = k_new[0].transpose(0, 1).to(storage_k.dtype)  # [T, KV, D], converted to cache_dtype
            storage_v[slots] = v_new[0].transpose(0, 1).to(storage_v.dtype)
        self.length = end
        return self._gather(storage_k, pool.k_scale[self.layer] if pool.quantized else None), \
            self._gather(storage_v, pool.v_scale[self.layer] if pool.quantized else None)

    def keys(self) -> torch.Tensor:
        pool = self.sequence.pool
        return self._gather(pool.k[self.layer], pool.k_scale[self.layer] if pool.quantized else None)

    def values(self) -> torch.Tensor:
        pool = self.sequence.pool
        return self._gather(pool.v[self.layer], pool.v_scale[self.layer] if pool.quantized else None)

    def _gather(self, storage: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """Read positions 0 .. length-1 through the block table: [1, KV, length, D] (float32 if quantized)."""
        slots = self.sequence.slot_mapping(0, self.length)  # [S]
        gathered = storage[slots]  # [S, KV, D]
        if scales is not None:
            gathered = kv_quant.dequantize_kv(gathered, scales[slots])
        return gathered.transpose(0, 1)[None]


class PagedKVCache(LayeredCache):
    """One sequence in a BlockPool, with the same interface as kvbook.cache.contiguous.KVCache."""

    def __init__(self, pool: BlockPool, num_layers: int, max_len: int):
        self.pool = pool
        self.max_len = max_len  # max_position_embeddings: positions, not memory, limit a paged sequence
        self.block_table: list[int] = []
        self.block_keys: list[bytes] = []  # keys of the full blocks at the start of block_table (prefix caching)
        self.layers = [PagedLayerCache(self, i) for i in range(num_layers)]

    def reuse_prefix(self, prompt: list[int]) -> int:
        """Take the pool's blocks that already hold this prompt's first full blocks; return the positions they
        cover. At most len(prompt) - 1: the last prompt position is always computed, its logits give the first
        token."""
        assert not self.block_table, "reuse_prefix is for an empty sequence"
        usable = (len(prompt) - 1) // self.pool.block_size
        keys = block_keys(prompt[:usable * self.pool.block_size], self.pool.block_size)
        blocks = self.pool.lookup(keys)
        for block in blocks:
            self.pool.share(block)
        self.block_table, self.block_keys = blocks, keys[:len(blocks)]
        for layer in self.layers:
            layer.length = len(blocks) * self.pool.block_size
        return self.length

    def register_full_blocks(self, token_ids: list[int]) -> None:
        """Key every block that became full (token_ids: the tokens at positions 0 .. length-1 or more)."""
        size = self.pool.block_size
        full = self.length // size
        if len(self.block_keys) == full:
            return
        done = len(self.block_keys) * size
        parent = self.block_keys[-1] if self.block_keys else b""
        for block, key in zip(self.block_table[len(self.block_keys):full],
                              block_keys(token_ids[done:full * size], size, parent), strict=True):
            self.pool.register(block, key)
            self.block_keys.append(key)

    def ensure_blocks(self, positions: int) -> None:
        """Hold enough blocks for `positions` positions, taking new ones from the pool only when needed."""
        if positions > self.max_len:
            raise CacheFullError(f"a sequence of {positions} positions exceeds max_position_embeddings "
                                 f"{self.max_len}; generate fewer tokens")
        needed = self.pool.blocks_for(positions)
        new = []
        try:
            while len(self.block_table) + len(new) < needed:
                new.append(self.pool.allocate())
        except PoolExhaustedError:
            self.pool.release(new)  # all or nothing: the sequence keeps what it had
            raise
        self.block_table += new

    def slot_mapping(self, start: int, end: int) -> torch.Tensor:
        """slot = block_table[p // block_size] * block_size + p % block_size for p in start .. end-1."""
        positions = torch.arange(start, end)
        size = self.pool.block_size
        table = torch.tensor(self.block_table, dtype=torch.long)
        return (table[positions // size] * size + positions % size).to(self.pool.k[0].device)

    def free(self) -> None:
        """Return every block to the pool (the sequence finished or its client went away)."""
        self.pool.release(self.block_table)
        self.block_table, self.block_keys = [], []
        for layer in self.layers:
            layer.length = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    def filled_bytes(self) -> int:
        """Bytes of K and V holding positions (as for the contiguous cache)."""
        return self.length * self.pool.block_bytes() // self.pool.block_size

    def reserved_bytes(self) -> int:
        """Bytes of the blocks this sequence holds: at most block_size - 1 positions of waste."""
        return self.num_blocks * self.pool.block_bytes()
