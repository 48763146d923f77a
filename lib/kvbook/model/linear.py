"""A bias-free linear layer, y = x W^T with W [out, in] as transformers stores it.

It computes in the weight's dtype and answers in it. kvbook.kernels may give the layer a faster way to compute
the same product on this device (a copy of the weight in another dtype, FBGEMM's packing); this file stays the
plain computation."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, dtype=None, device=None):
        super().__init__(in_features, out_features, bias=False, dtype=dtype, device=device)

    def reset_parameters(self) -> None:
        """No random init: weights always come from kvbook.model.weights (drawn from the config's seed or loaded)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        # a 2-D input: on a CPU, F.linear of a 3-D one such as lm_head's [1, 1, in] may copy the transposed weight
        flat = x.reshape(-1, self.in_features).to(self.weight.dtype)  # [rows, in]
        return F.linear(flat, self.weight).reshape(*x.shape[:-1], self.out_features)
