"""Prefix caching: full blocks keyed by their tokens and everything before them are shared by later prompts;
the same tokens and logits as without reuse; a fully cached prompt still computes its last position; a block
freed and refilled never keeps its old key."""

import pytest
import torch
from kvbook.cache.paged import block_keys
from kvbook.config import ConfigError
from kvbook.runtime.engine import Engine
from kvbook.runtime.scheduler import Scheduler
from kvbook.tools.trace import Tracer

from .conftest import small_config

SYSTEM = list(range(7000, 7048))  # a shared "system prompt" of exactly 3 blocks


def engines(max_cache_len=512):
    cfg = small_config(vocab=151936, max_cache_len=max_cache_len).replace(kv_cache={"layout": "paged"})
    plain = Engine(cfg, progress=False)
    cached = Engine(cfg.replace(kv_cache={"prefix_caching": True}), model=plain.model, progress=False)
    return plain, cached


def keys_are_consistent(pool):
    return all(pool.block_key[block] == key for key, block in pool.cached_block.items()) and \
        len(pool.block_key) == len(pool.cached_block)


def test_keys_chain_the_prefix():
    a, b = list(range(32)), list(range(16)) + list(range(100, 116))
    assert block_keys(a, 16)[0] == block_keys(b, 16)[0] and block_keys(a, 16)[1] != block_keys(b, 16)[1]
    # the same 16 tokens after different prefixes are different blocks
    assert block_keys([1] * 16 + [2] * 16, 16)[1] != block_keys([3] * 16 + [2] * 16, 16)[1]
    assert block_keys(list(range(15)), 16) == []


def test_reuse_gives_the_same_tokens_and_logits_and_computes_only_the_rest(weight_cache):
    plain, cached = engines()
    cached.generate(SYSTEM + [1, 2, 3], 4, ignore_eos=True)  # fills and keys the system prompt's blocks
    prompt = SYSTEM + list(range(500, 520))
    runs = {}
    for name, engine in (("plain", plain), ("cached", cached)):
        with Tracer(engine.model, record_logits=True) as tracer:
            runs[name] = (engine.generate(prompt, 10, ignore_eos=True, tracer=tracer), tracer.logits)
    assert runs["cached"][0].steps[0].positions_computed == len(prompt) - 48
    assert runs["plain"][0].steps[0].positions_computed == len(prompt)
    assert runs["cached"][0].output_ids == runs["plain"][0].output_ids
    for step in range(10):
        torch.testing.assert_close(runs["cached"][1][step], runs["plain"][1][step], atol=1e-5, rtol=1e-5)
    assert cached.pool.used_blocks == 0 and keys_are_consistent(cached.pool)


@pytest.mark.parametrize("length, reused", [(48, 32), (49, 48), (47, 32), (16, 0), (1, 0)])
def test_a_fully_cached_prompt_still_computes_its_last_position(weight_cache, length, reused):
    plain, cached = engines()
    prompt = SYSTEM[:length] if length <= 48 else SYSTEM + [5]
    cached.generate(SYSTEM + [5, 6], 3, ignore_eos=True)
    run = cached.generate(prompt, 5, ignore_eos=True)
    assert run.steps[0].positions_computed == len(prompt) - reused >= 1
    assert run.output_ids == plain.generate(prompt, 5, ignore_eos=True).output_ids


def test_blocks_filled_by_decode_are_shared_too(weight_cache):
    plain, cached = engines()
    first = cached.generate(SYSTEM[:20], 30, ignore_eos=True)  # 49 positions: 3 full blocks, the last by decode
    follow_up = SYSTEM[:20] + first.output_ids[:29] + [9, 9, 9]  # a second turn that repeats the first
    run = cached.generate(follow_up, 4, ignore_eos=True)
    assert run.steps[0].positions_computed == len(follow_up) - 48
    assert run.output_ids == plain.generate(follow_up, 4, ignore_eos=True).output_ids


def test_a_freed_block_refilled_with_other_tokens_loses_its_key(weight_cache):
    plain, cached = engines(max_cache_len=64)  # 4 blocks: the next prompt must take the keyed blocks
    cached.generate(SYSTEM, 2, ignore_eos=True)
    assert len(cached.pool.cached_block) == 3
    other = list(range(8000, 8050))
    cached.generate(other, 10, ignore_eos=True)  # 59 positions: all 4 blocks are allocated again
    assert keys_are_consistent(cached.pool)
    assert not set(block_keys(SYSTEM, 16)) & set(cached.pool.cached_block)  # the system blocks are gone
    run = cached.generate(SYSTEM + [1], 3, ignore_eos=True)
    assert run.steps[0].positions_computed == 49  # nothing stale was reused
    assert run.output_ids == plain.generate(SYSTEM + [1], 3, ignore_eos=True).output_ids


def test_concurrent_sequences_share_the_prefix_blocks(weight_cache):
    plain, cached = engines()
    scheduler = Scheduler(cached, max_num_seqs=8)
    prompts = [SYSTEM + [100 + i] * (i + 2) for i in range(3)]
    seqs = [scheduler.add(p, 6, ignore_eos=True) for p in prompts]
    for _ in range(4):  # three prefills, one decode step
        scheduler.step()
    tables = [s.cache.block_table for s in seqs]
    assert tables[0][:3] == tables[1][:3] == tables[2][:3]
    assert [cached.pool.ref_count[b] for b in tables[0][:3]] == [3, 3, 3]
    assert [s.cached_positions for s in seqs] == [0, 48, 48]
    scheduler.run_until_done()
    assert [s.output_ids for s in seqs] == [plain.generate(p, 6, ignore_eos=True).output_ids for p in prompts]
    assert cached.pool.used_blocks == 0 and len(cached.pool.cached_block) >= 3


def test_prefix_caching_needs_the_paged_layout():
    with pytest.raises(ConfigError, match='prefix_caching = true shares whole blocks of the paged pool'):
        small_config().replace(kv_cache={"prefix_caching": True})
