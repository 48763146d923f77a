"""python -m kvbook bench: TTFT, TPOT, model-ready time, peak memory and the memory-bandwidth floor of a decode
step, measured honestly (warm-up, repeated runs, synchronized), optionally beside transformers' Qwen3ForCausalLM
at the same shapes and dtype in the same run. Read by chapter 7 ("Latency") and BENCHMARKS.md.

Each party runs in its own process, so that one's memory and caches do not colour the other's figures:
  probe        a large float16 matrix-vector product outside any model: the best read bandwidth
  engine       kvbook from the weight cache, and (unless --no-cold) from an empty one, 3 times
  transformers Qwen3ForCausalLM built from a Qwen3Config, random init, prefill then step-by-step decode
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from .config import Config, kv_cache_bytes
from .device import TORCH_DTYPES, resolve_device, synchronize
from .quant import int8_weight_bytes
from .weights import expected_shapes

PROBE_ROWS, PROBE_COLS = 65536, 4096  # 512 MiB in float16: far larger than any cache


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# Cold starts timed (median reported): on a virtual machine the first process in a while to ask for gigabytes of
# memory can pay seconds for it, whatever it runs (BENCHMARKS.md, "Cold start").
COLD_RUNS = 3


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def decode_weight_bytes(config: Config) -> int:
    """Bytes every decode step must read: every weight but the embedding table, of which it looks up one row
    (with tied embeddings, lm_head is that table and is read whole)."""
    if config.inference.weight_dtype == "int8":  # int8 matrices and their scales (kvbook.quant)
        return int8_weight_bytes(config.model, _dtype_size(config))
    shapes = expected_shapes(config.model)
    shapes.pop("model.embed_tokens.weight")
    if config.model.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.model.vocab_size, config.model.hidden_size)
    return sum(torch.Size(shape).numel() for shape in shapes.values()) * _dtype_size(config)


def all_weight_bytes(config: Config) -> int:
    if config.inference.weight_dtype == "int8":
        return int8_weight_bytes(config.model, _dtype_size(config), decode=False)
    return sum(torch.Size(shape).numel() for shape in expected_shapes(config.model).values()) * _dtype_size(config)


def _dtype_size(config: Config) -> int:
    return torch.finfo(TORCH_DTYPES[config.inference.dtype]).bits // 8


# ---- workers: each prints one JSON line ---------------------------------------------------------------

def probe_worker(config: Config, repeats: int) -> dict:
    """Best read bandwidth of a float16 matrix-vector product on the engine's device, in GB/s."""
    device = resolve_device(config.inference.device)
    dtype = TORCH_DTYPES[config.inference.dtype]
    matrices = [torch.randn(PROBE_ROWS, PROBE_COLS, dtype=dtype, device=device) for _ in range(2)]
    x = torch.randn(1, PROBE_COLS, dtype=dtype, device=device)
    times = []
    for i in range(repeats + 2):
        synchronize(device)
        started = time.perf_counter()
        torch.nn.functional.linear(x, matrices[i % 2])
        synchronize(device)
        if i >= 2:  # the first two are warm-up
            times.append(time.perf_counter() - started)
    nbytes = matrices[0].numel() * matrices[0].element_size()
    return {"probe_gbps": nbytes / min(times) / 1e9, "probe_median_gbps": nbytes / statistics.median(times) / 1e9,
            "probe_shape": [PROBE_ROWS, PROBE_COLS]}


def engine_worker(config: Config, repeats: int, steps: int) -> dict:
    from .engine import Engine
    from .tokenizer import build_prompt_ids, sample_text

    engine = Engine(config, progress=False)
    if repeats == 0:  # only make sure the weight cache exists
        return {"ready_s": engine.ready_s}
    batch = config.inference.batch_size
    prompt = build_prompt_ids(config.inference.input_len)

    def run():
        """One run: (TTFT ms, mean decode step ms). With batch_size B > 1, B different prompts of input_len
        tokens decoded together (Engine.generate_batch); TTFT is then the first sequence's prefill."""
        if batch == 1:
            result = engine.generate(prompt, steps + 1, ignore_eos=True)
            return result.ttft_ms, result.tpot_ms
        prompts = [build_prompt_ids(config.inference.input_len, text=sample_text()[37 * i:]) for i in range(batch)]
        results = engine.generate_batch(prompts, steps + 1, ignore_eos=True)
        return results[0].ttft_ms, results[0].tpot_ms

    engine.generate(prompt, min(steps, 4) + 1, ignore_eos=True)  # warm-up
    if batch > 1:
        engine.generate_batch([prompt] * batch, 3, ignore_eos=True)  # warm-up of the batched path
    ttft, tpot = [], []
    for _ in range(repeats):
        first, step = run()
        ttft.append(first)
        tpot.append(step)
    cache = engine.new_cache()
    with torch.inference_mode():  # one prefill more, to weigh the cache it fills
        engine.model(torch.tensor([prompt], device=engine.device), torch.arange(len(prompt), device=engine.device),
                     cache, compute_dtype=engine.prefill_dtype)
    return {"ready_s": engine.ready_s, "ttft_runs": ttft, "tpot_runs": tpot,
            "peak_rss_mb": _peak_rss_mb(), "device": str(engine.device), "prefill_dtype": str(engine.prefill_dtype),
            "cuda_graphs": engine.decoder is not None,
            "kv_cache_bytes": cache.filled_bytes(), "kv_cache_positions": cache.length, "batch_size": batch}


def transformers_worker(config: Config, repeats: int, steps: int) -> dict:
    from transformers import DynamicCache, Qwen3ForCausalLM

    from .reference import hf_config
    from .tokenizer import build_prompt_ids

    device, dtype = resolve_device(config.inference.device), TORCH_DTYPES[config.inference.dtype]
    hf_cfg = hf_config(config.model)
    started = time.perf_counter()
    model = Qwen3ForCausalLM._from_config(hf_cfg, dtype=dtype).to(device).eval()
    synchronize(device)
    build_s = time.perf_counter() - started
    prompt = torch.tensor([build_prompt_ids(config.inference.input_len)], device=device)

    @torch.inference_mode()
    def run(new_tokens: int) -> tuple[float, list[float]]:
        cache = DynamicCache(config=hf_cfg)
        synchronize(device)
        started = time.perf_counter()
        logits = model(prompt, cache=cache, logits_to_keep=1).logits  # lm_head on the last position only
        token = logits[:, -1:].float().argmax(-1)  # float32 logits, as generate() takes them (and kvbook.sampling)
        synchronize(device)
        ttft = (time.perf_counter() - started) * 1e3
        step_ms = []
        for _ in range(new_tokens - 1):
            started = time.perf_counter()
            token = model(token, cache=cache).logits[:, -1:].float().argmax(-1)
            synchronize(device)
            step_ms.append((time.perf_counter() - started) * 1e3)
        return ttft, step_ms

    run(min(steps, 4) + 1)  # warm-up
    ttft, tpot = [], []
    for _ in range(repeats):
        first, step_ms = run(steps + 1)
        ttft.append(first)
        tpot.append(statistics.fmean(step_ms))
    return {"build_s": build_s, "ttft_runs": ttft, "tpot_runs": tpot, "peak_rss_mb": _peak_rss_mb()}


def roofline_worker(config: Config, repeats: int, steps: int) -> dict:
    from .engine import Engine
    from .roofline import roofline

    return roofline(Engine(config, progress=False), repeats=repeats)


WORKERS = {"probe": probe_worker, "engine": engine_worker, "transformers": transformers_worker,
           "roofline": roofline_worker}


# ---- the parent: runs the workers, computes floor and ratios ------------------------------------------

def _run_worker(role: str, config_path: str, overrides: list[str], repeats: int, steps: int,
                env: dict | None = None) -> dict:
    command = [sys.executable, "-m", "kvbook.bench", role, config_path, str(repeats), str(steps), *overrides]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"bench worker {role!r} failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _merge(rounds: list[dict]) -> dict:
    """Several worker processes of one party -> spreads over all their runs (and the worst peak memory)."""
    merged = {key: value for key, value in rounds[0].items() if not key.endswith("_runs")}
    for key in ("ttft", "tpot"):
        merged[f"{key}_spread"] = _spread([value for r in rounds for value in r[f"{key}_runs"]])
        merged[f"{key}_ms"] = merged[f"{key}_spread"]["median"]
    for key in ("ready_s", "build_s"):
        if key in merged:
            merged[key] = statistics.median(r[key] for r in rounds)
    merged["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rounds)
    return merged


def run_bench(config: Config, config_path: str, overrides: list[str], against: str | None = None,
              repeats: int = 3, steps: int = 32, cold: bool = True, rounds: int = 2, progress=print) -> dict:
    """With a peer, the engine and the peer run alternately `rounds` times (A, B, A, B), so that a machine
    whose speed drifts during the bench weighs on both alike. The cold start (an empty weight cache) runs after
    the first round, like the peer's second build: on memory that the processes before it have just used. On a
    virtual machine, memory left untouched for a minute can cost a second per GB to fault in again (BENCHMARKS.md),
    and the first process to ask for gigabytes would pay for it alone."""
    rounds = rounds if against else 1
    stages = ["bandwidth probe"]
    for r in range(1, rounds + 1):
        stages += [f"engine (weights from the cache), round {r}"] + ([f"{against}, round {r}"] if against else [])
        stages += [f"engine (empty cache), {COLD_RUNS} runs"] if cold and r == 1 else []
    stage = iter(range(1, len(stages) + 1))

    def announce() -> None:
        number = next(stage)
        progress(f"kvbook bench: [{number}/{len(stages)}] {stages[number - 1]} ...")

    announce()
    probe = _run_worker("probe", config_path, overrides, 20, steps)
    _run_worker("engine", config_path, overrides, 0, 1)  # makes sure the weight cache exists (not timed)
    engine_rounds, peer_rounds, cold_runs = [], [], []
    for r in range(rounds):
        announce()
        engine_rounds.append(_run_worker("engine", config_path, overrides, repeats, steps))
        if against:
            announce()
            peer_rounds.append(_run_worker("transformers", config_path, overrides, repeats, steps))
        if cold and r == 0:
            announce()
            for _ in range(COLD_RUNS):  # each into its own empty cache; the worker exits once the cache is written
                with tempfile.TemporaryDirectory(prefix="kvbook-cold-") as empty:
                    cold_runs.append(_run_worker("engine", config_path, overrides, 0, 1,
                                                 env={**os.environ, "XDG_CACHE_HOME": empty})["ready_s"])
    engine = _merge(engine_rounds)
    weights_read = decode_weight_bytes(config)
    result = {
        "ttft_ms": engine["ttft_ms"], "tpot_ms": engine["tpot_ms"],
        "tokens_per_s": engine["batch_size"] * 1e3 / engine["tpot_ms"], "batch_size": engine["batch_size"],
        "ready_s": engine["ready_s"], "peak_rss_mb": engine["peak_rss_mb"],
        "floor_ms": weights_read / (probe["probe_gbps"] * 1e9) * 1e3,
        "ttft_spread": engine["ttft_spread"], "tpot_spread": engine["tpot_spread"],
        "probe_gbps": probe["probe_gbps"], "probe_median_gbps": probe["probe_median_gbps"],
        "decode_weight_bytes": weights_read, "weight_bytes": all_weight_bytes(config),
        "kv_cache_bytes": engine["kv_cache_bytes"],
        "kv_cache_bytes_formula": kv_cache_bytes(config.model, engine["kv_cache_positions"],
                                                 config.kv_cache.cache_dtype),
        "kv_cache_positions": engine["kv_cache_positions"],
        "device": engine["device"], "dtype": config.inference.dtype, "prefill_dtype": engine["prefill_dtype"],
        "cuda_graphs": engine["cuda_graphs"],
        "input_len": config.inference.input_len, "decode_steps": steps, "repeats": repeats, "rounds": rounds,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
    }
    if cold_runs:
        result["cold_ready_spread"] = _spread(cold_runs)
        result["cold_ready_s"] = result["cold_ready_spread"]["median"]
    if against:
        peer = _merge(peer_rounds)
        result["transformers"] = {key: peer[key] for key in ("build_s", "ttft_ms", "tpot_ms", "peak_rss_mb",
                                                             "ttft_spread", "tpot_spread")}
    result["targets"] = targets(result)
    return result


def run_batch_sweep(config: Config, config_path: str, overrides: list[str], sizes: list[int], steps: int = 8,
                    progress=print) -> dict:
    """TPOT, generated tokens per second and KV-cache memory for each batch size (engine only, one run each)."""
    rows = []
    for i, size in enumerate(sizes, start=1):
        progress(f"kvbook bench: [{i}/{len(sizes)}] batch size {size} ...")
        r = _run_worker("engine", config_path, overrides + [f"inference.batch_size={size}"], 1, steps)
        tpot = r["tpot_runs"][0]
        kv = kv_cache_bytes(config.model, config.inference.input_len + steps, config.kv_cache.cache_dtype, size)
        rows.append({"batch_size": size, "tpot_ms": tpot, "tokens_per_s": size * 1e3 / tpot,
                     "kv_cache_mib": kv / 2**20, "peak_rss_mb": r["peak_rss_mb"]})
    return {"sweep": rows, "device": r["device"], "input_len": config.inference.input_len, "decode_steps": steps,
            "dtype": config.inference.dtype, "batch_dtype": r["prefill_dtype"].removeprefix("torch.")}


def format_batch_sweep(r: dict) -> str:
    lines = [f"batch sweep on {r['device']}: prompts of {r['input_len']} tokens, {r['decode_steps']} decode steps; "
             f"a step of 2+ sequences computes in {r['batch_dtype']}",
             f"{'batch':>6s}{'TPOT ms':>10s}{'tokens/s':>10s}{'KV MiB':>9s}{'peak RSS MiB':>14s}"]
    for row in r["sweep"]:
        lines.append(f"{row['batch_size']:6d}{row['tpot_ms']:10.1f}{row['tokens_per_s']:10.1f}"
                     f"{row['kv_cache_mib']:9.1f}{row['peak_rss_mb']:14.0f}")
    return "\n".join(lines)


def run_concurrency(config: Config, concurrency: int, max_tokens: int = 64, progress=print) -> dict:
    """Continuous batching measured from the client's side: the server in this process, one streaming request
    alone, then `concurrency` different requests at once; wall times, their ratio, each request's TTFT and TPOT."""
    import concurrent.futures

    from .client import stream_chat
    from .engine import Engine
    from .server import BackgroundServer

    progress(f"kvbook bench: [1/3] loading the model ({config.model.num_hidden_layers} layers) ...")
    engine = Engine(config, progress=False)
    messages = [[{"role": "user", "content": f"Request {i + 1}: what does a KV cache store, and why?"}]
                for i in range(concurrency)]
    with BackgroundServer(engine, record_timeline=True) as server:
        ask = {"model": config.model.name, "api_base": server.api_base, "config": config, "ignore_eos": True}

        def timed(message, tokens=max_tokens):
            started = time.perf_counter()
            result = stream_chat(message, max_tokens=tokens, **ask)
            if result.status != 200 or result.error or result.usage["completion_tokens"] != tokens:
                raise RuntimeError(f"the server did not answer a benchmark request: {result.status} {result.error}")
            return result, time.perf_counter() - started

        timed(messages[0], 2)  # warm-up
        progress("kvbook bench: [2/3] one request alone ...")
        alone, alone_s = timed(messages[0])
        progress(f"kvbook bench: [3/3] {concurrency} requests at once ...")
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as clients:
            together = list(clients.map(timed, messages))
        concurrent_s = time.perf_counter() - started
        batches = [len(step.seq_ids) for step in server.scheduler.timeline if step.phase == "decode"]
    return {"device": str(engine.device), "concurrency": concurrency, "max_tokens": max_tokens,
            "max_num_seqs": config.server.max_num_seqs,
            "decode_dtype": str(server.scheduler.decode_dtype).removeprefix("torch."),
            "alone_s": alone_s, "concurrent_s": concurrent_s, "ratio": concurrent_s / alone_s,
            "alone": {"ttft_ms": alone.ttft_s * 1e3, "tpot_ms": (alone.tpot_s or 0) * 1e3},
            "requests": [{"ttft_ms": r.ttft_s * 1e3, "tpot_ms": (r.tpot_s or 0) * 1e3, "s": s} for r, s in together],
            "tokens_per_s": {"alone": max_tokens / alone_s, "concurrent": concurrency * max_tokens / concurrent_s},
            "max_decode_batch": max(batches)}


def format_concurrency(r: dict) -> str:
    lines = [f"concurrency on {r['device']}: {r['concurrency']} requests of {r['max_tokens']} new tokens through the "
             f"server (max_num_seqs {r['max_num_seqs']}, decode in {r['decode_dtype']})",
             f"  one alone:   {r['alone_s']:7.2f} s  TTFT {r['alone']['ttft_ms']:7.1f} ms  TPOT "
             f"{r['alone']['tpot_ms']:6.1f} ms  {r['tokens_per_s']['alone']:6.1f} tokens/s",
             f"  {r['concurrency']} at once: {r['concurrent_s']:7.2f} s = {r['ratio']:.2f} x one request "
             f"(a queue: ~{r['concurrency']} x); {r['tokens_per_s']['concurrent']:.1f} tokens/s; "
             f"largest decode batch {r['max_decode_batch']}",
             f"  {'request':>9s}{'TTFT ms':>10s}{'TPOT ms':>10s}{'done s':>8s}"]
    for i, row in enumerate(r["requests"], start=1):
        lines.append(f"  {i:9d}{row['ttft_ms']:10.1f}{row['tpot_ms']:10.1f}{row['s']:8.2f}")
    return "\n".join(lines)


def run_roofline(config_path: str, overrides: list[str], repeats: int = 3, progress=print) -> dict:
    """The per-op roofline (kvbook.roofline) with this machine's bandwidth probe: which phase is bound by what."""
    progress("kvbook bench: [1/2] bandwidth probe ...")
    probe = _run_worker("probe", config_path, overrides, 20, 1)
    progress("kvbook bench: [2/2] roofline of prefill and one decode step ...")
    result = _run_worker("roofline", config_path, overrides, repeats, 1)
    result["peak_gbps"] = probe["probe_gbps"]
    result["machine_balance"] = result["peak_gflops"] / result["peak_gbps"]  # FLOP per byte at the ridge
    result["bound"] = {phase: "compute" if intensity > result["machine_balance"] else "memory"
                       for phase, intensity in result["intensity"].items()}
    return result


def format_roofline(r: dict) -> str:
    lines = [f"roofline on {r['device']}: peak {r['peak_gflops']:.0f} GFLOP/s ({r['prefill_dtype']} matrix product), "
             f"{r['peak_gbps']:.1f} GB/s (float16 matrix-vector); ridge at {r['machine_balance']:.1f} FLOP/byte"]
    for phase in ("prefill", "decode"):
        what = f"{r['prompt_len']} positions" if phase == "prefill" else f"one step at position {r['prompt_len']}"
        lines.append(f"{phase} ({what}): intensity {r['intensity'][phase]:.1f} FLOP/byte -> "
                     f"{r['bound'][phase]}-bound")
        lines.append(f"  {'op':26s}{'layer':>6s}{'GFLOP':>10s}{'MB':>10s}{'FLOP/B':>8s}{'ms':>9s}{'GFLOP/s':>9s}"
                     f"{'GB/s':>8s}")
        for row in r[phase]:
            layer = "" if row["layer"] is None else str(row["layer"])
            lines.append(f"  {row['op']:26s}{layer:>6s}{row['flops'] / 1e9:10.3f}{row['bytes'] / 1e6:10.1f}"
                         f"{row['intensity']:8.1f}{row['ms']:9.2f}{row['gflops']:9.1f}{row['gbps']:8.1f}")
    lines.append(f"lm_head's share of a decode step: {r['lm_head_share_of_decode']:.0%}")
    return "\n".join(lines)


def targets(r: dict) -> dict:
    """The speed issue's goals as ratios measured in this run (None where the run lacks the comparison)."""
    peer = r.get("transformers")
    goals = {
        "tpot_vs_floor": (r["tpot_ms"] / r["floor_ms"], 1.2),
        "peak_rss_vs_weights": (r["peak_rss_mb"] * 2**20 / r["weight_bytes"], 1.3),
        "kv_cache_bytes_exact": (float(r["kv_cache_bytes"] == r["kv_cache_bytes_formula"]), 1.0),
    }
    if peer:
        goals |= {"tpot_vs_transformers": (r["tpot_ms"] / peer["tpot_ms"], 0.7),
                  "ttft_vs_transformers": (r["ttft_ms"] / peer["ttft_ms"], 0.4),
                  "ready_vs_transformers_build": (r["ready_s"] / peer["build_s"], 0.1)}
        if "cold_ready_s" in r:
            goals["cold_ready_vs_transformers_build"] = (r["cold_ready_s"] / peer["build_s"], 0.4)
    out = {}
    for name, (ratio, limit) in goals.items():
        met = ratio == limit if name == "kv_cache_bytes_exact" else ratio <= limit
        out[name] = {"ratio": round(ratio, 3), "limit": limit, "met": bool(met)}
    return out


def format_table(r: dict) -> str:
    peer = r.get("transformers", {})
    lines = [f"kvbook bench on {r['device']} ({r['machine']['cpu_count']} CPUs), {r['dtype']} weights, prefill in "
             f"{r['prefill_dtype'].removeprefix('torch.')}, prompt {r['input_len']}, {r['decode_steps']} decode steps "
             f"x {r['repeats']} runs x {r['rounds']} rounds (medians)"
             + ("; decode through CUDA graphs" if r.get("cuda_graphs") else ""),
             f"{'':28s}{'kvbook':>12s}{'transformers':>14s}"]

    def row(label, ours, theirs, fmt):
        lines.append(f"{label:28s}{fmt.format(ours):>12s}{(fmt.format(theirs) if theirs is not None else '-'):>14s}")

    row("TTFT (ms)", r["ttft_ms"], peer.get("ttft_ms"), "{:.1f}")
    row("TPOT (ms)", r["tpot_ms"], peer.get("tpot_ms"), "{:.2f}")
    row("model ready (s)", r["ready_s"], peer.get("build_s"), "{:.2f}")
    if "cold_ready_s" in r:
        row("model ready, empty cache (s)", r["cold_ready_s"], peer.get("build_s"), "{:.2f}")
        lines.append(f"{'  (cold starts: min, max)':28s}{r['cold_ready_spread']['min']:>6.2f}"
                     f"{r['cold_ready_spread']['max']:>6.2f}")
    row("peak RSS (MiB)", r["peak_rss_mb"], peer.get("peak_rss_mb"), "{:.0f}")
    lines.append(f"bandwidth probe {r['probe_gbps']:.1f} GB/s (best); a decode step reads "
                 f"{r['decode_weight_bytes'] / 1e9:.2f} GB -> floor {r['floor_ms']:.1f} ms")
    lines.append(f"KV cache after prefill: {r['kv_cache_bytes']} bytes (formula {r['kv_cache_bytes_formula']})")
    for name, t in r["targets"].items():
        lines.append(f"  {'met ' if t['met'] else 'MISS'} {name:34s} {t['ratio']:.3f} (limit {t['limit']})")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Worker entry point: python -m kvbook.bench ROLE CONFIG REPEATS STEPS [OVERRIDES...]"""
    from .config import load_config

    role, config_path, repeats, steps, *overrides = argv
    config = load_config(config_path, overrides)
    fn = WORKERS[role]
    args = (config, int(repeats)) if role == "probe" else (config, int(repeats), int(steps))
    print(json.dumps(fn(*args)))


if __name__ == "__main__":
    main(sys.argv[1:])
