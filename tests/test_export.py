"""export --format hf: transformers loads the directory and computes kvbook's logits; bad targets are one line and
leave nothing behind."""

import json
import os

import pytest
import torch
from kvbook.config import ConfigError
from kvbook.model.weights import load_random_weights
from kvbook.runtime.engine import Engine
from kvbook.tools import export
from kvbook.tools.export import export_hf

from .conftest import small_config
from .test_cli import TINY, kvbook

IDS = torch.tensor([[9707, 1879, 11, 1052, 374, 264, 1273, 13]])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_loads_the_export_and_computes_the_same_logits(tmp_path, tied):
    from transformers import Qwen3ForCausalLM

    cfg = small_config(vocab=151936, tied=tied)
    weights = load_random_weights(cfg.model, torch.float32, progress=False)
    directory = export_hf(cfg.model, weights, tmp_path / "model")
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "generation_config.json",
                                                          "model.safetensors"]
    theirs = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    ours = Engine(cfg, progress=False).model
    with torch.no_grad():
        expected = ours(IDS, torch.arange(IDS.shape[1]), None, last_only=False)
        assert (theirs(IDS).logits - expected).abs().max() < 1e-5
    reread = Engine.from_checkpoint(cfg, directory).model  # and kvbook reads its own export back
    with torch.no_grad():
        assert torch.equal(reread(IDS, torch.arange(IDS.shape[1]), None, last_only=False), expected)


def test_an_export_never_overwrites_and_an_interrupted_one_leaves_nothing(tmp_path, monkeypatch):
    cfg = small_config()
    weights = load_random_weights(cfg.model, torch.float32, progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="'.*full' exists and is not an empty directory; export into a new one"):
        export_hf(cfg.model, weights, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_hf(cfg.model, weights, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no directory, no temporary one


def test_the_export_command_says_what_it_wrote_and_refuses_in_one_line(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    done = kvbook("export", "--format", "hf", str(tmp_path / "out"), *TINY, env=env)
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'out'}" in done.stdout and "vllm serve" in done.stdout
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 2
    again = kvbook("export", "--format", "hf", str(tmp_path / "out"), *TINY, env=env)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1 and "exists and is not an empty directory" in lines[0]
