"""python -m kvbook bench: TTFT, TPOT, model-ready time and peak memory, measured honestly (warm-up, repeated runs,
synchronized), against the machine's two floors and optionally beside transformers' Qwen3ForCausalLM at the same
shapes, in float16 and in bfloat16, in the same run. Read by chapter 8 ("Latency") and BENCHMARKS.md, which states
the project's goals for these ratios.

The floors belong to the machine, not to one kernel:
  memory floor   the bytes a decode step must read (the weights as stored, the embedding's one row, and the K/V
                 cache at the run's mean position) / the best plain streaming read over 1 GiB of float32
                 (torch.sum and torch.dot(x, x), BLAS's dot product: the faster; kvbook.tools.measure.READ_LOOPS)
  compute floor  the FLOPs prefill must compute, counted from the shapes as the engine computes them (the last
                 layer's queries, attention and MLP and lm_head on the last position only) / the best matrix-
                 product rate of any dtype the engine may compute in on the device (kvbook.tools.measure.candidates,
                 and FBGEMM's kernel on float16 weights where torch has it: a batching scheduler computes with it);
                 the fastest kernel's product is timed again with every later read sample and the best kept, as the
                 read's: a one-shot probe in a slow minute of a shared VM read half the rate and flattered TTFT 2 x

Each party runs in its own process, so that one's memory and caches do not colour the other's figures:
  machine      the plain read and the kernel table (matrix-vector, 8 rows, a 256-row product per dtype)
  engine       kvbook from the weight cache, and (unless --no-cold) from an empty one, 3 times
  transformers Qwen3ForCausalLM built from a Qwen3Config, random init, prefill then step-by-step decode, in the
               config's dtype and in bfloat16
  llama.cpp    (--against llama.cpp, beside transformers) the model exported to GGUF F16 and Q8_0, through
               llama-cpp-python (kvbook.tools.llama_cpp_peer), a plain read after each of its runs
and last, on purpose in one process (TPOT only; --paired-rounds):
  paired       the engine and transformers' faster decode dtype, alternating, so that both meet the same minutes,
               with a plain read beside each of the engine's runs: its TPOT against the floor of its own minutes
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ..cache.memory import kv_cache_bytes
from ..config import Config
from ..device import TORCH_DTYPES, resolve_device, synchronize
from ..kernels import fbgemm_available
from ..kernels.choice import LABELS, dtype_name
from ..model.quant import int8_weight_bytes
from ..model.weights import expected_shapes
from .llama_cpp_peer import GGUF_LABELS, decode_bytes, llama_cpp_worker
from .measure import (
    candidates,
    cpu_identity,
    kernel_specs,
    kernel_table,
    matmul_gflops,
    peak_rss_mb,
    read_around,
    read_bandwidth_gbps,
)
from .roofline import prefill_flops


def _peak_memory(device: torch.device) -> dict:
    """The process's peak memory: its RSS, and on a GPU the device memory torch allocated there, where the weights
    and the cache live (the RSS then holds only the host side)."""
    peak = {"peak_rss_mb": peak_rss_mb()}
    if device.type == "cuda":
        peak["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return peak


def _peak_memory_mb(r: dict) -> float:
    """The peak memory where the weights live: allocated on the GPU, or the process's RSS on a CPU."""
    return r.get("peak_gpu_mb", r["peak_rss_mb"])


def _peak_memory_of(r: dict) -> str:
    """What _peak_memory_mb(r) measured."""
    return "GPU memory allocated" if "peak_gpu_mb" in r else "process RSS"


# Cold starts timed (median reported): on a virtual machine the first process in a while to ask for gigabytes of
# memory can pay seconds for it, whatever it runs.
COLD_RUNS = 3
# plain-read samples of one run this far apart (largest / smallest) get a line beside the memory floor: a VM's
# memory speed moves from minute to minute (BENCHMARKS.md, "How each figure is measured")
READ_SPREAD = 1.2
# rounds of the paired worker (the engine and transformers alternating in one process); each round costs a minute or
# so of the bench on 2 cores, transformers' build and one float16 prefill included
PAIRED_ROUNDS = 8


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def decode_weight_bytes(config: Config) -> int:
    """Bytes every decode step must read: every weight but the embedding table, of which it looks up one row
    (with tied embeddings, lm_head is that table and is read whole)."""
    if config.inference.weight_dtype == "int8":  # int8 matrices and their scales (kvbook.model.quant)
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

def probe_worker(config: Config, repeats: int, kernel_label: str | None = None) -> dict:
    """The best plain read bandwidth of the engine's device (kvbook.tools.measure.read_bandwidth_gbps),
    and with kernel_label (one of the kernel table's) the 256-row product's GFLOP/s through that kernel."""
    device = resolve_device(config.inference.device)
    read = read_bandwidth_gbps(device, repeats=repeats)
    probe = {"probe_gbps": read["read_gbps"], "probe_median_gbps": read["read_median_gbps"],
             "probe_loop": read["read_loop"]}  # the faster plain read, over 1 GiB of float32
    if kernel_label:
        _, dtype, kernel, _ = next(k for k in kernel_specs(device, list(KERNEL_DTYPES)) if k[0] == kernel_label)
        probe["probe_gflops"] = matmul_gflops(device, dtype, kernel, repeats=3)
    return probe


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def machine_worker(config: Config, repeats: int) -> dict:
    """The machine's own numbers: the best plain read, and per dtype the kernel table (kvbook.tools.measure)."""
    device = resolve_device(config.inference.device)
    read = read_bandwidth_gbps(device, repeats=repeats)
    kernels = kernel_table(device, list(KERNEL_DTYPES))
    usable = [dtype_name(d) for d in candidates(TORCH_DTYPES[config.inference.dtype])]
    if TORCH_DTYPES[config.inference.dtype] == torch.float16 and fbgemm_available(device):
        usable.append(LABELS["fbgemm"])  # a batched step multiplies by the packed float16 weights (kvbook.kernels)
    if LABELS["onednn"] in kernels:  # prefill may multiply its float32 copy through oneDNN (kvbook.kernels)
        usable.append(LABELS["onednn"])
    best = max(usable, key=lambda name: kernels[name]["matmul_gflops"])
    return {**read, "kernels": kernels, "compute_dtypes": usable, "peak_gflops": kernels[best]["matmul_gflops"],
            "peak_gflops_dtype": best,
            "identity": cpu_identity() if device.type == "cpu" else {"gpu": torch.cuda.get_device_name(device)}}


def engine_worker(config: Config, repeats: int, steps: int) -> dict:
    from ..runtime.engine import Engine
    from ..tokenizer import build_prompt_ids, sample_text

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
    engine.prefill(cache, prompt)  # one prefill more, to weigh the cache it fills
    return {"ready_s": engine.ready_s, "ttft_runs": ttft, "tpot_runs": tpot,
            **_peak_memory(engine.device), "device": str(engine.device), "prefill_dtype": engine.kernels.prefill.label,
            "decode_dtype": engine.kernels.decode.label,
            "batched_decode_dtype": engine.kernels.batched_decode.label,
            "phases": engine.describe_kernels(), "phases_text": engine.kernels.describe(),
            "cuda_graphs": engine.decoder is not None and engine.decoder.replaying,  # a capture may have failed
            "kv_cache_bytes": cache.filled_bytes(), "kv_cache_positions": cache.length, "batch_size": batch}


def _transformers_peer(config: Config, peer_dtype: str | None):
    """transformers' Qwen3ForCausalLM at the config's shapes, random init -> (build seconds, prefill, decode): prefill()
    gives (cache, first token, TTFT ms), decode(cache, token, n) the n steps' milliseconds, greedy as the engine."""
    from transformers import DynamicCache, Qwen3ForCausalLM

    from ..tokenizer import build_prompt_ids
    from .reference import hf_config

    device, dtype = resolve_device(config.inference.device), TORCH_DTYPES[peer_dtype or config.inference.dtype]
    hf_cfg = hf_config(config.model)
    started = time.perf_counter()
    model = Qwen3ForCausalLM._from_config(hf_cfg, dtype=dtype).to(device).eval()
    synchronize(device)
    build_s = time.perf_counter() - started
    prompt = torch.tensor([build_prompt_ids(config.inference.input_len)], device=device)

    @torch.inference_mode()
    def prefill():
        cache = DynamicCache(config=hf_cfg)
        synchronize(device)
        started = time.perf_counter()
        logits = model(prompt, cache=cache, logits_to_keep=1).logits  # lm_head on the last position only
        token = logits[:, -1:].float().argmax(-1)  # float32 logits, as generate() takes them (and sampling)
        synchronize(device)
        return cache, token, (time.perf_counter() - started) * 1e3

    @torch.inference_mode()
    def decode(cache, token, steps: int) -> list[float]:
        step_ms = []
        for _ in range(steps):
            started = time.perf_counter()
            token = model(token, cache=cache).logits[:, -1:].float().argmax(-1)
            synchronize(device)
            step_ms.append((time.perf_counter() - started) * 1e3)
        return step_ms

    return build_s, prefill, decode


def transformers_worker(config: Config, repeats: int, steps: int, peer_dtype: str | None = None) -> dict:
    build_s, prefill, decode = _transformers_peer(config, peer_dtype)
    device = resolve_device(config.inference.device)
    decode(*prefill()[:2], min(steps, 4))  # warm-up
    ttft, tpot = [], []
    for _ in range(repeats):
        cache, token, first = prefill()
        ttft.append(first)
        tpot.append(statistics.fmean(decode(cache, token, steps)))
    return {"build_s": build_s, "ttft_runs": ttft, "tpot_runs": tpot, **_peak_memory(device),
            "dtype": peer_dtype or config.inference.dtype}


def paired_worker(config: Config, repeats: int, steps: int, peer_dtype: str) -> dict:
    """The engine's TPOT and transformers' (in peer_dtype) in one process, alternating (A B, B A, ...) `repeats`
    times: both see the same minutes of the machine. On a shared virtual machine the speed of the memory moves in
    phases of tens of seconds that slow both alike, and
    medians from separate processes can land in different phases. One sequence each (batch 1), decoding from the
    prompt's prefill every round (transformers' cache is a copy of one prefill: its float16 prefill takes seconds on
    a CPU). A plain read just before and just after the engine's run of each round gives the floor of that round's
    minutes (the faster of the two): the engine's TPOT against it tells a kernel that streams slower than the memory
    from memory that is slower than its best minute."""
    import copy

    from ..runtime.engine import Engine
    from ..tokenizer import build_prompt_ids

    engine = Engine(config, progress=False)
    prompt = build_prompt_ids(config.inference.input_len)
    _, prefill, decode = _transformers_peer(config, peer_dtype)
    prefilled, first_token, _ = prefill()

    def engine_tpot() -> float:
        return engine.generate(prompt, steps + 1, ignore_eos=True).tpot_ms

    def peer_tpot() -> float:
        return statistics.fmean(decode(copy.deepcopy(prefilled), first_token, steps))

    engine.generate(prompt, min(steps, 4) + 1, ignore_eos=True)  # warm-ups
    decode(copy.deepcopy(prefilled), first_token, min(steps, 4))
    ours, theirs, reads = [], [], []
    for r in range(repeats):
        if r % 2:
            theirs.append(peer_tpot())
            tpot, read = read_around(engine.device, engine_tpot)
        else:
            tpot, read = read_around(engine.device, engine_tpot)
            theirs.append(peer_tpot())
        ours.append(tpot)
        reads.append(read)
    return {"dtype": peer_dtype, "engine_tpot_runs": ours, "transformers_tpot_runs": theirs, "read_gbps_runs": reads}


def paired_summary(paired: dict, floor_bytes: float) -> dict:
    """The paired worker's runs -> medians, the median of the per-round ratios (engine / transformers), how many
    rounds the engine was the faster in, and the engine's TPOT against the memory floor of each round's own plain
    read (floor_bytes: what a decode step must read), with their median."""
    ours, theirs = paired["engine_tpot_runs"], paired["transformers_tpot_runs"]
    pair_ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    floors_ms = [floor_bytes / (gbps * 1e9) * 1e3 for gbps in paired["read_gbps_runs"]]
    vs_floor = [tpot / floor for tpot, floor in zip(ours, floors_ms, strict=True)]
    return {**paired, "engine_tpot_ms": statistics.median(ours), "transformers_tpot_ms": statistics.median(theirs),
            "ratio_median": statistics.median(pair_ratios), "engine_faster_rounds": sum(r < 1 for r in pair_ratios),
            "rounds": len(pair_ratios), "memory_floor_ms_runs": floors_ms, "engine_vs_round_floor_runs": vs_floor,
            "engine_vs_round_floor_median": statistics.median(vs_floor)}


def roofline_worker(config: Config, repeats: int, steps: int) -> dict:
    from ..runtime.engine import Engine
    from .roofline import roofline

    return roofline(Engine(config, progress=False), repeats=repeats)


WORKERS = {"probe": probe_worker, "machine": machine_worker, "engine": engine_worker,
           "transformers": transformers_worker, "paired": paired_worker, "roofline": roofline_worker,
           "llama.cpp": llama_cpp_worker}


def peer_dtypes(config: Config) -> list[str]:
    """transformers is measured in the config's dtype and in bfloat16 (the faster of them on some CPUs)."""
    return list(dict.fromkeys([config.inference.dtype, "bfloat16"]))


# ---- the parent: runs the workers, computes floor and ratios ------------------------------------------

def _run_worker(role: str, config_path: str, overrides: list[str], repeats: int, steps: int,
                env: dict | None = None) -> dict:
    command = [sys.executable, "-m", "kvbook.tools.bench", role, config_path, str(repeats), str(steps), *overrides]
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
    for key in ("peak_rss_mb", "peak_gpu_mb"):
        if key in merged:
            merged[key] = max(r[key] for r in rounds)
    return merged


def decode_kv_bytes(config: Config, steps: int) -> float:
    """K/V cache bytes a decode step reads, per sequence, at the run's mean position: step i (1..steps) attends to
    input_len + i positions."""
    positions = config.inference.input_len + (steps + 1) / 2
    return kv_cache_bytes(config.model, 1, config.kv_cache.cache_dtype) * positions


def run_bench(config: Config, config_path: str, overrides: list[str], against: str | None = None,
              repeats: int = 3, steps: int = 32, cold: bool = True, rounds: int = 2,
              paired_rounds: int = PAIRED_ROUNDS, progress=print) -> dict:
    """With a peer, the engine and the peer (in each of its dtypes) run alternately `rounds` times (A, B, C, A,
    B, C), so that a machine whose speed drifts during the bench weighs on all alike. The cold start (an empty
    weight cache) runs after the first round, like the peer's second build: on memory that the processes before it
    have just used. On a virtual machine, memory left untouched for a minute can cost a second per GB to fault in
    again, and the first process to ask for gigabytes would pay for it alone.
    The plain read is measured again after every round and the best kept: on a shared virtual machine the memory's
    speed drifts with the neighbours, and a floor measured in one slow minute would flatter every ratio.
    Last, with a peer and paired_rounds > 0, the engine and the peer's faster decode dtype alternate in one process
    (paired_worker): TPOT against the peer in the same minutes, reported beside the ratio of the separate medians."""
    rounds = rounds if against else 1
    paired_rounds = paired_rounds if against else 0
    peers = peer_dtypes(config) if against else []
    gguf_types = list(GGUF_LABELS) if against == "llama.cpp" else []  # llama.cpp beside transformers, not instead
    stages = ["the machine: plain read and kernels"]
    stages += ["llama.cpp's GGUF files (exported once into the weight cache)"] if gguf_types else []
    for r in range(1, rounds + 1):
        stages += [f"engine (weights from the cache), round {r}"] + [f"transformers {d}, round {r}" for d in peers]
        stages += [f"llama.cpp {GGUF_LABELS[t]}, round {r}" for t in gguf_types]
        stages += [f"engine (empty cache), {COLD_RUNS} runs"] if cold and r == 1 else []
    if paired_rounds:
        stages.append(f"engine and transformers (its faster decode) alternating in one process, {paired_rounds} rounds")
    stage = iter(range(1, len(stages) + 1))

    def announce() -> None:
        number = next(stage)
        progress(f"kvbook bench: [{number}/{len(stages)}] {stages[number - 1]} ...")

    announce()
    machine = _run_worker("machine", config_path, overrides, 10, steps)
    _run_worker("engine", config_path, overrides, 0, 1)  # the weight cache exists (not timed)
    if gguf_types:
        announce()
        for gguf_type in gguf_types:
            _run_worker(f"llama.cpp:{gguf_type}", config_path, overrides, 0, 1)
    engine_rounds, peer_rounds, cold_runs = [], {d: [] for d in peers}, []
    llama_rounds = {t: [] for t in gguf_types}
    reads = [machine["read_gbps"]]
    products = [machine["peak_gflops"]]  # GFLOP/s of the fastest kernel's 256-row product, sampled with each read
    read_loops = [machine["read_loop"]]  # which plain read streamed fastest in each sample

    def sample_read(role: str = "probe") -> dict:
        """A plain read in a process of its own, kept for the floor (and, with probe:KERNEL, the kernel's rate)."""
        probe = _run_worker(role, config_path, overrides, 10, 1)
        reads.append(probe["probe_gbps"])
        read_loops.append(probe["probe_loop"])
        return probe

    for r in range(rounds):
        announce()
        engine_rounds.append(_run_worker("engine", config_path, overrides, repeats, steps))
        for dtype in peers:
            announce()
            peer_rounds[dtype].append(_run_worker(f"transformers:{dtype}", config_path, overrides, repeats, steps))
        for gguf_type in gguf_types:
            announce()
            runs = _run_worker(f"llama.cpp:{gguf_type}", config_path, overrides, repeats, steps)
            runs["read_gbps"] = sample_read()["probe_gbps"]  # the memory's speed in its minutes
            llama_rounds[gguf_type].append(runs)
        products.append(sample_read(f"probe:{machine['peak_gflops_dtype']}")["probe_gflops"])
        if cold and r == 0:
            announce()
            for _ in range(COLD_RUNS):  # each into its own empty cache; the worker exits once the cache is written
                with tempfile.TemporaryDirectory(prefix="kvbook-cold-") as empty:
                    cold_runs.append(_run_worker("engine", config_path, overrides, 0, 1,
                                                 env={**os.environ, "XDG_CACHE_HOME": empty})["ready_s"])
    engine = _merge(engine_rounds)
    batch = engine["batch_size"]
    weights_read = decode_weight_bytes(config)
    kv_read = decode_kv_bytes(config, steps) * batch
    flops = prefill_flops(config.model, config.inference.input_len, computed=True)  # the work a prefill must do
    read_gbps = max(reads)
    memory_floor_ms = (weights_read + kv_read) / (read_gbps * 1e9) * 1e3
    slowest_read_floor_ms = memory_floor_ms * read_gbps / min(reads)
    peak_gflops = max(products)
    compute_floor_ms = flops / (peak_gflops * 1e9) * 1e3
    result = {
        "ttft_ms": engine["ttft_ms"], "tpot_ms": engine["tpot_ms"],
        "tokens_per_s": batch * 1e3 / engine["tpot_ms"], "batch_size": batch,
        "ready_s": engine["ready_s"], "peak_rss_mb": engine["peak_rss_mb"], "peak_memory_mb": _peak_memory_mb(engine),
        "peak_memory_of": _peak_memory_of(engine),
        "memory_floor_ms": memory_floor_ms, "compute_floor_ms": compute_floor_ms,
        "floors": {"decode_weight_bytes": weights_read, "decode_kv_bytes": kv_read,
                   "read_gbps": read_gbps, "read_gbps_samples": [round(r, 2) for r in reads],
                   "read_loops": read_loops, "read_loops_gbps": machine["read_loops_gbps"],
                   "read_median_gbps": machine["read_median_gbps"],
                   "memory_floor_at_slowest_read_ms": slowest_read_floor_ms,
                   "prefill_flops": flops,
                   "prefill_flops_every_position": prefill_flops(config.model, config.inference.input_len),
                   "peak_gflops": peak_gflops, "peak_gflops_samples": [round(g, 1) for g in products],
                   "peak_gflops_dtype": machine["peak_gflops_dtype"], "compute_dtypes": machine["compute_dtypes"]},
        "kernels": machine["kernels"], "identity": machine["identity"],
        "phases": engine["phases"], "phases_text": engine["phases_text"],
        "ttft_spread": engine["ttft_spread"], "tpot_spread": engine["tpot_spread"],
        "decode_weight_bytes": weights_read, "weight_bytes": all_weight_bytes(config),
        "weight_bytes_kept": engine["phases"]["weight_bytes_kept"],
        "kv_cache_bytes": engine["kv_cache_bytes"],
        "kv_cache_bytes_formula": kv_cache_bytes(config.model, engine["kv_cache_positions"],
                                                 config.kv_cache.cache_dtype),
        "kv_cache_positions": engine["kv_cache_positions"],
        "device": engine["device"], "dtype": config.inference.dtype, "prefill_dtype": engine["prefill_dtype"],
        "decode_dtype": engine["decode_dtype"], "batched_decode_dtype": engine["batched_decode_dtype"],
        "cuda_graphs": engine["cuda_graphs"],
        "input_len": config.inference.input_len, "decode_steps": steps, "repeats": repeats, "rounds": rounds,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "cpu": machine["identity"].get("cpu"),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
    }
    if cold_runs:
        result["cold_ready_spread"] = _spread(cold_runs)
        result["cold_ready_s"] = result["cold_ready_spread"]["median"]
    if against:
        by_dtype = {}
        for dtype, runs in peer_rounds.items():
            peer = _merge(runs)
            by_dtype[dtype] = {key: peer[key] for key in ("build_s", "ttft_ms", "tpot_ms", "peak_rss_mb",
                                                          "ttft_spread", "tpot_spread")}
            by_dtype[dtype]["peak_memory_mb"] = _peak_memory_mb(peer)
            by_dtype[dtype]["ttft_vs_compute_floor"] = peer["ttft_ms"] / compute_floor_ms
            by_dtype[dtype]["tpot_vs_memory_floor"] = peer["tpot_ms"] / memory_floor_ms
        best_ttft = min(by_dtype, key=lambda d: by_dtype[d]["ttft_ms"])
        best_tpot = min(by_dtype, key=lambda d: by_dtype[d]["tpot_ms"])
        best_build = min(by_dtype, key=lambda d: by_dtype[d]["build_s"])
        if paired_rounds:
            announce()
            paired = _run_worker(f"paired:{best_tpot}", config_path, overrides, paired_rounds, steps)
            result["tpot_paired"] = paired_summary(paired, weights_read + kv_read)
        result["transformers_by_dtype"] = by_dtype
        result["transformers"] = {  # the best configuration, per figure
            "ttft_ms": by_dtype[best_ttft]["ttft_ms"], "ttft_dtype": best_ttft,
            "tpot_ms": by_dtype[best_tpot]["tpot_ms"], "tpot_dtype": best_tpot,
            "build_s": by_dtype[best_build]["build_s"], "build_dtype": best_build,
            "peak_rss_mb": by_dtype[best_tpot]["peak_rss_mb"], "peak_memory_mb": by_dtype[best_tpot]["peak_memory_mb"],
            "ttft_spread": by_dtype[best_ttft]["ttft_spread"], "tpot_spread": by_dtype[best_tpot]["tpot_spread"]}
    if gguf_types:
        result["llama_cpp_by_type"] = {t: llama_cpp_summary(config, runs, t, steps, read_gbps, compute_floor_ms)
                                       for t, runs in llama_rounds.items()}
    result["ratios"] = ratios(result)
    return result


def llama_cpp_summary(config: Config, runs: list[dict], gguf_type: str, steps: int, read_gbps: float,
                      compute_floor_ms: float) -> dict:
    """One llama.cpp type's rounds -> medians, each against its floors: the memory floor of its own bytes (its
    matrices as stored, its float16 K/V), at the bench's best read and at the read right after each round's runs
    (a process of its own: the read's 1 GiB stays out of llama.cpp's RSS)."""
    peer = _merge(runs)
    kv_read = decode_kv_bytes(config.replace(kv_cache={"cache_dtype": "float16"}), steps)  # llama.cpp's default
    floor_bytes = decode_bytes(config, gguf_type) + kv_read
    vs_round = [t / (floor_bytes / (r["read_gbps"] * 1e9) * 1e3) for r in runs for t in r["tpot_runs"]]
    memory_floor_ms = floor_bytes / (read_gbps * 1e9) * 1e3
    return {key: peer[key] for key in ("build_s", "ttft_ms", "tpot_ms", "peak_rss_mb", "ttft_spread", "tpot_spread",
                                       "threads", "gguf_bytes", "llama_cpp", "system_info")} | {
        "label": f"llama.cpp {GGUF_LABELS[gguf_type]}", "peak_memory_mb": peer["peak_rss_mb"],
        "decode_bytes": floor_bytes, "memory_floor_ms": memory_floor_ms,
        "tpot_vs_memory_floor": peer["tpot_ms"] / memory_floor_ms,
        "ttft_vs_compute_floor": peer["ttft_ms"] / compute_floor_ms,
        "tpot_vs_round_floor_runs": vs_round, "tpot_vs_round_floor_median": statistics.median(vs_round)}


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
                     "kv_cache_mib": kv / 2**20, "peak_memory_mb": _peak_memory_mb(r), "cuda_graphs": r["cuda_graphs"]})
    return {"sweep": rows, "device": r["device"], "peak_memory_of": _peak_memory_of(r),
            "input_len": config.inference.input_len, "decode_steps": steps,
            "dtype": config.inference.dtype, "batched_decode_dtype": r["batched_decode_dtype"]}


def format_batch_sweep(r: dict) -> str:
    lines = [f"batch sweep on {r['device']}: prompts of {r['input_len']} tokens, {r['decode_steps']} decode steps; "
             f"a step of 2+ sequences computes in {r['batched_decode_dtype']}"
             + ("; a lone sequence replays CUDA graphs, a batch runs eagerly" if r["sweep"][0]["cuda_graphs"] else ""),
             f"{'batch':>6s}{'TPOT ms':>10s}{'tokens/s':>10s}{'KV MiB':>9s}"
             f"{'peak RSS MiB' if r['peak_memory_of'] == 'process RSS' else 'peak GPU MiB':>14s}"]
    for row in r["sweep"]:
        lines.append(f"{row['batch_size']:6d}{row['tpot_ms']:10.1f}{row['tokens_per_s']:10.1f}"
                     f"{row['kv_cache_mib']:9.1f}{row['peak_memory_mb']:14.0f}")
    return "\n".join(lines)


def run_concurrency(config: Config, concurrency: int, max_tokens: int = 64, progress=print) -> dict:
    """Continuous batching measured from the client's side: the server in this process, one streaming request
    alone, then `concurrency` different requests at once; wall times, their ratio, each request's TTFT and TPOT."""
    import concurrent.futures

    from ..runtime.engine import Engine
    from ..serving.client import stream_chat
    from ..serving.server import BackgroundServer

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
            "decode_dtype": (engine.kernels.batched_decode if server.scheduler.batched
                             else engine.kernels.decode).label,
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
    """The per-op roofline (kvbook.tools.roofline) with this machine's plain read bandwidth: which phase is bound by
    what."""
    progress("kvbook bench: [1/2] plain read bandwidth ...")
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
             f"{r['peak_gbps']:.1f} GB/s (plain read); ridge at {r['machine_balance']:.1f} FLOP/byte"]
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


def ratios(r: dict) -> dict:
    """Every figure against the machine's floors and the best transformers configuration (BENCHMARKS.md states the
    project's goals for them; None where the run lacks the comparison)."""
    peer = r.get("transformers")
    out = {
        "ttft_vs_compute_floor": r["ttft_ms"] / r["compute_floor_ms"],
        "tpot_vs_memory_floor": r["tpot_ms"] / r["memory_floor_ms"],
        "peak_memory_vs_weight_bytes_kept": r["peak_memory_mb"] * 2**20 / r["weight_bytes_kept"],
        "kv_cache_bytes_exact": r["kv_cache_bytes"] == r["kv_cache_bytes_formula"],
        "ttft_vs_best_transformers": None, "tpot_vs_best_transformers": None,
        "tpot_vs_best_transformers_paired": None,
        "ready_vs_transformers_build": None, "cold_ready_vs_transformers_build": None,
    }
    if "tpot_paired" in r:
        out["tpot_vs_best_transformers_paired"] = r["tpot_paired"]["ratio_median"]
    if peer:
        out |= {"ttft_vs_best_transformers": r["ttft_ms"] / peer["ttft_ms"],
                "tpot_vs_best_transformers": r["tpot_ms"] / peer["tpot_ms"],
                "ready_vs_transformers_build": r["ready_s"] / peer["build_s"]}
        if "cold_ready_s" in r:
            out["cold_ready_vs_transformers_build"] = r["cold_ready_s"] / peer["build_s"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def read_spread_note(tpot_ms: float, floors: dict) -> str | None:
    """A line for a run whose plain-read samples differ by READ_SPREAD or more, else None. The memory floor takes the
    best sample (what the memory can do); on a shared machine a burst can set it, and TPOT against it then says as
    much about the minute as about the engine."""
    samples = floors["read_gbps_samples"]
    if max(samples) / min(samples) < READ_SPREAD:
        return None
    slowest_ms = floors["memory_floor_at_slowest_read_ms"]
    return (f"  the plain read moved between {min(samples):.1f} and {max(samples):.1f} GB/s in this run "
            f"({max(samples) / min(samples):.2f} x): at the slowest sample the floor is {slowest_ms:.1f} ms and TPOT "
            f"{tpot_ms / slowest_ms:.2f} x it; a memory-bound ratio near its goal depends on the minute it ran in")


def format_table(r: dict) -> str:
    by_dtype = r.get("transformers_by_dtype", {})
    peers = list(by_dtype)
    columns = {f"transformers {d}": by_dtype[d] for d in peers}
    columns |= {p["label"]: p for p in r.get("llama_cpp_by_type", {}).values()}
    lines = [f"kvbook bench on {r['device']} ({r['machine'].get('cpu') or r['machine'].get('gpu')}, "
             f"{r['machine']['cpu_count']} CPUs), {r['dtype']} weights; prompt {r['input_len']}, {r['decode_steps']} "
             f"decode steps x {r['repeats']} runs x {r['rounds']} rounds (medians)"
             + ("; decode through CUDA graphs" if r.get("cuda_graphs") else "")]
    lines += ["kernels (kvbook.kernels):"] + [f"  {line}" for line in r["phases_text"]]
    lines.append(f"{'':28s}{'kvbook':>12s}" + "".join(f"{name:>24s}" for name in columns))

    def row(label, ours, key, fmt):
        lines.append(f"{label:28s}{fmt.format(ours):>12s}"
                     + "".join(f"{fmt.format(peer[key]):>24s}" for peer in columns.values()))

    row("TTFT (ms)", r["ttft_ms"], "ttft_ms", "{:.1f}")
    row("TPOT (ms)", r["tpot_ms"], "tpot_ms", "{:.2f}")
    row("model ready / build (s)", r["ready_s"], "build_s", "{:.2f}")
    if "cold_ready_s" in r:
        lines.append(f"{'model ready, empty cache (s)':28s}{r['cold_ready_s']:>12.2f}  (min "
                     f"{r['cold_ready_spread']['min']:.2f}, max {r['cold_ready_spread']['max']:.2f})")
    row("peak RSS (MiB)" if r["peak_memory_of"] == "process RSS" else "peak GPU memory (MiB)", r["peak_memory_mb"],
        "peak_memory_mb", "{:.0f}")
    f = r["floors"]
    lines.append(f"memory floor {r['memory_floor_ms']:.1f} ms = ({f['decode_weight_bytes'] / 1e9:.3f} GB of weights "
                 f"+ {f['decode_kv_bytes'] / 1e6:.1f} MB of K/V) / {f['read_gbps']:.1f} GB/s (plain read, best)")
    note = read_spread_note(r["tpot_ms"], f)
    if note:
        lines.append(note)
    lines.append(f"compute floor {r['compute_floor_ms']:.1f} ms = {f['prefill_flops'] / 1e9:.1f} GFLOP of prefill / "
                 f"{f['peak_gflops']:.0f} GFLOP/s ({f['peak_gflops_dtype']} matrix product, the best of "
                 f"{', '.join(f['compute_dtypes'])}; the best of samples "
                 f"{', '.join(f'{g:.0f}' for g in f['peak_gflops_samples'])}): what the engine computes (the last "
                 "layer's queries, attention output and MLP on the last position only; every position there would be "
                 f"{f['prefill_flops_every_position'] / 1e9:.1f} GFLOP)")
    lines.append(f"weights kept: {r['weight_bytes_kept'] / 2**20:.0f} MiB (values {r['weight_bytes'] / 2**20:.0f} MiB "
                 "+ arithmetic copies)")
    lines.append("kernels (GB/s of the weight read; GFLOP/s):")
    for name, k in r["kernels"].items():
        lines.append(f"  {name:14s} matrix-vector 32768x4096 {k['matvec_gbps']:6.1f}  8 rows {k['rows8_gbps']:6.1f}  "
                     f"256x4096x11008 {k['matmul_gflops']:7.1f}")
    if "tpot_paired" in r:
        p = r["tpot_paired"]
        lines.append(f"TPOT in one process, alternating {p['rounds']} rounds with transformers {p['dtype']}: kvbook "
                     f"{p['engine_tpot_ms']:.2f} ms, transformers {p['transformers_tpot_ms']:.2f} ms (medians); "
                     f"per-round ratio median {p['ratio_median']:.3f}, kvbook faster in {p['engine_faster_rounds']} "
                     f"of {p['rounds']}")
        lines.append(f"  kvbook's TPOT / the memory floor at the plain read beside it, per round: "
                     f"{', '.join(f'{v:.2f}' for v in p['engine_vs_round_floor_runs'])} (reads "
                     f"{', '.join(f'{g:.1f}' for g in p['read_gbps_runs'])} GB/s); median "
                     f"{p['engine_vs_round_floor_median']:.2f}")
    for d in peers:
        lines.append(f"transformers {d}: TTFT {by_dtype[d]['ttft_vs_compute_floor']:.2f} x compute floor, TPOT "
                     f"{by_dtype[d]['tpot_vs_memory_floor']:.2f} x memory floor")
    for p in r.get("llama_cpp_by_type", {}).values():
        lines.append(f"{p['label']} ({p['llama_cpp']}, {p['threads']} threads, {p['gguf_bytes'] / 1e9:.2f} GB file): "
                     f"TTFT {p['ttft_vs_compute_floor']:.2f} x compute floor, TPOT {p['tpot_vs_memory_floor']:.2f} x "
                     f"its memory floor ({p['memory_floor_ms']:.1f} ms = {p['decode_bytes'] / 1e9:.3f} GB a step), "
                     f"{p['tpot_vs_round_floor_median']:.2f} x at the read beside each run (median)")
    lines.append(f"KV cache after prefill: {r['kv_cache_bytes']} bytes (formula {r['kv_cache_bytes_formula']})")
    lines.append("ratios (goals: BENCHMARKS.md):")
    for name, value in r["ratios"].items():
        lines.append(f"  {name:36s} {'-' if value is None else value}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Worker entry point: python -m kvbook.tools.bench ROLE CONFIG REPEATS STEPS [OVERRIDES...]"""
    from ..config import load_config
    from ..kernels import enable_huge_pages

    enable_huge_pages()  # before the worker allocates anything, as `python -m kvbook` does (kvbook.kernels.memory)

    role, config_path, repeats, steps, *overrides = argv
    config = load_config(config_path, overrides)
    role, _, option = role.partition(":")  # transformers:bfloat16
    fn = WORKERS[role]
    args = (config, int(repeats)) if role in ("probe", "machine") else (config, int(repeats), int(steps))
    print(json.dumps(fn(*args, *([option] if option else []))))


if __name__ == "__main__":
    main(sys.argv[1:])
