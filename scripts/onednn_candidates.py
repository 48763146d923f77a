"""oneDNN's own inner product as a candidate kernel (issue 13: "oneDNN's own kernels. Measure them; don't guess"):
torch.ops.mkldnn._linear_pointwise, the op Inductor's CPU code calls, multiplies the same float32 copy that prefill
uses today through F.linear (MKL on x86). Three measurements, results in BENCHMARKS.md ("Eleventh session"):

1. one row times a 32768 x 4096 matrix, GB/s of weight bytes read, best of 10, beside the plain read, float16 /
   bfloat16 / float32 F.linear and FBGEMM's packed float16 kernel; oneDNN in float32, bfloat16 and float16 (the
   last two have no oneDNN primitive on an AVX2-only CPU: printed as "fails");
2. rows x 8192 x 4096 and rows x 4096 x 11008 products, GFLOP/s, best of 5: float32 F.linear, oneDNN float32, FBGEMM;
3. the engine's TTFT (Engine.generate(prompt, 1), median of 3, the better of two rounds) for 20, 64 and 256 prompt
   tokens with kvbook.model.linear's F.linear replaced by oneDNN for float32 products of several rows, in one
   process, and the largest difference of the last position's logits.

With --prepacked, instead, the weights oneDNN reorders once (`mkldnn._reorder_linear_weight`, what Inductor's
weight-packing pass does) against the same weights reordered on every call, in the dtype prefill computes in on this
machine (bfloat16 where it measured bfloat16 fastest, as on an AMD EPYC Zen 5, where the engine now reorders its
prefill copy so: kvbook.model.linear.reorder_copies; results in BENCHMARKS.md, "Zen 5"):

4. 64 and 256 rows times each layer shape, GFLOP/s, best of 10: F.linear, oneDNN, oneDNN on the prepacked weight,
   and whether the prepacked product equals F.linear's bit for bit;
5. the engine's TTFT for 20, 64 and 256 prompt tokens with its prefill copies prepacked (4 rounds of 3 runs each,
   interleaved; median and best), the time the packing took, and whether prefill's logits are equal.

    flock /tmp/kvbook-heavy.lock .venv/bin/python scripts/onednn_candidates.py [--prepacked]
"""

import statistics
import sys
import time
import types
from functools import partial

import kvbook
import kvbook.model.linear as linear_module
import torch
from kvbook.runtime.paths import best_seconds
from kvbook.tools.book import book_config
from torch.nn import functional as F


def best(fn, reps=10):
    """Best of `reps` calls after a warm-up (kvbook.runtime.paths' timer, on the CPU)."""
    return best_seconds(fn, torch.device("cpu"), reps)


def onednn(x, weight, bias=None):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def one_row() -> None:
    n, k = 32768, 4096
    w16 = (torch.randn(n, k) * 0.02).half()
    w32, wbf = w16.float(), w16.bfloat16()
    x = torch.randn(1, k)
    big = torch.ones(2**28)  # 1 GiB of float32
    print(f"plain read: {big.nbytes / best(big.sum, 5) / 1e9:.1f} GB/s")
    del big
    packed = [torch.ops.quantized.linear_prepack_fp16(b.float(), None) for b in w16.split(8192)]
    cases = {
        "F.linear float16": (w16.nbytes, lambda: F.linear(x.half(), w16)),
        "F.linear bfloat16": (wbf.nbytes, lambda: F.linear(x.bfloat16(), wbf)),
        "F.linear float32": (w32.nbytes, lambda: F.linear(x, w32)),
        "FBGEMM float16 (packed)": (w16.nbytes,
                                    lambda: [torch.ops.quantized.linear_dynamic_fp16(x, p) for p in packed]),
        "oneDNN float32": (w32.nbytes, lambda: onednn(x, w32)),
        "oneDNN bfloat16": (wbf.nbytes, lambda: onednn(x.bfloat16(), wbf)),
        "oneDNN float16": (w16.nbytes, lambda: onednn(x.half(), w16)),
    }
    for name, (nbytes, fn) in cases.items():
        try:
            print(f"one row, {name}: {nbytes / best(fn) / 1e9:.1f} GB/s", flush=True)
        except RuntimeError as err:
            print(f"one row, {name}: fails ({str(err).splitlines()[0][:100]})", flush=True)


def products() -> None:
    for n, k in ((8192, 4096), (4096, 11008)):
        w32 = (torch.randn(n, k) * 0.02).half().float()
        packed = [torch.ops.quantized.linear_prepack_fp16(b, None) for b in w32.split(8192)]
        for rows in (1, 8, 20, 64, 128, 192, 256, 512):
            x = torch.randn(rows, k)
            flops = 2 * rows * n * k
            mkl = best(lambda x=x, w32=w32: F.linear(x, w32), 5)
            dnn = best(lambda x=x, w32=w32: onednn(x, w32), 5)
            fb = best(lambda x=x, packed=packed: [torch.ops.quantized.linear_dynamic_fp16(x, p) for p in packed], 5)
            print(f"{rows:4d} x {n} x {k}: F.linear float32 {flops / mkl / 1e9:5.1f}, oneDNN float32 "
                  f"{flops / dnn / 1e9:5.1f}, FBGEMM {flops / fb / 1e9:5.1f} GFLOP/s", flush=True)


def engine_ttft() -> None:
    def linear(x, weight, bias=None):  # oneDNN for float32 products of several rows, F.linear otherwise
        if x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > 1:
            return onednn(x, weight, bias)
        return F.linear(x, weight, bias)

    through_onednn = types.SimpleNamespace(linear=linear)
    engine = kvbook.Engine(book_config())
    print(engine.paths.describe()[0])
    for tokens in (20, 64, 256):
        prompt = kvbook.build_prompt_ids(tokens)
        ttft = {}
        for name, functional in (("F.linear", F), ("oneDNN", through_onednn)) * 2:
            linear_module.F = functional
            engine.generate(prompt, 1)
            runs = sorted(engine.generate(prompt, 1).ttft_ms for _ in range(3))
            ttft[name] = min(ttft.get(name, float("inf")), runs[1])
        logits = {}
        for name, functional in (("F.linear", F), ("oneDNN", through_onednn)):
            linear_module.F = functional
            ids = torch.tensor([prompt], device=engine.device)
            logits[name] = engine.model(ids, torch.arange(tokens, device=engine.device), engine.new_cache(),
                                        compute_dtype=engine.prefill_dtype)[0, -1].float()
        linear_module.F = F
        print(f"{tokens} prompt tokens: TTFT F.linear {ttft['F.linear']:.0f} ms, oneDNN {ttft['oneDNN']:.0f} ms "
              f"({ttft['F.linear'] / ttft['oneDNN']:.2f} x); largest logit difference "
              f"{float((logits['F.linear'] - logits['oneDNN']).abs().max()):.4f}", flush=True)


def prepacked_products(dtype: torch.dtype) -> None:
    for out, width in ((11008, 4096), (4096, 11008), (4096, 4096)):
        weight = (torch.randn(out, width) * 0.02).to(dtype)
        packed = linear_module.reorder_for_onednn(weight)
        for rows in (64, 256):
            x = torch.randn(rows, width).to(dtype)
            flops = 2 * rows * out * width
            rates = {name: flops / best(partial(fn, x, w)) / 1e9 for name, fn, w in (
                ("F.linear", F.linear, weight), ("oneDNN", onednn, weight), ("oneDNN prepacked", onednn, packed))}
            equal = torch.equal(onednn(x, packed), F.linear(x, weight))
            print(f"{rows:4d} x {width} -> {out}, {dtype}: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items())
                  + f" GFLOP/s; prepacked equals F.linear: {equal}", flush=True)


def prepacked_engine_ttft() -> None:
    engine = kvbook.Engine(book_config())
    dtype = engine.prefill_dtype
    print(engine.paths.describe()[0])
    layers = [m for m in linear_module.linears(engine.model) if dtype in m.copies]
    plain = {id(m): m.weight.to(dtype) for m in layers}  # the engine may have reordered its copies already
    started = time.perf_counter()
    packed = {id(m): linear_module.reorder_for_onednn(plain[id(m)]) for m in layers}
    print(f"packing {len(layers)} {dtype} copies: {time.perf_counter() - started:.2f} s (one thread)")

    def use(kind):  # kvbook.model.linear sends every product on a reordered copy through oneDNN
        for m in layers:
            m.copies[dtype] = (packed if kind == "prepacked" else plain)[id(m)]

    for tokens in (20, 64, 256):
        prompt = kvbook.build_prompt_ids(tokens)
        runs, logits = {"plain": [], "prepacked": []}, {}
        for _ in range(4):
            for kind in runs:
                use(kind)
                engine.generate(prompt, 1)
                runs[kind] += [engine.generate(prompt, 1).ttft_ms for _ in range(3)]
        for kind in runs:
            use(kind)
            cache = engine.new_cache()
            logits[kind] = engine.prefill(cache, prompt)[0]
            engine.release_cache(cache)
        print(f"{tokens} prompt tokens: TTFT " + ", ".join(
            f"{kind} median {statistics.median(ms):.0f} ms (best {min(ms):.0f})" for kind, ms in runs.items())
            + f"; prefill's logits equal: {torch.equal(logits['plain'], logits['prepacked'])}", flush=True)
    use("prepacked")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    if "--prepacked" in sys.argv[1:]:
        for dtype in (torch.bfloat16, torch.float32):
            prepacked_products(dtype)
        prepacked_engine_ttft()
    else:
        one_row()
        products()
        engine_ttft()
