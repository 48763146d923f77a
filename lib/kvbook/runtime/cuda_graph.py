"""Decode steps with fixed shapes, replayed from captured CUDA graphs ([inference] cuda_graphs).

On a GPU a decode step of the article's model reads its ~2.46 GB in well under a millisecond, but eager PyTorch
makes ~300 calls from Python for it, each dispatched (and, if it computes, launched as a kernel) at some
microseconds of CPU time: the step waits on Python, not on memory. A CUDA graph records the launches once and
replays them all with one call. A replay reuses the recorded shapes and memory addresses, so the step is written to
keep them fixed:

- the fed token and its position live in two device tensors, filled before each replay;
- K and V go into the cache at the position tensor (index_copy_), not at a Python slice
  (kvbook.cache.contiguous.BucketedCache);
- attention reads a fixed bucket of cache positions (a multiple of 256) and masks those after the position, so one
  graph serves 256 steps and a longer sequence captures one more;
- the cache is the decoder's own and every sequence reuses it: its address is part of the graphs.

On the CPU the same fixed-shape step runs eagerly, without a graph: the tests check it against the ordinary
decode step there. Explained in the appendix ("Making it fast on a CPU").
"""

from __future__ import annotations

import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

from ..cache.contiguous import BucketedCache, KVCache


def wanted(config, device: torch.device) -> bool:
    """Graphs for [inference] cuda_graphs on a CUDA device with the contiguous cache (paged decode stays eager)."""
    kv = config.kv_cache
    return config.inference.cuda_graphs and device.type == "cuda" and kv.enable and kv.layout == "contiguous"


class GraphedDecoder:
    """Fixed-shape decode for one sequence at a time on the engine's contiguous cache
    (kvbook.runtime.engine.Engine.stream).

    capture: record and replay CUDA graphs (default: on a CUDA device); False runs the same step eagerly."""

    def __init__(self, engine, bucket_size: int = 256, capture: bool | None = None):
        self.engine = engine
        self.device = engine.device
        self.bucket_size = bucket_size
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.cache = KVCache(engine.config.model, engine.config.kv_cache, self.device)
        for layer in self.cache.layers:  # masked positions are multiplied by 0: they must not hold NaN
            layer.k.zero_()
            layer.v.zero_()
        self.max_len = self.cache.layers[0].max_len
        self.token = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # [1, 1], the token fed
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)  # [1], where it goes in the cache
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, its logits)
        self.graph_pool = None  # one CUDA graph memory pool shared by every bucket's graph (not a BlockPool)
        self._holder = threading.Lock()  # held by the sequence decoding on self.cache

    @property
    def replaying(self) -> bool:
        """Whether its steps replay captured graphs: False before the first capture, on the CPU, and after a capture
        failed (the steps then run eagerly, and a report must not claim graphs)."""
        return self.capture and bool(self.graphs)

    @property
    def in_use(self) -> bool:
        return self._holder.locked()

    def acquire(self) -> KVCache | None:
        """The decoder's cache, emptied, for a new sequence; None while another sequence holds it."""
        if not self._holder.acquire(blocking=False):
            return None
        for layer in self.cache.layers:
            layer.length = 0  # stale positions stay, masked, until overwritten
        return self.cache

    def release(self) -> None:
        self._holder.release()

    def bucket(self, position: int) -> int:
        """Cache positions attention reads at this position: 256 up to position 255, 512 up to 511, ..."""
        return min(-(-(position + 1) // self.bucket_size) * self.bucket_size, self.max_len)

    def step(self, token: int) -> torch.Tensor:
        """Feed token at the cache's next position -> logits [1, 1, vocab] (a static buffer when captured)."""
        position = self.cache.length
        bucket = self.bucket(position)
        self.token.fill_(token)
        self.position.fill_(position)
        if self.capture and bucket not in self.graphs:
            try:
                self.graphs[bucket] = self._capture(bucket)
            except RuntimeError as error:  # an optimisation must not cost the reader the run
                print(f"kvbook: capturing a CUDA graph failed ({str(error).splitlines()[0]}); decoding eagerly "
                      "from here on. Set [inference] cuda_graphs = false to skip the attempt.", file=sys.stderr)
                self.capture = False
        if self.capture:
            graph, logits = self.graphs[bucket]
            graph.replay()
        else:
            logits = self._forward(bucket)
        for layer in self.cache.layers:  # the graph wrote position; the Python bookkeeping follows
            layer.length = position + 1
        return logits

    def _forward(self, bucket: int) -> torch.Tensor:
        view = BucketedCache(self.cache, self.position, bucket)
        return self.engine.model(self.token, self.position, view,
                                 compute_dtype=self.engine.decode_dtype)  # [1, 1, vocab]

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (cuBLAS handles, allocator), then record on the same stream. The warm-up runs
        and writes K and V of the current position: the same values the replay writes again. The recording does
        not run."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a server's, the weight cache writer's) may not break the capture
        with torch.cuda.graph(graph, pool=self.graph_pool, stream=stream, capture_error_mode="thread_local"):
            logits = self._forward(bucket)
        self.graph_pool = graph.pool()
        return graph, logits


@torch.inference_mode()
def compare_with_ordinary(engine, prompt: list[int], steps: int) -> dict:
    """Decode `steps` greedy tokens through a GraphedDecoder (captured on CUDA, eager elsewhere) and through the
    ordinary step on a cache of its own, both fed the ordinary path's tokens -> {"same_tokens": bool,
    "max_logit_diff": float, "positions": cache length after the last step, "replayed": whether the steps replayed
    captured graphs}."""
    decoder = GraphedDecoder(engine)
    plain = engine.new_cache()
    decoder.acquire()
    engine.prefill(decoder.cache, prompt)
    logits, _ = engine.prefill(plain, prompt)  # [1, 1, vocab]
    token = int(logits[0, -1].argmax())
    same, max_diff = True, 0.0
    for _ in range(steps):
        fixed = decoder.step(token).float()  # [1, 1, vocab]
        ordinary = engine.decode([token], [plain]).float()  # [1, 1, vocab]
        max_diff = max(max_diff, float((fixed - ordinary).abs().max()))
        same = same and int(fixed.argmax()) == int(ordinary.argmax())
        token = int(ordinary[0, -1].argmax())
    return {"same_tokens": same, "max_logit_diff": max_diff, "positions": decoder.cache.length,
            "replayed": decoder.replaying}


def count_torch_calls(run) -> int:
    """How many times run() calls into torch from Python: functions and tensor methods, not attribute reads such
    as .shape. Eagerly, each is dispatched on its own, and on a GPU each that computes launches a kernel."""
    calls = 0

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            nonlocal calls
            calls += getattr(func, "__name__", "") != "__get__"
            return func(*args, **(kwargs or {}))

    with Counting():
        run()
    return calls
