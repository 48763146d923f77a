"""Tensor parallelism (kvbook.model.tensor_parallel, kvbook.runtime.ranks): two gloo ranks on the CPU compute what
one process does, each holding half the heads and half of every cache; a dead rank ends the run with one line."""

import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from kvbook.config import ConfigError
from kvbook.model.tensor_parallel import rank_config, shard_weights
from kvbook.model.weights import random_weights
from kvbook.runtime import ranks
from kvbook.runtime.engine import Engine

from .conftest import small_config
from .test_cli import TINY, kvbook

PROMPT = list(range(1, 30))


@pytest.fixture(scope="module")
def config():
    return small_config(vocab=1000, max_cache_len=256)  # float32; 4 query heads sharing 2 K/V heads (GQA)


@pytest.fixture(scope="module")
def engine(config):
    return Engine(config, progress=False)


def test_a_rank_holds_a_slice_of_the_heads_and_of_the_mlp(config):
    own = rank_config(config.model, 2)
    assert (own.num_attention_heads, own.num_key_value_heads, own.intermediate_size) == (2, 1, 64)
    assert own.hidden_size == config.model.hidden_size and own.vocab_size == config.model.vocab_size
    with pytest.raises(ConfigError, match="num_attention_heads = 4 does not split into 3 equal parts"):
        rank_config(config.model, 3)
    with pytest.raises(ConfigError, match="num_key_value_heads = 2 does not split into 4 equal parts"):
        rank_config(config.model, 4)


def test_the_shards_put_together_are_the_whole_model(config):
    weights = random_weights(config.model, torch.float32, progress=False)
    shards = [shard_weights(weights, rank, 2) for rank in range(2)]
    layer = "model.layers.1."
    for name, dim in [("self_attn.q_proj", 0), ("self_attn.k_proj", 0), ("mlp.up_proj", 0),
                      ("self_attn.o_proj", 1), ("mlp.down_proj", 1)]:
        key = layer + name + ".weight"
        assert shards[0][key].shape[dim] * 2 == weights[key].shape[dim]
        assert torch.equal(torch.cat([shard[key] for shard in shards], dim), weights[key])
    for key in ("model.embed_tokens.weight", "lm_head.weight", layer + "self_attn.q_norm.weight"):
        assert all(shard[key] is weights[key] for shard in shards)  # replicated, not copied


def test_two_ranks_compute_the_logits_of_one_process_each_with_half_of_every_cache(config, engine):
    logits = ranks.launch(config, 2, ranks.prefill_logits, PROMPT)
    alone = ranks.prefill_logits(engine, None, PROMPT)
    assert logits[0].shape == alone.shape == (1, 1, 1000)
    assert abs(logits[0] - alone).max() < 1e-5 and (logits[0] == logits[1]).all()  # every rank: the same logits
    facts = ranks.launch(config, 2, ranks.rank_facts, PROMPT)
    whole = engine.new_cache()
    engine.prefill(whole, PROMPT)
    assert [f["rank"] for f in facts] == [0, 1]
    assert all(f["K cache"] == [1, 1, len(PROMPT), 16] and f["cache bytes"] * 2 == whole.filled_bytes()
               for f in facts)


def sample_with_the_ranks_own_seed(engine, send, prompt):
    """Each rank asks for another seed: only rank 0's draws may count."""
    options = {"max_new_tokens": 8, "temperature": 1.0, "seed": dist.get_rank(), "ignore_eos": True}
    return ranks.generate_on_rank(engine, send, prompt, options).output_ids


def test_rank_0_samples_and_every_rank_takes_its_tokens(config, engine):
    tokens = ranks.launch(config, 2, sample_with_the_ranks_own_seed, PROMPT)
    seed_0, seed_1 = (engine.generate(PROMPT, 8, temperature=1.0, seed=s, ignore_eos=True).output_ids for s in (0, 1))
    assert seed_0 != seed_1  # the seeds draw differently, so rank 1 would have
    assert tokens == [seed_0, seed_0]


def test_generate_on_two_ranks_prints_the_token_ids_of_one_process(env):
    args = ["generate", "--input-ids", "9707,1879", "--max-new-tokens", "6", "--ignore-eos", "--json", *TINY]
    alone, split = kvbook(*args, env=env), kvbook(*args, "--tensor-parallel", "2", env=env)
    assert alone.returncode == split.returncode == 0, alone.stderr + split.stderr
    alone, split = json.loads(alone.stdout), json.loads(split.stdout)
    assert split["tensor_parallel"] == 2 and len(split["ready_s"]) == 2
    assert split["output_ids"] == alone["output_ids"] and split["text"] == alone["text"]


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}


def test_more_ranks_than_cores_or_an_uneven_split_is_one_line_before_any_process(env):
    too_many = str(len(os.sched_getaffinity(0)) + 1)
    for extra, fragment in [(["--tensor-parallel", too_many], f"tensor parallel {too_many}: this machine has "),
                            (["--tensor-parallel", "2", "--set", "model.intermediate_size=129"],
                             "intermediate_size = 129 does not split into 2 equal parts")]:
        result = kvbook("generate", "--input-ids", "1,2", *TINY, *extra, env=env)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvbook: error: "), lines
        assert fragment in lines[0]


def decode_until_stopped(engine, send, prompt):
    """Decode steps until the run is stopped: each one waits for the other rank at its all-reduces."""
    cache = engine.new_cache()
    engine.prefill(cache, prompt)
    send("decoding", None)
    while True:
        if cache.length == 200:  # before the cache fills: the prompt again
            cache.clear()
            engine.prefill(cache, prompt)
        engine.decode([1], [cache])


def test_a_rank_that_dies_stops_the_others_within_seconds_with_one_line(config):
    pids, decoding = {}, set()

    def kill_rank_1(rank, message):
        kind, value = message
        if kind == "ready":
            pids[rank] = value["pid"]
        elif kind == "decoding":
            decoding.add(rank)
            if len(decoding) == 2:  # both are inside the loop of collectives
                os.kill(pids[1], 9)
                started.append(time.monotonic())

    started = []
    with pytest.raises(ranks.RankError, match=r"^tensor parallel: rank 1 died \(killed by SIGKILL\); the other ranks "
                                              r"were stopped$"):
        ranks.launch(config, 2, decode_until_stopped, PROMPT, timeout_s=30, on_message=kill_rank_1)
    assert time.monotonic() - started[0] < 10
    for pid in pids.values():  # no process left behind
        assert not os.path.exists(f"/proc/{pid}")


def test_a_request_a_rank_refuses_is_one_line_naming_the_rank(config):
    with pytest.raises(ranks.RankError, match=r"^tensor parallel: rank [01] failed: ValueError: 29 prompt \+ 300 "
                                              r"new tokens need 328 positions but max_position_embeddings is 256"):
        ranks.generate(config, PROMPT, 2, max_new_tokens=300)
