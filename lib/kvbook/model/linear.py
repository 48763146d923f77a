"""A bias-free linear layer that may hold copies of its weight in other dtypes, for arithmetic.

Prefill multiplies every prompt position by every weight matrix: it is limited by arithmetic. A lone decode step
multiplies one position: it is limited by how fast the weights are read. A batched decode step multiplies a few.
Which dtype computes each fastest depends on the device (a CPU's vector instructions and the kernels torch has for
them), so kvbook.runtime.paths measures it once per machine, and the engine gives each Linear a copy of its float16
weight in the dtypes its phases chose (`copies`). The input's dtype selects the copy; an input in no copy's dtype
is cast to the weight's. The weight itself keeps the article's float16 values.

The input always reaches F.linear as a 2-D [rows, in] matrix: some CPUs' F.linear turns a 3-D input such as
lm_head's [1, 1, in] into a batched matrix product that copies the whole transposed weight first.

A lone row may read a wide matrix (down_proj's 11008 inputs) faster as contiguous column blocks of at most
SPLIT_WIDTH inputs, on some CPUs; kvbook.runtime.paths measures whether (`split_input`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.nn import functional as F

SPLIT_WIDTH = 8192  # column blocks of a split matrix are at most this wide

_state = threading.local()


@contextlib.contextmanager
def batch_invariant_rows(multiple: int):
    """Inside: every product's rows are padded (with zeros) to a multiple of `multiple`. A CPU library may pick
    its kernel, and with it the rounding, by the number of rows (one row as a matrix-vector product, or blocks of
    4 rows); padded so, a sequence decoding alone gets exactly the numbers it gets in a batch
    (kvbook.runtime.scheduler).
    kvbook.runtime.paths measures the smallest multiple that does this for the batched dtype on this machine."""
    previous = getattr(_state, "multiple", None)
    _state.multiple = multiple
    try:
        yield
    finally:
        _state.multiple = previous


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, dtype=None, device=None):
        super().__init__(in_features, out_features, bias=False, dtype=dtype, device=device)
        # none is a parameter: never saved, never loaded
        self.copies: dict[torch.dtype, torch.Tensor] = {}  # the weight's values in other dtypes, for arithmetic
        self.blocks: dict[torch.dtype, list[torch.Tensor]] = {}  # column blocks of the weight or a copy
        # lm_head: a lone row (prefill's last position, a decode step) computes in this dtype, whatever the
        # dtype of the layers' activations (kvbook.runtime.paths' decode choice)
        self.row_dtype: torch.dtype | None = None

    def reset_parameters(self) -> None:
        """No random init: weights always come from kvbook.model.weights (drawn from the config's seed or loaded)."""

    def weight_in(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The weight's values in dtype, if this layer holds them."""
        return self.weight if self.weight.dtype == dtype else self.copies.get(dtype)

    def split_input(self, dtype: torch.dtype | None = None, max_width: int = SPLIT_WIDTH) -> None:
        """Also keep the weight (or its dtype copy) as contiguous column blocks at most max_width wide; a lone row
        in that dtype reads the blocks instead."""
        dtype = dtype or self.weight.dtype
        weight = self.weight_in(dtype)
        count = -(-self.in_features // max_width)
        if weight is not None and count > 1 and dtype not in self.blocks:  # a shared model is split once
            self.blocks[dtype] = [block.contiguous() for block in weight.chunk(count, dim=1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        x = x.reshape(-1, self.in_features)  # [rows, in]: always 2-D (see the module's docstring)
        rows, multiple = x.shape[0], getattr(_state, "multiple", None)  # None: not a batched step
        if rows == 1 and multiple is None and self.row_dtype is not None:
            x = x.to(self.row_dtype)
        weight = self.weight_in(x.dtype)
        if weight is None:
            x = x.to(self.weight.dtype)
            weight = self.weight
        if multiple is not None and rows % multiple:
            padding = x.new_zeros(multiple - rows % multiple, self.in_features)
            out = F.linear(torch.cat([x, padding]), weight)[:rows]
        elif rows == 1 and weight.dtype in self.blocks:
            blocks = self.blocks[weight.dtype]
            parts = x.split(blocks[0].shape[1], dim=-1)
            out = sum(F.linear(part, block) for part, block in zip(parts, blocks, strict=True))
        else:
            out = F.linear(x, weight)
        return out.reshape(*leading, self.out_features)


def linears(model: nn.Module) -> list[Linear]:
    return [module for module in model.modules() if isinstance(module, Linear)]


def split_long_inputs(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Store every weight (or its dtype copy) wider than SPLIT_WIDTH inputs (down_proj) as column blocks too."""
    for module in linears(model):
        module.split_input(dtype)


def add_copies(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every Linear a copy of its weight in dtype (if it holds none), several matrices at a time."""
    missing = [module for module in linears(model) if module.weight_in(dtype) is None]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        for module, copy in zip(missing, pool.map(lambda m: m.weight.to(dtype), missing), strict=True):
            module.copies[dtype] = copy


def weight_bytes_kept(model: nn.Module) -> int:
    """Bytes of every tensor the model keeps for its weights: the parameters (the article's values), the buffers
    (an int8 layer's matrix and scales, kvbook.model.quant), and the arithmetic copies (an int8 layer's floating
    prefill copy too) and column blocks, each storage counted once (a tied lm_head is the embedding)."""
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        tensors += list(getattr(module, "copies", {}).values())
        tensors += [b for blocks in getattr(module, "blocks", {}).values() for b in blocks]
    seen, total = set(), 0
    for tensor in tensors:
        key = (tensor.untyped_storage().data_ptr(), tensor.device)
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total
