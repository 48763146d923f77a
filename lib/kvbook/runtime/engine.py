"""Prefill and decode as two visible phases.

Prefill runs every prompt position once, fills the caches and gives the first generated token from the last
position's logits. Each decode step feeds the token just generated (not a hidden state), attends to the
cache, appends one position and gives the next token. After 256 prompt + 128 generated tokens the cache
holds 383 positions: the last token is never fed back. Explained in chapters 4 ("Prefill") and 5 ("Decode").
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from ..cache import kv_quant
from ..cache.contiguous import CacheFullError, KVCache
from ..cache.paged import BlockPool, PagedKVCache
from ..config import Config
from ..device import TORCH_DTYPES, resolve_device, synchronize
from ..kernels import Kernels, choose, enable_huge_pages, weight_bytes_kept
from ..model import quant
from ..model.qwen3 import Qwen3ForCausalLM
from ..model.weights import CacheWrites, build_model, checkpoint_config, load_checkpoint, load_random_weights
from . import cuda_graph
from .inputs import prepare_decode
from .scheduler import Scheduler
from .sequence import Generation, check_sampling, positions_needed


class Engine:
    """Holds the model on its device and runs prefill + decode for one sequence at a time."""

    def __init__(self, config: Config, model: Qwen3ForCausalLM | None = None, progress: bool = True,
                 kernels: Kernels | None = None):
        """kernels: how each phase computes on this device; by default chosen for it (kvbook.kernels)."""
        enable_huge_pages()  # before the weights are allocated; no effect if this process allocated tensors already
        started = time.perf_counter()
        self.device = resolve_device(config.inference.device)
        self.dtype = TORCH_DTYPES[config.inference.dtype]
        self.kernels = kernels or choose(config, self.device)
        self.prefill_dtype = self.kernels.prefill.dtype
        self.decode_dtype = self.kernels.decode.dtype  # a lone sequence's decode step
        self.batched_decode_dtype = self.kernels.batched_decode.dtype  # a scheduler's step that may batch sequences
        self.prefix_caching = config.kv_cache.prefix_caching
        self.progress = progress
        self.batched_ready = False  # prepare_batched_decode has run
        # weight-cache files this engine drew or quantized: written once the model is whole (wait() joins them)
        self.cache_writes = CacheWrites()
        try:
            drawn = model is None  # random weights, from the weight cache (kvbook.model.weights)
            if drawn:
                weights = load_random_weights(config.model, self.dtype, progress, self.cache_writes)
                model = build_model(config.model, weights, self.device)
            kv_quant.check_cache_dtype(config.kv_cache.cache_dtype, self.device)
            if config.inference.weight_dtype == "int8":  # int8 matrices for decode (kvbook.model.quant)
                quant.quantize_model(model, self.device, self.dtype, config.model if drawn else None, self.cache_writes)
            self.kernels.prepare(model)  # prefill's copies of the weights, where this device computes faster so
        finally:  # also when the build fails: what was drawn is cached
            self.cache_writes.start()
        synchronize(self.device)
        self.ready_s = time.perf_counter() - started  # model build or cached load, to usable on the device
        self.config = config
        self.model = model
        # a contiguous cache given back, kept for the next sequence: its memory is faulted in already. A fresh one
        # is new memory that its first prefill faults in, page by page; a paged pool is allocated once anyway
        self.spare_cache: KVCache | None = None
        self._spare_lock = threading.Lock()  # two threads' new_cache never get the same spare
        # the paged layout's pool of blocks, shared by every sequence this engine runs
        self.pool = BlockPool(config.model, config.kv_cache, self.device) if config.kv_cache.layout == "paged" \
            else None
        # on a GPU, one sequence at a time decodes through captured CUDA graphs on the decoder's own cache
        self.decoder = cuda_graph.GraphedDecoder(self) if cuda_graph.wanted(config, self.device) else None

    @classmethod
    def from_checkpoint(cls, config: Config, directory: str | Path, num_layers: int | None = None) -> Engine:
        """A real local Hugging Face Qwen3 checkpoint, optionally cut to its first num_layers layers."""
        model_cfg = checkpoint_config(directory, num_layers)
        config = Config(model=model_cfg, inference=config.inference, kv_cache=config.kv_cache,
                        server=config.server)
        weights = load_checkpoint(directory, model_cfg, TORCH_DTYPES[config.inference.dtype])
        return cls(config, build_model(model_cfg, weights, resolve_device(config.inference.device)))

    def new_cache(self, graphed: bool = False) -> KVCache | PagedKVCache | None:
        """A cache for one sequence: contiguous, a sequence in the engine's block pool, or None when the cache is
        disabled. graphed: the CUDA-graph decoder's own cache, when this engine has one and no other sequence
        holds it. Give it back with release_cache."""
        if graphed and self.decoder is not None and self.decoder.acquire() is not None:
            return self.decoder.cache
        kv = self.config.kv_cache
        if not kv.enable:
            return None
        if kv.layout == "paged":
            return PagedKVCache(self.pool, self.config.model.num_hidden_layers,
                                self.config.model.max_position_embeddings)
        with self._spare_lock:
            spare, self.spare_cache = self.spare_cache, None
        if spare is not None:
            spare.clear()
            return spare
        return KVCache(self.config.model, kv, self.device)

    def release_cache(self, cache) -> None:
        """A sequence is done with its cache: a paged cache's blocks go back to the pool, the decoder's cache to the
        decoder, a contiguous one to the next new_cache (so it must not be used after this)."""
        if cache is None:
            return
        cache.free()
        if self.decoder is not None and cache is self.decoder.cache:
            self.decoder.release()
        elif isinstance(cache, KVCache) and (cache.model, cache.kv, cache.batch) == (self.config.model,
                                                                                  self.config.kv_cache, 1):
            self.spare_cache = cache  # one this engine's new_cache would have made: kept for the next sequence

    def prefill(self, cache, prompt: list[int], chunk: int = 0) -> tuple[torch.Tensor, int]:
        """Fill the cache with the prompt from where it stands -> (logits of the last position computed
        [1, 1, vocab], positions reused). On an empty cache with prefix caching, the prompt's leading full blocks
        already in the pool are reused, not computed. chunk > 0: at most chunk positions in this call (chunked
        prefill, kvbook.runtime.scheduler); call again until cache.length == len(prompt)."""
        reused = cache.reuse_prefix(prompt) if self.prefix_caching and cache.length == 0 else 0
        start = cache.length
        end = min(len(prompt), start + chunk) if chunk > 0 else len(prompt)
        ids = torch.tensor([prompt[start:end]], device=self.device)  # [1, T]: positions not reused, one pass
        positions = torch.arange(start, end, device=self.device)  # [T]
        with torch.inference_mode():
            logits = self.model(ids, positions, cache, compute_dtype=self.prefill_dtype)  # [1, 1, vocab]
        if self.prefix_caching:
            cache.register_full_blocks(prompt[:end])
        return logits, reused

    def decode(self, tokens: list[int], caches: list, batched: bool = False) -> torch.Tensor:
        """One decode step: tokens[b] goes in at the next position of caches[b] -> logits [B, 1, vocab]. It computes
        in decode_dtype, or with batched (a scheduler that may batch) as a batched step (kvbook.kernels), whose rows
        are padded so that a row's numbers do not depend on its neighbours. The decoder's cache replays its CUDA
        graph."""
        if not batched and self.decoder is not None and caches[0] is self.decoder.cache:
            return self.decoder.step(tokens[0])  # the same step, replayed from a CUDA graph
        ids, positions, batch = prepare_decode(tokens, caches, self.device)  # [B, 1], [B]
        if not batched:
            with torch.inference_mode():
                return self.model(ids, positions, batch, compute_dtype=self.decode_dtype)  # [B, 1, vocab]
        self.prepare_batched_decode()
        with torch.inference_mode(), self.kernels.batched_step():
            return self.model(ids, positions, batch, compute_dtype=self.batched_decode_dtype)  # [B, 1, vocab]

    def recompute(self, tokens: list[int]) -> torch.Tensor:
        """Without a cache: every position so far, computed again -> logits of the last one [1, 1, vocab]."""
        ids = torch.tensor([tokens], device=self.device)  # [1, T]
        with torch.inference_mode():
            return self.model(ids, torch.arange(len(tokens), device=self.device), None,
                              compute_dtype=self.prefill_dtype)  # [1, 1, vocab]

    def prepare_batched_decode(self) -> None:
        """What a batched step needs (the weights packed for FBGEMM where that is its kernel: seconds), when a
        scheduler that batches first needs it. Once per engine."""
        if not self.batched_ready:
            self.kernels.prepare_batched(self.model, self.config.model, self.progress)
            self.batched_ready = True

    def describe_kernels(self) -> dict:
        """Which arithmetic each phase runs and why, and the bytes kept for the weights (JSON-ready)."""
        return {**self.kernels.to_json(), "weight_bytes_kept": weight_bytes_kept(self.model),
                "weight_bytes_values": sum(p.nbytes for p in self.model.parameters())}

    def sampling_generator(self, temperature: float, top_p: float, seed: int | None,
                           top_k: int = 0) -> torch.Generator | None:
        """Check the sampling options -> the sequence's own seeded generator (None for greedy decoding)."""
        check_sampling(temperature, top_p, top_k)
        if temperature == 0:
            return None
        return torch.Generator(self.device).manual_seed(seed if seed is not None else 0)

    def check_request(self, prompt_len: int, max_new_tokens: int, tokens_name: str = "max_new_tokens") -> None:
        """Refuse, before any work, a request that the positions or the cache cannot hold. tokens_name: what the
        caller calls the new-token count (the server's requests say max_tokens)."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty; give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"{tokens_name} = {max_new_tokens}: must be >= 1")
        needed = positions_needed(prompt_len, max_new_tokens)  # the last generated token is never fed back
        limit = self.config.model.max_position_embeddings
        if needed > limit:
            raise ValueError(f"{prompt_len} prompt + {max_new_tokens} new tokens need {needed} positions but "
                             f"max_position_embeddings is {limit}; shorten the prompt or {tokens_name}")
        kv = self.config.kv_cache
        if kv.enable and kv.layout == "paged":
            capacity = self.pool.num_blocks * self.pool.block_size
            if needed > capacity:
                raise CacheFullError(
                    f"{prompt_len} prompt + {max_new_tokens} new tokens need {needed} cache positions but the whole "
                    f"block pool holds {capacity}; raise [kv_cache] pool_mib or generate fewer tokens")
        elif kv.enable and needed > kv.max_cache_len:
            raise CacheFullError(
                f"{prompt_len} prompt + {max_new_tokens} new tokens need {needed} cache positions but "
                f"max_cache_len is {kv.max_cache_len}; raise [kv_cache] max_cache_len to at least {needed} "
                f"(--set kv_cache.max_cache_len={needed}) or generate fewer tokens")

    def stream(self, input_ids: list[int], max_new_tokens: int | None = None, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False, tracer=None, top_k: int = 0):
        """Yield a Step per generated token. Stop on EOS (unless ignore_eos) or after max_new_tokens.

        The sequence runs through the same loop as a batch (kvbook.runtime.scheduler), with room for one sequence:
        its decode steps compute in decode_dtype and, on a GPU, replay the CUDA-graph decoder.
        Closing the generator early (a client that went away) ends the run and frees its cache.
        tracer: a kvbook.tools.trace.Tracer to record shapes, cache lengths and timings of every step.
        """
        scheduler = Scheduler(self, max_num_seqs=1)
        seq = scheduler.add(input_ids, max_new_tokens, temperature, top_p, seed, ignore_eos, tracer=tracer, top_k=top_k)
        yield from self._run_alone(scheduler, seq)

    def _run_alone(self, scheduler: Scheduler, seq):
        """Step a scheduler holding one sequence until it finishes, yielding each Step as it comes."""
        emitted = 0
        try:
            while not seq.finished:
                scheduler.step()
                if seq.error is not None:
                    raise seq.error
                if seq in scheduler.waiting:  # only another sequence on this engine's block pool keeps it out
                    raise CacheFullError(
                        f"the block pool has {len(self.pool.free_blocks)} free blocks but this request may need "
                        f"{self.pool.blocks_for(seq.positions_needed)}: other open streams hold the rest; "
                        "close them or raise [kv_cache] pool_mib")
                yield from seq.steps[emitted:]
                emitted = len(seq.steps)
        finally:
            scheduler.abort(seq)
            scheduler.drop_aborted()  # its cache goes back at once, also when the caller stopped early

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int | None = None,
                       ignore_eos: bool = False) -> list[Generation]:
        """Greedy generation for several prompts at once (kvbook.runtime.scheduler with room for all of them). Each
        prompt is prefilled on its own (so prompts may differ in length), then every decode step feeds the last
        token of every unfinished sequence together, input [B, 1]: each weight is read once for B tokens. A
        sequence leaves the batch when it stops (EOS or max_new_tokens). Each Step's ms is the whole pass.

        A decode step of several sequences computes as a batched step (kvbook.kernels)."""
        scheduler = Scheduler(self, max_num_seqs=len(prompts))
        sequences = [scheduler.add(prompt, max_new_tokens, ignore_eos=ignore_eos) for prompt in prompts]
        scheduler.run_until_done()
        for seq in sequences:
            if seq.error is not None:
                raise seq.error
        return [seq.generation() for seq in sequences]

    def generate(self, input_ids: list[int], max_new_tokens: int | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False, tracer=None,
                 on_step=None, top_k: int = 0) -> Generation:
        """Run stream()'s loop to the end -> the Generation, with the sequence's own finish reason. on_step: called
        with each Step as it comes (the CLI prints each token's text while the rest is computed)."""
        scheduler = Scheduler(self, max_num_seqs=1)
        seq = scheduler.add(input_ids, max_new_tokens, temperature, top_p, seed, ignore_eos, tracer=tracer, top_k=top_k)
        for step in self._run_alone(scheduler, seq):
            if on_step is not None:
                on_step(step)
        return seq.generation()
