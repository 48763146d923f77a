"""What a forward pass needs besides the token ids and their positions: which cache each layer writes to and reads
from, the attention mask, and whether each row of the batch has a cache of its own (nano-vllm's Context, passed
as an argument instead of a global). Explained in chapters 4, 5 and 11.

The model never asks what kind of cache it was given: a cache describes itself (LayeredCache.forward_batch in
kvbook.cache.contiguous, for the contiguous, paged and fixed-shape caches), and a batched decode step of several
sequences is ForwardBatch.per_row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def causal_mask(new: int, total: int, device) -> torch.Tensor | None:
    """True where a query may NOT look: new queries sit at the last `new` of `total` positions.
    None for a single new position, which may look at everything before it."""
    if new == 1:
        return None
    return torch.ones(new, total, dtype=torch.bool, device=device).triu(total - new + 1)  # [T, S]


@dataclass
class ForwardBatch:
    """layer_caches[i]: what layer i's attention writes K and V to and reads them from: None (no cache), one layer
    cache (one sequence, every row of it), or with per_row a list with one layer cache per sequence (row b of the
    batch appends to and reads layer_caches[i][b]). mask: True where a query may NOT look ([T, S] or [S]), or None."""

    layer_caches: list
    mask: torch.Tensor | None = None
    per_row: bool = False

    @classmethod
    def no_cache(cls, num_layers: int, new: int, device) -> ForwardBatch:
        """A pass over a whole sequence without a cache: every position attends causally to those before it."""
        return cls([None] * num_layers, causal_mask(new, new, device))

    @classmethod
    def per_row_decode(cls, caches: list) -> ForwardBatch:
        """A decode step of several sequences, input [B, 1]: row b appends to and reads caches[b] (each a
        LayeredCache). No mask: each row's one query may look at its whole history."""
        return cls([[cache[i] for cache in caches] for i in range(len(caches[0]))], None, per_row=True)

    def forward_batch(self, new: int, device) -> ForwardBatch:
        """A ForwardBatch describes itself, as a cache does."""
        return self

    @classmethod
    def of(cls, cache, num_layers: int, new: int, device) -> ForwardBatch:
        """What the model's forward was given -> a ForwardBatch: None (no cache), or a cache or a ForwardBatch,
        which describes itself (a batched decode step's comes from kvbook.runtime.inputs.prepare_decode)."""
        if cache is None:
            return cls.no_cache(num_layers, new, device)
        return cache.forward_batch(new, device)
