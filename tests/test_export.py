"""export --format hf: transformers loads the directory and computes kvbook's logits; bad targets are one line and
leave nothing behind."""

import json
import os

import pytest
import torch
from kvbook.config import ConfigError
from kvbook.model.weights import load_random_weights
from kvbook.runtime.engine import Engine
from kvbook.tokenizer import ENDOFTEXT_ID, IM_END_ID
from kvbook.tools import export
from kvbook.tools.export import export_hf
from kvbook.tools.llama_cpp_peer import teacher_forced_logits

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


# --- GGUF: llama.cpp (through llama-cpp-python) loads the export and computes kvbook's logits ---
# llama.cpp's kernels round differently and its KV cache is float16 even for float32 weights; on small float32
# configs the largest difference was below 1e-3 of the largest logit (f32 and f16 exports), so 5e-3 leaves room
# for other CPUs while a wrong tensor name, layout or rotation is off by the logits' own size.
LLAMA_CPP_TOLERANCE = 5e-3


def llama_cpp_logits(path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits at every position of ids."""
    return teacher_forced_logits(path, ids[:1], ids[1:])


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / ours.abs().max()).item()


@pytest.mark.parametrize(("gguf_type", "tied"), [("f32", False), ("f16", True)])
def test_llama_cpp_loads_the_gguf_and_computes_the_same_logits(tmp_path, gguf_type, tied):
    cfg = small_config(vocab=151936, tied=tied)
    weights = load_random_weights(cfg.model, torch.float32, progress=False)
    path = export.export_gguf(cfg.model, weights, tmp_path / "model.gguf", gguf_type)
    ours = Engine(cfg, progress=False).model
    with torch.no_grad():
        expected = ours(IDS, torch.arange(IDS.shape[1]), None, last_only=False)[0]
    assert relative_error(expected, llama_cpp_logits(path, IDS[0].tolist())) < LLAMA_CPP_TOLERANCE


def test_the_gguf_carries_qwens_vocabulary_and_chat_tokens(tmp_path):
    import llama_cpp
    from kvbook.tokenizer import get_default_tokenizer

    cfg = small_config(vocab=151936)
    path = export.export_gguf(cfg.model, load_random_weights(cfg.model, torch.float32, progress=False),
                              tmp_path / "model.gguf", "f16")
    llm = llama_cpp.Llama(str(path), n_ctx=64, vocab_only=True, verbose=False)
    tokenizer = get_default_tokenizer()
    text = "Prefill fills the KV cache; decode appends to it, one token at a time (TPOT ≈ 98 ms?)\n\n  done."
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer.encode(text)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    rendered = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert llm.tokenize(rendered.encode(), add_bos=False, special=True) == chat
    assert llm.detokenize(tokenizer.encode(text)).decode() == text
    assert (llm.token_eos(), llm.token_bos()) == (IM_END_ID, ENDOFTEXT_ID)


def test_q8_0_in_llama_cpp_against_kvbooks_int8(tmp_path):
    """Both store int8 numbers with float scales, Q8_0 one per 32 numbers, kvbook one per output row: the two
    quantized models differ from the float32 one by a few thousandths of the largest logit, not by its size."""
    cfg = small_config(vocab=151936)
    weights = load_random_weights(cfg.model, torch.float32, progress=False)
    path = export.export_gguf(cfg.model, weights, tmp_path / "model.gguf", "q8_0")
    q8_0 = llama_cpp_logits(path, IDS[0].tolist())
    with torch.no_grad():
        exact = Engine(cfg, progress=False).model(IDS, torch.arange(IDS.shape[1]), None, last_only=False)[0]
        int8 = Engine(cfg.replace(inference={"weight_dtype": "int8"}), progress=False).model(
            IDS, torch.arange(IDS.shape[1]), None, last_only=False)[0]
    q8_error, int8_error = relative_error(exact, q8_0), relative_error(exact, int8)
    print(f"max |logit error| / max |logit|: llama.cpp Q8_0 {q8_error:.4f}, kvbook int8 {int8_error:.4f}")
    assert 0 < q8_error < 0.05 and 0 < int8_error < 0.05  # quantized, not exact, and not broken


def test_gguf_export_refuses_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    small = small_config()  # vocab 1000: no room for Qwen's vocabulary
    weights = load_random_weights(small.model, torch.float32, progress=False)
    with pytest.raises(ConfigError, match="vocab_size = 1000: a GGUF carries its tokenizer"):
        export.export_gguf(small.model, weights, tmp_path / "a.gguf")
    uneven = small_config(vocab=151936, hidden=48, heads=4, head_dim=12)
    with pytest.raises(ConfigError, match="q8_0 stores rows in blocks of 32: hidden_size = 48"):
        export.check_gguf(uneven.model, "q8_0")
    with pytest.raises(ConfigError, match="unknown GGUF type 'q4_0'; use one of f16, q8_0, f32"):
        export.check_gguf(uneven.model, "q4_0")
    (tmp_path / "taken.gguf").write_text("mine")
    cfg = small_config(vocab=151936)
    weights = load_random_weights(cfg.model, torch.float32, progress=False)
    with pytest.raises(ConfigError, match="taken.gguf' exists; export into a new file"):
        export.export_gguf(cfg.model, weights, tmp_path / "taken.gguf")

    import gguf

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export.export_gguf(cfg.model, weights, tmp_path / "new.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.gguf"]  # no file, no partial one
    assert (tmp_path / "taken.gguf").read_text() == "mine"


def test_the_gguf_export_command_says_how_to_run_it(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    done = kvbook("export", "--format", "gguf", str(tmp_path / "m.gguf"), "--type", "q8_0", *TINY, env=env)
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'm.gguf'}" in done.stdout and f"llama-cli -m {tmp_path / 'm.gguf'}" in done.stdout
    assert (tmp_path / "m.gguf").read_bytes()[:4] == b"GGUF"
    for args, message in [(["--type", "q4_0"], "unknown GGUF type 'q4_0'"),
                          (["--set", "model.vocab_size=1000"], "vocab_size = 1000"),
                          ([], "exists; export into a new file")]:
        refused = kvbook("export", "--format", "gguf", str(tmp_path / "m.gguf"), *TINY, *args, env=env)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and message in lines[0], refused.stderr
