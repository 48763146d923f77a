"""Every validation message of config.toml: one line naming the key and the fix."""

import warnings

import pytest
from kvbook.cache.memory import kv_cache_bytes
from kvbook.config import Config, ConfigError, ConfigWarning, ModelConfig, load_config

ROOT_CONFIG = "config.toml"


def write(tmp_path, text):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_the_articles_config_loads_with_its_values():
    cfg = load_config(ROOT_CONFIG)
    m = cfg.model
    assert (m.name, m.num_hidden_layers, m.hidden_size, m.num_attention_heads, m.head_dim) == (
        "qwen3-3layer-demo", 3, 4096, 32, 128)
    assert (m.intermediate_size, m.vocab_size, m.max_position_embeddings, m.rms_norm_eps) == (11008, 151936, 4096, 1e-6)
    assert (m.num_key_value_heads, m.rope_theta, m.tie_word_embeddings) == (32, 1e6, False)
    assert (cfg.inference.input_len, cfg.inference.output_len, cfg.inference.dtype) == (256, 128, "float16")
    assert cfg.inference.device == "cuda:0"
    assert (cfg.kv_cache.enable, cfg.kv_cache.cache_dtype, cfg.kv_cache.max_cache_len) == (True, "float16", 4096)
    assert cfg.server.api_key_env == "TAOTOKEN_API_KEY"
    assert cfg.server.api_base + cfg.server.model_endpoint == "http://127.0.0.1:8000/api/v1/chat/completions"


def test_config_objects_are_frozen():
    cfg = load_config(ROOT_CONFIG)
    with pytest.raises(AttributeError):
        cfg.model.hidden_size = 1


def test_kv_heads_default_to_attention_heads():
    assert ModelConfig(num_key_value_heads=0).num_key_value_heads == 32
    assert ModelConfig(num_key_value_heads=8).num_key_value_groups == 4


@pytest.mark.parametrize("override, fragment", [
    ("model.head_dim=256", "head_dim = 256 does not split the 4096-wide Q/K/V projections into 32 heads"),
    ("model.head_dim=1365", "set head_dim = hidden_size / num_attention_heads = 128"),
    ("kv_cache.max_cache_len=256", "max_cache_len = 256 is too small for input_len 256 + output_len 128"),
    ("model.hiden_size=4096", "unknown key [model] hiden_size; did you mean 'hidden_size'?"),
    ("modle.hidden_size=4096", "unknown section [modle]; did you mean 'model'?"),
    ("model.hidden_size='4096'", "[model] hidden_size must be an integer, got str '4096'"),
    ("kv_cache.enable=1", "[kv_cache] enable must be true or false, got int 1"),
    ("model.num_hidden_layers=0", "[model] num_hidden_layers = 0: must be > 0"),
    ("inference.input_len=-5", "[inference] input_len = -5: must be > 0"),
    ("model.num_key_value_heads=5", "num_key_value_heads = 5 must divide num_attention_heads = 32"),
    ("inference.dtype=float64", "[inference] dtype = 'float64': must be one of"),
    ("inference.device=tpu", "[inference] device = 'tpu'"),
    ("inference.output_len=4000", "exceeds [model] max_position_embeddings = 4096"),
    ("server.api_key='sk-123'", "API keys are never read from the config file"),
    ("server.api_key_env='sk-live-abc'", "must be the NAME of an environment variable"),
    ("server.api_base=localhost", "must be an http(s) URL"),
    ("inference.max_cache_len=1", "unknown key [inference] max_cache_len"),
    ("kv_cache", "expected section.key=value"),
    ("kv_cache.layout=blocks", "[kv_cache] layout = 'blocks': must be one of 'contiguous', 'paged'"),
    ("kv_cache.pool_mib=-1", "[kv_cache] pool_mib = -1: must be >= 0"),
    ("server.max_num_seqs=0", "[server] max_num_seqs = 0: must be > 0"),
    ("server.prefill_chunk=-16", "[server] prefill_chunk = -16: must be >= 0 (0 = whole prompts)"),
])
def test_bad_settings_are_one_line_errors_naming_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT_CONFIG, [override])
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message


def test_max_cache_len_bound_is_383_for_256_plus_128():
    # 256 prompt + 128 generated tokens hold 383 positions: the last token is never fed back
    assert load_config(ROOT_CONFIG, ["kv_cache.max_cache_len=383"]).kv_cache.max_cache_len == 383
    with pytest.raises(ConfigError, match=">= 383"):
        load_config(ROOT_CONFIG, ["kv_cache.max_cache_len=382"])


def test_odd_head_dim_is_refused_for_rope():
    with pytest.raises(ConfigError, match="RoPE rotates pairs of dimensions, so it must be even"):
        load_config(ROOT_CONFIG, ["model.head_dim=127", "model.decoupled_head_dim=true"])


def test_decoupled_head_dim_is_allowed_when_asked():
    cfg = load_config(ROOT_CONFIG, ["model.head_dim=64", "model.decoupled_head_dim=true"])
    assert cfg.model.head_dim * cfg.model.num_attention_heads == 2048


def test_cache_dtype_mismatch_warns_with_memory_cost():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(ROOT_CONFIG, ["kv_cache.cache_dtype=float32"])
    assert len(caught) == 1 and caught[0].category is ConfigWarning
    text = str(caught[0].message)
    assert "2x the memory" in text and "384 MiB instead of 192 MiB" in text and "set cache_dtype = 'float16'" in text
    assert "for digits float16 weights cannot use" in text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(ROOT_CONFIG, ["inference.dtype=float32", "kv_cache.cache_dtype=float16"])
    assert "0.5x the memory" in str(caught[0].message) and "K and V are rounded to float16" in str(caught[0].message)


def test_api_key_table_key_in_file_is_refused(tmp_path):
    path = write(tmp_path, '[server]\napi_base = "http://127.0.0.1:8000/api"\nAPI_KEY = "sk-abc"\n')
    with pytest.raises(ConfigError, match="API keys are never read"):
        load_config(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found; pass --config PATH"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))
    with pytest.raises(ConfigError, match="cannot be read .Is a directory.; pass --config PATH of a TOML file"):
        load_config(tmp_path)
    (tmp_path / "latin1.toml").write_bytes("[model]\nname = 'caf\xe9'\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="cannot be read .not UTF-8 text."):
        load_config(tmp_path / "latin1.toml")


def test_overrides_parse_toml_values_and_bare_words():
    cfg = load_config(ROOT_CONFIG, ["kv_cache.enable=false", "inference.dtype=bfloat16", "model.rope_theta=10000",
                                    "kv_cache.cache_dtype=bfloat16"])
    assert cfg.kv_cache.enable is False and cfg.inference.dtype == "bfloat16" and cfg.model.rope_theta == 10000.0


def test_defaults_without_a_file_are_the_articles():
    assert load_config(None) == Config() == load_config(ROOT_CONFIG)


def test_kv_cache_bytes_formula():
    # 2 (K and V) x 3 layers x 32 kv heads x 128 x 383 positions x 2 bytes
    assert kv_cache_bytes(ModelConfig(), 383, "float16") == 2 * 3 * 32 * 128 * 383 * 2
    assert kv_cache_bytes(ModelConfig(num_key_value_heads=8), 383, "float32") == 2 * 3 * 8 * 128 * 383 * 4


def test_a_paged_pool_too_small_for_one_sequence_is_refused():
    with pytest.raises(ConfigError, match=r"pool_mib = 1 holds 1 blocks of 16 positions, fewer than one sequence"):
        load_config(ROOT_CONFIG, ["kv_cache.layout=paged", "kv_cache.pool_mib=1"])
    cfg = load_config(ROOT_CONFIG, ["kv_cache.layout=paged", "kv_cache.pool_mib=18"])  # 24 blocks: 384 positions
    assert cfg.kv_cache.pool_mib == 18
