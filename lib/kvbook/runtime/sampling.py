"""Choosing the next token from the last position's logits: greedy (temperature 0), or a draw from the softmax of
logits / temperature, cut to the top_k most likely tokens and then to the smallest set whose probability reaches
top_p, from the sequence's seeded generator. Explained in chapter 13 ("Sampling").

Each transform is a function of one [vocab] tensor, so a chapter can plot the distribution after each one.
"""

from __future__ import annotations

import torch


def with_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [vocab] -> softmax(logits / temperature) [vocab] float32: below 1 sharpens, above 1 flattens."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def keep_top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Zero all but the k most likely tokens and renormalise (k = 0 keeps every token)."""
    if k == 0 or k >= probs.numel():
        return probs
    top = torch.topk(probs, k)
    kept = torch.zeros_like(probs).scatter_(-1, top.indices, top.values)
    return kept / kept.sum()


def keep_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (the most likely one always), and
    renormalise (p = 1 keeps every token)."""
    if p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # the mass of the tokens ranked above each one
    inside = before < p
    inside[0] = True  # also when p is below float32's smallest number and compares as 0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * inside)
    return kept / kept.sum()


def next_token_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [vocab] -> the distribution a token is drawn from (temperature > 0)."""
    return keep_top_p(keep_top_k(with_temperature(logits, temperature), top_k), top_p)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None, top_k: int = 0) -> int:
    """logits [vocab] -> one token id."""
    if temperature == 0:
        # float16 -> float32 is exact, so the same token; on the CPU float16 argmax is not vectorized, and the cast
        # plus a float32 argmax is faster
        return int(torch.argmax(logits.float()))
    if not torch.isfinite(logits.float() / temperature).all():  # a temperature so close to 0 that logits overflow:
        return int(torch.argmax(logits.float()))  # its limit, greedy
    return int(torch.multinomial(next_token_probs(logits, temperature, top_k, top_p), 1, generator=generator))
