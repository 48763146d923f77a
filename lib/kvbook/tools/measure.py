"""Measuring the machine, for the bench (kvbook.tools.bench) and chapters 8 and 11: plain read bandwidth, the
kernel table (a matrix-vector product, 8 rows, a 256-row product per kernel), timed products, peak memory and
what the CPU is."""

from __future__ import annotations

import platform
import resource
import time
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

from ..device import synchronize
from ..kernels.choice import LABELS, dtype_name
from ..kernels.layers import fbgemm_available, onednn_available, onednn_linear, pack_float16, packed_linear


def candidates(weight_dtype: torch.dtype) -> list[torch.dtype]:
    """Arithmetic dtypes that hold the weights' values well enough: the weights' own, float32 (exact), and for
    float16 weights bfloat16 (8 bits of mantissa instead of 11)."""
    if weight_dtype == torch.float16:
        return [torch.float16, torch.bfloat16, torch.float32]
    if weight_dtype == torch.bfloat16:
        return [torch.bfloat16, torch.float32]
    return [weight_dtype]


def product_for(weight: torch.Tensor, kernel: str = "torch"):
    """x [rows, in] -> x times weight [out, in] through kernel: "torch" (F.linear), "onednn" (oneDNN's inner
    product) or "fbgemm" (the weight packed once, x float32)."""
    if kernel == "fbgemm":
        return partial(packed_linear, packed=pack_float16(weight))
    if kernel == "onednn":
        return partial(onednn_linear, weight=weight)
    return partial(F.linear, weight=weight)


def _cpuinfo() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ("model name", "cpu family", "model", ...); empty off Linux."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block ends here
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo (Linux) or the platform reports it."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def vector_flags(info: dict[str, str]) -> list[str]:
    """The vector and matrix instruction sets among the CPU's flags (avx*, amx*, fma, f16c), sorted: a virtual
    machine may hide some of its processor's, so family and model do not say which kernels run."""
    return sorted(flag for flag in info.get("flags", "").split()
                  if flag.startswith(("avx", "amx")) or flag in ("fma", "f16c"))


def cpu_identity() -> dict:
    """What decides which kernels run: the CPU (model name, family and model numbers, its vector instruction
    sets), the instruction set torch dispatches to, torch's version and its thread count."""
    info = _cpuinfo()
    return {"cpu": cpu_model(), "family": info.get("cpu family", ""), "model": info.get("model", ""),
            "vector_flags": vector_flags(info), "isa": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


class TimingWeights:
    """Random weights to time products on, made once per measurement: one float32 draw per input width (a matrix of
    fewer rows is a slice of it), and each dtype's copy, or FBGEMM's packing, once per shape. Drawing and packing
    8192 x 11008 weights takes seconds on a slow CPU, and every candidate is timed more than once."""

    def __init__(self, device: torch.device):
        self.device = device
        self._drawn: dict[int, torch.Tensor] = {}  # input width -> float32 [rows, width]
        self._weights: dict[tuple, torch.Tensor] = {}
        self._products: dict[tuple, object] = {}

    def weight(self, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
        """A random [out, in] matrix in dtype (N(0, 1) values, the same for every dtype)."""
        key = (out_features, in_features, dtype)
        if key not in self._weights:
            drawn = self._drawn.get(in_features)
            if drawn is None or drawn.shape[0] < out_features:
                generator = torch.Generator(self.device).manual_seed(in_features)
                drawn = torch.randn(out_features, in_features, device=self.device, generator=generator)
                self._drawn[in_features] = drawn
            self._weights[key] = drawn[:out_features].to(dtype)
        return self._weights[key]

    def product(self, out_features: int, in_features: int, dtype: torch.dtype, kernel: str = "torch"):
        """x [rows, in] -> x times weight(out, in, dtype) through kernel (product_for)."""
        key = (out_features, in_features, dtype, kernel)
        if key not in self._products:
            self._products[key] = product_for(self.weight(out_features, in_features, dtype), kernel)
        return self._products[key]


def peak_rss_mb() -> float:
    """This process's peak resident memory, in MiB: VmHWM, which starts afresh at exec. (getrusage's ru_maxrss
    does not: a worker started by a large process, a notebook's kernel, reported the parent's peak.)"""
    try:
        status = Path("/proc/self/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):  # not Linux: the rusage figure, KiB on Linux and BSD
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_linear(rows: int, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device,
                repeats: int = 5, kernel: str = "torch", weights: TimingWeights | None = None) -> float:
    """Best seconds of [rows, in] times [out, in] in dtype through kernel (product_for; "fbgemm": dtype float32).
    weights: random weights reused between calls (else drawn for this one)."""
    weights = weights or TimingWeights(device)
    x = torch.randn(rows, in_features, device=device).to(dtype)
    product = weights.product(out_features, in_features, dtype, kernel)
    return best_seconds(lambda: product(x), device, repeats)


def best_seconds(run, device: torch.device, repeats: int = 5) -> float:
    """Best seconds of run() over `repeats` calls after a warm-up, the device synchronized around each."""
    best = float("inf")
    for i in range(repeats + 1):  # the first is a warm-up
        synchronize(device)
        started = time.perf_counter()
        run()
        synchronize(device)
        if i:
            best = min(best, time.perf_counter() - started)
    return best


READ_LOOPS = {"torch.sum": lambda data: data.sum(), "torch.dot(x, x)": lambda data: torch.dot(data, data)}


def read_bandwidth_gbps(device: torch.device, gib: float = 1.0, repeats: int = 10) -> dict:
    """The best plain streaming read over `gib` GiB of float32 (no matrix kernel, no dtype's arithmetic): each of
    READ_LOOPS `repeats` times, interleaved; the faster loop's best and median."""
    data = torch.ones(int(gib * 2**30) // 4, device=device)
    times: dict[str, list[float]] = {name: [] for name in READ_LOOPS}
    for i in range(repeats + 1):
        for name, read in READ_LOOPS.items():
            synchronize(device)
            started = time.perf_counter()
            read(data)
            synchronize(device)
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - started)
    fastest = min(times, key=lambda name: min(times[name]))
    best = sorted(times[fastest])
    nbytes = data.numel() * 4
    return {"read_gbps": nbytes / best[0] / 1e9, "read_median_gbps": nbytes / best[len(best) // 2] / 1e9,
            "read_bytes": nbytes, "read_loop": fastest,
            "read_loops_gbps": {name: round(nbytes / min(t) / 1e9, 2) for name, t in times.items()}}


def read_around(device: torch.device, run, repeats: int = 2) -> tuple:
    """(run(), read speed): run between two plain reads, and the faster of them, the memory's speed in run's
    minutes (on a shared virtual machine it moves in phases; BENCHMARKS.md)."""
    before = read_bandwidth_gbps(device, repeats=repeats)["read_gbps"]
    result = run()
    return result, max(before, read_bandwidth_gbps(device, repeats=repeats)["read_gbps"])


KERNEL_MATVEC = (32768, 4096)  # rows x inputs, 256 MiB in float16: far larger than any cache
KERNEL_MATMUL = (256, 4096, 11008)  # prompt rows x inputs x outputs: one gate_proj of prefill


def kernel_specs(device: torch.device, dtypes: list[torch.dtype]) -> list[tuple[str, torch.dtype, str, int]]:
    """(label, dtype of the rows, kernel, bytes per weight) of each kernel kernel_table times: each dtype through
    torch, FBGEMM's float16 kernel where torch has it ("fbgemm-float16": float32 rows, float16 weights) and oneDNN's
    float32 inner product ("onednn-float32")."""
    kernels = [(dtype_name(d), d, "torch", torch.finfo(d).bits // 8) for d in dtypes]
    if fbgemm_available(device):
        kernels.append((LABELS["fbgemm"], torch.float32, "fbgemm", 2))
    if onednn_available(device) and torch.float32 in dtypes:
        kernels.append((LABELS["onednn"], torch.float32, "onednn", 4))
    return kernels


def matmul_gflops(device: torch.device, dtype: torch.dtype, kernel: str = "torch", repeats: int = 2,
                  weights: TimingWeights | None = None) -> float:
    """GFLOP/s of the KERNEL_MATMUL product (256 x 4096 x 11008) in dtype through kernel, the best of repeats."""
    t, k, n = KERNEL_MATMUL
    return 2 * t * k * n / time_linear(t, n, k, dtype, device, repeats, kernel=kernel, weights=weights) / 1e9


def kernel_table(device: torch.device, dtypes: list[torch.dtype], repeats: int = 5) -> dict:
    """Per kernel of kernel_specs: a matrix-vector product and 8 rows over 32768 x 4096 (the weight read's bandwidth),
    and a 256 x 4096 x 11008 matrix product (GFLOP/s). One random draw serves every kernel (TimingWeights)."""
    rows_out, width = KERNEL_MATVEC
    weights = TimingWeights(device)
    # the larger draw first: the product's weight is its slice
    weights.weight(max(rows_out, KERNEL_MATMUL[2]), width, torch.float32)
    table = {}
    for name, dtype, kernel, size in kernel_specs(device, dtypes):
        weight_bytes = rows_out * width * size
        matvec = [time_linear(rows, rows_out, width, dtype, device, repeats, kernel=kernel, weights=weights)
                  for rows in (1, 8)]
        table[name] = {"matvec_gbps": weight_bytes / matvec[0] / 1e9, "rows8_gbps": weight_bytes / matvec[1] / 1e9,
                       "matmul_gflops": matmul_gflops(device, dtype, kernel, max(2, repeats // 2), weights)}
    return table
