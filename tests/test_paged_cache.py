"""The paged KV cache: same tokens and logits as the contiguous cache, blocks allocated exactly at block
boundaries, the edge cases nano-vllm shipped bugs in, a pool that runs out, free and reuse, and several
sequences in one pool."""

import pytest
import torch
from kvbook.cache.contiguous import CacheFullError
from kvbook.cache.paged import PoolExhaustedError
from kvbook.runtime.engine import Engine
from kvbook.tools.trace import Tracer

from .conftest import small_config


def engines(max_cache_len=512, **paged_options):
    cfg = small_config(vocab=151936, max_cache_len=max_cache_len, max_positions=4096).replace(
        inference={"output_len": 8})
    contiguous = Engine(cfg, progress=False)
    paged = Engine(cfg.replace(kv_cache={"layout": "paged", **paged_options}), model=contiguous.model,
                   progress=False)
    return contiguous, paged


def blocks_needed(positions, block_size=16):
    return -(-positions // block_size)


def test_paged_equals_contiguous_tokens_and_logits(weight_cache):
    contiguous, paged = engines()
    prompt = list(range(1000, 1040))
    runs = {}
    for name, engine in (("contiguous", contiguous), ("paged", paged)):
        with Tracer(engine.model, record_logits=True) as tracer:
            runs[name] = (engine.generate(prompt, 30, ignore_eos=True, tracer=tracer), tracer.logits)
    assert runs["paged"][0].output_ids == runs["contiguous"][0].output_ids
    for step in range(30):
        torch.testing.assert_close(runs["paged"][1][step], runs["contiguous"][1][step], atol=1e-6, rtol=1e-6)


def test_blocks_for_the_articles_scenario_16_then_one_per_boundary_then_24(weight_cache):
    _, paged = engines()
    prompt = list(range(1000, 1256))  # 256 tokens
    run = paged.generate(prompt, 128, ignore_eos=True)
    blocks = [step.blocks for step in run.steps]
    assert blocks[0] == 16 and blocks[-1] == 24 and run.cache_len == 383
    assert blocks == [blocks_needed(step.cache_len) for step in run.steps]
    grew_at = [step.cache_len for prev, step in zip(run.steps, run.steps[1:], strict=False)
               if step.blocks > prev.blocks]
    assert grew_at == list(range(257, 384, 16))  # 257, 273, ..., 369
    assert paged.pool.used_blocks == 0  # freed when the sequence finished


def test_prompt_that_fills_its_last_block_needs_a_new_block_on_the_first_decode_step(weight_cache):
    contiguous, paged = engines()
    prompt = list(range(2000, 2032))  # exactly 2 blocks
    run = paged.generate(prompt, 3, ignore_eos=True)
    assert [s.blocks for s in run.steps] == [2, 3, 3]
    assert run.output_ids == contiguous.generate(prompt, 3, ignore_eos=True).output_ids


def test_one_token_prompt(weight_cache):
    contiguous, paged = engines()
    run = paged.generate([9707], 20, ignore_eos=True)
    assert [s.blocks for s in run.steps] == [1] * 16 + [2] * 4  # position 16 starts block 2
    assert run.output_ids == contiguous.generate([9707], 20, ignore_eos=True).output_ids


def test_a_pool_that_runs_out_is_a_clear_error_and_loses_nothing(weight_cache):
    # a pool of 4 blocks (64 positions): tiny model, 2 layers x 2 KV heads x 16 dims x 4 bytes x 2 = 512 B/pos
    _, paged = engines(pool_mib=1)
    pool = paged.pool
    assert pool.num_blocks == 2**20 // (512 * 16) == 128
    first, second = paged.new_cache(), paged.new_cache()
    first.ensure_blocks(120 * 16)
    with pytest.raises(PoolExhaustedError, match="all 128 blocks of 16 positions are held by running sequences"):
        second.ensure_blocks(9 * 16)
    assert second.num_blocks == 0 and pool.used_blocks == 120  # all or nothing
    second.ensure_blocks(8 * 16)
    assert pool.used_blocks == 128
    first.free()
    second.free()
    assert pool.used_blocks == 0


def test_requests_larger_than_the_whole_pool_are_refused_before_any_work(weight_cache):
    _, paged = engines(pool_mib=1)
    with pytest.raises(CacheFullError, match="the whole block pool holds 2048"):
        next(paged.stream(list(range(1000, 2100)), 1000))
    assert paged.pool.used_blocks == 0


def test_freed_blocks_are_reused_without_stale_contents(weight_cache):
    contiguous, paged = engines(max_cache_len=64)  # a pool of 4 blocks: the second sequence must reuse them
    assert paged.pool.num_blocks == 4
    prompt_a, prompt_b = list(range(3000, 3040)), list(range(4000, 4050))
    paged.generate(prompt_a, 10, ignore_eos=True)  # 49 positions: all 4 blocks, then freed
    run_b = paged.generate(prompt_b, 10, ignore_eos=True)  # 59 positions in the same 4 blocks
    assert [s.blocks for s in run_b.steps][-1] == 4
    assert run_b.output_ids == contiguous.generate(prompt_b, 10, ignore_eos=True).output_ids
    assert paged.pool.used_blocks == 0


def test_closing_a_stream_early_frees_its_blocks(weight_cache):
    _, paged = engines()
    stream = paged.stream(list(range(1000, 1100)), 50, ignore_eos=True)
    next(stream), next(stream)
    assert paged.pool.used_blocks == blocks_needed(101)
    stream.close()
    assert paged.pool.used_blocks == 0


def test_several_sequences_share_one_pool(weight_cache):
    contiguous, paged = engines()
    prompts = [list(range(1000 + 100 * i, 1020 + 100 * i + 7 * i)) for i in range(3)]
    alone = [contiguous.generate(p, 12, ignore_eos=True).output_ids for p in prompts]
    streams = [paged.stream(p, 12, ignore_eos=True) for p in prompts]
    together = [[], [], []]
    for _ in range(11):  # interleave the three sequences step by step
        for i, stream in enumerate(streams):
            together[i].append(next(stream).token_id)
    held = paged.pool.used_blocks  # after 11 tokens each: the prompt and 10 fed-back tokens
    assert held == sum(blocks_needed(len(p) + 10) for p in prompts)
    for i, stream in enumerate(streams):
        together[i].append(next(stream).token_id)  # the last token: the sequence finishes, its blocks go back
    assert paged.pool.used_blocks == 0
    for stream in streams:
        stream.close()
    assert together == alone and paged.pool.used_blocks == 0
