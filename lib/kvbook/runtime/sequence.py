"""What a request produces: a Step per generated token and the Generation they make up. Explained in chapters 4
and 5; the scheduler's Sequence (kvbook.runtime.scheduler) collects them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


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
