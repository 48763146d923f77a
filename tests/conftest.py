import time

import pytest
from kvbook.config import Config, InferenceConfig, KVCacheConfig, ModelConfig
from kvbook.kernels import enable_huge_pages

enable_huge_pages()  # as the CLI and the book do: before the tests allocate anything


def small_config(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, tied=False, dtype="float32",
                 max_cache_len=64, enable=True, vocab=1000, output_len=6, max_positions=256) -> Config:
    """A tiny model for parity and engine tests (never for the book: the book runs the full size)."""
    model = ModelConfig(name="tiny", num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=2 * hidden,
                        vocab_size=vocab, max_position_embeddings=max_positions, tie_word_embeddings=tied,
                        decoupled_head_dim=heads * head_dim != hidden)
    return Config(model=model,
                  inference=InferenceConfig(input_len=12, output_len=output_len, dtype=dtype, device="cpu"),
                  kv_cache=KVCacheConfig(enable=enable, cache_dtype=dtype, max_cache_len=max_cache_len))


def wait_until(condition, timeout=60.0, interval=0.02):
    """Poll condition() until it is true; fail the test after timeout seconds (a server thread that never got there)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s"
        time.sleep(interval)


@pytest.fixture
def weight_cache(tmp_path, monkeypatch):
    """Random weights of tiny models go to a private cache, not the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvbook" / "weights"
