"""The contiguous KV cache: per layer, preallocated K and V buffers with a write position.

New positions are written after the history (the source article's pitfall 3), and attention reads views of
the filled part, so decode never copies the history. Explained in chapters 4 ("Prefill") and 5 ("Decode").

A quantized cache ([kv_cache] cache_dtype = "int8" or "float8_e4m3fn", kvbook.cache.kv_quant) stores each position's
K and V per head in one byte per number with one float16 scale, and attention reads them dequantized to float32.

Shapes: B sequences (1 but in batched experiments), H = num_key_value_heads (32 in the article's model), S =
max_cache_len positions (4096), D = head_dim (128).
"""

from __future__ import annotations

import torch

from ..config import KVCacheConfig, ModelConfig
from ..device import TORCH_DTYPES
from ..model.forward_batch import ForwardBatch, causal_mask
from . import kv_quant


class CacheFullError(RuntimeError):
    """Writing past max_cache_len. Raised before anything is written, so the cache stays usable."""


def storage_dtype(cache_dtype: str) -> torch.dtype:
    """The dtype K and V are stored in: int8 or float8 for a quantized cache, else the floating cache_dtype."""
    return kv_quant.KV_STORAGE.get(cache_dtype) or TORCH_DTYPES[cache_dtype]


class LayerKVCache:
    def __init__(self, layer: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, cache_dtype: str | None = None):
        self.layer = layer
        self.max_len = max_len
        # a quantized cache: int8/float8 K and V, and one float16 scale per position and head. Zeros, so that a
        # position never written dequantizes to 0 (the fixed-shape step masks such positions, kvbook.runtime.cuda_graph)
        self.quantized = cache_dtype if cache_dtype is not None and kv_quant.is_quantized_cache(cache_dtype) else None
        self.k_scale = self.v_scale = None
        if self.quantized:
            scales = (batch, max_len, kv_heads, 1)
            self.k_scale = torch.zeros(scales, dtype=kv_quant.KV_SCALE_DTYPE, device=device).transpose(1, 2)
            self.v_scale = torch.zeros(scales, dtype=kv_quant.KV_SCALE_DTYPE, device=device).transpose(1, 2)
        # Stored position-major, [B, S, H, D], and seen through a transpose as [B, H, S, D]: a new
        # sequence's positions then fill consecutive memory. Head-major storage puts each head's first positions
        # 1 MiB apart, and with transparent huge pages the first write to a fresh cache faulted in 192 pages of
        # 2 MiB, which cost TTFT. Empty, not zeros: only the filled
        # part [:length] is read.
        storage = (batch, max_len, kv_heads, head_dim)
        self.k = torch.empty(storage, dtype=dtype, device=device).transpose(1, 2)  # [B, H, S, D]
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
        if self.quantized:
            self.k[:, :, start:end], self.k_scale[:, :, start:end] = kv_quant.quantize_kv(k_new, self.quantized)
            self.v[:, :, start:end], self.v_scale[:, :, start:end] = kv_quant.quantize_kv(v_new, self.quantized)
            self.length = end
            return self.keys(), self.values()  # float32, dequantized
        self.k[:, :, start:end] = k_new  # after the history, never before it; converted to cache_dtype
        self.v[:, :, start:end] = v_new
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # views in cache_dtype: nothing is copied

    def keys(self) -> torch.Tensor:
        if self.quantized:
            return kv_quant.dequantize_kv(self.k[:, :, :self.length], self.k_scale[:, :, :self.length])
        return self.k[:, :, :self.length]  # [B, KV, length, D]

    def values(self) -> torch.Tensor:
        if self.quantized:
            return kv_quant.dequantize_kv(self.v[:, :, :self.length], self.v_scale[:, :, :self.length])
        return self.v[:, :, :self.length]  # [B, KV, length, D]

    def stored_bytes(self, positions: int) -> int:
        """Bytes of K and V (and their scales) for `positions` positions."""
        per_position = self.k[:, :, 0].numel() * self.k.element_size()
        if self.quantized:
            per_position += self.k_scale[:, :, 0].numel() * self.k_scale.element_size()
        return 2 * positions * per_position


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

    def forward_batch(self, new: int, device) -> ForwardBatch:
        """How a pass of `new` positions after the ones held uses this cache: each layer appends to its own, and
        the new positions attend causally ([new, length + new] mask; None for one new position)."""
        return ForwardBatch([self[i] for i in range(len(self.layers))], causal_mask(new, self.length + new, device))

    # what a paged cache has (kvbook.cache.paged), trivial for a contiguous one: callers need not ask which it is
    num_blocks: int | None = None  # blocks held; None: not paged
    block_table: list[int] | None = None  # the blocks' ids, in order; None: not paged

    def free(self) -> None:
        """Give the cache's memory back for other sequences: a paged cache returns its blocks to the pool; a
        contiguous one goes with its last reference."""


class KVCache(LayeredCache):
    """One LayerKVCache per decoder layer: K0, V0, K1, V1, K2, V2 for the article's model."""

    def __init__(self, model: ModelConfig, kv: KVCacheConfig, device: torch.device, batch: int = 1):
        self.model, self.kv, self.device, self.batch = model, kv, device, batch  # what copy() builds again
        self.layers = [
            LayerKVCache(i, batch, model.num_key_value_heads, kv.max_cache_len, model.head_dim,
                         storage_dtype(kv.cache_dtype), device, kv.cache_dtype)
            for i in range(model.num_hidden_layers)
        ]

    def clear(self) -> None:
        """Hold no position (the memory stays: kvbook.runtime.engine hands a cache given back to the next sequence)."""
        for layer in self.layers:
            layer.length = 0

    def copy(self, slots=None) -> KVCache:
        """A new cache holding this one's positions `slots` (a list or tensor of indices; default: all, in order),
        in every layer, with K and V of the same slot kept together: a cache that lost a position, or holds them
        shuffled or with the oldest dropped. Chapters 6 and 7 run decode steps on such caches to show which bugs
        change the logits. The stored numbers are copied as they are (a quantized cache's scales with them)."""
        index = torch.arange(self.length) if slots is None else torch.as_tensor(slots, dtype=torch.long)
        if index.ndim != 1 or (len(index) and not 0 <= int(index.min()) <= int(index.max()) < self.length):
            raise IndexError(f"KVCache.copy: slots must be one list of positions in 0 … {self.length - 1} "
                             f"(the positions this cache holds); got {index.tolist()}")
        new = KVCache(self.model, self.kv, self.device, self.batch)
        index = index.to(self.device)
        for old, layer in zip(self.layers, new.layers, strict=True):
            for name in ("k", "v", "k_scale", "v_scale"):  # [B, KV, S, D], scales [B, KV, S, 1] or None
                if getattr(old, name) is not None:
                    getattr(layer, name)[:, :, :len(index)] = getattr(old, name)[:, :, index]
            layer.length = len(index)
        return new

    def filled_bytes(self) -> int:
        """Bytes of K and V actually holding positions: 2 x layers x kv_heads x head_dim x length x size (and the
        scales of a quantized cache: kvbook.cache.memory.kv_cache_bytes)."""
        return sum(layer.stored_bytes(layer.length) for layer in self.layers)

    def reserved_bytes(self) -> int:
        """Bytes preallocated for max_cache_len positions."""
        return sum(layer.stored_bytes(layer.max_len) for layer in self.layers)


class BucketedLayerView:
    """One layer of a BucketedCache: writes at a position tensor, reads a fixed number of positions."""

    def __init__(self, layer: LayerKVCache, position: torch.Tensor, bucket: int):
        self.layer, self.position, self.bucket = layer, position, bucket

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k_new, v_new [1, KV, 1, D] -> K and V of the first `bucket` positions [1, KV, bucket, D]."""
        layer = self.layer
        if layer.quantized:
            for store, scales, new in ((layer.k, layer.k_scale, k_new), (layer.v, layer.v_scale, v_new)):
                values, scale = kv_quant.quantize_kv(new, layer.quantized)
                store.index_copy_(2, self.position, values)
                scales.index_copy_(2, self.position, scale)
            return (kv_quant.dequantize_kv(layer.k[:, :, :self.bucket], layer.k_scale[:, :, :self.bucket]),
                    kv_quant.dequantize_kv(layer.v[:, :, :self.bucket], layer.v_scale[:, :, :self.bucket]))
        layer.k.index_copy_(2, self.position, k_new.to(layer.k.dtype))  # at the position tensor
        layer.v.index_copy_(2, self.position, v_new.to(layer.v.dtype))
        return layer.k[:, :, :self.bucket], layer.v[:, :, :self.bucket]


class BucketedCache(LayeredCache):
    """A contiguous cache as a fixed-shape decode step sees it (kvbook.runtime.cuda_graph): the same shapes and
    addresses at every position of a bucket, with a mask hiding the positions after the current one."""

    def __init__(self, cache: KVCache, position: torch.Tensor, bucket: int):
        self.layers = [BucketedLayerView(layer, position, bucket) for layer in cache.layers]
        self.position = position  # [1], on the device
        self.columns = torch.arange(bucket, device=position.device)  # [bucket]

    def decode_mask(self) -> torch.Tensor:
        """[bucket], True where the query may NOT look: the positions after the one being written."""
        return self.columns > self.position

    def forward_batch(self, new: int, device) -> ForwardBatch:
        """A fixed-shape decode step: one new position, written at the position tensor, reading the whole bucket
        with the positions after it masked ([S], S = the bucket)."""
        return ForwardBatch(self.layers, self.decode_mask())
