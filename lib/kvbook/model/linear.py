"""A bias-free linear layer that may hold copies of its weight in other dtypes, for arithmetic.

Prefill multiplies every prompt position by every weight matrix: it is limited by arithmetic. A lone decode step
multiplies one position: it is limited by how fast the weights are read. A batched decode step multiplies a few.
Which dtype computes each fastest depends on the device (a CPU's vector instructions and the kernels torch has for
them), so kvbook.runtime.paths measures it once per machine, and the engine gives each Linear a copy of its float16
weight in the dtypes its phases chose (`copies`). The input's dtype selects the copy; an input in no copy's dtype
is cast to the weight's. The weight itself keeps the article's float16 values.

The input always reaches F.linear as a 2-D [rows, in] matrix: some CPUs' F.linear turns a 3-D input such as
lm_head's [1, 1, in] into a batched matrix product that copies the whole transposed weight first.

A lone row may read every matrix faster through torch's matrix-vector kernel (torch.mv) than through F.linear's
matrix product of one row (`matvec`). And through either kernel, a wide matrix (down_proj's 11008 inputs) may read
faster as contiguous column blocks of at most SPLIT_WIDTH inputs (`split_input`). Which CPUs gain is in
BENCHMARKS.md; kvbook.runtime.paths measures both.

A batched decode step may instead multiply float32 rows by the float16 weight packed for FBGEMM (`pack`), the x86
library behind torch's quantized CPU operators: its float16 kernel converts the weight to float32 in registers,
so it reads 2 bytes per weight and multiplies in float32. On some CPUs it multiplies a few rows several times
faster than F.linear in any dtype; kvbook.runtime.paths measures whether. Packing is slow (tens of ns per weight,
seconds for this model), so only a scheduler that batches asks for it (kvbook.runtime.engine), and then its short
prompts' prefill may multiply by the packed weights too. Products of float32 rows go through them inside
`packed_products()`.

Prefill may multiply its float32 copy through oneDNN's own inner product (`onednn_dtype`), the op torch's
Inductor calls on a CPU, instead of F.linear (MKL on x86): on some CPUs it runs a few rows several times faster and
256 rows faster too, with no packing and no extra copy; kvbook.runtime.paths measures whether ("onednn-float32").
The choice belongs to the layer, not to a phase's context, so that every call of the model (the engine's, or a
chapter's own `engine.model(...)`) computes a product of several float32 rows the same way. A lone row and a
batched step keep F.linear, as kvbook.runtime.paths measured them.

Where F.linear in a copy's dtype is itself oneDNN's product (bfloat16 on a CPU with AVX512-BF16), it lays the weight
out in oneDNN's blocked format on every call. Prefill's copy may instead be laid out so once (`reorder_copies`):
the same numbers, bit for bit (`reorder_keeps_numbers` checks it on this CPU), sooner. Every product on such a
weight goes through oneDNN (`product`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial

import torch
from torch import nn
from torch.nn import functional as F

SPLIT_WIDTH = 8192  # column blocks of a split matrix are at most this wide
# FBGEMM packs a matrix as blocks of at most this many rows: its packing costs more per weight for taller blocks
# (BENCHMARKS.md)
PACK_ROWS = 4096
FBGEMM = "fbgemm"  # the kernel name kvbook.runtime.paths gives a phase that multiplies packed weights
FBGEMM_LABEL = "fbgemm-float16"  # how that phase is shown: float32 rows, float16 weights packed for FBGEMM
ONEDNN = "onednn"  # the kernel name of a prefill that multiplies its float32 copy through oneDNN's inner product
ONEDNN_LABEL = "onednn-float32"
REORDERED = "reordered"  # the kernel name kvbook.runtime.paths times a reordered prefill copy with
REORDER_ROWS = 256  # oneDNN lays a reordered weight out for products of about this many rows (a prompt's)
MATVEC = "matvec"  # the kernel name of a lone decode row multiplied by torch.mv instead of F.linear

_state = threading.local()  # how this thread's products run now: `multiple` (padding) and `packed` (FBGEMM)


@contextlib.contextmanager
def _setting(name: str, value):
    """Inside: this thread's _state.<name> is value (the previous value comes back after, so they nest)."""
    previous = getattr(_state, name, None)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, previous)


def batch_invariant_rows(multiple: int):
    """Inside: every product's rows are padded (with zeros) to a multiple of `multiple`. A CPU library may pick
    its kernel, and with it the rounding, by the number of rows (one row as a matrix-vector product, or blocks of
    4 rows); padded so, a sequence decoding alone gets exactly the numbers it gets in a batch
    (kvbook.runtime.scheduler).
    kvbook.runtime.paths measures the smallest multiple that does this for the batched dtype on this machine."""
    return _setting("multiple", multiple)


def packed_products():
    """Inside: a Linear that holds its weight packed for FBGEMM multiplies float32 rows by it (a batched step, or
    a batching scheduler's prefill; kvbook.runtime.engine)."""
    return _setting("packed", True)


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, dtype=None, device=None):
        super().__init__(in_features, out_features, bias=False, dtype=dtype, device=device)
        # none is a parameter: never saved, never loaded
        self.copies: dict[torch.dtype, torch.Tensor] = {}  # the weight's values in other dtypes, for arithmetic
        self.blocks: dict[torch.dtype, list[torch.Tensor]] = {}  # column blocks of the weight or a copy
        # lm_head: a lone row (prefill's last position, a decode step) computes in this dtype, whatever the
        # dtype of the layers' activations (kvbook.runtime.paths' decode choice)
        self.row_dtype: torch.dtype | None = None
        self.packed: list | None = None  # the weight packed for FBGEMM, in row blocks: a batched step's (`pack`)
        self.onednn_dtype: torch.dtype | None = None  # products of several rows in this dtype go through oneDNN
        self.lone_row_matvec = False  # a lone row (outside a batched step) goes through torch.mv (`use_matvec`)

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
        # a shared model is split once; a copy laid out for oneDNN is prefill's, never a lone row's
        if weight is not None and not weight.is_mkldnn and self.in_features > max_width and dtype not in self.blocks:
            self.blocks[dtype] = column_blocks(weight, max_width)

    def pack(self) -> None:
        """Keep the weight packed for FBGEMM too: a batched step's float32 rows are then multiplied by it."""
        self.packed = pack_float16(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        x = x.reshape(-1, self.in_features)  # [rows, in]: always 2-D (see the module's docstring)
        rows, multiple = x.shape[0], getattr(_state, "multiple", None)  # None: not a batched step
        if rows == 1 and multiple is None and self.row_dtype is not None:
            x = x.to(self.row_dtype)
        if self.packed is not None and x.dtype == torch.float32 and getattr(_state, "packed", None):
            out = padded_rows(x, multiple or 1, partial(packed_linear, packed=self.packed))  # FBGEMM's kernel
            return out.reshape(*leading, self.out_features)
        weight = self.weight_in(x.dtype)
        if weight is None:
            x = x.to(self.weight.dtype)
            weight = self.weight
        if multiple is not None:
            out = padded_rows(x, multiple, partial(product, weight=weight))
        elif rows == 1 and not weight.is_mkldnn and (self.lone_row_matvec or weight.dtype in self.blocks):
            out = lone_row_product(x, weight, self.blocks.get(weight.dtype), self.lone_row_matvec)
        else:
            out = several_rows_product(x, weight, self.onednn_dtype, rows)
        return out.reshape(*leading, self.out_features)


def several_rows_product(x: torch.Tensor, weight: torch.Tensor, onednn_dtype: torch.dtype | None,
                         rows: int) -> torch.Tensor:
    """x [rows, in] times weight [out, in] outside a batched step: oneDNN's inner product for several rows in
    onednn_dtype (a prefill whose measured kernel it is), F.linear otherwise. The row count is checked first: a
    decode step's row makes the same torch calls whatever prefill chose (the appendix counts them)."""
    if rows > 1 and x.dtype == onednn_dtype:
        return onednn_linear(x, weight)
    return product(x, weight)


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] times weight [out, in]: F.linear, or oneDNN's product where the weight is laid out for it."""
    return onednn_linear(x, weight) if weight.is_mkldnn else F.linear(x, weight)


def column_blocks(weight: torch.Tensor, max_width: int = SPLIT_WIDTH) -> list[torch.Tensor]:
    """weight [out, in] -> contiguous copies of its columns in as few equal blocks as keep each at most max_width."""
    return [block.contiguous() for block in weight.chunk(-(-weight.shape[1] // max_width), dim=1)]


def lone_row_product(x: torch.Tensor, weight: torch.Tensor, blocks: list[torch.Tensor] | None = None,
                     through_matvec: bool = False) -> torch.Tensor:
    """x [1, in] times weight [out, in] -> [1, out] through a lone row's kernel (torch.mv, or F.linear), on the
    weight whole or, given its column blocks, on each block, the partial products added."""
    kernel = matvec if through_matvec else F.linear
    if not blocks:
        return kernel(x, weight)
    parts = x.split(blocks[0].shape[1], dim=-1)  # [1, block width] each
    return sum(kernel(part, block) for part, block in zip(parts, blocks, strict=True))


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, in] times weight [out, in] -> [1, out] through torch's matrix-vector kernel (torch.mv)."""
    return torch.mv(weight, x[0])[None]


def use_matvec(model: nn.Module, enabled: bool) -> None:
    """Every lone row outside a batched step goes through torch.mv from now on (the engine whose decode path
    measured it fastest sets it, for every caller of the model, as use_onednn does for prefill)."""
    for module in linears(model):
        module.lone_row_matvec = enabled


def reorder_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout for products of several rows (what Inductor's weight packing does;
    an opaque tensor: only oneDNN's product reads it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, REORDER_ROWS)


@cache
def reorder_keeps_numbers(dtype: torch.dtype) -> bool:
    """Whether oneDNN's product on a weight reordered once gives F.linear's numbers bit for bit in dtype on this CPU,
    for 1 to 256 rows: true where F.linear is that same product (bfloat16 on some CPUs: BENCHMARKS.md)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(512, 4096, generator=generator).to(dtype)  # [out, in]
        reordered = reorder_for_onednn(weight)
        rows = [torch.randn(n, 4096, generator=generator).to(dtype) for n in (1, 2, 3, 8, 64, 256)]
        return all(torch.equal(onednn_linear(x, reordered), F.linear(x, weight)) for x in rows)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def reorder_copies(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace every layer's copy in dtype (prefill's) by the same values laid out for oneDNN, one after another
    (oneDNN's reorder is itself parallel)."""
    for module in model.modules():
        if dtype in getattr(module, "copies", {}) and not module.copies[dtype].is_mkldnn:
            module.copies[dtype] = reorder_for_onednn(module.copies[dtype])


def padded_rows(x: torch.Tensor, multiple: int, product) -> torch.Tensor:
    """product(x) [rows, out] computed on x [rows, in] padded with zero rows to a multiple of `multiple`."""
    rows = x.shape[0]
    if rows % multiple == 0:
        return product(x)
    return product(torch.cat([x, x.new_zeros(multiple - rows % multiple, x.shape[1])]))[:rows]


def fbgemm_available(device: torch.device) -> bool:
    """Whether torch was built with FBGEMM (x86 CPUs) and the weights live on a CPU."""
    return device.type == "cpu" and FBGEMM in torch.backends.quantized.supported_engines


def onednn_available(device: torch.device) -> bool:
    """Whether torch was built with oneDNN (its CPU builds are), the weights live on a CPU, and the op runs here."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and _onednn_runs()


@cache
def _onednn_runs() -> bool:
    """One tiny product: a build may register the op yet have no float32 primitive for this CPU (another
    architecture's oneDNN), and the paths must then not offer it rather than fail on every engine."""
    try:
        x, weight = torch.ones(2, 8), torch.ones(4, 8)  # [rows, in], [out, in]
        return torch.equal(onednn_linear(x, weight), F.linear(x, weight))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] times weight [out, in] -> [rows, out] through oneDNN's inner product (the op Inductor's CPU code
    calls; the same values as F.linear up to the order of the sums)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def use_onednn(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Every floating (and int8 layer's prefill) product of several rows in dtype goes through oneDNN from now on,
    whoever calls the model (the engine whose prefill measured it fastest sets it; kvbook.runtime.engine); None:
    through F.linear."""
    for module in model.modules():
        if hasattr(module, "onednn_dtype"):
            module.onednn_dtype = dtype


def fbgemm_serves(weight_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether FBGEMM's float16 kernel is a candidate for these weights: it holds float16 values exactly, so the
    weights must be float16 (kvbook.runtime.paths measures it; the bench counts it in the compute floor)."""
    return weight_dtype == torch.float16 and fbgemm_available(device)


def pack_float16(weight: torch.Tensor) -> list:
    """weight [out, in] -> FBGEMM's packed float16 matrices of at most PACK_ROWS rows each (the values are the
    weight's, rounded to float16 if they were not already)."""
    return [pack_block(block) for block in weight.split(PACK_ROWS)]


def pack_block(block: torch.Tensor) -> torch.Tensor:
    """One block of at most PACK_ROWS rows [rows, in] -> FBGEMM's packed float16 matrix."""
    return torch.ops.quantized.linear_prepack_fp16(block.float(), None)


def packed_linear(x: torch.Tensor, packed: list) -> torch.Tensor:
    """x [rows, in] float32 times a weight packed by pack_float16 -> [rows, out] float32 (FBGEMM's float16 kernel:
    the weight converted to float32 in registers, products and sums in float32)."""
    parts = [torch.ops.quantized.linear_dynamic_fp16(x, block) for block in packed]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def product_for(weight: torch.Tensor, kernel: str = "torch"):
    """x [rows, in] -> x times weight [out, in]: F.linear, with kernel FBGEMM the weight packed once and x float32,
    with kernel ONEDNN oneDNN's inner product, with kernel REORDERED the same on the weight reordered once, with
    kernel MATVEC torch.mv for one row (kvbook.runtime.paths times and checks each candidate through this)."""
    if kernel == FBGEMM:
        return partial(packed_linear, packed=pack_float16(weight))
    if kernel == ONEDNN:
        return partial(onednn_linear, weight=weight)
    if kernel == REORDERED:
        return partial(onednn_linear, weight=reorder_for_onednn(weight))
    if kernel == MATVEC:
        return partial(matvec, weight=weight)
    return partial(F.linear, weight=weight)


def linears(model: nn.Module) -> list[Linear]:
    return [module for module in model.modules() if isinstance(module, Linear)]


def split_long_inputs(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Store every weight (or its dtype copy) wider than SPLIT_WIDTH inputs (down_proj) as column blocks too."""
    for module in linears(model):
        module.split_input(dtype)


def pack_model(model: nn.Module, progress: bool = False) -> None:
    """Pack every Linear's weight for FBGEMM, once per model. It takes seconds for the article's model, so with
    progress it says so on stderr, before and after (two lines, which a notebook keeps in the cell that asked)."""
    unpacked = [module for module in linears(model) if module.packed is None]  # a shared model is packed once
    if not unpacked:
        return
    if progress:
        print(f"kvbook: packing {len(unpacked)} float16 weight matrices for FBGEMM's batched steps "
              "(once per process: packed weights are not cached) ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    # FBGEMM packs one block on one CPU and torch releases the GIL meanwhile: every block of every matrix is
    # handed to a pool, so that the CPUs pack at once (a matrix of one block, q_proj, would otherwise wait alone)
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        packing = [(module, [pool.submit(pack_block, block) for block in module.weight.split(PACK_ROWS)])
                   for module in unpacked]
        for module, blocks in packing:
            module.packed = [block.result() for block in blocks]
    if progress:
        print(f"kvbook: packed in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def add_copies(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every Linear a copy of its weight in dtype (if it holds none), several matrices at a time."""
    missing = [module for module in linears(model) if module.weight_in(dtype) is None]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        for module, copy in zip(missing, pool.map(lambda m: m.weight.to(dtype), missing), strict=True):
            module.copies[dtype] = copy


def weight_bytes_kept(model: nn.Module) -> int:
    """Bytes of every tensor the model keeps for its weights: the parameters (the article's values), the buffers
    (an int8 layer's matrix and scales, kvbook.model.quant), and the arithmetic copies (an int8 layer's floating
    prefill copy too) and column blocks, each storage counted once (a tied lm_head is the embedding), and the
    matrices packed for FBGEMM (2 bytes per weight: their blocks' padding, none at this model's widths, is not
    counted)."""
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        tensors += list(getattr(module, "copies", {}).values())
        tensors += [b for blocks in getattr(module, "blocks", {}).values() for b in blocks]
    seen, total = set(), 0
    for tensor in tensors:
        if tensor.is_mkldnn:  # a copy laid out for oneDNN (reorder_copies) has no storage to share
            total += tensor.numel() * tensor.element_size()
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.device)
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total + sum(2 * m.weight.numel() for m in linears(model) if m.packed is not None)
