"""The real 1.85B-parameter model (the article's config, float16) on this machine's device: the shape
checklist of `python -m kvbook trace --json`, with cache_len 257 ... 383, for the contiguous cache and for the
paged one (blocks 16 ... 24, same tokens).

The weights come from the user's cache (~/.cache/kvbook, built on first use), like a reader's run."""

import json
import subprocess
import sys

import pytest


def trace(*overrides):
    result = subprocess.run([sys.executable, "-m", "kvbook", "trace", "--json", *overrides], capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def contiguous():
    return trace()


def test_trace_json_full_size_checklist(contiguous):
    pre, decode = contiguous["prefill"], contiguous["decode"]
    assert pre["input_ids"] == [256]
    assert pre["embedding"] == [1, 256, 4096]
    # the last layer passes on the last position only: nothing reads the others' outputs (kvbook.model.qwen3)
    assert [layer["output"] for layer in pre["layers"]] == [[1, 256, 4096]] * 2 + [[1, 1, 4096]]
    assert [(c["k"], c["v"]) for c in pre["kv_cache"]] == [([1, 32, 256, 128], [1, 32, 256, 128])] * 3
    assert pre["attention_weights"] == [1, 32, 256, 256]
    assert pre["logits"] == [1, 1, 151936] and pre["cache_len"] == 256
    assert len(decode) == 127
    for i, step in enumerate(decode, start=1):
        assert step["input"] == [1, 1, 4096] and step["q"] == [1, 1, 32, 128]
        assert step["k"] == step["v"] == [1, 32, 256 + i, 128]
        assert step["attention_weights"] == [1, 32, 1, 256 + i]
        assert step["output"] == [1, 1, 4096] and step["logits"] == [1, 1, 151936]
    assert [step["cache_len"] for step in decode] == list(range(257, 384))
    assert len(contiguous["output_ids"]) == 128 and all(0 <= t < 151936 for t in contiguous["output_ids"])
    assert contiguous["output_ids"][0] == pre["first_token"]
    assert contiguous["dtype"] == "float16" and "blocks" not in pre


def test_paged_trace_reports_blocks_and_gives_the_same_tokens(contiguous):
    paged = trace("--set", "kv_cache.layout=paged")
    assert paged["prefill"]["blocks"] == 16
    assert [step["cache_len"] for step in paged["decode"]] == list(range(257, 384))
    assert [step["blocks"] for step in paged["decode"]] == [-(-n // 16) for n in range(257, 384)]
    assert paged["decode"][-1]["blocks"] == 24
    assert paged["decode"][0]["k"] == [1, 32, 257, 128]
    assert paged["output_ids"] == contiguous["output_ids"]


def test_fixed_shape_decode_step_at_full_size_matches_the_ordinary_one():
    """The step a GPU replays from a CUDA graph (kvbook.runtime.cuda_graph), run eagerly on the CPU,
    captured on CUDA."""
    from kvbook.config import load_config
    from kvbook.runtime.cuda_graph import compare_with_ordinary
    from kvbook.runtime.engine import Engine

    engine = Engine(load_config("config.toml"), progress=False)
    result = compare_with_ordinary(engine, list(range(1000, 1020)), steps=3)
    assert result["positions"] == 23
    assert result["replayed"] == (engine.device.type == "cuda")  # a failed capture falls back to eager steps
    assert result["max_logit_diff"] < 0.05  # float16 logits of size ~1
    # greedy tokens of random weights can flip at near-ties on a GPU (summation order); on the CPU they are equal
    assert result["same_tokens"] or engine.device.type != "cpu"
