"""The real 1.85B-parameter model (the article's config, float16) on this machine's device: the shape
checklist of `python -m kvbook trace --json`, with cache_len 257 ... 383.

The weights come from the user's cache (~/.cache/kvbook, built on first use), like a reader's run."""

import json
import subprocess
import sys


def test_trace_json_full_size_checklist():
    result = subprocess.run([sys.executable, "-m", "kvbook", "trace", "--json"], capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
    trace = json.loads(result.stdout)
    pre, decode = trace["prefill"], trace["decode"]
    assert pre["input_ids"] == [256]
    assert pre["embedding"] == [1, 256, 4096]
    assert [layer["output"] for layer in pre["layers"]] == [[1, 256, 4096]] * 3
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
    assert len(trace["output_ids"]) == 128 and all(0 <= t < 151936 for t in trace["output_ids"])
    assert trace["output_ids"][0] == pre["first_token"]
    assert trace["dtype"] == "float16"
