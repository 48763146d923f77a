"""The contiguous KV cache: per layer, preallocated K and V buffers with a write position.

New positions are written after the history (the source article's pitfall 3), and attention reads views of
the filled part, so decode never copies the history. Explained in chapters 4 ("Prefill") and 5 ("Decode").
"""

from __future__ import annotations

import torch

from .config import KVCacheConfig, ModelConfig
from .device import TORCH_DTYPES


class CacheFullError(RuntimeError):
    """Writing past max_cache_len. Raised before anything is written, so the cache stays usable."""


class LayerKVCache:
    def __init__(self, layer: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.layer = layer
        self.max_len = max_len
        # Stored position-major, [1, 4096, 32, 128], and seen through a transpose as [1, 32, 4096, 128]: a new
        # sequence's positions then fill consecutive memory. Head-major storage puts each head's first positions
        # 1 MiB apart, and with transparent huge pages the first write to a fresh cache faulted in 192 pages of
        # 2 MiB: 50-200 ms of TTFT on the 2-core CPU. Empty, not zeros: only the filled part [:length] is read.
        storage = (batch, max_len, kv_heads, head_dim)
        self.k = torch.empty(storage, dtype=dtype, device=device).transpose(1, 2)  # [1, 32, 4096, 128]
        self.v = torch.empty(storage, dtype=dtype, device=device).transpose(1, 2)
        self.length = 0

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k_new, v_new [B, KV, T, D] -> the whole cache so far, K and V [B, KV, length + T, D]."""
        start, end = self.length, self.length + k_new.shape[2]
        if end > self.max_len:
            raise CacheFullError(
                f"KV cache full at layer {self.layer}: writing position {end - 1} needs {end} positions but "
                f"max_cache_len is {self.max_len}; raise [kv_cache] max_cache_len to at least {end} "
                f"(--set kv_cache.max_cache_len={end}) or generate fewer tokens")
        self.k[:, :, start:end] = k_new  # after the history, never before it; converted to cache_dtype
        self.v[:, :, start:end] = v_new
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # views in cache_dtype: nothing is copied

    def keys(self) -> torch.Tensor:
        return self.k[:, :, :self.length]  # [B, KV, length, D]

    def values(self) -> torch.Tensor:
        return self.v[:, :, :self.length]  # [B, KV, length, D]


class LayeredCache:
    """What the model needs of a cache, contiguous or paged: one cache per layer, indexed by layer."""

    layers: list

    def __getitem__(self, layer: int):
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        """Positions held (the same in every layer): 256 after prefill, 383 after 127 decode steps."""
        return self.layers[0].length

    def lengths(self) -> list[int]:
        return [layer.length for layer in self.layers]


class KVCache(LayeredCache):
    """One LayerKVCache per decoder layer: K0, V0, K1, V1, K2, V2 for the article's model."""

    def __init__(self, model: ModelConfig, kv: KVCacheConfig, device: torch.device, batch: int = 1):
        self.layers = [
            LayerKVCache(i, batch, model.num_key_value_heads, kv.max_cache_len, model.head_dim,
                         TORCH_DTYPES[kv.cache_dtype], device)
            for i in range(model.num_hidden_layers)
        ]

    def filled_bytes(self) -> int:
        """Bytes of K and V actually holding positions: 2 x layers x kv_heads x head_dim x length x size."""
        return sum(2 * layer.keys().numel() * layer.k.element_size() for layer in self.layers)

    def reserved_bytes(self) -> int:
        """Bytes preallocated for max_cache_len positions."""
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)


class BucketedLayerView:
    """One layer of a BucketedCache: writes at a position tensor, reads a fixed number of positions."""

    def __init__(self, layer: LayerKVCache, position: torch.Tensor, bucket: int):
        self.layer, self.position, self.bucket = layer, position, bucket

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k_new, v_new [1, KV, 1, D] -> K and V of the first `bucket` positions [1, KV, bucket, D]."""
        self.layer.k.index_copy_(2, self.position, k_new.to(self.layer.k.dtype))  # at the position tensor
        self.layer.v.index_copy_(2, self.position, v_new.to(self.layer.v.dtype))
        return self.layer.k[:, :, :self.bucket], self.layer.v[:, :, :self.bucket]


class BucketedCache(LayeredCache):
    """A contiguous cache as a fixed-shape decode step sees it (kvbook.cuda_graph): the same shapes and addresses
    at every position of a bucket, with a mask hiding the positions after the current one."""

    def __init__(self, cache: KVCache, position: torch.Tensor, bucket: int):
        self.layers = [BucketedLayerView(layer, position, bucket) for layer in cache.layers]
        self.position = position  # [1], on the device
        self.columns = torch.arange(bucket, device=position.device)  # [bucket]

    def decode_mask(self) -> torch.Tensor:
        """[bucket], True where the query may NOT look: the positions after the one being written."""
        return self.columns > self.position
