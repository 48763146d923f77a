"""Checks that give the same answer on every device, for the book's comparisons of two computations.

Two computations of the same logits (cached against recomputed, batched against alone, kvbook against
transformers) differ by rounding, and by how much depends on the device's kernels. With random weights the
next-token distribution is nearly flat (top probability ~0.001), so the greedy token often sits on a near-tie
that such rounding can flip. A check that must hold everywhere therefore compares logits within a stated
tolerance, and asks of a greedy token only what that tolerance can decide. Explained in chapter 6 ("Proof").
"""

from __future__ import annotations

import torch


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of two logit tensors of the same shape, in float32. They may live on two
    devices: a Tracer keeps the logits it records on the CPU, the model's own are on its device (a GPU's)."""
    return float((a.float() - b.float().to(a.device)).abs().max())


def logits_agree(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    return max_difference(a, b) <= tolerance


def greedy_within(logits: torch.Tensor, token: int, tolerance: float) -> bool:
    """Whether `token` is a greedy choice of `logits` [vocab] for some computation within `tolerance` of them.

    If another computation's logits differ from these by at most `tolerance` everywhere, its argmax can only be
    a token whose logit here is within 2 x tolerance of the maximum: near-ties may flip, nothing else can."""
    logits = logits.float()
    return bool(logits.max() - logits[token] <= 2 * tolerance)
