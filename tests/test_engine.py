"""The engine on tiny float32 models: cached decode equals full recompute, the cache grows one position per
step and ends at prompt + new - 1, errors before any work, sampling, EOS, and the weight cache."""

import subprocess
import sys

import pytest
import torch
from kvbook.cache.contiguous import CacheFullError, KVCache
from kvbook.model.weights import load_random_weights, random_weights, random_weights_path
from kvbook.runtime.engine import Engine

from .conftest import small_config

PROMPT = list(range(3, 15))  # 12 tokens


@pytest.fixture
def engine(weight_cache):
    return Engine(small_config(), progress=False)


def test_cached_decode_equals_full_recompute_logits_at_every_step(engine):
    model, cfg = engine.model, engine.config
    cache = KVCache(cfg.model, cfg.kv_cache, engine.device)
    sequence = torch.tensor([PROMPT])
    with torch.inference_mode():
        cached = model(sequence, torch.arange(12), cache)
        for _ in range(8):
            recomputed = model(sequence, torch.arange(sequence.shape[1]), None)  # no cache at all
            torch.testing.assert_close(cached, recomputed, atol=1e-5, rtol=1e-5)
            token = cached[:, -1:].argmax(-1)  # [1, 1]
            sequence = torch.cat([sequence, token], dim=1)
            cached = model(token, torch.tensor([sequence.shape[1] - 1]), cache)
    assert cache.length == 12 + 8


def test_a_contiguous_cache_given_back_serves_the_next_sequence_from_empty(engine):
    """release_cache keeps a contiguous cache for the next new_cache (its memory is faulted in already): the next
    sequence starts on it empty and gets exactly the tokens a fresh cache gives."""
    first = engine.generate(PROMPT, 6, ignore_eos=True)
    kept = engine.spare_cache
    assert isinstance(kept, KVCache) and kept.length == 12 + 6 - 1  # as the run left it: cleared when handed out
    cache = engine.new_cache()
    assert cache is kept and engine.spare_cache is None and cache.lengths() == [0, 0]
    engine.prefill(cache, list(range(40, 60)))  # another sequence fills it
    engine.release_cache(cache)
    again = engine.generate(PROMPT, 6, ignore_eos=True)
    assert again.output_ids == first.output_ids
    other = Engine(small_config(max_cache_len=128), model=engine.model, progress=False)
    other.release_cache(kept)  # a cache of another shape is never handed out
    assert other.new_cache() is not kept


def test_cache_disabled_recomputes_everything_and_gives_the_same_tokens(weight_cache):
    on = Engine(small_config(), progress=False).generate(PROMPT, 6, ignore_eos=True)
    off = Engine(small_config(enable=False), progress=False).generate(PROMPT, 6, ignore_eos=True)
    assert on.output_ids == off.output_ids
    assert [s.positions_computed for s in on.steps] == [12, 1, 1, 1, 1, 1]
    assert [s.positions_computed for s in off.steps] == [12, 13, 14, 15, 16, 17]
    assert [s.cache_len for s in on.steps] == [12, 13, 14, 15, 16, 17]
    assert [s.cache_len for s in off.steps] == [0] * 6


def test_prefill_then_decode_phases_and_timings(engine):
    run = engine.generate(PROMPT, 6, ignore_eos=True)
    assert [s.phase for s in run.steps] == ["prefill"] + ["decode"] * 5
    assert len(run.output_ids) == 6 and run.finish_reason == "length"
    assert run.cache_len == 12 + 6 - 1  # the last token is never fed back
    assert run.ttft_ms > 0 and run.tpot_ms > 0 and len(run.step_ms) == 5


def test_kv_cache_bytes_are_exact(engine):
    cfg = engine.config
    cache = KVCache(cfg.model, cfg.kv_cache, engine.device)
    with torch.inference_mode():
        engine.model(torch.tensor([PROMPT]), torch.arange(12), cache)
    m = cfg.model
    assert cache.filled_bytes() == 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * 12 * 4
    assert cache.reserved_bytes() == 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * 64 * 4
    assert cache[0].keys().shape == (1, m.num_key_value_heads, 12, m.head_dim)


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_cache_copy_keeps_the_chosen_positions_and_decodes_like_the_original(engine, cache_dtype):
    cfg = engine.config.replace(kv_cache={"cache_dtype": cache_dtype})
    cache = KVCache(cfg.model, cfg.kv_cache, engine.device)
    token, position = torch.tensor([[7]]), torch.tensor([12])
    with torch.inference_mode():
        engine.model(torch.tensor([PROMPT]), torch.arange(12), cache)
        whole, shuffled, dropped = cache.copy(), cache.copy(torch.arange(12).flip(0)), cache.copy([0, 1, 3])
        assert whole.lengths() == shuffled.lengths() == [12, 12] and dropped.lengths() == [3, 3]
        for old, same, flipped, short in zip(cache.layers, whole.layers, shuffled.layers, dropped.layers,
                                             strict=True):
            assert torch.equal(same.keys(), old.keys()) and torch.equal(same.values(), old.values())
            assert torch.equal(flipped.keys(), old.keys().flip(2))
            assert torch.equal(flipped.values(), old.values().flip(2))
            assert torch.equal(short.keys(), old.keys()[:, :, [0, 1, 3]])
        # the copy is independent: a step on it gives the original's logits and leaves the original as it was
        on_copy = engine.model(token, position, whole)
        assert cache.lengths() == [12, 12] and whole.lengths() == [13, 13]
        torch.testing.assert_close(on_copy, engine.model(token, position, cache), atol=0, rtol=0)


def test_cache_copy_names_slots_it_does_not_hold(engine):
    cfg = engine.config
    cache = KVCache(cfg.model, cfg.kv_cache, engine.device)
    with torch.inference_mode():
        engine.model(torch.tensor([PROMPT]), torch.arange(12), cache)
    with pytest.raises(IndexError, match=r"positions in 0 … 11 .*got \[3, 12\]"):
        cache.copy([3, 12])


def test_cache_overflow_names_length_limit_and_fix_and_loses_nothing(engine):
    cfg = engine.config.replace(kv_cache={"max_cache_len": 20}, inference={"output_len": 5})
    cache = KVCache(cfg.model, cfg.kv_cache, engine.device)
    with torch.inference_mode():
        engine.model(torch.tensor([PROMPT + PROMPT[:8]]), torch.arange(20), cache)  # exactly full
        with pytest.raises(CacheFullError) as err:
            engine.model(torch.tensor([[5]]), torch.tensor([20]), cache)
    assert "needs 21 positions but max_cache_len is 20" in str(err.value)
    assert "--set kv_cache.max_cache_len=21" in str(err.value)
    assert cache.lengths() == [20, 20]  # nothing half-written


def test_requests_the_cache_cannot_hold_are_refused_before_any_work(weight_cache):
    engine = Engine(small_config(max_cache_len=16, output_len=5), progress=False)
    with pytest.raises(CacheFullError, match="need 17 cache positions but max_cache_len is 16"):
        next(engine.stream(PROMPT, 6))
    assert len(engine.generate(PROMPT, 5, ignore_eos=True).output_ids) == 5  # 16 positions fit exactly
    with pytest.raises(ValueError, match="max_new_tokens = -1"):
        next(engine.stream(PROMPT, -1))
    with pytest.raises(ValueError, match="prompt is empty"):
        next(engine.stream([], 3))
    with pytest.raises(ValueError, match="max_position_embeddings is 256"):
        next(Engine(small_config(max_cache_len=4096), progress=False).stream(PROMPT * 30, 10))


def test_eos_stops_unless_ignored(engine, monkeypatch):
    greedy = engine.generate(PROMPT, 6, ignore_eos=True).output_ids
    monkeypatch.setattr("kvbook.runtime.sequence.EOS_IDS", frozenset({greedy[1]}))  # pretend the 2nd token is EOS
    stopped = engine.generate(PROMPT, 6)
    assert stopped.output_ids == greedy[:2] and stopped.finish_reason == "stop"
    assert stopped.cache_len == 12 + 1
    ignored = engine.generate(PROMPT, 6, ignore_eos=True)
    assert ignored.output_ids == greedy and ignored.finish_reason == "length"


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(engine):
    greedy = engine.generate(PROMPT, 6, ignore_eos=True).output_ids
    a = engine.generate(PROMPT, 6, temperature=1.5, seed=7, ignore_eos=True).output_ids
    b = engine.generate(PROMPT, 6, temperature=1.5, seed=7, ignore_eos=True).output_ids
    c = engine.generate(PROMPT, 6, temperature=1.5, seed=8, ignore_eos=True).output_ids
    assert a == b and a != c
    assert engine.generate(PROMPT, 6, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True).output_ids == greedy
    seen = []  # generate hands each Step over as it comes (the CLI prints its text then)
    run = engine.generate(PROMPT, 4, ignore_eos=True, on_step=seen.append)
    assert [step.token_id for step in seen] == run.output_ids and [step.index for step in seen] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="temperature = -1: must be >= 0"):
        next(engine.stream(PROMPT, 3, temperature=-1))
    with pytest.raises(ValueError, match=r"top_p = 1.5: must be in \(0, 1\]"):  # only the option that is wrong
        next(engine.stream(PROMPT, 3, top_p=1.5))
    with pytest.raises(ValueError, match=r"token id 999999 is outside the vocabulary"):  # not an IndexError
        next(engine.stream([1, 999999], 3))


def test_closing_a_stream_early_stops_generation(engine):
    stream = engine.stream(PROMPT, 6, ignore_eos=True)
    first = next(stream)
    stream.close()
    assert first.phase == "prefill"
    with pytest.raises(StopIteration):
        next(stream)


def test_weights_are_cached_under_xdg_and_reloaded_identically(weight_cache):
    cfg = small_config().model
    path = random_weights_path(cfg, torch.float32)
    assert path.parent == weight_cache and not path.exists()
    first = load_random_weights(cfg, torch.float32, progress=False)  # drawn and written before it returns
    assert path.exists() and not list(path.parent.glob("*.partial-*"))
    mtime = path.stat().st_mtime_ns
    second = load_random_weights(cfg, torch.float32, progress=False)
    assert path.stat().st_mtime_ns == mtime  # not regenerated
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_random_weights_are_drawn_in_the_target_dtype_and_per_tensor_deterministic():
    one = random_weights(small_config(layers=1).model, torch.float16, progress=False)
    two = random_weights(small_config(layers=2).model, torch.float16, progress=False)
    assert all(t.dtype == torch.float16 for t in one.values())
    assert torch.equal(one["model.layers.0.mlp.up_proj.weight"], two["model.layers.0.mlp.up_proj.weight"])
    assert not torch.equal(two["model.layers.0.mlp.up_proj.weight"][:8], two["model.layers.1.mlp.up_proj.weight"][:8])
    std = one["model.layers.0.mlp.up_proj.weight"].float().std().item()
    assert 0.018 < std < 0.022


def test_different_seed_gives_different_weights_file(weight_cache):
    a = random_weights_path(small_config().model, torch.float16)
    b = random_weights_path(small_config().model.__class__(**{**small_config().model.__dict__, "seed": 1}),
                            torch.float16)
    assert a != b


FAULTS_PER_LAYER = """
import resource, sys, torch
from kvbook.kernels import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None

def layer():  # a few activations alive at once, then all freed, as in one layer of a prefill
    tensors = [torch.empty(2_000_000).fill_(1.0) for _ in range(4)]  # 4 x 8 MB
    del tensors

layer(), layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page faults counted through Linux's getrusage")
def test_freed_activations_are_reused_without_faulting_pages_in_again():
    # Engine calls keep_freed_memory for the whole process; a fresh interpreter shows the difference it makes
    def faults_per_layer(mode: str) -> tuple[str, float]:
        out = subprocess.run([sys.executable, "-c", FAULTS_PER_LAYER, mode], capture_output=True, text=True,
                             check=True).stdout.split()
        return out[0], float(out[1])

    default, kept = faults_per_layer("default"), faults_per_layer("keep")
    assert kept[0] == "True"  # glibc (the Linux CI's C library) took the setting
    assert default[1] > 1000  # 32 MB handed back to the OS and faulted in again (8192 pages of 4 KiB at most)
    assert kept[1] < 0.1 * default[1]
