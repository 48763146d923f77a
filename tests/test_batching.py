"""Batched decode: B sequences of different lengths, one decode step for all of them, each sequence's tokens and
cache exactly what it would be alone (float32), per-sequence stop, with the contiguous and the paged cache."""

import pytest
import torch
from kvbook.runtime.engine import Engine
from kvbook.runtime.inputs import prepare_decode

from .conftest import small_config

PROMPTS = [list(range(1000, 1012)), list(range(2000, 2031)), [9707], list(range(3000, 3016))]


@pytest.fixture(params=["contiguous", "paged"])
def engine(request, weight_cache):
    cfg = small_config(vocab=151936, max_cache_len=128).replace(kv_cache={"layout": request.param})
    return Engine(cfg, progress=False)


def test_batched_tokens_equal_each_sequence_alone(engine):
    alone = [engine.generate(p, 10, ignore_eos=True) for p in PROMPTS]
    batch = engine.generate_batch(PROMPTS, 10, ignore_eos=True)
    assert [r.output_ids for r in batch] == [r.output_ids for r in alone]
    assert [r.cache_len for r in batch] == [len(p) + 9 for p in PROMPTS]
    for run, prompt in zip(batch, PROMPTS, strict=True):
        assert [s.positions_computed for s in run.steps] == [len(prompt)] + [1] * 9
    if engine.pool is not None:
        assert engine.pool.used_blocks == 0


def test_batched_logits_match_single_sequence_logits(engine):
    def prefilled(prompt):
        cache = engine.new_cache()
        engine.model(torch.tensor([prompt]), torch.arange(len(prompt)), cache)
        return cache

    prompts, tokens = PROMPTS[:2], [5, 6]
    with torch.inference_mode():
        caches = [prefilled(p) for p in prompts]
        batched = engine.model(*prepare_decode(tokens, caches, engine.device))  # [2, 1, vocab]
        alone = [engine.model(torch.tensor([[t]]), torch.tensor([len(p)]), prefilled(p))
                 for t, p in zip(tokens, prompts, strict=True)]
    assert list(batched.shape) == [2, 1, 151936]
    for b in range(2):
        torch.testing.assert_close(batched[b:b + 1], alone[b], atol=1e-5, rtol=1e-5)
    assert [c.length for c in caches] == [len(p) + 1 for p in prompts]


def test_each_sequence_stops_on_its_own(engine, monkeypatch):
    alone = engine.generate(PROMPTS[1], 10, ignore_eos=True).output_ids
    monkeypatch.setattr("kvbook.runtime.sequence.EOS_IDS", frozenset({alone[3]}))  # sequence 1 "ends" at its 4th token
    batch = engine.generate_batch(PROMPTS[:3], 10)
    assert batch[1].output_ids == alone[:4] and batch[1].finish_reason == "stop"
    others = [r for b, r in enumerate(batch) if b != 1]
    assert all(len(r.output_ids) == 10 or r.finish_reason == "stop" for r in others)
    assert max(len(r.steps) for r in batch) == 10


def test_batch_needs_the_cache(weight_cache):
    engine = Engine(small_config(enable=False), progress=False)
    with pytest.raises(ValueError, match="batched generation needs the KV cache"):
        engine.generate_batch(PROMPTS[:2], 3)
