"""Loading a real Hugging Face Qwen3 checkpoint directory written by transformers' save_pretrained: tied and
untied, cut to its first N layers, and errors that name the HF key and both shapes."""

import json
import re

import pytest
import torch
from kvbook.config import ConfigError
from kvbook.model.weights import CheckpointError, build_model, checkpoint_config, load_checkpoint
from kvbook.runtime.engine import Engine
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from .conftest import small_config
from .test_parity import hf_reference


def saved(tmp_path, tied=False, layers=3):
    cfg = small_config(layers=layers, tied=tied)
    hf, hf_cfg = hf_reference(cfg)
    hf.save_pretrained(tmp_path)
    return cfg, hf


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_loads_and_matches_transformers(tmp_path, tied):
    cfg, hf = saved(tmp_path, tied)
    model_cfg = checkpoint_config(tmp_path)
    assert model_cfg.num_hidden_layers == 3 and model_cfg.tie_word_embeddings == tied
    assert model_cfg.num_key_value_heads == 2 and model_cfg.head_dim == 16 and model_cfg.rope_theta == 1e6
    ours = build_model(model_cfg, load_checkpoint(tmp_path, model_cfg, torch.float32), torch.device("cpu"))
    ids = torch.arange(5, 25)[None]
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids, torch.arange(20), None, last_only=False), hf(ids).logits,
                                   atol=1e-5, rtol=1e-5)
    if tied:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_truncated_to_first_layers_equals_transformers_with_those_layers(tmp_path):
    cfg, hf = saved(tmp_path)
    model_cfg = checkpoint_config(tmp_path, num_layers=1)
    ours = build_model(model_cfg, load_checkpoint(tmp_path, model_cfg, torch.float32), torch.device("cpu"))
    hf.model.layers = hf.model.layers[:1]
    hf.config.num_hidden_layers = 1
    ids = torch.arange(5, 25)[None]
    with torch.inference_mode():
        reference = hf(ids, cache=DynamicCache(config=hf.config)).logits
        torch.testing.assert_close(ours(ids, torch.arange(20), None, last_only=False), reference,
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="the checkpoint has 3 layers; choose 1..3"):
        checkpoint_config(tmp_path, num_layers=4)


def test_engine_from_checkpoint_generates(tmp_path, weight_cache):
    cfg, _ = saved(tmp_path)
    engine = Engine.from_checkpoint(cfg, tmp_path, num_layers=2)
    assert engine.config.model.num_hidden_layers == 2
    run = engine.generate(list(range(3, 15)), 4, ignore_eos=True)
    assert len(run.output_ids) == 4 and run.cache_len == 15


def test_missing_tensor_names_the_hf_key(tmp_path):
    saved(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path)
    model_cfg = checkpoint_config(tmp_path)
    expected = r"no tensor 'model.layers.1.self_attn.k_norm.weight' \(expected shape \[16\]\)"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(tmp_path, model_cfg, torch.float32)


def test_misshaped_tensor_names_the_hf_key_and_both_shapes(tmp_path):
    saved(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:100].clone()
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, checkpoint_config(tmp_path), torch.float32)
    assert str(err.value) == ("checkpoint tensor 'model.layers.0.mlp.up_proj.weight' has shape [100, 64], "
                              "the model needs [128, 64]")


def test_directory_errors(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        checkpoint_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4,
                                                      "num_hidden_layers": 1}))
    with pytest.raises(ConfigError, match=r"has no \*.safetensors files"):
        load_checkpoint(tmp_path, checkpoint_config(tmp_path), torch.float32)
    (tmp_path / "model.safetensors").write_bytes(b"\x01")  # a download cut short
    with pytest.raises(ConfigError, match=r"model.safetensors: not a readable safetensors file .*download it again"):
        load_checkpoint(tmp_path, checkpoint_config(tmp_path), torch.float32)


@pytest.mark.parametrize("config_json, fragment", [
    ('{"model_type": "llama", "hidden_size": 64}', "model_type 'llama'; kvbook runs Qwen3 checkpoints"),
    ('{"model_type": "qwen3"}', "no integer num_hidden_layers, hidden_size, num_attention_heads"),
    ('{"hidden_size": 64,', "config.json: not a readable JSON file"),
])
def test_a_config_json_kvbook_cannot_run_is_one_line_naming_the_file(tmp_path, config_json, fragment):
    (tmp_path / "config.json").write_text(config_json)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        checkpoint_config(tmp_path)
