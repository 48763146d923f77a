"""The fixed-shape decode step that CUDA graphs replay (kvbook.runtime.cuda_graph), run eagerly on the CPU: the same
logits, caches and tokens as the ordinary decode step, across bucket boundaries and from one sequence to the
next. (Capturing and replaying needs a GPU: scripts/gpu_check.sh runs the graphs and compares their tokens.)"""

import pytest
import torch
from kvbook.runtime.cuda_graph import GraphedDecoder, count_torch_calls, wanted
from kvbook.runtime.engine import Engine

from .conftest import small_config

PROMPT = list(range(3, 8))  # 5 positions: with buckets of 8, decode crosses into 16 and 24


@pytest.fixture
def engine(weight_cache):
    return Engine(small_config(output_len=20), progress=False)


def test_fixed_shape_steps_match_ordinary_decode_across_buckets(engine):
    decoder = GraphedDecoder(engine, bucket_size=8, capture=False)
    plain = engine.new_cache()
    assert decoder.acquire() is decoder.cache
    engine.prefill(decoder.cache, PROMPT)
    logits, _ = engine.prefill(plain, PROMPT)
    token = int(logits[0, -1].argmax())
    buckets = set()
    with torch.inference_mode():
        for position in range(len(PROMPT), len(PROMPT) + 17):
            buckets.add(decoder.bucket(position))
            fixed = decoder.step(token)  # [1, 1, vocab]
            ordinary = engine.model(torch.tensor([[token]]), torch.tensor([position]), plain)
            torch.testing.assert_close(fixed, ordinary, atol=1e-5, rtol=1e-5)
            assert decoder.cache.lengths() == plain.lengths() == [position + 1] * 2
            token = int(ordinary[0, -1].argmax())
    assert buckets == {8, 16, 24}
    for fixed_layer, plain_layer in zip(decoder.cache.layers, plain.layers, strict=True):
        torch.testing.assert_close(fixed_layer.keys(), plain_layer.keys(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(fixed_layer.values(), plain_layer.values(), atol=1e-6, rtol=1e-6)


def test_the_bucket_never_passes_max_cache_len(engine):
    decoder = GraphedDecoder(engine, bucket_size=48, capture=False)  # max_cache_len 64
    assert [decoder.bucket(p) for p in (0, 47, 48, 63)] == [48, 48, 64, 64]


def test_stream_through_the_decoder_gives_the_ordinary_tokens_sequence_after_sequence(engine, weight_cache):
    ordinary = Engine(small_config(output_len=20), model=engine.model, progress=False)
    engine.decoder = GraphedDecoder(engine, bucket_size=8, capture=False)
    longer = list(range(40, 60))  # a longer first sequence leaves stale positions that the next must not see
    for prompt in (longer, PROMPT, PROMPT):
        assert engine.generate(prompt, 12, ignore_eos=True).output_ids == \
            ordinary.generate(prompt, 12, ignore_eos=True).output_ids
    assert not engine.decoder.in_use


def test_a_second_open_stream_gets_its_own_cache(engine, weight_cache):
    engine.decoder = GraphedDecoder(engine, bucket_size=8, capture=False)
    first, second = engine.stream(PROMPT, 6, ignore_eos=True), engine.stream(PROMPT, 6, ignore_eos=True)
    a = [next(first).token_id]
    b = [step.token_id for step in second]  # runs to the end while the first holds the decoder's cache
    a += [step.token_id for step in first]
    assert a == b
    assert not engine.decoder.in_use


def test_a_stream_closed_early_gives_the_cache_back(engine):
    engine.decoder = GraphedDecoder(engine, bucket_size=8, capture=False)
    steps = engine.stream(PROMPT, 6, ignore_eos=True)
    next(steps)
    assert engine.decoder.in_use
    steps.close()
    assert not engine.decoder.in_use


def test_graphs_only_on_cuda_with_the_contiguous_cache(weight_cache):
    config, cpu, gpu = small_config(), torch.device("cpu"), torch.device("cuda", 0)
    assert wanted(config, gpu) and not wanted(config, cpu)
    assert not wanted(config.replace(inference={"cuda_graphs": False}), gpu)
    assert not wanted(config.replace(kv_cache={"layout": "paged"}), gpu)
    assert not wanted(config.replace(kv_cache={"enable": False}), gpu)
    assert Engine(config, progress=False).decoder is None  # cuda_graphs = true by default, but this is the CPU


def test_count_torch_calls_counts_calls_not_attribute_reads():
    x = torch.ones(3)
    assert count_torch_calls(lambda: (x.shape, x.dtype, x.sum())) == 1
    assert count_torch_calls(lambda: torch.ones(2) + 1) == 2  # a factory and an add
    assert count_torch_calls(lambda: None) == 0


def test_a_failed_capture_falls_back_to_eager_with_one_notice(engine, capsys, weight_cache):
    ordinary = Engine(small_config(output_len=20), model=engine.model, progress=False)
    decoder = GraphedDecoder(engine, bucket_size=8, capture=True)

    def fail(bucket):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    decoder._capture = fail
    engine.decoder = decoder
    tokens = engine.generate(PROMPT, 12, ignore_eos=True).output_ids
    assert tokens == ordinary.generate(PROMPT, 12, ignore_eos=True).output_ids
    notice = capsys.readouterr().err
    assert notice.count("capturing a CUDA graph failed (operation not permitted") == 1
    assert "cuda_graphs = false" in notice and "more detail" not in notice
    assert decoder.capture is False and decoder.replaying is False  # the bench then reports no graphs
