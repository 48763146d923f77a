"""The sampler's transforms on fixed logits, and the request options that reach it (engine, CLI, server)."""

import pytest
import requests
import torch
from kvbook.runtime import sampling
from kvbook.runtime.engine import Engine
from kvbook.runtime.sampling import keep_top_k, keep_top_p, next_token_probs, sample_next, with_temperature
from kvbook.serving.server import BackgroundServer

from .conftest import small_config

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])  # softmax: 0.57, 0.21, 0.13, 0.08, 0.03


def test_temperature_sharpens_below_one_and_flattens_above():
    plain, sharp, flat = (with_temperature(LOGITS, t) for t in (1.0, 0.5, 2.0))
    assert torch.allclose(plain, torch.softmax(LOGITS, -1)) and torch.allclose(sharp.sum(), torch.tensor(1.0))
    assert sharp[0] > plain[0] > flat[0] and sharp[-1] < plain[-1] < flat[-1]
    assert torch.equal(with_temperature(LOGITS, 1e-3), torch.tensor([1.0, 0, 0, 0, 0]))  # its limit is greedy


def test_top_k_keeps_the_k_most_likely_and_top_p_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)
    two = keep_top_k(probs, 2)
    assert torch.count_nonzero(two) == 2 and two[:2].sum() == pytest.approx(1.0)
    assert two[0] / two[1] == pytest.approx(float(probs[0] / probs[1]))  # the kept ones keep their odds
    assert torch.equal(keep_top_k(probs, 0), probs) and torch.equal(keep_top_k(probs, 9), probs)
    mass = torch.cumsum(probs, -1)  # sorted already: 0.57, 0.79, 0.92, ...
    for p, kept in [(0.5, 1), (float(mass[0]) + 1e-4, 2), (0.8, 3), (float(mass[2]) - 1e-4, 3), (1.0, 5)]:
        assert torch.count_nonzero(keep_top_p(probs, p)) == kept, p
    assert torch.count_nonzero(keep_top_p(probs, 1e-300)) == 1  # rounds to 0 in float32: still the top token
    both = next_token_probs(LOGITS, 1.0, top_k=3, top_p=0.7)  # top-k first, then top-p of what is left
    assert torch.count_nonzero(both) == 2 and both.sum() == pytest.approx(1.0)


def test_a_seed_repeats_its_draws_and_temperature_zero_is_argmax():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    draws = [sample_next(logits, 1.0, 1.0, torch.Generator().manual_seed(seed)) for seed in (1, 1, 2, 3, 4)]
    assert draws[0] == draws[1] and len(set(draws)) > 1
    assert sample_next(logits, 0.0) == int(torch.argmax(logits))
    generator = torch.Generator().manual_seed(0)
    assert {sample_next(logits, 1.0, 1.0, generator, top_k=1) for _ in range(20)} == {int(torch.argmax(logits))}
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert {sample_next(logits, 5.0, 1.0, generator, top_k=3) for _ in range(200)} == top3


@pytest.fixture(scope="module")
def engine():
    return Engine(small_config(vocab=151936, max_cache_len=256).replace(inference={"output_len": 4}), progress=False)


def spy_on_sampler(monkeypatch):
    calls = []
    real = sampling.sample_next

    def spy(logits, temperature=0.0, top_p=1.0, generator=None, top_k=0):
        calls.append((temperature, top_p, top_k, generator.initial_seed() if generator else None))
        return real(logits, temperature, top_p, generator, top_k)

    monkeypatch.setattr("kvbook.runtime.scheduler.sample_next", spy)
    return calls


def test_the_engine_and_the_server_hand_the_requests_options_to_the_sampler(engine, monkeypatch):
    calls = spy_on_sampler(monkeypatch)
    engine.generate([1, 2, 3], 2, temperature=0.7, top_p=0.9, top_k=5, seed=11, ignore_eos=True)
    assert calls == [(0.7, 0.9, 5, 11)] * 2
    calls.clear()
    with BackgroundServer(engine) as server:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "ignore_eos": True, "temperature": 0.6, "top_p": 0.8, "top_k": 4, "seed": 12}
        assert requests.post(server.api_base + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert calls == [(0.6, 0.8, 4, 12)] * 3
        bad = requests.post(server.api_base + "/v1/chat/completions", json={**body, "top_k": -1}, timeout=60)
        assert bad.status_code == 400 and "top_k = -1 is too small" in bad.json()["error"]["message"]
    with pytest.raises(ValueError, match="top_k = -2: must be >= 0"):
        engine.generate([1, 2, 3], 2, temperature=1.0, top_k=-2)
