"""python -m kvbook bench on a tiny model: the JSON fields the book and BENCHMARKS.md read, the exact KV-cache
bytes, and the peer measured in the same run. (Speed is measured by the bench, never asserted here.)"""

import json
import subprocess
import sys

from kvbook.bench import decode_weight_bytes, targets
from kvbook.config import Config, ModelConfig

from .test_cli import TINY


def test_bench_json_against_transformers_on_a_tiny_model(tmp_path):
    import os
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    result = subprocess.run([sys.executable, "-m", "kvbook", "bench", "--json", "--steps", "2", "--repeats", "1",
                             "--rounds", "1", "--against", "transformers", *TINY], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    for key in ("ttft_ms", "tpot_ms", "ready_s", "peak_rss_mb", "floor_ms", "cold_ready_s", "probe_gbps"):
        assert out[key] > 0, key
    assert out["kv_cache_bytes"] == out["kv_cache_bytes_formula"] == 2 * 1 * 2 * 16 * 256 * 4
    assert set(out["transformers"]) >= {"build_s", "ttft_ms", "tpot_ms", "peak_rss_mb"}
    assert set(out["targets"]) >= {"tpot_vs_floor", "tpot_vs_transformers", "ttft_vs_transformers",
                                   "cold_ready_vs_transformers_build", "kv_cache_bytes_exact"}
    assert "kvbook bench: [1/" in result.stderr  # progress lines


def test_decode_reads_every_weight_but_the_embedding():
    untied = Config()
    assert decode_weight_bytes(untied) == 2 * (3 * 202383616 + 4096 + 151936 * 4096)  # 2.46 GB
    tied = untied.replace(model={"tie_word_embeddings": True})
    assert decode_weight_bytes(tied) == decode_weight_bytes(untied)  # lm_head is the table, read whole
    assert ModelConfig().vocab_size == 151936


def test_targets_compare_ratios_with_their_limits():
    result = {"tpot_ms": 60.0, "floor_ms": 50.0, "peak_rss_mb": 4000.0, "weight_bytes": 3703629312,
              "kv_cache_bytes": 10, "kv_cache_bytes_formula": 11, "ttft_ms": 500.0, "ready_s": 0.3,
              "transformers": {"tpot_ms": 100.0, "ttft_ms": 5000.0, "build_s": 12.0}}
    t = targets(result)
    assert t["tpot_vs_floor"] == {"ratio": 1.2, "limit": 1.2, "met": True}
    assert t["tpot_vs_transformers"]["met"] is True and t["ttft_vs_transformers"]["ratio"] == 0.1
    assert t["kv_cache_bytes_exact"]["met"] is False


def test_roofline_json_on_a_tiny_model(tmp_path):
    import os
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    result = subprocess.run([sys.executable, "-m", "kvbook", "bench", "--roofline", "--json", "--repeats", "1",
                             *TINY], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    ops = [row["op"] for row in out["decode"]]
    assert ops[0] == "embedding" and ops[-1] == "lm_head" and ops.count("attention") == 1  # one layer
    q_prefill = next(r for r in out["prefill"] if r["op"] == "q_proj")
    q_decode = next(r for r in out["decode"] if r["op"] == "q_proj")
    assert q_prefill["flops"] == 2 * 256 * 64 * 64 and q_decode["flops"] == 2 * 1 * 64 * 64
    assert q_decode["bytes"] == 64 * 64 * 4 + (64 + 64) * 4  # float32 weight, one position in and out
    assert q_prefill["intensity"] > 10 * q_decode["intensity"]
    assert out["intensity"]["prefill"] > out["intensity"]["decode"]
    assert 0 < out["lm_head_share_of_decode"] < 1 and out["bound"]["decode"] == "memory"
    assert all(row["ms"] >= 0 for row in out["prefill"] + out["decode"])


def test_batch_sweep_reports_tokens_per_second_per_batch_size(tmp_path):
    import os
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    result = subprocess.run([sys.executable, "-m", "kvbook", "bench", "--batch-sweep", "1,3", "--steps", "2",
                             "--json", *TINY], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout)["sweep"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert abs(r["tokens_per_s"] - r["batch_size"] * 1e3 / r["tpot_ms"]) < 1e-6
    assert rows[1]["kv_cache_mib"] == 3 * rows[0]["kv_cache_mib"]
    bad = subprocess.run([sys.executable, "-m", "kvbook", "bench", "--batch-sweep", "1,x"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "expected batch sizes like 1,2,4,8" in bad.stderr


def test_concurrency_bench_sends_requests_alone_and_at_once_through_the_server(tmp_path):
    import os
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop("TAOTOKEN_API_KEY", None)
    result = subprocess.run([sys.executable, "-m", "kvbook", "bench", "--json", "--concurrency", "4", "--max-tokens",
                             "5", *TINY], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert out["concurrency"] == 4 and len(out["requests"]) == 4 and out["max_tokens"] == 5
    assert out["ratio"] == out["concurrent_s"] / out["alone_s"] > 0
    assert out["tokens_per_s"]["concurrent"] == 4 * 5 / out["concurrent_s"]
    assert 1 <= out["max_decode_batch"] <= 4 and out["max_num_seqs"] == 8
    assert all(r["ttft_ms"] > 0 and r["s"] <= out["concurrent_s"] for r in out["requests"])
    assert "kvbook bench: [3/3] 4 requests at once" in result.stderr


def test_concurrency_must_be_positive():
    result = subprocess.run([sys.executable, "-m", "kvbook", "bench", "--concurrency", "0", *TINY],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "kvbook: error: --concurrency and --max-tokens must be >= 1"]
