"""llama.cpp as a measured peer (bench --against llama.cpp): the book's model exported to GGUF, run through
llama-cpp-python at the bench's shapes, greedy, batch 1 (the bench reads the memory's speed beside each round).

The exports are kept beside the random weights (kvbook.model.weights.cache_dir), one file per GGUF type, and
written the first time a bench asks for them: an F16 file is the float16 weights' size, a Q8_0 file about half.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..config import Config
from ..device import TORCH_DTYPES
from ..model.weights import expected_shapes, load_random_weights, random_weights_path
from .export import Q8_0_BLOCK, export_gguf
from .measure import peak_rss_mb

GGUF_LABELS = {"f16": "F16", "q8_0": "Q8_0"}  # the types the bench runs, as llama.cpp names them
BYTES_PER_NUMBER = {"f16": 2.0, "q8_0": (Q8_0_BLOCK + 2) / Q8_0_BLOCK}  # Q8_0: 32 int8 and one float16 scale


def gguf_path(config: Config, gguf_type: str) -> Path:
    """The model's GGUF in the weight cache, exported from the random weights if it is not there yet."""
    weights_path = random_weights_path(config.model, TORCH_DTYPES[config.inference.dtype])
    path = weights_path.with_name(f"{weights_path.stem}-{gguf_type}.gguf")
    if not path.exists():
        weights = load_random_weights(config.model, TORCH_DTYPES[config.inference.dtype], progress=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        export_gguf(config.model, weights, path, gguf_type)
    return path


def decode_bytes(config: Config, gguf_type: str) -> float:
    """Bytes a decode step reads from the GGUF's weights: every matrix in gguf_type but the embedding table (one
    row of it), the float32 norms. The K/V cache is float16 in llama.cpp, as kvbook's: the bench adds it."""
    shapes = expected_shapes(config.model)
    embedding = shapes.pop("model.embed_tokens.weight")
    if config.model.tie_word_embeddings:
        shapes["lm_head.weight"] = embedding
    matrices = sum(torch.Size(shape).numel() for shape in shapes.values() if len(shape) == 2)
    norms = sum(torch.Size(shape).numel() for shape in shapes.values() if len(shape) == 1)
    return (matrices + embedding[1]) * BYTES_PER_NUMBER[gguf_type] + norms * 4


def llama_cpp_worker(config: Config, repeats: int, steps: int, gguf_type: str) -> dict:
    """TTFT (the prompt in one llama_decode, then the first greedy token) and TPOT (steps single-token decodes),
    repeats times; the load time and the process's peak RSS."""
    path = gguf_path(config, gguf_type)
    if repeats == 0:  # only make sure the export exists (not timed, and not in the measured process's RSS)
        return {"gguf_bytes": path.stat().st_size}
    import llama_cpp
    import numpy as np

    from ..tokenizer import build_prompt_ids

    threads = torch.get_num_threads()  # the engine's threads: one per core
    started = time.perf_counter()
    llm = llama_cpp.Llama(str(path), n_ctx=config.inference.input_len + steps + 8, n_batch=config.inference.input_len,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - started
    prompt = build_prompt_ids(config.inference.input_len)

    def greedy() -> int:
        """The last position's logits, read where llama.cpp left them (only that row is computed)."""
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        return int(logits.argmax())

    def run(n: int) -> tuple[float, float]:
        llm.reset()  # the next eval overwrites the cache from position 0
        started = time.perf_counter()
        llm.eval(prompt)
        token = greedy()
        ttft = (time.perf_counter() - started) * 1e3
        step_ms = []
        for _ in range(n):
            started = time.perf_counter()
            llm.eval([token])
            token = greedy()
            step_ms.append((time.perf_counter() - started) * 1e3)
        return ttft, statistics.fmean(step_ms)

    run(min(steps, 4))  # warm-up
    ttft, tpot = zip(*[run(steps) for _ in range(repeats)], strict=True)
    return {"build_s": load_s, "ttft_runs": list(ttft), "tpot_runs": list(tpot), "threads": threads,
            "peak_rss_mb": peak_rss_mb(), "type": gguf_type,
            "gguf_bytes": path.stat().st_size, "llama_cpp": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def teacher_forced_logits(path: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """llama.cpp's float32 logits [len(tokens) + 1, vocab] on prompt + tokens, as kvbook.tools.quant_cost's:
    row 0 after the prompt, row i after feeding tokens[i - 1]."""
    import llama_cpp

    ids = prompt + tokens
    llm = llama_cpp.Llama(str(path), n_ctx=len(ids) + 8, n_batch=len(ids), logits_all=True,
                          n_threads=torch.get_num_threads(), verbose=False)
    llm.eval(ids)
    return torch.from_numpy(llm.scores[len(prompt) - 1:len(ids)].copy())
