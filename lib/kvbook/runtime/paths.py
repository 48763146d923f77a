"""Which dtype each phase computes in: prefill, a lone decode step and a batched decode step.

The weights' values are the article's float16 and stay so. The arithmetic need not be: a CPU may multiply
bfloat16 or float32 copies of the same values faster than float16 ones, and which one wins depends on the CPU
(its vector instructions, oneDNN's kernels for them) and on the phase. Prefill is a matrix product of the prompt's
T rows by every layer matrix (limited by arithmetic); a lone decode step is a matrix-vector product (limited by
how fast the weights stream); a batched step is a product of a few rows. So the engine does not hard-code one
CPU's answer: on a CPU it times each candidate dtype once on the model's own matrix shapes, keeps the fastest per
phase, and caches the choice beside the weights (keyed by the CPU model, its instruction set as torch sees it,
torch's version and thread count, and the shapes). On a GPU the choice is by capability: the weights' dtype, which
tensor cores run natively. A float32 copy holds the float16 values exactly; a bfloat16 copy rounds them to 8 bits
of mantissa (a numeric choice, stated wherever the path is printed). Copies cost memory, counted by the bench.

A batched decode step has one more candidate on an x86 CPU: float32 rows times the float16 weights packed for FBGEMM
(kvbook.model.linear; the kernel "fbgemm", shown as "fbgemm-float16"). It computes in float32 like a float32 copy but
reads 2 bytes per weight. Packing takes seconds for the article's model, so only the batched step, which a
long-running server or batch job builds once, is offered it; a lone step and prefill are built with every engine
(a lone step through the packed weights is faster on some CPUs, but packing costs every process more than a
128-token generation saves; BENCHMARKS.md).
Once a batching scheduler has the packed weights, its prefill may use them too: on some CPUs float32's product
of a few prompt rows is several times slower than FBGEMM's (a 20-token chat prompt), so the measurement also
finds up to how many prompt rows FBGEMM beats prefill's own path (`packed_prefill_rows`; 0: never).

Prefill has one more candidate where torch has oneDNN (its CPU builds): the float32 copy multiplied through oneDNN's
own inner product instead of F.linear ("onednn-float32", kvbook.model.linear). It needs no packing, so every
engine may use it; a lone row and a batched step keep F.linear.

Where prefill's copy is bfloat16 and F.linear in it is oneDNN's product (a CPU with AVX512-BF16), the copy is laid
out once in oneDNN's blocked format instead of on every call (kvbook.model.linear.reorder_copies): the same numbers,
sooner, so it is timed so and is not a separate candidate (reorders_prefill_copy).

A lone decode step has one more candidate: each dtype's weights multiplied by torch's matrix-vector kernel (torch.mv,
"matvec-<dtype>") instead of F.linear's matrix product of one row. On some CPUs F.linear's bfloat16 row
goes through oneDNN's matrix product, which streamed the weights ~20% slower than torch.mv; other CPUs are measured as
they come. Prefill's last position through lm_head is a lone row too, and follows the decode step's choice. Through
the kernel that wins, one row through down_proj (the widest rows) is then timed whole and as column blocks, and the
faster is kept (`split_wide_rows`).

Not a candidate: a lone row through a loop torch.compile (Inductor) writes. It made a decode step faster
than F.linear on an AVX2 CPU, but every process paid ~5 s to import the compiler and load its code, more than the
128 steps of a generation save (BENCHMARKS.md, "Thirteenth session").

[inference] prefill_dtype pins prefill's dtype ("auto" = measured). The appendix ("Making it fast on a CPU") shows
the choice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

from ..config import Config
from ..device import TORCH_DTYPES, synchronize
from ..model.linear import (
    FBGEMM,
    FBGEMM_LABEL,
    MATVEC,
    ONEDNN,
    ONEDNN_LABEL,
    REORDERED,
    column_blocks,
    fbgemm_available,
    fbgemm_serves,
    lone_row_product,
    onednn_available,
    padded_rows,
    product_for,
    reorder_keeps_numbers,
)
from ..model.quant import INT8
from ..model.weights import cache_dir

PHASES = ("prefill", "decode", "batched_decode")
PATHS_VERSION = 11  # bump when what is measured changes, so old choices are measured again
# a copy of the weights must earn its memory: the weights' own dtype is kept unless another is this much faster
COPY_MARGIN = 0.10
MEASURE_ROUNDS = 2  # passes over the candidate dtypes, interleaved
TIMED_ROWS_MAX = 8192  # a timed matrix has at most this many output rows (64 MiB in float16 at 4096 wide)
PREFILL_ROWS_MAX = 64  # prefill is timed on at most this many prompt rows: the same kernels, sooner known
# prompt rows at which prefill's dtype and FBGEMM's packed weights are timed
PACKED_PREFILL_PROBES = (16, 64, 128, 256)
# other processes' share of the machine's CPU time during a measurement above which its choice is not cached: timed
# on a busy machine, a candidate can lose by chance (float16 prefill was once cached that way: a 50 s TTFT)
BUSY_SHARE = 0.25

log = logging.getLogger(__name__)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def matvec_label(dtype: torch.dtype) -> str:
    return f"{MATVEC}-{dtype_name(dtype)}"


def candidates(weight_dtype: torch.dtype) -> list[torch.dtype]:
    """Arithmetic dtypes that hold the weights' values well enough: the weights' own, float32 (exact), and for
    float16 weights bfloat16 (8 bits of mantissa instead of 11)."""
    if weight_dtype == torch.float16:
        return [torch.float16, torch.bfloat16, torch.float32]
    if weight_dtype == torch.bfloat16:
        return [torch.bfloat16, torch.float32]
    return [weight_dtype]


@dataclasses.dataclass(frozen=True)
class PhasePath:
    """One phase's arithmetic: its dtype (the activations'), its kernel ("torch": F.linear on the weights or their
    copy in dtype; "fbgemm": float32 rows times the float16 weights packed for FBGEMM; "onednn": F.linear replaced by
    oneDNN's inner product for several rows (prefill's float32 copy); "matvec": a lone row through torch.mv on the
    weights or their copy in dtype; "int8": the int8 matrices of kvbook.model.quant, dtype being that of the rest of
    the step), why, and the estimate per candidate that decided it."""

    dtype: torch.dtype
    reason: str
    estimated_ms: dict[str, float] = dataclasses.field(default_factory=dict)  # candidate label -> the matrices' ms
    kernel: str = "torch"

    @property
    def label(self) -> str:
        """'float16', 'bfloat16', 'float32', 'fbgemm-float16' (float32 rows, float16 weights packed for FBGEMM),
        'onednn-float32' (the float32 copy through oneDNN's inner product), 'matvec-bfloat16' (one row through
        torch.mv; any dtype) or 'int8' (int8 weights, kvbook.model.quant)."""
        if self.kernel == MATVEC:
            return matvec_label(self.dtype)
        return {FBGEMM: FBGEMM_LABEL, ONEDNN: ONEDNN_LABEL, INT8: INT8}.get(self.kernel, dtype_name(self.dtype))

    def to_json(self) -> dict:
        return {"dtype": dtype_name(self.dtype), "kernel": self.kernel, "label": self.label, "reason": self.reason,
                "estimated_ms": self.estimated_ms}


@dataclasses.dataclass(frozen=True)
class ComputePaths:
    prefill: PhasePath
    decode: PhasePath
    batched_decode: PhasePath
    source: str  # "measured", "cached", "capability" or "fixed"
    measured_s: float = 0.0  # time the measurement took (0 when read from the cache)
    split_wide_rows: bool = False  # a lone row reads down_proj as column blocks (kvbook.model.linear)
    split_reason: str = "not measured"
    batch_row_multiple: int = 1  # batched rows padded to a multiple of this (kvbook.model.linear.batch_invariant_rows)
    batch_row_reason: str = "not measured"
    others_cpu_share: float | None = None  # other processes' share of the CPUs while measuring (None: unknown)
    # a batching scheduler's prefill pass of at most this many rows multiplies by the batched step's packed weights
    # (kvbook.runtime.engine.Engine.prefill_path_for; 0: never)
    packed_prefill_rows: int = 0
    packed_prefill_reason: str = "not measured"

    def to_json(self) -> dict:
        return {"source": self.source, "measured_s": round(self.measured_s, 3),
                **{phase: getattr(self, phase).to_json() for phase in PHASES},
                "split_wide_rows": self.split_wide_rows, "split_reason": self.split_reason,
                "batch_row_multiple": self.batch_row_multiple, "batch_row_reason": self.batch_row_reason,
                "packed_prefill_rows": self.packed_prefill_rows, "packed_prefill_reason": self.packed_prefill_reason,
                "others_cpu_share": self.others_cpu_share}

    def describe(self) -> list[str]:
        """One line per phase: 'decode: float32 (measured, one row ...)'."""
        return [f"{phase}: {getattr(self, phase).label} ({getattr(self, phase).reason})"
                for phase in PHASES] + [f"down_proj as column blocks for one row: "
                                        f"{'yes' if self.split_wide_rows else 'no'} ({self.split_reason})",
                                        f"batched rows padded to a multiple of {self.batch_row_multiple} "
                                        f"({self.batch_row_reason})",
                                        f"a batching scheduler's prefill through the packed weights: "
                                        f"{self._packed_prefill_rule()} ({self.packed_prefill_reason})"]

    def _packed_prefill_rule(self) -> str:
        if self.packed_prefill_rows <= 0:
            return "no"
        return f"prompt passes of up to {self.packed_prefill_rows} rows"

    def dtypes(self) -> set[torch.dtype]:
        return {getattr(self, phase).dtype for phase in PHASES}


def fixed_paths(prefill: torch.dtype, decode: torch.dtype, batched: torch.dtype, reason: str = "fixed",
                batch_row_multiple: int = 1, batched_kernel: str = "torch",
                prefill_kernel: str = "torch", decode_kernel: str = "torch") -> ComputePaths:
    """Paths chosen by the caller (tests, or a machine where nothing needs measuring); batched_kernel FBGEMM and
    prefill_kernel ONEDNN need float32 for their phase; decode_kernel MATVEC runs in any."""
    return ComputePaths(PhasePath(prefill, reason, kernel=prefill_kernel),
                        PhasePath(decode, reason, kernel=decode_kernel),
                        PhasePath(batched, reason, kernel=batched_kernel), "fixed",
                        batch_row_multiple=batch_row_multiple, batch_row_reason=reason)


def int8_decode_paths(paths: ComputePaths, activation_dtype: torch.dtype) -> ComputePaths:
    """An int8 model's decode steps, alone or batched, read its int8 matrices (kvbook.model.quant) whatever was
    measured for floating weights; each phase keeps its dtype for the rest of the step (norms, attention)."""
    def int8(path: PhasePath) -> PhasePath:
        return PhasePath(path.dtype, f"[inference] weight_dtype = \"int8\": {dtype_name(activation_dtype)} rows "
                                     f"through torch's int8 weight-only kernel, the rest of the step in "
                                     f"{dtype_name(path.dtype)}", kernel=INT8)
    return dataclasses.replace(paths, decode=int8(paths.decode), batched_decode=int8(paths.batched_decode),
                               split_wide_rows=False,
                               split_reason="int8 weights: a lone row reads each int8 matrix whole",
                               packed_prefill_rows=0, packed_prefill_reason="int8 weights: nothing is packed")


# ---- what the machine is -----------------------------------------------------------------------------------

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
    """The vector and matrix instruction sets among the CPU's flags (avx*, amx*, fma, f16c), sorted.

    A virtual machine may hide some of its processor's: two CPUs that report the same family and model ran
    bfloat16 products through AMX on one and without it on the other, where float32 prefill was 3.8 x faster than
    bfloat16 (BENCHMARKS.md, "twenty-second session"), and torch names both "AVX512"."""
    return sorted(flag for flag in info.get("flags", "").split()
                  if flag.startswith(("avx", "amx")) or flag in ("fma", "f16c"))


def cpu_identity() -> dict:
    """What decides which kernels run: the CPU (model name, family and model numbers, its vector instruction
    sets), the instruction set torch dispatches to, torch's version and its thread count."""
    info = _cpuinfo()
    return {"cpu": cpu_model(), "family": info.get("cpu family", ""), "model": info.get("model", ""),
            "vector_flags": vector_flags(info), "isa": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process has used since boot, from /proc/stat (None off Linux)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OthersLoad:
    """Measures, over a with-block, the share of the machine's CPUs that other processes used (0: a quiet
    machine, 1: every CPU busy with something else); share is None where /proc/stat is missing."""

    def __enter__(self):
        self.share = None
        self._start = (_busy_cpu_seconds(), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *exc):
        busy, own, wall = self._start
        if busy is not None:
            others = (_busy_cpu_seconds() - busy) - (time.process_time() - own)
            self.share = round(max(0.0, others) / ((time.perf_counter() - wall) * (os.cpu_count() or 1)), 3)
        return False


def paths_cache_dir() -> Path:
    """Beside the weights' cache ($XDG_CACHE_HOME/kvbook/paths): one measurement per machine, like the weights."""
    return cache_dir().parent / "paths"


# ---- measuring ---------------------------------------------------------------------------------------------

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
        """x [rows, in] -> x times weight(out, in, dtype) through kernel (kvbook.model.linear.product_for)."""
        key = (out_features, in_features, dtype, kernel)
        if key not in self._products:
            self._products[key] = product_for(self.weight(out_features, in_features, dtype), kernel)
        return self._products[key]


def time_linear(rows: int, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device,
                repeats: int = 5, split: int = 0, give_up_s: float = float("inf"), kernel: str = "torch",
                weights: TimingWeights | None = None) -> float:
    """Best seconds of F.linear([rows, in], [out, in]) in dtype; kernel FBGEMM: float32 rows times the float16 weight
    packed (dtype is then float32), MATVEC: one row through torch.mv; split > 0 (one row, F.linear or MATVEC): the
    weight as column blocks of at most `split` inputs, summed (kvbook.model.linear). A warm-up slower than
    give_up_s is not repeated (a dtype that has already lost).
    weights: the measurement's random weights, reused between calls (else drawn for this one)."""
    weights = weights or TimingWeights(device)
    x = torch.randn(rows, in_features, device=device).to(dtype)
    if split and in_features > split:
        weight = weights.weight(out_features, in_features, dtype)
        blocks = column_blocks(weight, split)
        def run():
            return lone_row_product(x, weight, blocks, through_matvec=kernel == MATVEC)
    else:
        product = weights.product(out_features, in_features, dtype, kernel)
        def run():
            return product(x)
    return best_seconds(run, device, repeats, give_up_s)


def best_seconds(run, device: torch.device, repeats: int = 5, give_up_s: float = float("inf")) -> float:
    """Best seconds of run() over `repeats` calls after a warm-up, the device synchronized around each. A warm-up
    slower than give_up_s is returned at once, not repeated."""
    best = float("inf")
    for i in range(repeats + 1):  # the first is a warm-up
        synchronize(device)
        started = time.perf_counter()
        run()
        synchronize(device)
        elapsed = time.perf_counter() - started
        if i == 0 and elapsed > give_up_s:
            return elapsed
        if i:
            best = min(best, elapsed)
    return best


def matrix_groups(config: Config, lm_head: bool) -> list[tuple[tuple[int, int], int]]:
    """The weight matrices a forward pass multiplies by, grouped by input width: [((out, in) of one real matrix
    of that width, parameters of the group)]. A matrix's rows are independent, so the group's time is the timed
    matrix's time scaled by parameters."""
    m = config.model
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    layers = m.num_hidden_layers
    groups: dict[int, list] = {}

    def add(shape: tuple[int, int], params: int) -> None:
        if shape[1] in groups:  # o_proj's input is as wide as the hidden state in the article's shapes
            groups[shape[1]][1] += params
        else:
            groups[shape[1]] = [shape, params]

    add((m.intermediate_size, m.hidden_size), layers * (q + 2 * kv + 2 * m.intermediate_size) * m.hidden_size)
    add((m.hidden_size, q), layers * m.hidden_size * q)
    add((m.hidden_size, m.intermediate_size), layers * m.hidden_size * m.intermediate_size)
    if lm_head:
        add((m.vocab_size, m.hidden_size), m.vocab_size * m.hidden_size)
    return [(tuple(shape), params) for shape, params in groups.values()]


def estimate_ms(config: Config, rows: int, dtype: torch.dtype, device: torch.device, lm_head: bool,
                repeats: int = 3, kernel: str = "torch", weights: TimingWeights | None = None) -> float:
    """Milliseconds of every layer matrix (and lm_head) multiplied by `rows` rows, from one timed matrix per
    input width (as many output rows as the model has at that width, at most TIMED_ROWS_MAX)."""
    total = 0.0
    for (_, width), params in matrix_groups(config, lm_head):
        out = max(1, min(params // width, TIMED_ROWS_MAX))
        total += time_linear(rows, out, width, dtype, device, repeats, kernel=kernel, weights=weights) * params / (
            out * width)
    return total * 1e3


def reorders_prefill_copy(config: Config, dtype: torch.dtype, kernel: str, device: torch.device) -> bool:
    """Whether a prefill that multiplies through F.linear (kernel "torch") in dtype has its copy laid out once for
    oneDNN (kvbook.model.linear.reorder_copies): a copy (not the weights themselves), on a CPU where that gives
    F.linear's numbers bit for bit. Prefill is timed so; the engine does so when no other phase computes in dtype."""
    return (kernel == "torch" and device.type == "cpu" and dtype != TORCH_DTYPES[config.inference.dtype]
            and reorder_keeps_numbers(dtype))


def estimate_prefill_ms(config: Config, rows: int, dtype: torch.dtype, device: torch.device,
                        best_ms: float = float("inf"), weights: TimingWeights | None = None,
                        kernel: str = "torch") -> float:
    """Prefill's layer matrices for `rows` prompt rows, from one timed gate_proj (at most TIMED_ROWS_MAX of its
    rows: the products are limited by arithmetic, whose rate hardly depends on the matrix's size). best_ms: the
    best estimate so far; a dtype whose first product already takes 3 times as long is not timed again. F.linear's
    copy is timed reordered where the engine will reorder it (reorders_prefill_copy)."""
    if reorders_prefill_copy(config, dtype, kernel, device):
        kernel = REORDERED
    m = config.model
    params = sum(params for _, params in matrix_groups(config, lm_head=False))
    out = max(1, min(params // m.hidden_size, m.intermediate_size, TIMED_ROWS_MAX))
    scale = params / (out * m.hidden_size)
    seconds = time_linear(rows, out, m.hidden_size, dtype, device, repeats=2, give_up_s=3 * best_ms / 1e3 / scale,
                          weights=weights, kernel=kernel)
    return seconds * scale * 1e3


def time_wide_rows(config: Config, dtype: torch.dtype, device: torch.device, weights: TimingWeights | None = None,
                   kernel: str = "torch") -> tuple[float, float] | None:
    """One row through down_proj's shape and a lone row's kernel (F.linear, or MATVEC), as one matrix and as column
    blocks (kvbook.model.linear.SPLIT_WIDTH wide), interleaved: (plain ms, split ms), the best of each, or None when
    no matrix is that wide."""
    from ..model.linear import SPLIT_WIDTH

    m = config.model
    if m.intermediate_size <= SPLIT_WIDTH:
        return None
    plain, split = float("inf"), float("inf")
    for _ in range(MEASURE_ROUNDS):
        plain = min(plain, time_linear(1, m.hidden_size, m.intermediate_size, dtype, device, weights=weights,
                                       kernel=kernel))
        split = min(split, time_linear(1, m.hidden_size, m.intermediate_size, dtype, device, split=SPLIT_WIDTH,
                                       weights=weights, kernel=kernel))
    return plain * 1e3, split * 1e3


def matrix_shapes(config: Config) -> list[tuple[int, int]]:
    """Every distinct (out, in) shape of the weight matrices a decode step multiplies by, lm_head's included, with
    at most TIMED_ROWS_MAX output rows (the kernels measured so far change their rounding between 256 and 4096)."""
    m = config.model
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    shapes = [(q, m.hidden_size), (kv, m.hidden_size), (m.hidden_size, q), (m.intermediate_size, m.hidden_size),
              (m.hidden_size, m.intermediate_size), (m.vocab_size, m.hidden_size)]
    return sorted({(min(out, TIMED_ROWS_MAX), width) for out, width in shapes})


def invariant_row_multiple(config: Config, dtype: torch.dtype, device: torch.device, max_rows: int,
                           kernel: str = "torch") -> tuple[int, str]:
    """The smallest multiple m (1, 2, 4, 8, 16) such that, with rows padded to a multiple of m, each of 1..max_rows
    rows gets exactly the numbers it gets among max_rows, for every matrix shape of the model (matrix_shapes),
    through the batched step's kernel; max_rows itself (every step computes as many rows) when none does. The output
    count matters: on some CPUs bfloat16 rounds one row as in a batch against 256 output rows and not
    against 4096."""
    generator = torch.Generator().manual_seed(0)
    products = [(product_for(torch.randn(out, width, generator=generator).to(device, dtype), kernel),
                 torch.randn(max_rows, width, generator=generator).to(device, dtype))
                for out, width in matrix_shapes(config)]

    for multiple in (1, 2, 4, 8, 16):
        if multiple > max_rows:
            break
        if all(torch.equal(padded_rows(x[:rows], multiple, product), padded_rows(x, multiple, product)[:rows])
               for product, x in products for rows in range(1, max_rows + 1)):
            return multiple, f"measured: the smallest with which 1..{max_rows} rows round as in a batch"
    return max_rows, f"measured: no multiple up to 16 rounds 1..{max_rows} rows alike; every step computes {max_rows}"


def _batch_rows(config: Config) -> int:
    """Rows a batched step is measured with: the server's max_num_seqs, at least 2 and at most 16."""
    return max(2, min(config.server.max_num_seqs, 16))


def _summary(estimates: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.1f} ms" for name, ms in sorted(estimates.items(), key=lambda kv: kv[1]))


def measure_paths(config: Config, device: torch.device) -> ComputePaths:
    """Time every candidate dtype on this model's matrix shapes, per phase (seconds on a CPU, once per machine),
    noting how busy other processes kept the machine meanwhile."""
    with OthersLoad() as load:
        paths = _measure_paths(config, device)
    return dataclasses.replace(paths, others_cpu_share=load.share)


def _measure_paths(config: Config, device: torch.device) -> ComputePaths:
    started = time.perf_counter()
    weight_dtype = TORCH_DTYPES[config.inference.dtype]
    kernels = {dtype_name(d): (d, "torch") for d in candidates(weight_dtype)}  # label -> (dtype, kernel)
    batched_kernels = dict(kernels)
    if fbgemm_serves(weight_dtype, device):
        batched_kernels[FBGEMM_LABEL] = (torch.float32, FBGEMM)
    prefill_kernels = dict(kernels)
    if onednn_available(device):  # float32 is a candidate for every weight dtype the config allows
        prefill_kernels[ONEDNN_LABEL] = (torch.float32, ONEDNN)
    decode_kernels = dict(kernels)
    decode_kernels.update({matvec_label(d): (d, MATVEC) for d in candidates(weight_dtype)})
    prefill_rows = min(config.inference.input_len, PREFILL_ROWS_MAX)
    batch_rows = _batch_rows(config)
    timing = TimingWeights(device)
    phases = {
        "prefill": (f"{prefill_rows} prompt rows through the layers", prefill_kernels,
                    lambda dtype, kernel, best: estimate_prefill_ms(config, prefill_rows, dtype, device, best,
                                                                    weights=timing, kernel=kernel)),
        "decode": ("one row through the layers and lm_head", decode_kernels,
                   lambda dtype, kernel, best: estimate_ms(config, 1, dtype, device, lm_head=True, kernel=kernel,
                                                           weights=timing)),
        "batched_decode": (f"{batch_rows} rows through the layers and lm_head", batched_kernels,
                           lambda dtype, kernel, best: estimate_ms(config, batch_rows, dtype, device, lm_head=True,
                                                                   kernel=kernel, weights=timing)),
    }
    chosen = {}
    for phase, (what, options, estimate) in phases.items():
        estimates: dict[str, float] = {}
        for _ in range(MEASURE_ROUNDS):  # candidates interleaved, the best of each kept: a machine whose speed
            for label, (dtype, kernel) in options.items():  # drifts (other processes) weighs on every one alike
                best_so_far = min(estimates.values(), default=float("inf"))
                estimates[label] = min(estimates.get(label, float("inf")), estimate(dtype, kernel, best_so_far))
        best = min(estimates, key=estimates.get)
        # the fastest candidate that computes in the weights' own dtype (F.linear, or torch.mv for a lone row)
        own = min((label for label, (dtype, _) in options.items() if dtype == weight_dtype), key=estimates.get)
        note = ""
        if options[best][0] != weight_dtype and estimates[own] <= (1 + COPY_MARGIN) * estimates[best]:
            best, note = own, f"; the weights' own dtype, within {COPY_MARGIN:.0%} of the fastest, needs no copy"
        dtype, kernel = options[best]
        chosen[phase] = PhasePath(dtype, f"measured, {what}: {_summary(estimates)}{note}",
                                  {k: round(v, 3) for k, v in estimates.items()}, kernel)
    split, split_reason = False, "no matrix is wider than the split width"
    decode = chosen["decode"]
    if (wide := time_wide_rows(config, decode.dtype, device, timing, decode.kernel)) is not None:
        split = wide[1] < wide[0]
        split_reason = (f"measured, one row through down_proj, {decode.label}: as blocks {wide[1]:.2f} ms, "
                        f"whole {wide[0]:.2f} ms")
    batched = chosen["batched_decode"]
    multiple, multiple_reason = invariant_row_multiple(config, batched.dtype, device, batch_rows, batched.kernel)
    packed_rows, packed_reason = 0, "the batched step does not pack its weights"
    if batched.kernel == FBGEMM:
        packed_rows, packed_reason = packed_prefill_rows(config, chosen["prefill"], device, timing)
    return ComputePaths(chosen["prefill"], chosen["decode"], batched, "measured",
                        time.perf_counter() - started, split, split_reason, multiple, multiple_reason,
                        packed_prefill_rows=packed_rows, packed_prefill_reason=packed_reason)


def packed_prefill_rows(config: Config, prefill: PhasePath, device: torch.device,
                        weights: TimingWeights | None = None) -> tuple[int, str]:
    """Up to how many prompt rows FBGEMM's packed float16 weights multiply faster than prefill's path, timed at
    PACKED_PREFILL_PROBES rows (capped by the model's positions): the largest probe at and below which FBGEMM
    always won, every length when it won at the largest probe, 0 when it lost at the smallest (or a longer
    prompt's product would have to be extrapolated: FBGEMM's lead shrinks with the rows on some CPUs)."""
    limit = config.model.max_position_embeddings
    probes = sorted({min(rows, limit) for rows in PACKED_PREFILL_PROBES})
    rows_won, timings = 0, []
    for rows in probes:
        own = estimate_prefill_ms(config, rows, prefill.dtype, device, weights=weights, kernel=prefill.kernel)
        packed = estimate_prefill_ms(config, rows, torch.float32, device, weights=weights, kernel=FBGEMM)
        timings.append(f"{rows} rows {FBGEMM_LABEL} {packed:.1f} ms, {prefill.label} {own:.1f} ms")
        if packed >= own:
            break
        rows_won = rows
    if rows_won == probes[-1]:
        rows_won = limit
    return rows_won, "measured, prompt rows through the layers: " + "; ".join(timings)


def _cache_path(config: Config) -> Path:
    m = config.model
    key = {"machine": cpu_identity(), "version": PATHS_VERSION, "dtype": config.inference.dtype,
           "shapes": [m.num_hidden_layers, m.hidden_size, m.num_attention_heads, m.num_key_value_heads,
                      m.head_dim, m.intermediate_size, m.vocab_size],
           "prefill_rows": min(config.inference.input_len, PREFILL_ROWS_MAX),
           "batch_rows": _batch_rows(config)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return paths_cache_dir() / f"paths-{digest}.json"


def _from_json(data: dict, source: str) -> ComputePaths:
    phases = {phase: PhasePath(TORCH_DTYPES[data[phase]["dtype"]], data[phase]["reason"],
                               data[phase].get("estimated_ms", {}), data[phase]["kernel"]) for phase in PHASES}
    return ComputePaths(**phases, source=source, measured_s=0.0, split_wide_rows=data["split_wide_rows"],
                        split_reason=data["split_reason"], batch_row_multiple=data["batch_row_multiple"],
                        batch_row_reason=data["batch_row_reason"], others_cpu_share=data.get("others_cpu_share"),
                        packed_prefill_rows=data["packed_prefill_rows"],
                        packed_prefill_reason=data["packed_prefill_reason"])


def choose_paths(config: Config, device: torch.device, progress: bool = False) -> ComputePaths:
    """The paths for this config on this device: by capability on a GPU, else measured once per machine (and
    cached); [inference] prefill_dtype other than "auto" pins prefill. progress: say on stderr, before and after,
    that a measurement runs (half a minute for the article's model on 2 cores; a notebook keeps the two lines in the
    cell that asked)."""
    weight_dtype = TORCH_DTYPES[config.inference.dtype]
    pinned = config.inference.prefill_dtype
    if device.type != "cpu" or len(candidates(weight_dtype)) == 1:
        reason = "capability: the GPU's tensor cores run the weights' dtype natively" if device.type != "cpu" \
            else "the weights' dtype (no other holds float32 values)"
        # a few small products at the model's widths: milliseconds, not cached (a GPU's library, too, may pick
        # another kernel for another row count)
        multiple, multiple_reason = invariant_row_multiple(config, weight_dtype, device, _batch_rows(config))
        paths = ComputePaths(PhasePath(weight_dtype, reason), PhasePath(weight_dtype, reason),
                             PhasePath(weight_dtype, reason), "capability", batch_row_multiple=multiple,
                             batch_row_reason=multiple_reason)
    else:
        path = _cache_path(config)
        try:
            paths = _from_json(json.loads(path.read_text()), "cached")
        except (OSError, ValueError, KeyError):
            if progress:
                print("kvbook: timing each phase's candidate kernels on this CPU (once per machine and model "
                      "shape) ...", file=sys.stderr, flush=True)
            paths = measure_paths(config, device)
            if progress:
                print(f"kvbook: timed in {paths.measured_s:.0f} s: prefill {paths.prefill.label}, decode "
                      f"{paths.decode.label}, batched decode {paths.batched_decode.label}", file=sys.stderr, flush=True)
            if (paths.others_cpu_share or 0.0) > BUSY_SHARE:
                log.warning("other processes used %.0f%% of the CPUs while kvbook timed its compute paths: the choice "
                            "is used by this process only and measured again next time", 100 * paths.others_cpu_share)
                paths = dataclasses.replace(paths, source="measured on a busy machine, not cached")
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_suffix(f".partial-{os.getpid()}")
                partial.write_text(json.dumps({"machine": cpu_identity(), **paths.to_json()}, indent=1))
                os.replace(partial, path)
    if pinned != "auto":
        pinned_reason = "pinned by [inference] prefill_dtype"
        paths = dataclasses.replace(paths, prefill=PhasePath(TORCH_DTYPES[pinned], pinned_reason),
                                    packed_prefill_rows=0, packed_prefill_reason=f"prefill {pinned_reason}")
    return paths


# ---- the machine's own numbers, for the bench's floors and its kernel table --------------------------------

# the plain reads: each reads every byte of its data once and does next to no arithmetic per byte, so neither is
# limited by a kernel's arithmetic. Which streams faster depends on the CPU (BENCHMARKS.md), so both
# run
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
        kernels.append((FBGEMM_LABEL, torch.float32, FBGEMM, 2))
    if onednn_available(device) and torch.float32 in dtypes:
        kernels.append((ONEDNN_LABEL, torch.float32, ONEDNN, 4))
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
