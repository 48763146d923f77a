"""The paged KV cache ([kv_cache] layout = "paged"), vLLM's idea with vLLM's names.

One pool of fixed-size blocks (block_size positions each, 16 here) serves every sequence. A sequence holds a
block table — the ids of its blocks, in order — and position p lives in slot
    slot = block_table[p // block_size] * block_size + p % block_size
of every layer's K and V storage. Blocks are allocated on demand, one more exactly when a position crosses a
block boundary (positions 256, 272, ... start a new block: 16 blocks after a 256-token prefill, 24 at 383
positions), and returned to the pool when the sequence is freed. Attention reads through the block table.
Explained in chapter 10 ("Memory").
"""

from __future__ import annotations

from collections import deque

import torch

from .config import DTYPE_BYTES, KVCacheConfig, ModelConfig
from .device import TORCH_DTYPES
from .kv_cache import CacheFullError, LayeredCache


class PoolExhaustedError(CacheFullError):
    """Every block of the pool is held by some sequence."""


class BlockPool:
    """K and V storage for num_blocks blocks, per layer: [num_blocks * block_size slots, kv_heads, head_dim]."""

    def __init__(self, model: ModelConfig, kv: KVCacheConfig, device: torch.device):
        self.block_size = kv.block_size
        self.num_blocks = blocks_for_budget(model, kv)
        slots = self.num_blocks * self.block_size
        shape = (slots, model.num_key_value_heads, model.head_dim)  # [4096, 32, 128] for the default budget
        dtype = TORCH_DTYPES[kv.cache_dtype]
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(model.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(model.num_hidden_layers)]
        self.free_blocks: deque[int] = deque(range(self.num_blocks))

    def allocate(self) -> int:
        if not self.free_blocks:
            raise PoolExhaustedError(
                f"KV block pool exhausted: all {self.num_blocks} blocks of {self.block_size} positions are held by "
                "running sequences; raise [kv_cache] pool_mib (or max_cache_len), or wait for sequences to finish")
        return self.free_blocks.popleft()

    def release(self, blocks: list[int]) -> None:
        self.free_blocks.extend(blocks)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return 2 * len(self.k) * self.block_size * self.k[0].shape[1] * self.k[0].shape[2] * self.k[0].element_size()

    def reserved_bytes(self) -> int:
        return self.num_blocks * self.block_bytes()


def blocks_for_budget(model: ModelConfig, kv: KVCacheConfig) -> int:
    """pool_mib of memory in blocks; 0 means the contiguous cache's budget (max_cache_len positions)."""
    per_block = 2 * model.num_hidden_layers * kv.block_size * model.num_key_value_heads * model.head_dim * \
        DTYPE_BYTES[kv.cache_dtype]
    if kv.pool_mib:
        return max(1, kv.pool_mib * 2**20 // per_block)
    return -(-kv.max_cache_len // kv.block_size)


class PagedLayerCache:
    """One layer's view of a sequence: the same append/keys/values as kvbook.kv_cache.LayerKVCache."""

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
        storage_k[slots] = k_new[0].transpose(0, 1).to(storage_k.dtype)  # [T, KV, D], converted to cache_dtype
        storage_v[slots] = v_new[0].transpose(0, 1).to(storage_v.dtype)
        self.length = end
        return self.keys(), self.values()

    def keys(self) -> torch.Tensor:
        return self._gather(self.sequence.pool.k[self.layer])

    def values(self) -> torch.Tensor:
        return self._gather(self.sequence.pool.v[self.layer])

    def _gather(self, storage: torch.Tensor) -> torch.Tensor:
        """Read positions 0 .. length-1 through the block table: [1, KV, length, D]."""
        return storage[self.sequence.slot_mapping(0, self.length)].transpose(0, 1)[None]


class PagedKVCache(LayeredCache):
    """One sequence in a BlockPool, with the same interface as kvbook.kv_cache.KVCache."""

    def __init__(self, pool: BlockPool, num_layers: int, max_len: int):
        self.pool = pool
        self.max_len = max_len  # max_position_embeddings: positions, not memory, limit a paged sequence
        self.block_table: list[int] = []
        self.layers = [PagedLayerCache(self, i) for i in range(num_layers)]

    def ensure_blocks(self, positions: int) -> None:
        """Hold enough blocks for `positions` positions, taking new ones from the pool only when needed."""
        if positions > self.max_len:
            raise CacheFullError(f"a sequence of {positions} positions exceeds max_position_embeddings "
                                 f"{self.max_len}; generate fewer tokens")
        needed = -(-positions // self.pool.block_size)
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
        self.block_table = []
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
