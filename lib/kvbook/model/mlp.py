"""The SwiGLU feed-forward block: down_proj(silu(gate_proj(x)) * up_proj(x)).

Shapes: C = hidden_size, I = intermediate_size (the article's model: 4096 and 11008). Explained in chapter 3
("Inside layer 0")."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .linear import Linear
from .probe import Probe
from .tensor_parallel import sum_over_ranks


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype=None, device=None):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, dtype=dtype, device=device)
        self.up_proj = Linear(hidden_size, intermediate_size, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype, device=device)
        self.swiglu = Probe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C]
        gated = self.swiglu(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, T, I]
        # under tensor parallelism (kvbook.model.tensor_parallel) a rank's down_proj adds up its own I/N columns
        return sum_over_ranks(self.down_proj(gated))  # [B, T, C]
