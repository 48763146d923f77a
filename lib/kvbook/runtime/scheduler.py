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

A sequence's tokens do not depend on its neighbours: each row of a decode step attends to its own cache, and
the step computes in one dtype whatever the batch size (Engine.batch_dtype, measured for the machine by
kvbook.runtime.paths), and its rows are padded as kvbook.runtime.paths measured
(kvbook.model.linear.batch_invariant_rows). With
max_num_seqs = 1 there is never a batch and decode runs in the lone step's dtype (Engine.decode_dtype), as
Engine.stream does. Explained in chapter 11 ("Tuning the service").
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..model.linear import batch_invariant_rows
from .inputs import prepare_decode
from .sampling import sample_next
from .sequence import Sequence, make_step


@dataclass(frozen=True)
class BatchStep:
    """One forward pass of the scheduler, for the timeline of chapter 11."""

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
        if not engine.config.kv_cache.enable:
            raise ValueError("batched generation needs the KV cache; set kv_cache.enable = true")
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.decode_dtype = engine.batch_dtype if max_num_seqs > 1 else engine.decode_dtype  # kvbook.runtime.paths
        if max_num_seqs > 1:
            engine.prepare_batched_decode()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.timeline: list[BatchStep] | None = [] if record_timeline else None
        self._next_id = 0
        self._last_phase = ""

    def add(self, prompt: list[int], max_new_tokens: int | None = None, temperature: float = 0.0,
            top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False) -> Sequence:
        """Queue a request (checked now, so a bad one fails here and not inside a batch)."""
        if max_new_tokens is None:
            max_new_tokens = self.engine.config.inference.output_len
        self.engine.check_request(len(prompt), max_new_tokens)
        seq = Sequence(self._next_id, list(prompt), max_new_tokens, temperature, top_p, seed, ignore_eos,
                       generator=self.engine.sampling_generator(temperature, top_p, seed))
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Sequence]:
        """One forward pass; returns the sequences that got a token (each has it as steps[-1]) or failed."""
        self._drop_aborted()
        decoding = [s for s in self.running if s.steps]
        prefilling = next((s for s in self.running if not s.steps), None)  # between two chunks of its prompt
        if prefilling is not None and not (decoding and self._last_phase == "prefill"):
            batch, phase = [prefilling], "prefill"  # its next chunk; a decode step ran since the last one
        elif prefilling is None and self.waiting and self._can_admit(self.waiting[0]):
            batch = [self.waiting.popleft()]
            self.running.append(batch[0])
            phase = "prefill"
        elif decoding:
            batch, phase = decoding, "decode"
        else:
            return []
        self._last_phase = phase
        started = time.perf_counter()
        try:
            tokens = self._prefill(batch[0]) if phase == "prefill" else self._decode(batch)
        except Exception as err:  # noqa: BLE001 - the sequences of this pass fail, the scheduler goes on
            for seq in batch:
                seq.error, seq.finish_reason = err, "error"
            self._retire(batch)
            return batch
        ms = (time.perf_counter() - started) * 1e3
        if not tokens:  # a chunk of a prompt that is not finished: no token yet
            batch[0].prefill_ms += ms
            self._record(phase, ms, batch)
            return []
        for seq, token in zip(batch, tokens, strict=True):
            computed = len(seq.prompt) - seq.cached_positions if phase == "prefill" else 1
            step_ms = seq.prefill_ms + ms if phase == "prefill" else ms  # TTFT's compute: every chunk
            seq.steps.append(make_step(len(seq.steps), phase, token, step_ms, seq.cache, computed))
            if self.engine.prefix_caching:
                seq.cache.register_full_blocks(seq.prompt + seq.output_ids)
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

    # -- internals --

    def _prefill(self, seq: Sequence) -> list[int]:
        """The prompt, or its next chunk: [first token] once the whole prompt is in the cache, else []."""
        first_chunk = seq.cache is None
        if first_chunk:
            seq.cache = self.engine.new_cache()
        logits, reused = self.engine.prefill(seq.cache, seq.prompt, self.prefill_chunk)  # [1, 1, vocab]
        if first_chunk:
            seq.cached_positions = reused
        if seq.cache.length < len(seq.prompt):
            return []
        return [sample_next(logits[0, -1], seq.temperature, seq.top_p, seq.generator)]

    def _decode(self, batch: list[Sequence]) -> list[int]:
        device = self.engine.device
        ids, positions, inputs = prepare_decode([seq.steps[-1].token_id for seq in batch],
                                                [seq.cache for seq in batch], device)  # [B, 1], [B]
        # rows padded as kvbook.runtime.paths measured, so that a row's numbers do not depend on its neighbours
        invariant = batch_invariant_rows(self.engine.paths.batch_row_multiple) if self.max_num_seqs > 1 \
            else contextlib.nullcontext()
        with torch.inference_mode(), invariant:
            logits = self.engine.model(ids, positions, inputs,
                                       compute_dtype=self.decode_dtype)  # [B, 1, vocab]
        return [sample_next(logits[b, -1], seq.temperature, seq.top_p, seq.generator) for b, seq in enumerate(batch)]

    def _worst_case_blocks(self, seq: Sequence) -> int:
        return -(-seq.positions_needed // self.engine.pool.block_size)

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

    def _drop_aborted(self) -> None:
        for seq in [s for s in self.waiting if s.aborted]:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
        aborted = [s for s in self.running if s.aborted and not s.finished]
        for seq in aborted:
            seq.finish_reason = "abort"
        self._retire(aborted)

    def _retire(self, finished: list[Sequence]) -> None:
        for seq in finished:
            if seq in self.running:
                self.running.remove(seq)
            if seq.cache is not None:
                seq.cache.free()  # a paged cache's blocks go back to the pool
            seq.cache = None  # a contiguous cache's memory goes with it

    def _record(self, phase: str, ms: float, batch: list[Sequence]) -> None:
        if self.timeline is None:
            return
        live = self.running + [s for s in batch if s not in self.running]
        self.timeline.append(BatchStep(
            len(self.timeline), phase, ms, tuple(s.seq_id for s in batch),
            {s.seq_id: s.cache.length for s in live},
            {s.seq_id: tuple(s.cache.block_table) for s in live if s.cache.block_table is not None}))
