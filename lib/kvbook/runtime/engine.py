"""Prefill and decode as two visible phases.

Prefill runs every prompt position once, fills the caches and gives the first generated token from the last
position's logits. Each decode step feeds the token just generated (not a hidden state), attends to the
cache, appends one position and gives the next token. After 256 prompt + 128 generated tokens the cache
holds 383 positions: the last token is never fed back. Explained in chapters 4 ("Prefill") and 5 ("Decode").
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch

from ..cache import kv_quant
from ..cache.contiguous import CacheFullError, KVCache
from ..cache.paged import BlockPool, PagedKVCache
from ..config import Config
from ..device import TORCH_DTYPES, enable_huge_pages, keep_freed_memory, resolve_device, synchronize
from ..model import quant
from ..model.linear import (
    FBGEMM,
    MATVEC,
    ONEDNN,
    add_copies,
    batch_invariant_rows,
    pack_model,
    packed_products,
    reorder_copies,
    split_long_inputs,
    use_matvec,
    use_onednn,
    weight_bytes_kept,
)
from ..model.qwen3 import Qwen3ForCausalLM
from ..model.weights import (
    attach_prefill_weights,
    build_model,
    checkpoint_config,
    has_prefill_weights,
    load_checkpoint,
    load_random_weights,
    prefill_copies,
    saves_held,
)
from . import cuda_graph
from .inputs import prepare_decode
from .paths import ComputePaths, PhasePath, choose_paths, int8_decode_paths, reorders_prefill_copy
from .scheduler import Scheduler
from .sequence import Generation, check_sampling, positions_needed


class Engine:
    """Holds the model on its device and runs prefill + decode for one sequence at a time."""

    def __init__(self, config: Config, model: Qwen3ForCausalLM | None = None, progress: bool = True,
                 paths: ComputePaths | None = None):
        """paths: the arithmetic dtype of each phase; by default measured once per machine (kvbook.runtime.paths)."""
        enable_huge_pages()  # before the weights are allocated; no effect if this process allocated tensors already
        keep_freed_memory()  # a prefill's activations reuse freed memory instead of faulting in new pages
        self.device = resolve_device(config.inference.device)
        self.dtype = TORCH_DTYPES[config.inference.dtype]
        started = time.perf_counter()
        self.paths = paths or choose_paths(config, self.device, progress)
        self.prefill_dtype = self.paths.prefill.dtype
        self.decode_dtype = self.paths.decode.dtype  # a lone sequence's decode step
        self.batched_decode_dtype = self.paths.batched_decode.dtype  # a scheduler's step that may batch sequences
        self.prefix_caching = config.kv_cache.prefix_caching
        self.progress = progress
        self.batched_ready = False  # prepare_batched_decode has run
        separate_prefill = self.prefill_dtype != self.dtype
        drawn = model is None  # random weights, from the weight cache (kvbook.model.weights)
        # a lone or batched step computes in prefill's dtype: its copy is theirs too
        steps_share_prefill_copy = self.prefill_dtype in (self.decode_dtype, self.batched_decode_dtype)
        with saves_held():  # the weight cache is written once the model is whole, int8 matrices too
            if model is None:
                # a copy that decode steps stream too (int8 steps read their own matrices) is read into memory, not
                # mapped (kvbook.model.weights)
                weights, prefill = load_random_weights(
                    config.model, self.dtype, self.prefill_dtype if separate_prefill else None, progress,
                    decode_reads_prefill_copy=steps_share_prefill_copy and config.inference.weight_dtype != "int8")
                model = build_model(config.model, weights, self.device)
                if separate_prefill:
                    attach_prefill_weights(model, prefill)
            elif separate_prefill and not has_prefill_weights(model, self.prefill_dtype):  # a model of another Engine
                attach_prefill_weights(model, prefill_copies(config.model, dict(model.named_parameters()),
                                                             self.prefill_dtype))
            kv_quant.check_cache_dtype(config.kv_cache.cache_dtype, self.device)
            if config.inference.weight_dtype == "int8":  # int8 matrices for decode (kvbook.model.quant)
                quant.quantize_model(model, self.device, self.dtype, drawn_from=config.model if drawn else None)
                self.paths = int8_decode_paths(self.paths, quant.activation_dtype(self.device, self.dtype))
            else:
                add_copies(model, self.decode_dtype)  # every matrix, lm_head too
                model.lm_head.row_dtype = self.decode_dtype  # prefill's last position is one row too
                if self.paths.split_wide_rows:
                    split_long_inputs(model, self.decode_dtype)
            # every caller's product of several prefill rows follows this engine's kernel, not only ours; a model
            # shared with an earlier engine takes this one's choice, as it takes its copies and lm_head's row dtype
            use_onednn(model, self.prefill_dtype if self.paths.prefill.kernel == ONEDNN else None)
            use_matvec(model, self.paths.decode.kernel == MATVEC)
            # prefill's copy laid out once for oneDNN where that changes no number, unless a lone or batched step
            # multiplies by it too (kvbook.model.linear: what was measured for those phases is F.linear's speed)
            if (reorders_prefill_copy(config, self.prefill_dtype, self.paths.prefill.kernel, self.device)
                    and not steps_share_prefill_copy):
                reorder_copies(model, self.prefill_dtype)
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

    def prefill(self, cache, prompt: list[int], chunk: int = 0, batched: bool = False) -> tuple[torch.Tensor, int]:
        """Fill the cache with the prompt from where it stands -> (logits of the last position computed
        [1, 1, vocab], positions reused). On an empty cache with prefix caching, the prompt's leading full blocks
        already in the pool are reused, not computed. chunk > 0: at most chunk positions in this call (chunked
        prefill, kvbook.runtime.scheduler); call again until cache.length == len(prompt). batched: for a
        scheduler that batches, whose weights may be packed for FBGEMM (prefill_path_for)."""
        reused = cache.reuse_prefix(prompt) if self.prefix_caching and cache.length == 0 else 0
        start = cache.length
        end = min(len(prompt), start + chunk) if chunk > 0 else len(prompt)
        ids = torch.tensor([prompt[start:end]], device=self.device)  # [1, T]: positions not reused, one pass
        positions = torch.arange(start, end, device=self.device)  # [T]
        path = self.prefill_path_for(batched, end - start)
        packed = contextlib.nullcontext()
        if path.kernel == FBGEMM:
            self.prepare_batched_decode()  # packs the weights, once
            packed = packed_products()
        with torch.inference_mode(), packed:
            logits = self.model(ids, positions, cache, compute_dtype=path.dtype)  # [1, 1, vocab]
        if self.prefix_caching:
            cache.register_full_blocks(prompt[:end])
        return logits, reused

    def decode(self, tokens: list[int], caches: list, batched: bool = False) -> torch.Tensor:
        """One decode step: tokens[b] goes in at the next position of caches[b] -> logits [B, 1, vocab]. It computes
        in decode_dtype, or with batched (a scheduler that may batch) in batched_decode_dtype with rows padded as
        kvbook.runtime.paths measured, so that a row's numbers do not depend on its neighbours. The decoder's
        cache replays its CUDA graph."""
        if not batched and self.decoder is not None and caches[0] is self.decoder.cache:
            return self.decoder.step(tokens[0])  # the same step, replayed from a CUDA graph
        if batched:
            self.prepare_batched_decode()
        ids, positions, batch = prepare_decode(tokens, caches, self.device)  # [B, 1], [B]
        path = self.decode_path_for(batched)
        invariant = batch_invariant_rows(self.paths.batch_row_multiple) if batched else contextlib.nullcontext()
        packed = packed_products() if path.kernel == FBGEMM else contextlib.nullcontext()
        with torch.inference_mode(), invariant, packed:
            return self.model(ids, positions, batch, compute_dtype=path.dtype)  # [B, 1, vocab]

    def prefill_path_for(self, batched: bool, rows: int) -> PhasePath:
        """How a prefill pass of `rows` prompt positions computes: prefill's path, or, in a scheduler that batches
        on FBGEMM's packed weights, those weights when kvbook.runtime.paths measured them faster for that many
        rows (a short prompt: float32's product of a few rows is slow on some CPUs)."""
        if batched and self.paths.batched_decode.kernel == FBGEMM and rows <= self.paths.packed_prefill_rows:
            return PhasePath(torch.float32, f"the batched step's weights packed for FBGEMM, for passes of up to "
                                            f"{self.paths.packed_prefill_rows} rows", kernel=FBGEMM)
        return self.paths.prefill

    def decode_path_for(self, batched: bool) -> PhasePath:
        """How a decode step computes: a lone sequence's path, or that of a scheduler that may batch."""
        return self.paths.batched_decode if batched else self.paths.decode

    def recompute(self, tokens: list[int]) -> torch.Tensor:
        """Without a cache: every position so far, computed again -> logits of the last one [1, 1, vocab]."""
        ids = torch.tensor([tokens], device=self.device)  # [1, T]
        with torch.inference_mode():
            return self.model(ids, torch.arange(len(tokens), device=self.device), None,
                              compute_dtype=self.prefill_dtype)  # [1, 1, vocab]

    def prepare_batched_decode(self) -> None:
        """Give every matrix a batched_decode_dtype copy, or pack it for FBGEMM where that is the batched step's
        kernel (kvbook.model.linear), when a scheduler that batches, or a batched step, first needs it (an int8
        model reads its int8 weights for a few rows, kvbook.model.quant). Once per engine."""
        if self.batched_ready:
            return
        if self.paths.batched_decode.kernel == FBGEMM:
            pack_model(self.model, self.progress)
        else:
            add_copies(self.model, self.batched_decode_dtype)
        self.batched_ready = True

    def describe_paths(self) -> dict:
        """Which arithmetic each phase runs and why, and the bytes kept for the weights (JSON-ready)."""
        copies = [getattr(m, "copies", {}).get(self.prefill_dtype) for m in self.model.modules()]
        reordered = any(c is not None and c.is_mkldnn for c in copies)  # by this engine or one sharing the model
        return {**self.paths.to_json(), "prefill_copy_reordered_for_onednn": reordered,
                "weight_bytes_kept": weight_bytes_kept(self.model),
                "weight_bytes_values": sum(p.nbytes for p in self.model.parameters())}

    def sampling_generator(self, temperature: float, top_p: float, seed: int | None) -> torch.Generator | None:
        """Check the sampling options -> the sequence's own seeded generator (None for greedy decoding)."""
        check_sampling(temperature, top_p)
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
               top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False, tracer=None):
        """Yield a Step per generated token. Stop on EOS (unless ignore_eos) or after max_new_tokens.

        The sequence runs through the same loop as a batch (kvbook.runtime.scheduler), with room for one sequence:
        its decode steps compute in decode_dtype and, on a GPU, replay the CUDA-graph decoder.
        Closing the generator early (a client that went away) ends the run and frees its cache.
        tracer: a kvbook.tools.trace.Tracer to record shapes, cache lengths and timings of every step.
        """
        scheduler = Scheduler(self, max_num_seqs=1)
        seq = scheduler.add(input_ids, max_new_tokens, temperature, top_p, seed, ignore_eos, tracer=tracer)
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

        A decode step of several sequences computes in batched_decode_dtype, measured for this machine
        (kvbook.runtime.paths)."""
        scheduler = Scheduler(self, max_num_seqs=len(prompts))
        sequences = [scheduler.add(prompt, max_new_tokens, ignore_eos=ignore_eos) for prompt in prompts]
        scheduler.run_until_done()
        for seq in sequences:
            if seq.error is not None:
                raise seq.error
        return [seq.generation() for seq in sequences]

    def generate(self, input_ids: list[int], max_new_tokens: int | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False, tracer=None,
                 on_step=None) -> Generation:
        """Run stream()'s loop to the end -> the Generation, with the sequence's own finish reason. on_step: called
        with each Step as it comes (the CLI prints each token's text while the rest is computed)."""
        scheduler = Scheduler(self, max_num_seqs=1)
        seq = scheduler.add(input_ids, max_new_tokens, temperature, top_p, seed, ignore_eos, tracer=tracer)
        for step in self._run_alone(scheduler, seq):
            if on_step is not None:
                on_step(step)
        return seq.generation()
