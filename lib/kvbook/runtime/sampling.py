"""Choosing the next token from the last position's logits: greedy (temperature 0) or temperature + top-p
sampling from a seeded generator. Explained in chapter 5 ("Decode")."""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> int:
    """logits [vocab] -> one token id."""
    if temperature == 0:
        # float16 -> float32 is exact, so the same token; on the CPU float16 argmax is not vectorized, and the cast
        # plus a float32 argmax is faster
        return int(torch.argmax(logits.float()))
    scaled = logits.float() / temperature
    if not torch.isfinite(scaled).all():  # a temperature so close to 0 that the logits overflow: its limit, greedy
        return int(torch.argmax(logits.float()))
    probs = torch.softmax(scaled, dim=-1)  # [vocab]
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest set of most likely tokens whose mass reaches top_p (the first one always)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        outside[0] = False  # also when top_p is below float32's smallest number and compares as 0
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
