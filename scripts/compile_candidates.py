"""torch.compile (Inductor's CPU code generation) as a candidate for the decode step's matrix-vector products
(issues 13 and 17): a fused int8 dequantize-and-reduce, and a float16 one, against torch's own kernels, on one
32768 x 4096 matrix and one row. GB/s of weight bytes read, best of 10. Results: BENCHMARKS.md ("int8").

    flock /tmp/kvbook-heavy.lock .venv/bin/python scripts/compile_candidates.py
"""

import time

import torch
from kvbook.runtime.paths import best_seconds
from torch.nn import functional as F

N, K = 32768, 4096


def best(f, *args, n=10):
    """Best seconds of f(*args) over n calls after a warm-up (kvbook.runtime.paths' timer, on the CPU)."""
    return best_seconds(lambda: f(*args), torch.device("cpu"), n)


def compiled(f, *args):
    started = time.perf_counter()
    g = torch.compile(f, dynamic=False)
    g(*args)
    return g, time.perf_counter() - started


def int8_reduce(w, s, x):  # [N, K] int8, [N], [1, K] -> [N]: dequantize and reduce in one loop
    return (w.to(torch.float32) * x).sum(-1) * s


def int8_blocked(w, s, x):  # the same, reduced in blocks of 64 inputs
    return (w.view(N, K // 64, 64).to(torch.float32) * x.view(1, K // 64, 64)).sum(-1).sum(-1) * s


def int8_product(w, s, x):  # dequantize, then a matrix product
    return (x @ w.to(torch.float32).T) * s


def float16_reduce(w, x):
    return (w.to(torch.float32) * x).sum(-1)


def main():
    data = torch.randn(1 << 28)
    print(f"plain read (sum over 1 GiB float32): {data.numel() * 4 / best(torch.sum, data) / 1e9:.1f} GB/s")
    del data
    w8 = torch.randint(-127, 127, (N, K), dtype=torch.int8)
    scale = torch.rand(N)
    w16 = torch.randn(N, K, dtype=torch.float16)
    x = torch.randn(1, K)
    for name, f in [("int8, one reduction", int8_reduce), ("int8, blocks of 64", int8_blocked),
                    ("int8, dequantize + product", int8_product)]:
        g, seconds = compiled(f, w8, scale, x)
        print(f"compiled {name}: {N * K / best(g, w8, scale, x) / 1e9:.2f} GB/s (compiled in {seconds:.1f} s)")
    g, seconds = compiled(float16_reduce, w16, x)
    print(f"compiled float16 reduction: {N * K * 2 / best(g, w16, x) / 1e9:.2f} GB/s (compiled in {seconds:.1f} s)")
    print(f"F.linear float16: {N * K * 2 / best(F.linear, x.half(), w16) / 1e9:.2f} GB/s")
    print(f"F.linear bfloat16: {N * K * 2 / best(F.linear, x.bfloat16(), w16.bfloat16()) / 1e9:.2f} GB/s")
    half = w16[:N // 2].float()  # float32, half the rows: the same bytes as float16
    print(f"F.linear float32: {N // 2 * K * 4 / best(F.linear, x, half) / 1e9:.2f} GB/s")
    int8pack = torch.ops.aten._weight_int8pack_mm
    seconds = best(int8pack, x.bfloat16(), w8, scale.bfloat16())
    print(f"_weight_int8pack_mm, bfloat16 row: {N * K / seconds / 1e9:.2f} GB/s")
    print(f"_weight_int8pack_mm, float32 row: {N * K / best(int8pack, x, w8, scale) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
