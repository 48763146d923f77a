"""Which dtype and kernel each phase computes in: rules on what the device is, and one short timing."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..config import Config, ModelConfig
from ..device import TORCH_DTYPES
from ..model.weights import matrix_shapes
from .layers import (
    _step,
    add_copies,
    fast_layers,
    fbgemm_available,
    onednn_available,
    onednn_linear,
    pack_float16,
    pack_layers,
    packed_linear,
    padded_rows,
)
from .memory import keep_freed_memory

PHASES = ("prefill", "decode", "batched_decode")
BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")  # a CPU with either multiplies bfloat16 in hardware
TIMED_ROWS = 64  # prompt rows the two float32 prefill kernels are timed on
# a lone row is timed through a matrix this large ([out, in], 256 MiB in float16): larger than any cache, so that it
# measures the weights' stream
TIMED_MATRIX = (32768, 4096)
# a copy of every weight must earn its memory: a lone row keeps the weights unless the copy is this much faster
COPY_MARGIN = 0.10
CHECKED_ROWS_MAX = 8192  # a matrix checked for batch invariance has at most this many output rows
LABELS = {"fbgemm": "fbgemm-float16", "onednn": "onednn-float32", "int8": "int8", "matvec": "matvec-bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase's arithmetic: the activations' dtype (which picks the layers' copy in it), the kernel ("torch":
    F.linear; "matvec": a lone row through torch.mv on the bfloat16 copy; "onednn": oneDNN's inner product on the
    float32 copy; "fbgemm": float32 rows times the float16 weights packed for FBGEMM; "int8": kvbook.model.quant's
    int8 matrices) and why."""

    dtype: torch.dtype
    kernel: str = "torch"
    reason: str = ""

    @property
    def label(self) -> str:
        """'float16', 'bfloat16', 'float32', 'onednn-float32', 'fbgemm-float16' or 'int8'."""
        return LABELS.get(self.kernel, dtype_name(self.dtype))

    def to_json(self) -> dict:
        return {"dtype": dtype_name(self.dtype), "kernel": self.kernel, "label": self.label, "reason": self.reason}


@dataclasses.dataclass
class Kernels:
    """The phases' arithmetic for one config on one device (choose), and what it does to a model."""

    prefill: Phase
    decode: Phase
    batched_decode: Phase
    device: torch.device
    batch_rows: int = 8  # rows of a batched step: its padding is checked for 1..batch_rows
    batch_row_multiple: int | None = None  # a batched step's rows are padded to a multiple of it (prepare_batched)
    batch_row_reason: str = "checked when a batched step first runs"

    def prepare(self, model: nn.Module) -> None:
        """Make the model's layers Fast ones (kvbook.kernels.layers): the decoder layers' matrices get a copy in
        prefill's dtype (lm_head runs on one row in prefill), and every matrix one in a lone row's dtype if that is
        not the weights'."""
        if self.device.type == "cpu":
            keep_freed_memory()  # a prefill's activations reuse freed memory instead of faulting in new pages
        layers = fast_layers(model)
        add_copies([layer for layer in layers if layer is not model.lm_head], self.prefill.dtype)
        if self.decode.kernel != "int8":
            add_copies(layers, self.decode.dtype)
        for layer in layers:
            layer.onednn = self.prefill.kernel == "onednn"
            layer.matvec = self.decode.kernel == "matvec"
            layer.row_dtype = None if self.decode.kernel == "int8" else self.decode.dtype

    def prepare_batched(self, model: nn.Module, model_cfg: ModelConfig, progress: bool = False) -> None:
        """What a batched step needs: the weights packed for FBGEMM (seconds), and its rows' padding checked."""
        if self.batched_decode.kernel == "fbgemm":
            pack_layers(fast_layers(model), progress)
        elif self.batched_decode.kernel != "int8":
            add_copies(fast_layers(model), self.batched_decode.dtype)
        if self.batch_row_multiple is None:
            self.batch_row_multiple, self.batch_row_reason = invariant_row_multiple(
                model_cfg, self.batched_decode, self.device, self.batch_rows)

    @contextlib.contextmanager
    def batched_step(self):
        """Inside, on this thread: the Fast layers compute a batched step (padded rows; FBGEMM's packed weights)."""
        previous, _step.multiple = getattr(_step, "multiple", None), self.batch_row_multiple or 1
        try:
            yield
        finally:
            _step.multiple = previous

    def describe(self) -> list[str]:
        """One line per phase, 'decode: float16 (why)', and the batched step's padding."""
        return [f"{phase}: {getattr(self, phase).label} ({getattr(self, phase).reason})" for phase in PHASES] + [
            f"batched rows padded to a multiple of {self.batch_row_multiple or 1} ({self.batch_row_reason})"]

    def to_json(self) -> dict:
        return {**{phase: getattr(self, phase).to_json() for phase in PHASES},
                "batch_row_multiple": self.batch_row_multiple, "batch_row_reason": self.batch_row_reason}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty off Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def choose(config: Config, device: torch.device, flags: frozenset[str] | None = None) -> Kernels:
    """The phases' arithmetic for this config on this device (flags: the CPU's, by default read from /proc)."""
    weights = TORCH_DTYPES[config.inference.dtype]
    own = "the weights' own dtype"
    if device.type != "cpu":
        prefill = decode = batched = Phase(weights, reason=f"{own}: a GPU's tensor cores run it natively")
    elif weights == torch.float32:
        prefill = decode = batched = Phase(weights, reason=f"{own}: no other dtype holds float32 values")
    else:
        flags = cpu_flags() if flags is None else flags
        if any(flag in flags for flag in BFLOAT16_FLAGS):
            prefill = Phase(torch.bfloat16, reason="a bfloat16 copy: the CPU multiplies bfloat16 in hardware "
                                                   f"({' or '.join(BFLOAT16_FLAGS)} among its flags)")
        else:
            m = config.model
            kernel, timing = float32_prefill_kernel(m.hidden_size, m.intermediate_size, device)
            prefill = Phase(torch.float32, kernel, f"a float32 copy: no bfloat16 instructions among the CPU's "
                                                   f"flags; {timing}")
        decode = lone_row_phase(weights, device)
        if "amx_bf16" in flags:
            batched = Phase(torch.bfloat16, reason="a bfloat16 copy: AMX multiplies a few bfloat16 rows at once "
                                                   "(amx_bf16 among the CPU's flags)")
        elif weights == torch.float16 and fbgemm_available(device):
            batched = Phase(torch.float32, "fbgemm", "float32 rows times the float16 weights packed for FBGEMM: "
                                                     "2 bytes read per weight, float32 arithmetic")
        else:
            batched = Phase(weights, reason=f"{own}: torch has no FBGEMM here")
    if config.inference.prefill_dtype != "auto":
        prefill = Phase(TORCH_DTYPES[config.inference.prefill_dtype], reason="pinned by [inference] prefill_dtype")
    if config.inference.weight_dtype == "int8":
        decode = batched = Phase(weights, "int8", "[inference] weight_dtype = \"int8\": torch's int8 weight-only "
                                                  f"kernel, the rest of the step in {dtype_name(weights)}")
    return Kernels(prefill, decode, batched, device, batch_rows=max(2, min(config.server.max_num_seqs, 16)))


def best_seconds(runs: dict, rounds: int = 3) -> dict[str, float]:
    """The best seconds of each of runs (name -> a call), over `rounds` interleaved rounds: a machine whose speed
    drifts weighs on every one alike."""
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


@functools.cache
def lone_row_phase(weights: torch.dtype, device: torch.device) -> Phase:
    """A lone row's arithmetic: the float16 weights through F.linear, or a bfloat16 copy through torch.mv where
    that streams the weights at least COPY_MARGIN faster (on some CPUs twice as fast), timed through a
    TIMED_MATRIX matrix, the best of 3 interleaved runs each (a fraction of a second; once per process)."""
    own = Phase(weights, reason="the weights' own dtype: one row reads every weight once")
    if weights != torch.float16:
        return own
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(*TIMED_MATRIX, generator=generator).to(weights)  # [out, in]
    copy = weight.to(torch.bfloat16)
    x = torch.randn(1, TIMED_MATRIX[1], generator=generator).to(weights)  # [1, in]
    # interleaved, each run reads its own 256 MiB after the other's: neither finds its matrix in a cache
    best = best_seconds({"float16 F.linear": lambda: F.linear(x, weight),
                         "bfloat16 torch.mv": lambda: torch.mv(copy, x[0].bfloat16())})
    timing = (f"timed, one row through a {TIMED_MATRIX[0]} x {TIMED_MATRIX[1]} matrix: "
              + ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in best.items()))
    if best["bfloat16 torch.mv"] * (1 + COPY_MARGIN) < best["float16 F.linear"]:
        return Phase(torch.bfloat16, "matvec", f"a bfloat16 copy through torch.mv, faster by more than "
                                               f"{COPY_MARGIN:.0%}: {timing}")
    return dataclasses.replace(own, reason=f"{own.reason}; {timing}")


@functools.cache
def float32_prefill_kernel(hidden: int, intermediate: int, device: torch.device) -> tuple[str, str]:
    """("onednn" or "torch", the timings): whichever multiplies TIMED_ROWS float32 rows by a gate_proj-shaped
    matrix faster, the best of 3 interleaved runs each (well under a second; once per process)."""
    if not onednn_available(device):
        return "torch", "torch has no oneDNN here"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(intermediate, hidden, generator=generator)  # [out, in]
    x = torch.randn(TIMED_ROWS, hidden, generator=generator)  # [rows, in]
    try:
        best = best_seconds({"torch": lambda: F.linear(x, weight), "onednn": lambda: onednn_linear(x, weight)})
    except (AttributeError, RuntimeError, NotImplementedError):  # a build without oneDNN's float32 product here
        return "torch", "oneDNN's product does not run here"
    kernel = min(best, key=best.get)
    return kernel, (f"timed on {TIMED_ROWS} rows through a {intermediate} x {hidden} matrix: F.linear "
                    f"{best['torch'] * 1e3:.1f} ms, oneDNN {best['onednn'] * 1e3:.1f} ms")


def invariant_row_multiple(cfg: ModelConfig, phase: Phase, device: torch.device, max_rows: int) -> tuple[int, str]:
    """The smallest multiple m (1, 2, 4, 8, 16) such that, with rows padded to a multiple of m, each of 1..max_rows
    rows gets exactly the numbers it gets among max_rows, for every matrix shape of the model, through the batched
    step's kernel; max_rows itself (every step computes as many rows) when none does. An int8 step is not padded
    (the int8 kernel is used for every row count)."""
    if phase.kernel == "int8":
        return 1, "int8 weights: rows are not padded"
    generator = torch.Generator().manual_seed(0)
    products = []
    for out, width in sorted({(min(out, CHECKED_ROWS_MAX), width) for out, width in matrix_shapes(cfg).values()}):
        weight = torch.randn(out, width, generator=generator)
        x = torch.randn(max_rows, width, generator=generator).to(device, phase.dtype)
        if phase.kernel == "fbgemm":
            product = functools.partial(packed_linear, packed=pack_float16(weight))
        else:
            product = functools.partial(F.linear, weight=weight.to(device, phase.dtype))
        products.append((product, x))
    for multiple in (1, 2, 4, 8, 16):
        if multiple > max_rows:
            break
        if all(torch.equal(padded_rows(x[:rows], multiple, product), padded_rows(x, multiple, product)[:rows])
               for product, x in products for rows in range(1, max_rows + 1)):
            return multiple, f"checked: the smallest with which 1..{max_rows} rows round as in a batch"
    return max_rows, f"checked: no multiple up to 16 rounds 1..{max_rows} rows alike; every step computes {max_rows}"
