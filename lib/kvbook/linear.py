"""A bias-free linear layer that may hold a second copy of its weight for prefill.

Prefill multiplies 256 positions by every weight matrix: it is limited by arithmetic. Decode multiplies one
position: it is limited by how fast the weights are read. On a CPU without native float16 arithmetic,
float16 matrix products run at ~50 GFLOP/s and bfloat16 ones at ~400, while a float16 matrix-vector product
reads memory as fast as any. So the engine keeps the weights in float16 for decode and, on such CPUs, a
bfloat16 copy of the decoder layers' matrices for prefill ([inference] prefill_dtype; chapter 7, "Latency").
A batched decode step (several sequences, Engine.generate_batch) is a matrix product too and uses the same
copies; lm_head then gets one as well.

The same CPUs' float16 matrix-vector product streams ~52 GB/s over 4096-wide rows but only ~30 GB/s over
down_proj's 11008-wide ones; stored as two contiguous 5504-wide column blocks, down_proj reads at full speed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, dtype=None, device=None):
        super().__init__(in_features, out_features, bias=False, dtype=dtype, device=device)
        # neither is a parameter: never saved, never loaded
        self.prefill_weight: torch.Tensor | None = None
        self.weight_blocks: list[torch.Tensor] | None = None

    def reset_parameters(self) -> None:
        """No random init: weights always come from kvbook.weights (drawn from the config's seed or loaded)."""

    def split_input(self, max_width: int = 8192) -> None:
        """Keep the weight as contiguous column blocks at most max_width wide (used instead of the weight)."""
        blocks = -(-self.in_features // max_width)
        if blocks > 1 and self.weight_blocks is None:  # a model shared by several engines is split once
            self.weight_blocks = [block.contiguous() for block in self.weight.chunk(blocks, dim=1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prefill_weight is not None and x.dtype == self.prefill_weight.dtype:
            if x.device.type == "cpu" and x.numel() == x.shape[-1]:
                # oneDNN computes a single bfloat16 row with another kernel than two or more, which rounds
                # differently; as two rows a sequence gets the same result alone as in a batch (kvbook.scheduler)
                return F.linear(x.reshape(1, -1).repeat(2, 1), self.prefill_weight)[:1].reshape(*x.shape[:-1], -1)
            return F.linear(x, self.prefill_weight)
        x = x.to(self.weight.dtype)
        if self.weight_blocks is None:
            return F.linear(x, self.weight)
        parts = x.split(self.weight_blocks[0].shape[1], dim=-1)
        return sum(F.linear(part, block) for part, block in zip(parts, self.weight_blocks, strict=True))


def split_long_inputs(model: nn.Module) -> None:
    """For float16 on a CPU: store every weight wider than 8192 inputs (down_proj) as column blocks."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.split_input()
