"""Where a decode step's time goes on this machine: the step against the matrix products it is made of.

    .venv/bin/python scripts/decode_breakdown.py [--set inference.weight_dtype=int8] [--rounds 3]

For the full model (config.toml plus any --set), in one process, each round: the plain read (kvbook.runtime.paths)
just before and just after the steps, the engine's decode step after a 256-token prefill (median and best of 12),
and the sum of its products alone, each matrix with one row in the decode path's dtype (float16 weights: `F.linear`
or `torch.mv`, whole or as column blocks, as the decode path chose, on the engine's copy; int8 weights:
`_weight_int8pack_mm`), the best of 5. Then the products' share of a step is what is left to gain outside them, and
the step against the floor of that round's read (the products' bytes / the faster of its two reads) tells a kernel
that streams slower than the memory from memory slower than its best minute. Where a batched step multiplies the
weights packed for FBGEMM, one sequence's step on that path is timed beside the lone one (the packing, once, is
timed too).
BENCHMARKS.md records its figures with the CPU model ("Where a decode step's time goes").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from kvbook.config import load_config
from kvbook.model.linear import FBGEMM, linears, lone_row_product
from kvbook.model.quant import Int8Linear, int8_matmul
from kvbook.runtime.engine import Engine
from kvbook.runtime.paths import best_seconds, cpu_model, read_around
from kvbook.tokenizer import build_prompt_ids


def step_ms(engine: Engine, prompt: list[int], steps: int = 12, batched: bool = False) -> tuple[float, float]:
    """(median, best) milliseconds of the engine's decode step after a prefill of the prompt (batched: one
    sequence's step on a batching scheduler's path)."""
    cache = engine.new_cache()
    logits, _ = engine.prefill(cache, prompt)  # [1, 1, vocab]
    times = []
    for _ in range(steps):
        token = int(logits[0, -1].argmax())
        started = time.perf_counter()
        logits = engine.decode([token], [cache], batched=batched)  # [1, 1, vocab]
        times.append((time.perf_counter() - started) * 1e3)
    engine.release_cache(cache)
    return statistics.median(times), min(times)


def products_ms(engine: Engine) -> tuple[float, int]:
    """(ms, bytes) of every matrix product of a decode step, one row each, timed alone."""
    total_ms, total_bytes = 0.0, 0
    for module in engine.model.modules():
        if isinstance(module, Int8Linear):
            x = torch.randn(1, module.in_features).to(module.scale.dtype)  # [1, in]
            total_ms += best_seconds(lambda m=module, x=x: int8_matmul(x, m.qweight, m.scale), engine.device) * 1e3
            total_bytes += module.weight_bytes
    for module in linears(engine.model):
        weight = module.weight_in(engine.decode_dtype)
        x = torch.randn(1, module.in_features).to(weight.dtype)  # [1, in]
        blocks = module.blocks.get(weight.dtype)  # the decode path's kernel and layout (kvbook.runtime.paths)
        total_ms += best_seconds(lambda m=module, w=weight, x=x, b=blocks: lone_row_product(x, w, b, m.lone_row_matvec),
                                 engine.device) * 1e3
        total_bytes += weight.nbytes
    return total_ms, total_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    config = load_config("config.toml", args.set)
    engine = Engine(config, progress=False)
    prompt = build_prompt_ids(config.inference.input_len)
    print(f"{cpu_model()}, {torch.get_num_threads()} threads; weights {config.inference.weight_dtype}, "
          f"decode in {str(engine.decode_dtype).removeprefix('torch.')}")
    packed = engine.paths.batched_decode.kernel == FBGEMM
    if packed:
        started = time.perf_counter()
        engine.prepare_batched_decode()
        print(f"packed the weights for FBGEMM in {time.perf_counter() - started:.1f} s")
    for _ in range(args.rounds):
        def steps():
            return step_ms(engine, prompt), step_ms(engine, prompt, batched=True)[0] if packed else None

        ((median, best), packed_median), read = read_around(engine.device, steps, repeats=3)
        alone, nbytes = products_ms(engine)
        floor = nbytes / read / 1e6  # ms
        print(f"plain read {read:.1f} GB/s (floor {floor:.1f} ms) | step median {median:.1f} ms "
              f"({median / floor:.2f} x floor), best {best:.1f} | its products alone {alone:.1f} ms "
              f"({nbytes / alone / 1e6:.1f} GB/s, {alone / median:.0%} of the median step)"
              + (f" | one sequence through FBGEMM {packed_median:.1f} ms ({packed_median / floor:.2f} x floor)"
                 if packed else ""))


if __name__ == "__main__":
    main()
