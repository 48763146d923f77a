"""One request: the Sequence that carries it (prompt, options, cache, steps, finish reason), the rules of when it
stops and how many positions it needs, written once here, and what it produces: a Step per generated token and the
Generation they make up. Explained in chapters 4, 5 and 11.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from ..tokenizer import EOS_IDS


def positions_needed(prompt_len: int, max_new_tokens: int) -> int:
    """Cache positions a request fills at most: the prompt and every generated token but the last, which is never
    fed back (256 prompt + 128 new tokens: 383)."""
    return prompt_len + max_new_tokens - 1


def check_sampling(temperature: float, top_p: float, top_k: int = 0) -> None:
    """Refuse sampling options no sampler can use, one line naming the option."""
    if temperature < 0:
        raise ValueError(f"temperature = {temperature:g}: must be >= 0 (0 is greedy decoding)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p:g}: must be in (0, 1] (1 keeps every token)")
    if top_k < 0:
        raise ValueError(f"top_k = {top_k}: must be >= 0 (0 keeps every token)")


def check_token_ids(input_ids: list[int], vocab_size: int) -> None:
    """Refuse a prompt with an id the embedding has no row for: one line, not an IndexError deep in the model."""
    bad = next((i for i in input_ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size}) of model.vocab_size = "
                         f"{vocab_size}; give ids below it, or raise model.vocab_size (Qwen3's is 151936)")


def stops_on(token: int, ignore_eos: bool) -> bool:
    """The stop rule: an EOS token ends the sequence, unless ignore_eos (benchmarks generate a fixed length)."""
    return token in EOS_IDS and not ignore_eos


def finish_reason(token: int, generated: int, max_new_tokens: int, ignore_eos: bool) -> str | None:
    """After `generated` tokens, the latest being `token`: "stop" (stops_on), "length" (max_new_tokens reached) or
    None (the sequence goes on)."""
    if stops_on(token, ignore_eos):
        return "stop"
    return "length" if generated >= max_new_tokens else None


@dataclass(frozen=True)
class Step:
    """One generated token: index 0 comes from prefill, 1.. from decode steps."""

    index: int
    phase: str  # "prefill" or "decode"
    token_id: int
    ms: float  # the forward pass and the choice of the token, synchronized
    cache_len: int  # positions in every layer's cache after this step (0 with the cache disabled)
    positions_computed: int  # 256 in prefill; 1 per decode step with the cache, the whole sequence without
    cache_lens: tuple[int, ...] = ()  # each layer's cache length after this step (empty with the cache disabled)
    blocks: int | None = None  # paged layout: blocks the sequence holds after this step


@dataclass
class Generation:
    input_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (an EOS token) or "length" (max_new_tokens reached)
    steps: list[Step] = field(repr=False)

    @property
    def ttft_ms(self) -> float:
        """Time to first token: prefill plus choosing the first token."""
        return self.steps[0].ms

    @property
    def step_ms(self) -> list[float]:
        return [step.ms for step in self.steps[1:]]

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: the mean decode step (None if there was no decode step)."""
        return statistics.fmean(self.step_ms) if len(self.steps) > 1 else None

    @property
    def cache_len(self) -> int:
        return self.steps[-1].cache_len


def make_step(index: int, phase: str, token: int, ms: float, cache, positions_computed: int) -> Step:
    """A Step with the cache's state after it (cache None: the cache is disabled)."""
    if cache is None:
        return Step(index, phase, token, ms, 0, positions_computed)
    return Step(index, phase, token, ms, cache.length, positions_computed, tuple(cache.lengths()), cache.num_blocks)


@dataclass(eq=False)
class Sequence:
    """One request from arrival to finish: its prompt, sampling options, cache, the Step of every token it got,
    and why it finished. The scheduler (kvbook.runtime.scheduler) and the server (kvbook.serving) share it."""

    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    top_k: int = 0
    steps: list[Step] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    error: Exception | None = None
    cached_positions: int = 0  # prompt positions taken from the prefix cache instead of computed
    prefill_ms: float = 0.0  # chunked prefill: the passes of its chunks so far
    aborted: bool = False  # set from any thread; the scheduler frees the sequence at its next step
    cache: object = field(default=None, repr=False)
    generator: torch.Generator | None = field(default=None, repr=False)
    tracer: object = field(default=None, repr=False)  # a kvbook.tools.trace.Tracer recording its passes, or None

    @property
    def output_ids(self) -> list[int]:
        return [step.token_id for step in self.steps]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def generation(self) -> Generation:
        return Generation(list(self.prompt), self.output_ids, self.finish_reason or "length", list(self.steps))

    @property
    def positions_needed(self) -> int:
        return positions_needed(len(self.prompt), self.max_new_tokens)

    def positions_computed(self, phase: str) -> int:
        """Positions the pass that gave its next token computes: the prompt but its reused prefix in prefill, one
        per decode step, and every position so far with the cache disabled."""
        if self.cache is None:
            return len(self.prompt) + len(self.steps)
        return len(self.prompt) - self.cached_positions if phase == "prefill" else 1

    def stops_on(self, token: int) -> bool:
        return stops_on(token, self.ignore_eos)

    def finish_after(self, token: int) -> str | None:
        """Why the sequence finishes with `token`, its latest Step ("stop", "length"), or None to go on."""
        return finish_reason(token, len(self.steps), self.max_new_tokens, self.ignore_eos)
