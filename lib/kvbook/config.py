"""config.toml -> typed, frozen config objects, with one-line errors that name the key and the fix.

Explained in chapter 1 ("The pipeline"), which introduces the model and request keys and names the chapter
that explains each of the others; chapter 7 ("Pitfalls") triggers the checks below on purpose.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache.memory import DTYPE_BYTES, QUANTIZED_CACHE_DTYPES, blocks_for_budget, kv_cache_bytes

# [inference] weight_dtype: "auto" keeps the weights in [inference] dtype (float16: the article's); "int8" stores the
# matrices as int8 with one scale per output channel (weight-only, kvbook.model.quant)
WEIGHT_DTYPES = ["auto", "int8", *DTYPE_BYTES]
# keys that would hold a secret: refused, keys come only from the environment variable named by api_key_env
SECRET_KEY_NAMES = re.compile(r"(^|_)(api_?key|key|token|secret|password)$", re.IGNORECASE)


class ConfigError(ValueError):
    """A mistake in config.toml or a --set override. The message is one line: the key, the problem, the fix."""


class QuantizationError(ConfigError):
    """A checkpoint that cannot be quantized, or a device that cannot run the int8 kernels (kvbook.model.quant)
    or store a quantized KV cache (kvbook.cache.kv_quant)."""


class ConfigWarning(UserWarning):
    """A legal but costly setting (e.g. a float32 cache for a float16 model)."""


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"[{section}] {name} = {value!r}: must be > 0")


def _one_of(section: str, name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"[{section}] {name} = {value!r}: must be one of {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape. Defaults are the article's 3-layer Qwen3-style model (1.85B parameters)."""

    name: str = "qwen3-3layer-demo"
    num_hidden_layers: int = 3
    hidden_size: int = 4096
    num_attention_heads: int = 32
    head_dim: int = 128
    intermediate_size: int = 11008
    vocab_size: int = 151936
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int = 0  # 0 = same as num_attention_heads (no grouped-query attention)
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    seed: int = 0
    # Real Qwen3 sizes such as Qwen3-0.6B (hidden 1024, 16 heads of 128) project to a width other than
    # hidden_size; set this to true to allow head_dim * num_attention_heads != hidden_size on purpose.
    decoupled_head_dim: bool = False

    def __post_init__(self) -> None:
        if self.num_key_value_heads == 0:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        _positive("model", self, "num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                  "num_key_value_heads", "rope_theta")
        if self.seed < 0:
            raise ConfigError(f"[model] seed = {self.seed}: must be >= 0")
        attention_width = self.head_dim * self.num_attention_heads
        if attention_width != self.hidden_size and not self.decoupled_head_dim:
            if self.hidden_size % self.num_attention_heads == 0:
                right = self.hidden_size // self.num_attention_heads
                fix = f"set head_dim = hidden_size / num_attention_heads = {right}"
            else:
                fix = "make hidden_size a multiple of num_attention_heads"
            raise ConfigError(
                f"[model] head_dim = {self.head_dim} does not split the {self.hidden_size}-wide Q/K/V projections "
                f"into {self.num_attention_heads} heads ({self.num_attention_heads} x {self.head_dim} = "
                f"{attention_width}); {fix} (or decoupled_head_dim = true for a Qwen3 size whose attention "
                "width differs on purpose)")
        if self.head_dim % 2:
            raise ConfigError(f"[model] head_dim = {self.head_dim}: RoPE rotates pairs of dimensions, "
                              "so it must be even")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"[model] num_key_value_heads = {self.num_key_value_heads} must divide num_attention_heads = "
                f"{self.num_attention_heads} (each K/V head serves a whole group of query heads)")

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per K/V head: 1 for multi-head attention, > 1 for grouped-query attention."""
        return self.num_attention_heads // self.num_key_value_heads


@dataclass(frozen=True)
class InferenceConfig:
    batch_size: int = 1
    input_len: int = 256
    output_len: int = 128
    dtype: str = "float16"
    device: str = "cuda:0"
    # "auto": the dtype kvbook.kernels chooses for prefill on this device (the weights' own on a GPU)
    prefill_dtype: str = "auto"
    # on a GPU, single-sequence decode steps replay captured CUDA graphs (kvbook.runtime.cuda_graph); ignored on the CPU
    cuda_graphs: bool = True
    weight_dtype: str = "auto"  # "int8": weight-only int8 matrices, per-output-channel scales (kvbook.model.quant)

    def __post_init__(self) -> None:
        _positive("inference", self, "batch_size", "input_len", "output_len")
        _one_of("inference", "dtype", self.dtype, DTYPE_BYTES)
        _one_of("inference", "prefill_dtype", self.prefill_dtype, ["auto", *DTYPE_BYTES])
        _one_of("inference", "weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
        if self.weight_dtype in DTYPE_BYTES and self.weight_dtype != self.dtype:
            raise ConfigError(f"[inference] weight_dtype = {self.weight_dtype!r}: floating weights are stored in "
                              f"[inference] dtype = {self.dtype!r}; set weight_dtype = \"auto\" (or \"int8\")")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"[inference] device = {self.device!r}: use \"cpu\", \"cuda\" or \"cuda:N\"")


@dataclass(frozen=True)
class KVCacheConfig:
    enable: bool = True
    cache_dtype: str = "float16"
    max_cache_len: int = 4096
    block_size: int = 16
    layout: str = "contiguous"  # or "paged": blocks of block_size positions from a shared pool (chapter 9)
    pool_mib: int = 0  # paged: the pool's memory; 0 = what the contiguous cache reserves (max_cache_len)
    prefix_caching: bool = False  # paged: full blocks keyed by their tokens are reused by later prompts (chapter 11a)

    def __post_init__(self) -> None:
        _positive("kv_cache", self, "max_cache_len", "block_size")
        _one_of("kv_cache", "cache_dtype", self.cache_dtype, [*DTYPE_BYTES, *QUANTIZED_CACHE_DTYPES])
        _one_of("kv_cache", "layout", self.layout, ["contiguous", "paged"])
        if self.pool_mib < 0:
            raise ConfigError(f"[kv_cache] pool_mib = {self.pool_mib}: must be >= 0 (0 = max_cache_len's worth)")
        if self.prefix_caching and (self.layout != "paged" or not self.enable):
            raise ConfigError("[kv_cache] prefix_caching = true shares whole blocks of the paged pool; also set "
                              "layout = \"paged\" (--set kv_cache.layout=paged) and enable = true")


@dataclass(frozen=True)
class ServerConfig:
    api_base: str = "http://127.0.0.1:8000/api"
    api_key_env: str = "TAOTOKEN_API_KEY"
    model_endpoint: str = "/v1/chat/completions"
    # requests decoded together (continuous batching); 1 = one request at a time (chapter 11a)
    max_num_seqs: int = 8
    # prompt positions per prefill pass, with decode steps of the running requests between passes (vLLM's chunked
    # prefill); 0 = a whole prompt in one pass
    prefill_chunk: int = 0
    # requests queued behind the running ones; past it a request is answered 503 with Retry-After at once
    max_waiting: int = 64

    def __post_init__(self) -> None:
        _positive("server", self, "max_num_seqs", "max_waiting")
        if self.prefill_chunk < 0:
            raise ConfigError(f"[server] prefill_chunk = {self.prefill_chunk}: must be >= 0 (0 = whole prompts)")
        if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", self.api_base):
            raise ConfigError(f"[server] api_base = {self.api_base!r}: must be an http(s) URL such as "
                              "\"http://127.0.0.1:8000/api\"")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise ConfigError("[server] api_key_env must be the NAME of an environment variable (like "
                              "\"TAOTOKEN_API_KEY\"), not the key itself; put the key in that variable")
        if not self.model_endpoint.startswith("/"):
            raise ConfigError(f"[server] model_endpoint = {self.model_endpoint!r}: must start with \"/\"")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        inf, kv, model = self.inference, self.kv_cache, self.model
        # 256 prompt + 128 generated tokens leave 383 positions in the cache: the last token is never fed back.
        needed = inf.input_len + inf.output_len - 1
        if needed > model.max_position_embeddings:
            raise ConfigError(
                f"[inference] input_len + output_len - 1 = {needed} exceeds [model] max_position_embeddings = "
                f"{model.max_position_embeddings}; shorten the run or raise max_position_embeddings")
        if kv.enable and kv.layout == "paged" and kv.pool_mib:
            blocks = blocks_for_budget(model, kv)
            if blocks * kv.block_size < needed:
                raise ConfigError(
                    f"[kv_cache] pool_mib = {kv.pool_mib} holds {blocks} blocks of {kv.block_size} positions, fewer "
                    f"than one sequence of input_len {inf.input_len} + output_len {inf.output_len} needs "
                    f"({needed} positions); raise pool_mib")
        elif kv.enable and kv.max_cache_len < needed:
            raise ConfigError(
                f"[kv_cache] max_cache_len = {kv.max_cache_len} is too small for input_len {inf.input_len} + "
                f"output_len {inf.output_len}: decode would stop at position {kv.max_cache_len}; set "
                f"max_cache_len >= {needed}")
        if kv.enable and kv.cache_dtype != inf.dtype and kv.cache_dtype in DTYPE_BYTES:
            ratio = DTYPE_BYTES[kv.cache_dtype] / DTYPE_BYTES[inf.dtype]
            mib = kv_cache_bytes(model, kv.max_cache_len, kv.cache_dtype) / 2**20
            same_mib = kv_cache_bytes(model, kv.max_cache_len, inf.dtype) / 2**20
            # attention computes in float32 whatever the cache holds (kvbook.model.attention): a wider cache only
            # keeps rounding noise of the arithmetic, a narrower one rounds K and V
            effect = (f"for digits {inf.dtype} weights cannot use" if ratio > 1
                      else f"and K and V are rounded to {kv.cache_dtype}")
            warnings.warn(
                f"[kv_cache] cache_dtype = {kv.cache_dtype!r} differs from [inference] dtype = {inf.dtype!r}: "
                f"the cache takes {ratio:g}x the memory ({mib:.0f} MiB instead of {same_mib:.0f} MiB at max_cache_len "
                f"{kv.max_cache_len}) {effect}; set cache_dtype = {inf.dtype!r}",
                ConfigWarning, stacklevel=3)

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys changed, validated again: cfg.replace(kv_cache={"enable": False})."""
        changed = {name: dataclasses.replace(getattr(self, name), **keys) for name, keys in sections.items()}
        return dataclasses.replace(self, **changed)


SECTIONS = {"model": ModelConfig, "inference": InferenceConfig, "kv_cache": KVCacheConfig, "server": ServerConfig}


def _check_type(section: str, key: str, value: Any, expected: type) -> Any:
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return value
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    raise ConfigError(f"[{section}] {key} must be {names[expected]}, got {type(value).__name__} {value!r}")


def _suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(choices)}"


def config_from_dict(data: dict[str, Any]) -> Config:
    """Validate a parsed TOML document (unknown keys, types, sizes, cross-checks) and build the Config."""
    sections = {}
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]{_suggest(section, SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table of keys")
        cls = SECTIONS[section]
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {}
        for key, value in table.items():
            if section == "server" and SECRET_KEY_NAMES.search(key):
                raise ConfigError(
                    f"[server] {key}: API keys are never read from the config file; delete this line and "
                    f"export the key in the environment variable named by api_key_env instead")
            if key not in types:
                raise ConfigError(f"unknown key [{section}] {key}{_suggest(key, types)}")
            values[key] = _check_type(section, key, value, {"int": int, "float": float, "bool": bool,
                                                            "str": str}[types[key]])
        sections[section] = cls(**values)
    return Config(**sections)


def parse_override(text: str) -> tuple[str, str, Any]:
    """'kv_cache.enable=false' -> ('kv_cache', 'enable', False). Values are TOML; a bare word is a string."""
    target, sep, raw = text.partition("=")
    section, dot, key = target.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set kv_cache.enable=false")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def load_config(path: str | Path | None = "config.toml", overrides: list[str] = ()) -> Config:
    """Read config.toml (or start from the defaults when path is None) and apply --set overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} not found; pass --config PATH") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from None
        except (OSError, UnicodeDecodeError) as err:  # a directory, no permission, not UTF-8 text
            reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
            raise ConfigError(f"config file {str(path)!r} cannot be read ({reason}); pass --config PATH of a TOML "
                              "file") from None
    for text in overrides:
        section, key, value = parse_override(text)
        data.setdefault(section, {})[key] = value
    return config_from_dict(data)
