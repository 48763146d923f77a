"""Our model against transformers' Qwen3ForCausalLM (eager attention, float32) on tiny random configs:
logits after prefill and at every decode step within 1e-5, and the caches' contents equal."""

import pytest
import torch
from kvbook.cache.contiguous import KVCache
from kvbook.model.weights import build_model
from kvbook.tools.reference import hf_random_model, hf_weights
from transformers import DynamicCache

from .conftest import small_config

CASES = {
    "mha-untied": dict(heads=4, kv_heads=4, head_dim=16, tied=False),
    "gqa-untied": dict(heads=4, kv_heads=2, head_dim=16, tied=False),
    "gqa-tied": dict(heads=4, kv_heads=1, head_dim=16, tied=True),
    "mha-tied-wide-heads": dict(heads=4, kv_heads=4, head_dim=32, tied=True),  # head_dim != hidden / heads
    "gqa-untied-narrow-heads": dict(heads=8, kv_heads=2, head_dim=4, tied=False),
}


def hf_reference(cfg):
    hf = hf_random_model(cfg.model)
    return hf, hf.config


@pytest.mark.parametrize("case", CASES)
@torch.inference_mode()
def test_logits_and_caches_match_transformers(case):
    cfg = small_config(**CASES[case])
    hf, hf_cfg = hf_reference(cfg)
    if cfg.model.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ours = build_model(cfg.model, hf_weights(hf), torch.device("cpu"))

    prompt = torch.randint(0, cfg.model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    hf_cache = DynamicCache(config=hf_cfg)
    hf_out = hf(prompt, cache=hf_cache, use_cache=True)
    cache = KVCache(cfg.model, cfg.kv_cache, torch.device("cpu"))
    logits = ours(prompt, torch.arange(12), cache, last_only=False)  # [1, 12, vocab]
    torch.testing.assert_close(logits, hf_out.logits, atol=1e-5, rtol=1e-5)

    token = hf_out.logits[:, -1:].argmax(-1)  # [1, 1]
    for step in range(6):
        hf_out = hf(token, cache=hf_cache, use_cache=True)
        logits = ours(token, torch.tensor([12 + step]), cache)  # [1, 1, vocab]
        torch.testing.assert_close(logits, hf_out.logits, atol=1e-5, rtol=1e-5)
        token = hf_out.logits[:, -1:].argmax(-1)

    assert cache.length == hf_cache.get_seq_length() == 18
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(layer.keys(), hf_cache.layers[i].keys, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(layer.values(), hf_cache.layers[i].values, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["gqa-untied", "mha-tied-wide-heads"])
@pytest.mark.parametrize("chunks", [[12], [5, 7]])
@torch.inference_mode()
def test_last_layer_on_the_last_position_only(case, chunks):
    """last_only (what prefill runs): the last layer computes its queries and MLP for the last position alone. Its
    logits are transformers' for that position, and every cache holds exactly what the full pass writes, also when
    the prompt comes in chunks (each chunk's own last position)."""
    cfg = small_config(layers=3, **CASES[case])
    hf, _ = hf_reference(cfg)
    ours = build_model(cfg.model, hf_weights(hf), torch.device("cpu"))
    prompt = torch.randint(0, cfg.model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    full, trimmed = (KVCache(cfg.model, cfg.kv_cache, torch.device("cpu")) for _ in range(2))
    start = 0
    for n in chunks:
        ids, positions = prompt[:, start:start + n], torch.arange(start, start + n)
        every = ours(ids, positions, full, last_only=False)  # [1, n, vocab]
        last = ours(ids, positions, trimmed)  # [1, 1, vocab]
        assert last.shape == (1, 1, cfg.model.vocab_size)
        torch.testing.assert_close(last, every[:, -1:], atol=1e-5, rtol=1e-5)
        start += n
    torch.testing.assert_close(last, hf(prompt).logits[:, -1:], atol=1e-5, rtol=1e-5)
    for a, b in zip(full.layers, trimmed.layers, strict=True):
        assert torch.equal(a.keys(), b.keys()) and torch.equal(a.values(), b.values())


@torch.inference_mode()
def test_inputs_embeds_match_transformers_and_input_ids():
    """The layers fed a vector directly (chapter 5's wrong decode input) as transformers' inputs_embeds are."""
    cfg = small_config()
    hf, _ = hf_reference(cfg)
    ours = build_model(cfg.model, hf_weights(hf), torch.device("cpu"))
    prompt = torch.arange(1, 13)[None]  # [1, 12]
    embeds = torch.randn(1, 12, cfg.model.hidden_size, generator=torch.Generator().manual_seed(2))  # [1, 12, C]
    logits = ours(None, torch.arange(12), None, last_only=False, inputs_embeds=embeds)  # [1, 12, vocab]
    torch.testing.assert_close(logits, hf(inputs_embeds=embeds).logits, atol=1e-5, rtol=1e-5)
    from_ids = ours(prompt, torch.arange(12), None, last_only=False)
    torch.testing.assert_close(ours(None, torch.arange(12), None, last_only=False,
                                    inputs_embeds=ours.model.embed_tokens(prompt)), from_ids, atol=0, rtol=0)
    with pytest.raises(ValueError, match="input_ids or inputs_embeds"):
        ours(prompt, torch.arange(12), None, inputs_embeds=embeds)


def test_parity_test_can_fail():
    """A wrong cache order (new key before the history) must break the comparison above."""
    cfg = small_config()
    hf, hf_cfg = hf_reference(cfg)
    ours = build_model(cfg.model, hf_weights(hf), torch.device("cpu"))
    prompt = torch.arange(1, 13)[None]
    with torch.inference_mode():
        logits = ours(prompt, torch.arange(12).flip(0), None, last_only=False)  # positions reversed
        reference = hf(prompt).logits
    assert not torch.allclose(logits, reference, atol=1e-5, rtol=1e-5)
