"""Weights: deterministic random ones cached on disk as safetensors, or a local Hugging Face Qwen3 checkpoint.

No real Qwen3 weights can be downloaded where this book is built, so by default every tensor is drawn from
a generator seeded by ([model].seed, tensor name), directly in the target dtype. The first build writes
them to $XDG_CACHE_HOME/kvbook/weights (default ~/.cache); every later load maps that file (an mmap: nothing is
read until it is used), except the embedding table, read into the OS's page cache at once (read_into_page_cache),
and the matrices every decode step streams whole, read into the process's memory (read_tensors).
Explained in chapter 1 ("The pipeline").
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
READ_BLOCK = 16 * 2**20  # bytes per read of a cache file's tensors (read_into_page_cache, read_tensors)
# read a row at a time by every decode step (one new token's row), so read into the page cache whole when loaded
SPARSELY_READ = ("model.embed_tokens.weight",)
# the dtypes kvbook writes to its cache files, by their safetensors names
SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I8": torch.int8}


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


# ---- a copy of the decoder layers' matrices in a faster dtype for prefill (kvbook.model.linear) ----------------

def prefill_weight_names(cfg: ModelConfig) -> list[str]:
    """The layers' matrices: prefill's arithmetic. lm_head runs on one position and the embedding is a lookup."""
    shapes = expected_shapes(cfg)
    return [name for name, shape in shapes.items() if name.startswith("model.layers.") and len(shape) == 2]


def prefill_copies(cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layers' matrices converted to dtype, several tensors at a time."""
    names = prefill_weight_names(cfg)
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return dict(zip(names, pool.map(lambda name: weights[name].to(dtype), names), strict=True))


def _owner(model: Qwen3ForCausalLM, weight_name: str):
    """The Linear that holds a weight: "model.layers.0.mlp.up_proj.weight" -> that up_proj."""
    return model.get_submodule(weight_name.removesuffix(".weight"))


def has_prefill_weights(model: Qwen3ForCausalLM, dtype: torch.dtype) -> bool:
    """Whether every layer matrix already carries a prefill copy in dtype."""
    return all(_owner(model, name).weight_in(dtype) is not None for name in prefill_weight_names(model.cfg))


def attach_prefill_weights(model: Qwen3ForCausalLM, prefill: dict[str, torch.Tensor]) -> None:
    device = model.lm_head.weight.device
    for name, tensor in prefill.items():
        _owner(model, name).copies[tensor.dtype] = tensor.to(device)


_pending_saves: list[threading.Thread] = []
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
    # Only the logger speaks from this thread: a print would land in whatever notebook cell runs next.
    log.info("kvbook: cached weights in %s", path)


_held_saves: list[threading.Thread] | None = None  # saves asked for inside saves_held(), not started yet


def _save_in_background(tensors: dict[str, torch.Tensor], path: Path, progress: bool) -> None:
    """The model is usable while its weights are written; the process waits for the write before it exits.
    The caller's thread says so now, so the message belongs to the call (or notebook cell) that asked."""
    if progress:
        print(f"kvbook: caching the weights in {path} (written in the background)", file=sys.stderr, flush=True)
    thread = threading.Thread(target=_save_atomically, args=(tensors, path), name=f"save {path.name}")
    if _held_saves is None:
        _start_save(thread)
    else:
        _held_saves.append(thread)


def _start_save(thread: threading.Thread) -> None:
    _pending_saves.append(thread)  # only started writes: wait_for_saves joins these
    thread.start()


@contextlib.contextmanager
def saves_held():
    """Writes asked for inside the block start when it ends (also on an error): kvbook.runtime.engine builds its
    whole model first: writing gigabytes on the same CPUs made quantizing the matrices to int8 over 2x slower
    (BENCHMARKS.md, "Eighth session")."""
    global _held_saves
    if _held_saves is not None:  # nested: the outer block starts them
        yield
        return
    _held_saves = []
    try:
        yield
    finally:
        held, _held_saves = _held_saves, None
        for thread in held:
            _start_save(thread)


def wait_for_saves() -> None:
    """Block until every weight file started by this process is written (tests, benchmarks); inside a
    saves_held() block the writes it holds have not started, so they are not waited for."""
    while _pending_saves:
        _pending_saves.pop().join()


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


def load_random_weights(cfg: ModelConfig, dtype: torch.dtype, prefill_dtype: torch.dtype | None = None,
                        progress: bool = True, decode_reads_prefill_copy: bool = False,
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """The weights and, if prefill_dtype is given, their prefill copy: mmaps of the cached files, except a prefill
    copy that decode steps multiply by too (decode_reads_prefill_copy), which is read in (read_tensors). The first
    time, drawn (and converted) in memory, then written to the cache in the background."""
    path = random_weights_path(cfg, dtype)
    prefill_path = None
    if prefill_dtype is not None:
        prefill_path = path.with_name(f"{path.stem}.prefill-{str(prefill_dtype).removeprefix('torch.')}.safetensors")
    if path.exists():
        read_into_page_cache(path, SPARSELY_READ)
        weights = load_file(str(path))
    else:
        weights = random_weights(cfg, dtype, progress)
    prefill = None
    if prefill_path is not None:
        if not prefill_path.exists():
            prefill = prefill_copies(cfg, weights, prefill_dtype)
        else:
            prefill = read_tensors(prefill_path) if decode_reads_prefill_copy else load_file(str(prefill_path))
    # written only once everything is in memory, so the writes do not slow the drawing down (an Engine holds them
    # longer, until its whole model is built: saves_held)
    if not path.exists():
        _save_in_background(weights, path, progress)
    if prefill_path is not None and not prefill_path.exists():
        _save_in_background(prefill, prefill_path, progress)
    return weights, prefill


def read_into_page_cache(path: Path, names: tuple[str, ...]) -> None:
    """Read these tensors' bytes of a safetensors file once, in large blocks, so that the OS holds them in its page
    cache and the file's mmap finds them there.

    An mmap reads a page from the disk when it is first touched. The embedding table is read a row per new token, so
    each decode step of a table not yet in the page cache (after a reboot, or once other files pushed it out) waited
    for a small disk read (BENCHMARKS.md). Asking the OS to read ahead (madvise or posix_fadvise WILLNEED) read
    nothing there; one pass of large reads does, at the disk's speed."""
    with open(path, "rb", buffering=0) as file:
        data_start, header = _safetensors_header(file)
        for name in names:
            start, end = header[name]["data_offsets"]
            _read_span(file, data_start + start, data_start + end)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, read into this process's own memory rather than mapped from the file.

    For the matrices a decode step streams whole, every step: on some CPUs a step reads them faster from the
    process's own memory, in the huge pages torch allocates (kvbook.device.enable_huge_pages), than mapped from the
    file (BENCHMARKS.md). The price is a pass over the file when the model is loaded. No memory beyond the mapped
    pages it replaces; and torch's allocations are aligned as its int8 kernel needs (kvbook.model.quant)."""
    tensors = {}
    with open(path, "rb", buffering=0) as file:
        data_start, header = _safetensors_header(file)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            tensor = torch.empty(entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]])
            start, end = entry["data_offsets"]
            raw = memoryview(tensor.view(-1).view(torch.uint8).numpy())  # the tensor's bytes, written in place
            _read_span(file, data_start + start, data_start + end, raw)
            tensors[name] = tensor
    return tensors


def _safetensors_header(file) -> tuple[int, dict]:
    """(where the data starts, the JSON header) of a safetensors file: an 8-byte length, the header, the data."""
    length = int.from_bytes(file.read(8), "little")
    return 8 + length, json.loads(file.read(length))


def _read_span(file, start: int, end: int, into: memoryview | None = None) -> None:
    """Bytes start..end of the file, read in blocks of at most READ_BLOCK into `into` (end - start bytes long), or
    into a scratch block and dropped."""
    scratch = memoryview(bytearray(min(READ_BLOCK, end - start))) if into is None else None
    file.seek(start)
    done = 0
    while done < end - start:
        size = min(READ_BLOCK, end - start - done)
        read = file.readinto(scratch[:size] if into is None else into[done:done + size])
        if not read:
            raise OSError(f"{file.name}: shorter than its header says; delete it and kvbook writes it again")
        done += read


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
