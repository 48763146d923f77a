"""python -m kvbook: exit codes and one-line errors; generate on a tiny model."""

import json
import socket
import subprocess
import sys

import pytest

TINY_SETTINGS = ["model.num_hidden_layers=1", "model.hidden_size=64", "model.num_attention_heads=4",
                 "model.head_dim=16", "model.num_key_value_heads=2", "model.intermediate_size=128",
                 "inference.dtype=float32", "kv_cache.cache_dtype=float32", "inference.device=cpu"]
TINY = [arg for setting in TINY_SETTINGS for arg in ("--set", setting)]


def kvbook(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvbook", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.fixture
def env(tmp_path, monkeypatch):
    import os
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}


@pytest.mark.parametrize("args, fragment", [
    (["trace", "--bogus"], "unrecognized arguments: --bogus"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["trace", "--config", "missing.toml"], "config file 'missing.toml' not found; pass --config PATH"),
    (["trace", "--set", "model.hiden_size=1"], "unknown key [model] hiden_size; did you mean 'hidden_size'?"),
    (["trace", "--set", "kv_cache.max_cache_len=256"], "set max_cache_len >= 383"),
    (["generate", "--prompt", "a", "--input-ids", "1"], "not allowed with argument"),
    (["generate", "--input-ids", "1,x"], "expected comma-separated integers"),
    (["generate", "--prompt", "hi", "--checkpoint", "/nonexistent"], "has no config.json"),
    (["generate", "--prompt", "hi", "--num-layers", "1"], "--num-layers needs --checkpoint"),
])
def test_user_mistakes_are_one_line_and_exit_2(args, fragment, env):
    result = kvbook(*args, env=env)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("kvbook: device")]
    assert len(lines) == 1 and lines[0].startswith("kvbook: error: ") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def refused_before_loading(args, tmp_path, monkeypatch, capsys) -> str:
    """main(args) in this process (the subprocess test above shows it is the same as python -m kvbook): exit code
    2, one line, and no weights drawn -> that line."""
    from kvbook.tools.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("kvbook: device")]
    assert len(lines) == 1 and lines[0].startswith("kvbook: error: "), lines
    assert not (tmp_path / "xdg" / "kvbook").exists()  # refused before any weights were drawn or paths timed
    return lines[0]


@pytest.mark.parametrize("args, fragment", [
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["generate", "--temperature", "-1"], "temperature = -1: must be >= 0"),
    (["generate", "--top-p", "0"], "top_p = 0: must be in (0, 1]"),
    (["trace", "--set", "model.vocab_size=10"], "token id 151644 is outside the vocabulary [0, 10)"),
    (["serve", "--port", "99999"], "--port 99999: a port is 0..65535"),
    (["serve", "--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid:8000"),
    (["bench", "--roofline", "--batch-sweep", "1,2"], "not allowed with argument"),
    (["bench", "--url", "http://127.0.0.1:9"], "--url needs --load RATES"),
    (["bench", "--paired-rounds", "-1"], "--paired-rounds must be >= 0"),
    (["bench", "--load", "1", "--url", "http://127.0.0.1:9"], "--url http://127.0.0.1:9: no kvbook server answers"),
])
def test_argument_mistakes_are_refused_before_the_model_loads(args, fragment, tmp_path, monkeypatch, capsys):
    assert fragment in refused_before_loading(args, tmp_path, monkeypatch, capsys)


def test_serve_refuses_a_port_in_use_before_loading_the_model(tmp_path, monkeypatch, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused_before_loading(["serve", "--port", str(port)], tmp_path, monkeypatch, capsys)
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use)" in line


def test_generate_json_on_a_tiny_model(env):
    result = kvbook("generate", "--input-ids", "9707,1879", "--max-new-tokens", "5", "--ignore-eos", "--json",
                    *TINY, env=env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["input_ids"] == [9707, 1879] and len(out["output_ids"]) == 5
    assert out["cache_len"] == 2 + 5 - 1 and out["finish_reason"] == "length"
    assert out["ttft_ms"] > 0 and out["tpot_ms"] > 0 and isinstance(out["text"], str)
    assert out["device"] == "cpu" and out["dtype"] == "float32"


def test_generate_prints_the_text_as_it_comes_and_it_is_the_json_text(env):
    args = ["generate", "--input-ids", "9707,1879", "--max-new-tokens", "6", "--ignore-eos", *TINY]
    streamed = kvbook(*args, env=env)
    whole = kvbook(*args, "--json", env=env)
    assert streamed.returncode == whole.returncode == 0, streamed.stderr + whole.stderr
    assert streamed.stdout == json.loads(whole.stdout)["text"] + "\n"  # the same greedy tokens, one process each
    assert "finish_reason length, cache_len 7" in streamed.stderr


def test_generate_prompt_uses_chat_template_and_rejects_out_of_vocab_ids(env):
    result = kvbook("generate", "--prompt", "Hello world", "--max-new-tokens", "2", "--json", *TINY, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["input_ids"][:1] == [151644]
    bad = kvbook("generate", "--input-ids", "1,200000", *TINY, env=env)
    assert bad.returncode == 2 and "token id 200000 is outside the vocabulary [0, 151936)" in bad.stderr


def test_generate_defaults_to_the_scenario_prompt_of_input_len_tokens(env):
    result = kvbook("generate", "--max-new-tokens", "3", "--json", *TINY, "--set", "inference.input_len=40", env=env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["input_ids"]) == 40 and out["cache_len"] == 42


def test_cache_dtype_warning_is_one_line(env):
    result = kvbook("generate", "--input-ids", "1,2", "--max-new-tokens", "1", "--json", *TINY,
                    "--set", "kv_cache.cache_dtype=float16", env=env)
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and warning[0].startswith("kvbook: warning: [kv_cache] cache_dtype = 'float16'")
