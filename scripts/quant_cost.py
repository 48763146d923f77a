"""What int8 costs in accuracy (issue 17), measured and not asserted: for int8 weights and for a quantized KV cache
separately, against the float engine with the same weights.

    flock /tmp/kvbook-heavy.lock .venv/bin/python scripts/quant_cost.py [--steps 128] [--json FILE]

Two models: the book's full-size random one (float16, the article's), and a small float32 Qwen3 checkpoint that
transformers writes with save_pretrained (4 layers, hidden 256) and kvbook loads (--checkpoint). For each:
the reference greedy run of `steps` tokens after the 256-token scenario prompt; each variant fed the reference's
tokens (teacher forcing, kvbook.tools.quant_cost.teacher_forced_logits) gives logits at the same positions: the largest
absolute logit error, that error over the logits' spread (their standard deviation over the vocabulary), and the
KL divergence of the next-token distributions (mean and max over positions); then each variant's own greedy run,
and how many of its tokens equal the reference's (and the first step where one differs). Greedy tokens of random
weights sit on near-ties (chapter 6), so agreement measures sensitivity more than quality."""

import argparse
import json
import tempfile
import time

import torch
from kvbook.config import load_config
from kvbook.model import quant
from kvbook.runtime.engine import Engine
from kvbook.tokenizer import build_prompt_ids
from kvbook.tools import quant_cost
from kvbook.tools.trace import Tracer


def measure(reference: Engine, variants: dict[str, Engine], prompt: list[int], steps: int) -> dict:
    with Tracer(reference.model, record_logits=True) as tracer:
        run = reference.generate(prompt, steps, ignore_eos=True, tracer=tracer)
    tokens = run.output_ids
    reference_logits = torch.stack([tracer.logits[step] for step in range(steps)])  # [steps, vocab]
    results = {}
    for name, engine in variants.items():
        started = time.perf_counter()
        logits = quant_cost.teacher_forced_logits(engine, prompt, tokens[:-1])
        error = quant_cost.logit_error(reference_logits, logits)
        own = engine.generate(prompt, steps, ignore_eos=True).output_ids
        results[name] = {**error, **quant_cost.greedy_agreement(tokens, own), "seconds": time.perf_counter() - started}
        print(name, json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in results[name].items()}),
              flush=True)
    return results


def full_size(steps: int) -> dict:
    config = load_config("config.toml", ["inference.device=cpu"])
    reference = Engine(config, progress=False)
    started = time.perf_counter()
    int8 = Engine(config.replace(inference={"weight_dtype": "int8"}), progress=False)
    print(f"int8 engine ready in {time.perf_counter() - started:.1f} s "
          f"({quant.quantized_weight_bytes(int8.model)} weight bytes)", flush=True)
    variants = {"int8 weights": int8}
    for cache_dtype in ("int8", "float8_e4m3fn"):
        variants[f"{cache_dtype} KV cache"] = Engine(config.replace(kv_cache={"cache_dtype": cache_dtype}),
                                                     model=reference.model, progress=False)
    prompt = build_prompt_ids(config.inference.input_len)
    results = measure(reference, variants, prompt, steps)
    # TTFT and TPOT of the float16 and the int8 engine, alternating in this process (3 runs of 16 steps each)
    timings = {"float16": [], "int8 weights": []}
    for _ in range(3):
        for name, engine in (("float16", reference), ("int8 weights", int8)):
            run = engine.generate(prompt, 17, ignore_eos=True)
            timings[name].append((run.ttft_ms, run.tpot_ms))
    for name, runs in timings.items():
        results[name] = {**results.get(name, {}), "ttft_ms": sorted(t for t, _ in runs)[1],
                         "tpot_ms": sorted(p for _, p in runs)[1]}
        print(name, "median of 3: TTFT", round(results[name]["ttft_ms"]), "ms, TPOT",
              round(results[name]["tpot_ms"], 1), "ms", flush=True)
    return results


def small_checkpoint(steps: int) -> dict:
    from kvbook.config import ModelConfig
    from kvbook.tools.reference import hf_config
    from transformers import Qwen3ForCausalLM

    model_cfg = ModelConfig(name="small", num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=32, intermediate_size=768)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM._from_config(hf_config(model_cfg), dtype=torch.float32)
    base = load_config("config.toml", ["inference.device=cpu", "inference.dtype=float32",
                                       "kv_cache.cache_dtype=float32"])
    with tempfile.TemporaryDirectory(prefix="kvbook-small-") as directory:
        hf.save_pretrained(directory)
        reference = Engine.from_checkpoint(base, directory)
        int8 = Engine.from_checkpoint(base.replace(inference={"weight_dtype": "int8"}), directory)
    variants = {"int8 weights": int8}
    for cache_dtype in ("int8", "float8_e4m3fn"):
        config = reference.config.replace(kv_cache={"cache_dtype": cache_dtype})
        variants[f"{cache_dtype} KV cache"] = Engine(config, model=reference.model, progress=False)
    prompt = build_prompt_ids(base.inference.input_len)
    return measure(reference, variants, prompt, steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    print("small float32 checkpoint (transformers save_pretrained):", flush=True)
    results = {"small float32 checkpoint": small_checkpoint(args.steps)}
    print("full-size random model (float16):", flush=True)
    results["full-size random model"] = full_size(args.steps)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
