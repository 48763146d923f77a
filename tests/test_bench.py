"""python -m kvbook bench on a tiny model: the JSON fields the book and BENCHMARKS.md read, the exact KV-cache
bytes, and the peer measured in the same run. (Speed is measured by the bench, never asserted here.)"""

import json
import subprocess
import sys

import kvbook.tools.roofline as roofline_module
import pytest
import torch
from kvbook.config import Config, ModelConfig, load_config
from kvbook.kernels import Phase, choose, fbgemm_available
from kvbook.kernels.layers import onednn_available
from kvbook.runtime.engine import Engine
from kvbook.tools.bench import decode_weight_bytes, format_table, paired_summary, ratios, read_spread_note
from kvbook.tools.llama_cpp_peer import decode_bytes
from kvbook.tools.measure import READ_LOOPS, read_bandwidth_gbps
from kvbook.tools.roofline import prefill_flops

from .conftest import small_config
from .test_cli import TINY, TINY_SETTINGS


def test_the_plain_read_is_the_faster_loop(monkeypatch):
    """The memory floor's bandwidth is the fastest of the plain reads, not torch.sum's alone: a loop that reads
    the same bytes faster sets it, and the result names it."""
    import time

    def slow_sum(data):
        time.sleep(0.02)
        return data.sum()

    monkeypatch.setattr("kvbook.tools.measure.READ_LOOPS", {"slow": slow_sum, "fast": lambda data: data.sum()})
    read = read_bandwidth_gbps(torch.device("cpu"), gib=1 / 64, repeats=3)
    assert read["read_loop"] == "fast"
    assert read["read_loops_gbps"]["fast"] > read["read_loops_gbps"]["slow"]
    assert read["read_gbps"] == pytest.approx(read["read_loops_gbps"]["fast"], abs=0.01)
    assert read["read_bytes"] == 2**30 // 64
    # the real loops read every byte once: each sums 1.0 over the data to its element count
    data = torch.ones(1024)
    assert [float(loop(data)) for loop in READ_LOOPS.values()] == [1024.0] * len(READ_LOOPS)


def test_bench_json_against_transformers_on_a_tiny_model(tmp_path):
    import os
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    result = subprocess.run([sys.executable, "-m", "kvbook", "bench", "--json", "--steps", "2", "--repeats", "1",
                             "--rounds", "1", "--paired-rounds", "3", "--against", "transformers", *TINY],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    for key in ("ttft_ms", "tpot_ms", "ready_s", "peak_rss_mb", "memory_floor_ms", "compute_floor_ms",
                 "cold_ready_s", "weight_bytes_kept"):
        assert out[key] > 0, key
    # on a CPU the weights live in the process's memory: its peak RSS is the peak memory the goal weighs
    assert out["peak_memory_of"] == "process RSS" and out["peak_memory_mb"] == out["peak_rss_mb"]
    assert out["kv_cache_bytes"] == out["kv_cache_bytes_formula"] == 2 * 1 * 2 * 16 * 256 * 4
    floors = out["floors"]
    # the plain read is measured before the runs and after the round; the floor uses the best
    assert len(floors["read_gbps_samples"]) == 2
    assert floors["read_gbps"] == pytest.approx(max(floors["read_gbps_samples"]), abs=0.01)
    # each sample is the faster of the plain reads, named
    assert len(floors["read_loops"]) == 2 and set(floors["read_loops"]) <= set(READ_LOOPS)
    assert set(floors["read_loops_gbps"]) == set(READ_LOOPS)
    assert floors["read_gbps_samples"][0] == pytest.approx(max(floors["read_loops_gbps"].values()), abs=0.01)
    assert floors["memory_floor_at_slowest_read_ms"] == pytest.approx(
        (floors["decode_weight_bytes"] + floors["decode_kv_bytes"]) / min(floors["read_gbps_samples"]) / 1e6, rel=1e-3)
    assert floors["decode_weight_bytes"] == decode_weight_bytes(load_config("config.toml", TINY_SETTINGS))
    assert floors["decode_kv_bytes"] == 2 * 1 * 2 * 16 * 4 * (256 + 1.5)  # the mean of 2 steps' positions
    assert out["memory_floor_ms"] == pytest.approx(
        (floors["decode_weight_bytes"] + floors["decode_kv_bytes"]) / floors["read_gbps"] / 1e6)
    assert out["compute_floor_ms"] == pytest.approx(floors["prefill_flops"] / floors["peak_gflops"] / 1e6)
    # the floor counts the work the engine must do, not every position's last layer (issue 51)
    tiny = load_config("config.toml", TINY_SETTINGS)
    assert floors["prefill_flops"] == prefill_flops(tiny.model, tiny.inference.input_len, computed=True)
    assert floors["prefill_flops_every_position"] == prefill_flops(tiny.model, tiny.inference.input_len)
    # the fastest kernel's product, sampled before the runs and with the read after the round: the best sets it
    assert floors["peak_gflops_samples"][0] == pytest.approx(
        max(out["kernels"][d]["matmul_gflops"] for d in floors["compute_dtypes"]), abs=0.1)
    assert len(floors["peak_gflops_samples"]) == 2
    assert floors["peak_gflops"] == pytest.approx(max(floors["peak_gflops_samples"]), abs=0.1)
    # float32 weights: FBGEMM's float16 kernel would round them; oneDNN's float32 product may serve prefill
    onednn = ["onednn-float32"] if onednn_available(torch.device("cpu")) else []
    assert floors["compute_dtypes"] == ["float32", *onednn]
    fbgemm = {"fbgemm-float16"} if fbgemm_available(torch.device("cpu")) else set()  # a batched step's candidate
    assert set(out["kernels"]) == {"float16", "bfloat16", "float32"} | fbgemm | set(onednn)
    assert all(v > 0 for k in out["kernels"].values() for v in k.values())
    assert set(out["transformers_by_dtype"]) == {"float32", "bfloat16"}  # the config's dtype and bfloat16
    best = out["transformers"]
    assert best["tpot_ms"] == min(p["tpot_ms"] for p in out["transformers_by_dtype"].values())
    assert best["ttft_ms"] == out["transformers_by_dtype"][best["ttft_dtype"]]["ttft_ms"]
    ratios = out["ratios"]
    assert ratios["tpot_vs_best_transformers"] == round(out["tpot_ms"] / best["tpot_ms"], 3)
    assert ratios["ttft_vs_compute_floor"] == round(out["ttft_ms"] / out["compute_floor_ms"], 3)
    assert ratios["kv_cache_bytes_exact"] is True
    # then both decode in one process, alternating, against the peer's faster decode dtype
    paired = out["tpot_paired"]
    assert paired["dtype"] == best["tpot_dtype"] and paired["rounds"] == 3
    assert len(paired["engine_tpot_runs"]) == len(paired["transformers_tpot_runs"]) == 3
    assert all(t > 0 for t in paired["engine_tpot_runs"] + paired["transformers_tpot_runs"])
    assert ratios["tpot_vs_best_transformers_paired"] == round(paired["ratio_median"], 3)
    # each engine run has a plain read beside it, and its floor is that read's
    assert len(paired["read_gbps_runs"]) == 3 and all(g > 0 for g in paired["read_gbps_runs"])
    assert paired["engine_vs_round_floor_runs"] == pytest.approx(
        [t / ((floors["decode_weight_bytes"] + floors["decode_kv_bytes"]) / g / 1e6)
         for t, g in zip(paired["engine_tpot_runs"], paired["read_gbps_runs"], strict=True)])
    assert "kvbook bench: [6/6] engine and transformers (its faster decode) alternating" in result.stderr
    assert out["phases"]["decode"]["label"] == out["decode_dtype"] and len(out["phases_text"]) == 4
    assert out["phases"]["prefill"]["label"] == out["prefill_dtype"]  # the kernel too, as the other phases' labels
    assert "kvbook bench: [1/" in result.stderr  # progress lines


def test_decode_reads_every_weight_but_the_embedding():
    untied = Config()
    assert decode_weight_bytes(untied) == 2 * (3 * 202383616 + 4096 + 151936 * 4096)  # 2.46 GB
    tied = untied.replace(model={"tie_word_embeddings": True})
    assert decode_weight_bytes(tied) == decode_weight_bytes(untied)  # lm_head is the table, read whole
    assert ModelConfig().vocab_size == 151936


def test_prefill_flops_count_lm_head_on_one_position():
    m = ModelConfig()  # the article's shapes
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008
    assert prefill_flops(m, 256) == 3 * (2 * 256 * layer + 4 * 32 * 256 * 256 * 128) + 2 * 4096 * 151936
    assert round(prefill_flops(m, 256) / 1e9, 1) == 315.3  # lm_head on all 256 positions would add 317 GFLOP
    # what the engine computes: the last layer's k_proj and v_proj on 256 rows, its q_proj, o_proj, MLP and
    # attention on one
    last_layer = 2 * 256 * 2 * 4096 * 4096 + 2 * (2 * 4096 * 4096 + 3 * 4096 * 11008) + 4 * 32 * 256 * 128
    assert prefill_flops(m, 256, computed=True) == (2 * (2 * 256 * layer + 4 * 32 * 256 * 256 * 128) + last_layer
                                                    + 2 * 4096 * 151936)


def test_ratios_against_floors_and_the_best_peer():
    result = {"tpot_ms": 60.0, "memory_floor_ms": 50.0, "ttft_ms": 500.0, "compute_floor_ms": 400.0,
              "peak_memory_mb": 4000.0, "weight_bytes_kept": 4000 * 2**20, "kv_cache_bytes": 10,
              "kv_cache_bytes_formula": 11, "ready_s": 0.3,
              "transformers": {"tpot_ms": 100.0, "ttft_ms": 5000.0, "build_s": 12.0}}
    r = ratios(result)
    assert r["tpot_vs_memory_floor"] == 1.2 and r["ttft_vs_compute_floor"] == 1.25
    assert r["peak_memory_vs_weight_bytes_kept"] == 1.0 and r["kv_cache_bytes_exact"] is False
    assert r["tpot_vs_best_transformers"] == 0.6 and r["ttft_vs_best_transformers"] == 0.1
    assert r["cold_ready_vs_transformers_build"] is None  # no cold start in this run
    assert r["tpot_vs_best_transformers_paired"] is None  # nor a paired decode
    result["tpot_paired"] = paired_summary({"dtype": "float16", "engine_tpot_runs": [60.0, 80.0, 66.0],
                                            "transformers_tpot_runs": [70.0, 100.0, 60.0],
                                            "read_gbps_runs": [50.0, 50.0, 50.0]}, 2.5e9)
    assert ratios(result)["tpot_vs_best_transformers_paired"] == 0.857  # the per-round ratios' median: 60 / 70
    del result["transformers"]
    assert ratios(result)["tpot_vs_best_transformers"] is None


def test_the_paired_summary_takes_the_median_of_the_rounds_ratios():
    """Each round's ratio compares two runs of the same minute; their median, not the ratio of the medians, is the
    paired figure."""
    paired = paired_summary({"dtype": "float16", "engine_tpot_runs": [80.0, 64.0, 66.0],
                             "transformers_tpot_runs": [84.0, 70.0, 60.0], "read_gbps_runs": [25.0, 50.0, 40.0]},
                            2.0e9)
    assert paired["engine_tpot_ms"] == 66.0 and paired["transformers_tpot_ms"] == 70.0
    assert paired["ratio_median"] == pytest.approx(80.0 / 84.0)  # rounds: 0.952, 0.914, 1.1
    assert paired["engine_faster_rounds"] == 2 and paired["rounds"] == 3


def test_the_paired_summary_weighs_each_round_against_its_own_read():
    """A round whose plain read was slow has a higher floor: the engine's TPOT is weighed against the floor of its
    own minutes, not the best minute's."""
    paired = paired_summary({"dtype": "float16", "engine_tpot_runs": [80.0, 64.0, 66.0],
                             "transformers_tpot_runs": [84.0, 70.0, 60.0], "read_gbps_runs": [25.0, 50.0, 40.0]},
                            2.0e9)
    assert paired["memory_floor_ms_runs"] == pytest.approx([80.0, 40.0, 50.0])  # 2 GB at 25, 50, 40 GB/s
    assert paired["engine_vs_round_floor_runs"] == pytest.approx([1.0, 1.6, 1.32])
    assert paired["engine_vs_round_floor_median"] == pytest.approx(1.32)


def test_roofline_json_on_a_tiny_model(tmp_path):
    import os
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    result = subprocess.run([sys.executable, "-m", "kvbook", "bench", "--roofline", "--json", "--repeats", "1",
                             *TINY], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    ops = [row["op"] for row in out["decode"]]
    assert ops[0] == "embedding" and ops[-1] == "lm_head" and ops.count("attention") == 1  # one layer
    def op(phase, name):
        return next(r for r in out[phase] if r["op"] == name)

    # the only layer is the last: in prefill its K and V take 256 rows, its queries one (kvbook.model.qwen3)
    assert op("prefill", "q_proj")["flops"] == op("decode", "q_proj")["flops"] == 2 * 1 * 64 * 64
    assert op("prefill", "k_proj")["flops"] == 256 * op("decode", "k_proj")["flops"]
    assert op("decode", "q_proj")["bytes"] == 64 * 64 * 4 + (64 + 64) * 4  # float32 weight, one position in and out
    assert op("prefill", "k_proj")["intensity"] > 10 * op("decode", "k_proj")["intensity"]
    assert out["intensity"]["prefill"] > out["intensity"]["decode"]
    # the engine's prefill path label, not "torch.float32": float32 weights leave nothing to measure
    tiny = load_config("config.toml", TINY_SETTINGS)
    assert out["prefill_dtype"] == choose(tiny, torch.device("cpu")).prefill.label
    assert 0 < out["lm_head_share_of_decode"] < 1 and out["bound"]["decode"] == "memory"
    assert all(row["ms"] >= 0 for row in out["prefill"] + out["decode"])


def test_batch_sweep_reports_tokens_per_second_per_batch_size(tmp_path):
    import os
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    result = subprocess.run([sys.executable, "-m", "kvbook", "bench", "--batch-sweep", "1,3", "--steps", "2",
                             "--json", *TINY, "--set", "inference.prefill_dtype=bfloat16"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    sweep = json.loads(result.stdout)
    assert sweep["batched_decode_dtype"] == "float32"  # the batched step's, not prefill's (pinned to bfloat16 here)
    rows = sweep["sweep"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert abs(r["tokens_per_s"] - r["batch_size"] * 1e3 / r["tpot_ms"]) < 1e-6
    assert rows[1]["kv_cache_mib"] == 3 * rows[0]["kv_cache_mib"]
    assert sweep["peak_memory_of"] == "process RSS" and all(r["peak_memory_mb"] > 0 for r in rows)  # a CPU's
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


def test_peak_compute_times_the_arithmetic_of_the_phase_it_is_given(weight_cache, monkeypatch):
    engine = Engine(small_config(layers=1), progress=False)
    timed = []
    monkeypatch.setattr(roofline_module, "time_linear",
                        lambda rows, out, inp, dtype, device, repeats, kernel: timed.append((dtype, kernel)) or 1.0)
    assert roofline_module.peak_compute_gflops(engine) == 2 * 256 * 4096 * 11008 / 1e9  # 1 s: GFLOP count
    assert timed == [(engine.kernels.prefill.dtype, engine.kernels.prefill.kernel)]  # prefill's by default
    roofline_module.peak_compute_gflops(engine, path=Phase(torch.float32, "fbgemm", "a batched step's"))
    assert timed[-1] == (torch.float32, "fbgemm")


def test_a_run_whose_plain_read_moved_says_what_the_slowest_sample_gives():
    floors = {"read_gbps_samples": [54.4, 34.8, 33.6], "memory_floor_at_slowest_read_ms": 73.6}
    note = read_spread_note(102.9, floors)
    assert "between 33.6 and 54.4 GB/s" in note and "(1.62 x)" in note
    assert "floor is 73.6 ms and TPOT 1.40 x it" in note
    steady = {"read_gbps_samples": [35.4, 33.7, 33.2], "memory_floor_at_slowest_read_ms": 74.5}
    assert read_spread_note(86.1, steady) is None  # 1.07 x apart: the best sample is the machine's


def test_llama_cpp_decode_bytes_are_the_gguf_tensors_a_step_reads(weight_cache):
    """The floor's bytes, counted from the shapes, equal what the exported file stores: every tensor but the
    embedding table, of which a step reads one row."""
    import gguf
    from kvbook.tools.llama_cpp_peer import decode_bytes, gguf_path

    tiny = load_config("config.toml", TINY_SETTINGS)
    for gguf_type in ("f16", "q8_0"):
        tensors = {t.name: t for t in gguf.GGUFReader(gguf_path(tiny, gguf_type)).tensors}
        embedding = tensors.pop("token_embd.weight")
        row = int(embedding.n_bytes) // tiny.model.vocab_size
        assert decode_bytes(tiny, gguf_type) == sum(int(t.n_bytes) for t in tensors.values()) + row


def test_bench_against_llama_cpp_on_a_tiny_model(tmp_path):
    import os
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    result = subprocess.run([sys.executable, "-m", "kvbook", "bench", "--json", "--steps", "2", "--repeats", "1",
                             "--rounds", "1", "--paired-rounds", "0", "--no-cold", "--against", "llama.cpp", *TINY],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert set(out["transformers_by_dtype"]) == {"float32", "bfloat16"}  # transformers runs beside llama.cpp
    peers = out["llama_cpp_by_type"]
    assert set(peers) == {"f16", "q8_0"} and [p["label"] for p in peers.values()] == ["llama.cpp F16",
                                                                                     "llama.cpp Q8_0"]
    tiny = load_config("config.toml", TINY_SETTINGS)
    kv_float16 = 2 * 1 * 2 * 16 * 2 * (256 + 1.5)  # llama.cpp's float16 cache at the mean of 2 steps' positions
    for gguf_type, peer in peers.items():
        assert peer["ttft_ms"] > 0 and peer["tpot_ms"] > 0 and peer["peak_rss_mb"] > 0 and peer["build_s"] > 0
        assert peer["decode_bytes"] == decode_bytes(tiny, gguf_type) + kv_float16
        assert peer["memory_floor_ms"] == pytest.approx(peer["decode_bytes"] / out["floors"]["read_gbps"] / 1e6)
        assert peer["tpot_vs_memory_floor"] == pytest.approx(peer["tpot_ms"] / peer["memory_floor_ms"])
        assert len(peer["tpot_vs_round_floor_runs"]) == 1 and peer["threads"] >= 1
    assert peers["q8_0"]["gguf_bytes"] < peers["f16"]["gguf_bytes"]
    assert "llama.cpp's GGUF files (exported once into the weight cache)" in result.stderr
    from kvbook.tools.book import engines_table

    rows = engines_table(out)  # chapter 8's table
    assert list(rows.index) == ["kvbook", "transformers float32", "transformers bfloat16", "llama.cpp F16",
                                "llama.cpp Q8_0"]
    assert rows.loc["llama.cpp Q8_0", "TPOT ms"] == round(peers["q8_0"]["tpot_ms"], 2)
    assert rows.loc["transformers float32", "memory floor ms"] == round(out["memory_floor_ms"], 2)
    table = format_table(out).splitlines()
    header = [line for line in table if line.startswith(" ") and line.split()[0] == "kvbook"]
    assert header[0].split()[-4:] == ["llama.cpp", "F16", "llama.cpp", "Q8_0"]
    assert sum(line.startswith("llama.cpp Q8_0 (") and "x its memory floor" in line for line in table) == 1
