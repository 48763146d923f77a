"""The kernels that could read int8 weights on this machine, against floating ones and a plain read (issue 17).

    flock /tmp/kvbook-heavy.lock .venv/bin/python scripts/quant_kernels.py [--json]

Best of 10 calls each (after one warm-up), in GB/s of weight bytes read (the int8 matrix: 1 byte per weight):
torch's int8 weight-only kernel with bfloat16, float16 and float32 rows, 1 and 8 rows, over a 32768 x 4096 matrix;
the floating matrix-vector products over the same shape; a plain read (sum over 1 GiB of float32); and for
prefill, a 256-row product against 4096 x 11008 as a bfloat16 matrix product, through the int8 kernel, and the
cost of dequantizing that matrix per call. Results go to BENCHMARKS.md ("int8").

Also the candidate the engine does not use: FBGEMM's W8A8 product (`quantized::linear_dynamic`), which quantizes
the activations to 8 bits on the fly (7 with reduce_range, which x86 CPUs without VNNI need so that vpmaddubsw's
int16 pair sums cannot saturate), with one scale for the whole input, so a row's result also depends on its batch.
Issue 17 asks for activations that stay floating point, so its speed is printed beside the relative error it costs
on one 4096 x 4096 product, with and without a few outlier activations (trained models have them; random ones do
not)."""

import json
import sys
import warnings

import torch
from kvbook.runtime.paths import best_seconds as paths_best_seconds
from torch.nn import functional as F

CPU = torch.device("cpu")


def best_seconds(fn, repeats: int = 10) -> float:
    """Best of `repeats` calls after a warm-up (kvbook.runtime.paths' timer, on the CPU)."""
    return paths_best_seconds(fn, CPU, repeats)


def fbgemm_w8a8(weight: torch.Tensor, scale: torch.Tensor):
    """Pack a float32 weight for FBGEMM's W8A8 product with per-output-channel int8 scales."""
    with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated; the pinned torch has them
        warnings.simplefilter("ignore", UserWarning)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        quantized = torch.quantize_per_channel(weight, scale.double(), zero_points, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(quantized, None)


def w8a8_candidate(rows: int, cols: int) -> dict:
    results = {}
    packed = fbgemm_w8a8(torch.randn(rows, cols), torch.full((rows,), 4.5 / 127))
    x = torch.randn(1, cols)
    seconds = best_seconds(lambda: torch.ops.quantized.linear_dynamic(x, packed, True))
    results["W8A8 (FBGEMM linear_dynamic), float32 rows x 1"] = {"GB/s": rows * cols / seconds / 1e9,
                                                                  "ms": seconds * 1e3}
    weight = torch.randn(4096, 4096) * 0.02
    scale = weight.abs().amax(1) / 127
    dequantized = torch.round(weight / scale[:, None]).clamp(-127, 127) * scale[:, None]
    int8_rows = torch.round(weight / scale[:, None]).to(torch.int8)
    packed = fbgemm_w8a8(weight, scale)
    x = torch.randn(1, 4096)
    with_outliers = x.clone()
    with_outliers[0, :4] *= 30
    for name, rows_in in (("gaussian row", x), ("row with 4 outliers x30", with_outliers)):
        exact = rows_in @ weight.T

        def error(y, exact=exact):
            return ((y.float() - exact).norm() / exact.norm()).item()

        results[f"relative error, {name}"] = {
            "int8 weight-only, bf16 rows": error(torch.ops.aten._weight_int8pack_mm(rows_in.bfloat16(), int8_rows,
                                                                                     scale.bfloat16())),
            "int8 weight-only, f32 rows": error(rows_in @ dequantized.T),
            "W8A8, 7-bit rows": error(torch.ops.quantized.linear_dynamic(rows_in, packed, True)),
            "W8A8, 8-bit rows": error(torch.ops.quantized.linear_dynamic(rows_in, packed, False)),
        }
    return results


def main() -> dict:
    rows, cols = 32768, 4096
    results = {}
    with torch.inference_mode():
        data = torch.randn(2**28)  # 1 GiB of float32
        results["plain read (sum of 1 GiB float32)"] = {"GB/s": data.nbytes / best_seconds(data.sum) / 1e9}
        del data
        q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            scale = torch.rand(rows, dtype=dtype) * 0.01 + 0.001
            for batch in (1, 8):
                x = torch.randn(batch, cols, dtype=dtype)
                seconds = best_seconds(lambda x=x, scale=scale: torch.ops.aten._weight_int8pack_mm(x, q, scale))
                results[f"int8 weights, {dtype} rows x {batch}"] = {"GB/s": q.nbytes / seconds / 1e9,
                                                                     "ms": seconds * 1e3}
        results.update(w8a8_candidate(rows, cols))
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            weight = torch.randn(rows, cols, dtype=dtype)
            for batch in (1, 8):
                x = torch.randn(batch, cols, dtype=dtype)
                seconds = best_seconds(lambda x=x, weight=weight: F.linear(x, weight))
                results[f"{dtype} weights, rows x {batch}"] = {"GB/s": weight.nbytes / seconds / 1e9,
                                                               "ms": seconds * 1e3}
            del weight
        # prefill: 256 rows against one MLP matrix
        q = torch.randint(-127, 128, (11008, 4096), dtype=torch.int8)
        scale = torch.rand(11008, dtype=torch.bfloat16) * 0.01
        x = torch.randn(256, 4096, dtype=torch.bfloat16)
        flops = 2 * 256 * 4096 * 11008
        seconds = best_seconds(lambda: q.float().mul_(scale.float()[:, None]).to(torch.bfloat16), 3)
        results["dequantize 11008 x 4096 int8 -> bfloat16"] = {"ms": seconds * 1e3}
        for dtype in (torch.bfloat16, torch.float32):
            weight = q.to(dtype)
            seconds = best_seconds(lambda weight=weight: F.linear(x.to(weight.dtype), weight), 3)
            results[f"prefill 256 x 4096 x 11008, {dtype} matrix product"] = {"GFLOP/s": flops / seconds / 1e9,
                                                                               "ms": seconds * 1e3}
        seconds = best_seconds(lambda: torch.ops.aten._weight_int8pack_mm(x, q, scale), 3)
        results["prefill 256 x 4096 x 11008, int8 kernel, bfloat16 rows"] = {"GFLOP/s": flops / seconds / 1e9,
                                                                             "ms": seconds * 1e3}
    return results


if __name__ == "__main__":
    torch.manual_seed(0)
    table = main()
    if "--json" in sys.argv:
        print(json.dumps(table, indent=1))
    else:
        for name, values in table.items():
            print(f"{name:58s}" + "  ".join(f"{value:9.4g} {unit}" for unit, value in values.items()))
