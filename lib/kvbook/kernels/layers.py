"""The faster products: a layer that multiplies a copy of its weight, or the weight packed for FBGEMM.

Kernels.prepare turns each of the model's kvbook.model.linear.Linear (and kvbook.model.quant.Int8Linear) into the
Fast variant below, in place: the layer keeps its parameters and names, only its forward changes. It then holds
`copies` (its weight's values in other dtypes: an input in one of them is multiplied by it), how a lone row
computes (`row_dtype`, `matvec`), `onednn` (several float32 rows go through oneDNN's inner product) and `packed`
(FBGEMM's float16 packing, for a batched step).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.nn import functional as F

from ..model.linear import Linear
from ..model.quant import DECODE_ROWS, Int8Linear

PACK_ROWS = 4096  # FBGEMM packs a matrix as blocks of at most this many rows: taller blocks pack slower per weight

_step = threading.local()  # `multiple`: inside a batched decode step on this thread, rows are padded to it


class FastProducts:
    """The forward of a prepared layer (a mixin before Linear or Int8Linear, whose forward is the plain one)."""

    copies: dict[torch.dtype, torch.Tensor]
    row_dtype: torch.dtype | None  # a lone row (a decode step, prefill's last position) computes in this dtype
    matvec: bool  # a lone row goes through torch.mv on its copy
    onednn: bool  # several float32 rows go through oneDNN's inner product
    packed: list | None  # the float16 weight packed for FBGEMM: a batched step's float32 rows multiply by it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1])  # [rows, in]
        multiple = getattr(_step, "multiple", None)
        if multiple is not None:  # a batched decode step
            out = padded_rows(flat, multiple, self._batched_product)
        else:
            lone = flat.shape[0] == 1
            if lone and self.row_dtype is not None:
                flat = flat.to(self.row_dtype)
            copy = self.copies.get(flat.dtype)
            if copy is None:
                out = super().forward(flat)  # the plain product, in the weight's dtype
            elif lone and self.matvec:
                out = torch.mv(copy, flat[0])[None]
            elif not lone and self.onednn and flat.dtype == torch.float32:
                out = onednn_linear(flat, copy)
            else:
                out = F.linear(flat, copy)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _batched_product(self, flat: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and flat.dtype == torch.float32:
            return packed_linear(flat, self.packed)
        copy = self.copies.get(flat.dtype)
        return super().forward(flat) if copy is None else F.linear(flat, copy)


class FastLinear(FastProducts, Linear):
    pass


class FastInt8Linear(FastProducts, Int8Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= DECODE_ROWS:  # a decode step, alone or batched: the int8 matrices
            return Int8Linear.forward(self, x)
        return super().forward(x)


FAST = {Linear: FastLinear, Int8Linear: FastInt8Linear}


def fast_layers(model: nn.Module) -> list[FastProducts]:
    """Every layer of the model, made a Fast one if it is not yet (a model shared by engines is made so once)."""
    layers = []
    for module in model.modules():
        if type(module) in FAST:
            module.__class__ = FAST[type(module)]  # the same object, parameters and names: only forward changes
            module.copies, module.row_dtype, module.packed = {}, None, None
            module.matvec = module.onednn = False
        if isinstance(module, FastProducts):
            layers.append(module)
    return layers


def add_copies(layers: list[FastProducts], dtype: torch.dtype) -> None:
    """Give each layer its weight's values in dtype (torch's conversion is itself parallel)."""
    for layer in layers:
        if dtype not in layer.copies and layer.weight.dtype != dtype:
            layer.copies[dtype] = layer.weight.to(dtype)


@torch.no_grad()
def padded_rows(x: torch.Tensor, multiple: int, product) -> torch.Tensor:
    """product(x) [rows, out] computed on x [rows, in] padded with zero rows to a multiple of `multiple`: a library may
    pick its kernel, and with it the rounding, by the number of rows."""
    rows = x.shape[0]
    if rows % multiple == 0:
        return product(x)
    return product(torch.cat([x, x.new_zeros(multiple - rows % multiple, x.shape[1])]))[:rows]


def onednn_available(device: torch.device) -> bool:
    """Whether torch was built with oneDNN (its CPU builds are) and the weights live on a CPU."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] times weight [out, in] -> [rows, out] through oneDNN's inner product (the op Inductor's CPU code
    calls; F.linear's values up to the order of the sums)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def fbgemm_available(device: torch.device) -> bool:
    """Whether torch was built with FBGEMM (x86 CPUs) and the weights live on a CPU."""
    return device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines


def pack_block(block: torch.Tensor) -> torch.Tensor:
    """[rows, in], at most PACK_ROWS rows -> FBGEMM's packed float16 matrix."""
    return torch.ops.quantized.linear_prepack_fp16(block.float(), None)


def pack_float16(weight: torch.Tensor) -> list:
    """weight [out, in] -> FBGEMM's packed float16 blocks (the values rounded to float16 if they were not)."""
    return [pack_block(block) for block in weight.split(PACK_ROWS)]


def packed_linear(x: torch.Tensor, packed: list) -> torch.Tensor:
    """x [rows, in] float32 times a weight packed by pack_float16 -> [rows, out] float32 (FBGEMM converts each
    weight to float32 in registers: 2 bytes read per weight, float32 arithmetic)."""
    parts = [torch.ops.quantized.linear_dynamic_fp16(x, block) for block in packed]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def pack_layers(layers: list[FastProducts], progress: bool = False) -> None:
    """Pack every floating layer's weight for FBGEMM, once per model; seconds for the article's model, so with
    progress it says so on stderr, before and after."""
    unpacked = [layer for layer in layers if layer.packed is None and not isinstance(layer, Int8Linear)]
    if not unpacked:
        return
    if progress:
        print(f"kvbook: packing {len(unpacked)} float16 weight matrices for the batched steps (once per "
              "process) ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    # FBGEMM packs one block on one CPU and releases the GIL: every block goes to a pool, so the CPUs pack at once
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        packing = [(layer, [pool.submit(pack_block, block) for block in layer.weight.split(PACK_ROWS)])
                   for layer in unpacked]
        for layer, blocks in packing:
            layer.packed = [block.result() for block in blocks]
    if progress:
        print(f"kvbook: packed in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def weight_bytes_kept(model: nn.Module) -> int:
    """Bytes of every tensor the model keeps for its weights: parameters, buffers (an int8 layer's matrix and
    scales), copies (each storage counted once: a tied lm_head is the embedding) and FBGEMM's packed matrices
    (2 bytes per weight)."""
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        tensors += list(getattr(module, "copies", {}).values())
    seen, total = set(), 0
    for tensor in tensors:
        key = (tensor.untyped_storage().data_ptr(), tensor.device)
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total + sum(2 * m.weight.numel() for m in model.modules() if getattr(m, "packed", None) is not None)
