"""Weights: deterministic random ones cached on disk as safetensors, or a local Hugging Face Qwen3 checkpoint.

No real Qwen3 weights can be downloaded where this book is built, so by default every tensor is drawn from
a generator seeded by ([model].seed, tensor name), directly in the target dtype. The first build writes
them to $XDG_CACHE_HOME/kvbook/weights (default ~/.cache); every later load maps that file (an mmap: nothing is
read until it is used). Explained in chapter 1 ("The pipeline").
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..config import ConfigError, ModelConfig
from .qwen3 import Qwen3ForCausalLM

INIT_STD = 0.02  # transformers' initializer_range for Qwen3
INIT_VERSION = 1  # bump when the drawing below changes, so old cache files are not reused


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the Hugging Face key and both shapes."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by its Hugging Face name, with its shape."""
    hidden, q_width = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv_width, inter = cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_width, hidden),
            p + "self_attn.k_proj.weight": (kv_width, hidden),
            p + "self_attn.v_proj.weight": (kv_width, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_width),
            p + "self_attn.q_norm.weight": (cfg.head_dim,),
            p + "self_attn.k_norm.weight": (cfg.head_dim,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    return shapes


def matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The matrices the model multiplies by, [out, in] by name: the layers' and lm_head's (tied or not; the embedding
    is a lookup)."""
    shapes = {name: shape for name, shape in expected_shapes(cfg).items()
              if len(shape) == 2 and name != "model.embed_tokens.weight"}
    return shapes | {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device) -> Qwen3ForCausalLM:
    """Put the tensors into the model without copying them (an mmap stays an mmap on the CPU)."""
    check_shapes(cfg, weights)
    dtype = weights["model.embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, dtype=dtype)
    state = dict(weights)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_word_embeddings:  # assign=True made two Parameters; make them one again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval().requires_grad_(False)


def check_shapes(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    for name, shape in expected_shapes(cfg).items():
        if name not in weights:
            raise CheckpointError(f"checkpoint has no tensor {name!r} (expected shape {list(shape)})")
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"checkpoint tensor {name!r} has shape {list(weights[name].shape)}, "
                                  f"the model needs {list(shape)}")


log = logging.getLogger(__name__)


def _save_atomically(tensors: dict[str, torch.Tensor], path: Path) -> None:
    partial = path.with_suffix(f".partial-{os.getpid()}-{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(partial), metadata={"kvbook_init": str(INIT_VERSION)})
        os.replace(partial, path)  # atomic: an interrupted write never leaves a half file under the real name
    except OSError as err:  # a full disk or a read-only cache costs the next run a redraw, nothing else
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        log.warning("kvbook: could not cache weights in %s (%s); the next run draws them again", path, err)
        return
    # Only the logger speaks from a writing thread: a print would land in whatever notebook cell runs next.
    log.info("kvbook: cached weights in %s", path)


class CacheWrites:
    """Weight-cache files written in background threads, so a model is in use while gigabytes go to disk.

    Its owner starts them when it is ready (an Engine: once its whole model is built, since writing on the same
    CPUs slows quantizing the matrices to int8 down) and may wait for them; Python waits for started ones at exit."""

    def __init__(self):
        self.queued: list[threading.Thread] = []  # asked for, not started
        self.started: list[threading.Thread] = []

    def add(self, tensors: dict[str, torch.Tensor], path: Path, progress: bool = True) -> None:
        """The caller's thread says so now, so the message belongs to the call (or notebook cell) that asked."""
        if progress:
            print(f"kvbook: caching the weights in {path}", file=sys.stderr, flush=True)
        self.queued.append(threading.Thread(target=_save_atomically, args=(tensors, path), name=f"save {path.name}"))

    def start(self) -> None:
        while self.queued:
            thread = self.queued.pop(0)
            thread.start()
            self.started.append(thread)

    def wait(self) -> None:
        """Start what is queued, then block until every file is written."""
        self.start()
        while self.started:
            self.started.pop().join()


def cache_write(tensors: dict[str, torch.Tensor], path: Path, progress: bool, writes: CacheWrites | None) -> None:
    """Queue the write on writes (its owner starts it), or without one write it before returning."""
    if writes is not None:
        writes.add(tensors, path, progress)
        return
    now = CacheWrites()
    now.add(tensors, path, progress)
    now.wait()


# ---- deterministic random weights, cached as safetensors -------------------------------------------------

def _tensor_seed(seed: int, name: str) -> int:
    """Each tensor has its own stream, so a 1-layer model's layer 0 equals a 3-layer model's layer 0."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def random_weights(cfg: ModelConfig, dtype: torch.dtype, progress: bool = True) -> dict[str, torch.Tensor]:
    """N(0, 0.02) matrices drawn directly in `dtype` (no float32 copy), norm weights of ones.

    One generator per tensor, so tensors are drawn in parallel threads (torch's normal_ uses one core)."""
    shapes = expected_shapes(cfg)

    def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape, dtype=dtype)
        generator = torch.Generator().manual_seed(_tensor_seed(cfg.seed, name))
        return torch.empty(shape, dtype=dtype).normal_(0.0, INIT_STD, generator=generator)

    total = sum(torch.Size(s).numel() for s in shapes.values())
    with ThreadPoolExecutor(os.cpu_count()) as pool, tqdm(
            total=total, unit="param", unit_scale=True, desc="kvbook: drawing random weights",
            disable=not progress) as bar:
        # largest first (embedding and lm_head, a third of the work each), so no thread is left with a big one
        largest_first = sorted(shapes.items(), key=lambda item: -torch.Size(item[1]).numel())
        futures = {name: pool.submit(draw, name, shape) for name, shape in largest_first}
        weights = {}
        for name in shapes:  # the config's order, whatever order they were drawn in
            weights[name] = futures[name].result()
            bar.update(weights[name].numel())
    return weights


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvbook" / "weights"


def random_weights_path(cfg: ModelConfig, dtype: torch.dtype) -> Path:
    """One file per (shape-relevant config, seed, dtype): the model's name does not change the weights."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "name"}
    key_text = json.dumps({"model": fields, "dtype": str(dtype), "init": INIT_VERSION}, sort_keys=True)
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    return cache_dir() / f"random-{str(dtype).removeprefix('torch.')}-{key}.safetensors"


def load_random_weights(cfg: ModelConfig, dtype: torch.dtype, progress: bool = True,
                        writes: CacheWrites | None = None) -> dict[str, torch.Tensor]:
    """The weights: mmaps of the cached file, or the first time drawn in memory and written to the cache, in the
    background when writes is given (an Engine passes its own and starts them once its model is built)."""
    path = random_weights_path(cfg, dtype)
    if path.exists():
        return load_file(str(path))
    weights = random_weights(cfg, dtype, progress)
    cache_write(weights, path, progress, writes)
    return weights


# ---- a local Hugging Face Qwen3 checkpoint ---------------------------------------------------------------

HF_CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                  "max_position_embeddings", "rms_norm_eps", "num_key_value_heads", "rope_theta",
                  "tie_word_embeddings")


def checkpoint_config(directory: str | Path, num_layers: int | None = None) -> ModelConfig:
    """ModelConfig from a checkpoint's config.json, optionally keeping only the first num_layers layers."""
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"checkpoint directory {str(directory)!r} has no config.json; pass a Hugging Face "
                          "Qwen3 model directory (config.json + *.safetensors)")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{path}: not a readable JSON file ({err})") from None
    if hf.get("model_type") not in ("qwen3", None):
        raise ConfigError(f"{path}: model_type {hf['model_type']!r}; kvbook runs Qwen3 checkpoints (model_type "
                          "\"qwen3\")")
    missing = [key for key in ("num_hidden_layers", "hidden_size", "num_attention_heads")
               if not isinstance(hf.get(key), int)]
    if missing:
        raise ConfigError(f"{path}: no integer {', '.join(missing)}; a Qwen3 config.json has them all")
    values = {key: hf[key] for key in HF_CONFIG_KEYS if hf.get(key) is not None}
    values["rope_theta"] = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 1e6)
    values["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    values["decoupled_head_dim"] = values["head_dim"] * hf["num_attention_heads"] != hf["hidden_size"]
    values["name"] = directory.name
    if num_layers is not None:
        if not 1 <= num_layers <= values["num_hidden_layers"]:
            raise ConfigError(f"--num-layers {num_layers}: the checkpoint has {values['num_hidden_layers']} "
                              f"layers; choose 1..{values['num_hidden_layers']}")
        values["num_hidden_layers"] = num_layers
    return ModelConfig(**values)


def load_checkpoint(directory: str | Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors cfg needs from *.safetensors in directory (layers beyond cfg's count are not read)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint directory {str(directory)!r} has no *.safetensors files")
    wanted = set(expected_shapes(cfg))
    weights = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in wanted:
                        weights[name] = f.get_tensor(name).to(dtype)
        except SafetensorError as err:
            raise ConfigError(f"{file}: not a readable safetensors file ({err}); download it again") from None
    check_shapes(cfg, weights)
    return weights
