"""Where a decode step's inputs are made, once for every caller: Engine.stream, the scheduler's batched step, the
fixed-shape step of kvbook.runtime.cuda_graph and its comparison with the ordinary one. Explained in chapters 5 and 11.
"""

from __future__ import annotations

import torch

from ..model.forward_batch import ForwardBatch


def prepare_decode(tokens: list[int], caches: list, device) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    """One decode step of B sequences: tokens[b], the token sequence b generated last, goes in at the next position
    of caches[b] -> (input_ids [B, 1], positions [B], the ForwardBatch). One sequence attends to its cache as a
    prefill does (mask None: one query sees its whole history); several do so row by row (ForwardBatch.per_row)."""
    input_ids = torch.tensor([[token] for token in tokens], device=device)  # [B, 1]
    positions = torch.tensor([cache.length for cache in caches], device=device)  # [B]
    if len(caches) == 1:
        return input_ids, positions, caches[0].forward_batch(1, device)
    return input_ids, positions, ForwardBatch.per_row_decode(caches)
