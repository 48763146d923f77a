"""RMSNorm, computed in float32 like transformers' Qwen3RMSNorm. It never changes a shape.

Explained in chapter 3 ("Inside layer 0")."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)  # [..., 1]
        x = x * torch.rsqrt(variance + self.eps)
        # transformers casts back before scaling; the order matters for bit-parity in float16.
        # (The weight follows the activations' dtype: bfloat16 during a bfloat16 prefill.)
        return self.weight.to(input_dtype) * x.to(input_dtype)
