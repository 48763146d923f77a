"""What quantization costs (kvbook.model.quant, kvbook.cache.kv_quant), measured: the same tokens fed to two engines,
their next-token distributions compared position by position. Used by chapter 12 ("Reading fewer bytes")
and the tests.
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def teacher_forced_logits(engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Prefill `prompt`, then decode feeding `tokens` (another engine's greedy choices) one at a time ->
    float32 logits [len(tokens) + 1, vocab]: row 0 from prefill, row i after feeding tokens[i - 1]. Both engines
    then see the same history, so their logits compare position by position even where a near-tie flipped."""
    cache = engine.new_cache()
    logits, _ = engine.prefill(cache, prompt)  # [1, 1, vocab]
    rows = [logits[0, -1].float()]
    for token in tokens:
        rows.append(engine.decode([token], [cache])[0, -1].float())  # a lone decode step, [1, 1, vocab]
    engine.release_cache(cache)
    return torch.stack(rows).cpu()  # [len(tokens) + 1, vocab]


def logit_error(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """reference, other [steps, vocab] float32 -> the largest absolute difference, that relative to the
    reference logits' spread (their standard deviation over the vocabulary, averaged over steps), and the KL
    divergence KL(reference || other) of the next-token distributions (mean and max over steps, in nats)."""
    difference = float((reference - other).abs().max())
    spread = float(reference.std(dim=-1).mean())
    kl = torch.sum(torch.softmax(reference, -1) * (torch.log_softmax(reference, -1) - torch.log_softmax(other, -1)),
                   dim=-1)  # [steps]
    return {"max_abs_error": difference, "logit_spread": spread, "relative_error": difference / spread,
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def greedy_agreement(reference: list[int], other: list[int]) -> dict[str, float]:
    """Two greedy runs from the same prompt: the share of equal tokens and the first step that differs."""
    same = [a == b for a, b in zip(reference, other, strict=True)]
    first = same.index(False) if not all(same) else len(same)
    return {"agreement": sum(same) / len(same), "first_difference": first}
