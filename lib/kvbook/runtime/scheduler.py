"""Continuous batching: sequences join the running batch after their prefill and leave it when they finish.

Each call of Scheduler.step() is one forward pass of the model: either the prefill of the next waiting
sequence (new arrivals first, as vLLM does by default) or one decode step of every running sequence together,
input [B, 1], so each weight is read once for B tokens. A sequence is admitted when fewer than max_num_seqs run
and, with the paged layout, when the pool's free blocks cover the worst case of every running sequence and of
the new one (prompt + max_new_tokens - 1 positions): a running sequence never waits for memory. Finished and
aborted sequences give their blocks back at once.

With prefill_chunk > 0 ([server] prefill_chunk, vLLM's chunked prefill) a prompt is prefilled at most
prefill_chunk positions per pass, and a decode step of the running sequences runs between its chunks: a long
prompt no longer stalls everyone's next token for its whole prefill. Its first token comes after the last chunk.

Every generation runs through this loop, one pass per step: schedule -> run the model (kvbook.runtime.engine.Engine
prepares the inputs: prefill, a decode step, or, with the cache disabled, every position again) -> sample -> update
the sequences. Engine.stream and Engine.generate are a Scheduler with room for one sequence; generate_batch,
the server and the bench use the same one with more.

A sequence's tokens do not depend on its neighbours: each row of a decode step attends to its own cache, and when
the scheduler may batch (max_num_seqs > 1) every decode step is a batched step whatever the batch size, its rows
padded to a multiple checked for the machine (kvbook.kernels). With max_num_seqs = 1 there is never a batch:
decode runs in the lone step's dtype (Engine.decode_dtype) and, on a GPU, replays CUDA graphs. Explained in
chapter 11a ("Continuous batching, chunked prefill and prefix caching").
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass

from ..device import synchronize
from .sampling import sample_next
from .sequence import Sequence, check_token_ids, make_step


@dataclass(frozen=True)
class BatchStep:
    """One forward pass of the scheduler, for the timeline of chapter 11a."""

    index: int
    phase: str  # "prefill" (one sequence) or "decode" (every running sequence)
    ms: float
    seq_ids: tuple[int, ...]  # the sequences computed in this pass
    cache_lens: dict[int, int]  # every running sequence's cache length after the pass
    blocks: dict[int, tuple[int, ...]]  # paged layout: every running sequence's block table after the pass


class Scheduler:
    """Runs the requests of one kvbook.runtime.engine.Engine (given, not imported: the engine builds a scheduler
    for generate_batch)."""

    def __init__(self, engine, max_num_seqs: int, record_timeline: bool = False, prefill_chunk: int = 0):
        self.batched = max_num_seqs > 1  # decode steps of several sequences may run (the module's docstring)
        if self.batched and not engine.config.kv_cache.enable:
            raise ValueError("batched generation needs the KV cache; set kv_cache.enable = true")
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        if self.batched:
            engine.prepare_batched_decode()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.timeline: list[BatchStep] | None = [] if record_timeline else None
        self._next_id = 0
        self._last_phase = ""

    def add(self, prompt: list[int], max_new_tokens: int | None = None, temperature: float = 0.0,
            top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False, tracer=None,
            top_k: int = 0) -> Sequence:
        """Queue a request (checked now, so a bad one fails here and not inside a batch). tracer: a
        kvbook.tools.trace.Tracer recording every pass of this sequence (with room for one sequence only)."""
        if max_new_tokens is None:
            max_new_tokens = self.engine.config.inference.output_len
        self.engine.check_request(len(prompt), max_new_tokens)
        check_token_ids(prompt, self.engine.config.model.vocab_size)
        seq = Sequence(self._next_id, list(prompt), max_new_tokens, temperature, top_p, seed, ignore_eos, top_k=top_k,
                       generator=self.engine.sampling_generator(temperature, top_p, seed, top_k), tracer=tracer)
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Sequence]:
        """One forward pass; returns the sequences that got a token (each has it as steps[-1]) or failed."""
        self.drop_aborted()
        batch, phase = self._schedule()
        if not batch:
            return []
        self._last_phase = phase
        seq = batch[0]
        traced = seq.tracer.step(phase, len(seq.steps)) if seq.tracer is not None else contextlib.nullcontext()
        started = time.perf_counter()
        try:
            with traced:
                tokens = self._run(batch, phase)
                synchronize(self.engine.device)
        except Exception as err:  # noqa: BLE001 - the sequences of this pass fail, the scheduler goes on
            for failed in batch:
                failed.error, failed.finish_reason = err, "error"
            self._retire(batch)
            return batch
        ms = (time.perf_counter() - started) * 1e3
        if not tokens:  # a chunk of a prompt that is not finished: no token yet
            seq.prefill_ms += ms
            self._record(phase, ms, batch)
            return []
        for seq, token in zip(batch, tokens, strict=True):
            step_ms = seq.prefill_ms + ms if phase == "prefill" else ms  # TTFT's compute: every chunk
            seq.steps.append(make_step(len(seq.steps), phase, token, step_ms, seq.cache,
                                       seq.positions_computed(phase)))
            if self.engine.prefix_caching and seq.cache is not None:
                seq.cache.register_full_blocks(seq.prompt + seq.output_ids)  # a block filled by decode is shared too
            if seq.tracer is not None:
                seq.tracer.add_step(seq.steps[-1], len(seq.prompt))
            seq.finish_reason = seq.finish_after(token)
        self._record(phase, ms, batch)
        self._retire([seq for seq in batch if seq.finished])
        return batch

    def run_until_done(self) -> None:
        while self.has_work:
            self.step()

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence (its client went away): safe from any thread, effective at the next step."""
        seq.aborted = True

    def drop_aborted(self) -> None:
        """Retire the aborted sequences now: their caches go back."""
        for seq in [s for s in self.waiting if s.aborted]:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
        aborted = [s for s in self.running if s.aborted and not s.finished]
        for seq in aborted:
            seq.finish_reason = "abort"
        self._retire(aborted)

    # -- internals --

    def _schedule(self) -> tuple[list[Sequence], str]:
        """The sequences of the next pass and its phase: the next chunk of a prompt being prefilled (once a decode
        step ran since its last chunk), else a new arrival's prefill, else a decode step of every running
        sequence; ([], "") when nothing can run."""
        decoding = [s for s in self.running if s.steps]
        prefilling = next((s for s in self.running if not s.steps), None)  # between two chunks of its prompt
        if prefilling is not None and not (decoding and self._last_phase == "prefill"):
            return [prefilling], "prefill"
        if prefilling is None and self.waiting and self._can_admit(self.waiting[0]):
            seq = self.waiting.popleft()
            # a lone sequence decodes on the CUDA-graph decoder's cache when it is free and nobody traces modules
            seq.cache = self.engine.new_cache(graphed=not self.batched and seq.tracer is None)
            self.running.append(seq)
            return [seq], "prefill"
        if decoding:
            return decoding, "decode"
        return [], ""

    def _run(self, batch: list[Sequence], phase: str) -> list[int]:
        """Run the model for this pass and sample -> a token per sequence ([] after a prompt chunk that is not
        the last)."""
        engine = self.engine
        if batch[0].cache is None:  # the cache is disabled: every position so far, again
            seq = batch[0]
            logits = engine.recompute(seq.prompt + seq.output_ids)  # [1, 1, vocab]
        elif phase == "prefill":
            seq = batch[0]
            first_chunk = seq.cache.length == 0
            logits, reused = engine.prefill(seq.cache, seq.prompt, self.prefill_chunk)  # [1, 1, vocab]
            if first_chunk:
                seq.cached_positions = reused
            if seq.cache.length < len(seq.prompt):
                return []
        else:
            logits = engine.decode([seq.steps[-1].token_id for seq in batch], [seq.cache for seq in batch],
                                   self.batched)  # [B, 1, vocab]
        return self._sample(logits, batch)

    def _sample(self, logits, batch: list[Sequence]) -> list[int]:
        """logits [B, 1, vocab] -> each sequence's next token, with its own options and generator."""
        return [sample_next(logits[b, -1], seq.temperature, seq.top_p, seq.generator, seq.top_k)
                for b, seq in enumerate(batch)]

    def _worst_case_blocks(self, seq: Sequence) -> int:
        return self.engine.pool.blocks_for(seq.positions_needed)

    def _can_admit(self, seq: Sequence) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False
        pool = self.engine.pool
        if pool is None:
            return True
        # blocks the running sequences may still take; the new one's worst case ignores the prefix blocks it may
        # share (the safe side)
        promised = sum(self._worst_case_blocks(s) - s.cache.num_blocks for s in self.running)
        return len(pool.free_blocks) - promised >= self._worst_case_blocks(seq)

    def _retire(self, finished: list[Sequence]) -> None:
        for seq in finished:
            if seq in self.running:
                self.running.remove(seq)
            self.engine.release_cache(seq.cache)  # a paged cache's blocks go back to the pool
            seq.cache = None  # a contiguous cache's memory goes with it

    def _record(self, phase: str, ms: float, batch: list[Sequence]) -> None:
        if self.timeline is None:
            return
        live = self.running + [s for s in batch if s not in self.running]
        self.timeline.append(BatchStep(
            len(self.timeline), phase, ms, tuple(s.seq_id for s in batch),
            {s.seq_id: s.cache.length if s.cache is not None else 0 for s in live},
            {s.seq_id: tuple(s.cache.block_table) for s in live
             if s.cache is not None and s.cache.block_table is not None}))
