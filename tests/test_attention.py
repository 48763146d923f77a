"""Attention's float32 copies of K and V (kvbook.model.attention.float32_copy): the values of x.float(), in x's
layout, written into memory each thread reuses, and a float16 model's logits bit for bit those of fresh copies; and
K and V taken KV_BLOCK positions at a time, within float32's rounding of the whole cache at once."""

import threading

import pytest
import torch
from kvbook.cache.contiguous import KVCache
from kvbook.model import attention
from kvbook.model.attention import float32_copy
from kvbook.model.weights import build_model, random_weights

from .conftest import small_config


def cache_view(positions: int, max_len: int = 64) -> torch.Tensor:
    """[1, H, S, D] float16 seen through a transpose of [1, max_len, H, D] storage, as the contiguous cache is."""
    storage = torch.randn(1, max_len, 4, 8).half()
    return storage.transpose(1, 2)[:, :, :positions]


@torch.inference_mode()
def test_same_values_and_layout_as_a_fresh_copy():
    x = cache_view(10)
    copy = float32_copy(x, "k")
    assert copy.dtype == torch.float32 and torch.equal(copy, x.float())

    def strides(t):  # a dim of size 1 has no meaningful stride
        return [stride for stride, size in zip(t.stride(), t.shape, strict=True) if size > 1]

    assert strides(copy) == strides(x.float()) == [8, 32, 1]  # position-major like the cache: a straight copy


@torch.inference_mode()
def test_memory_is_reused_and_grows_once():
    first = float32_copy(cache_view(10), "reuse-test")
    shorter = float32_copy(cache_view(6), "reuse-test")
    assert shorter.data_ptr() == first.data_ptr()  # the same memory, written again
    longer = float32_copy(cache_view(40), "reuse-test")
    assert longer.untyped_storage().nbytes() == 40 * 4 * 8 * 4  # grown to the new size
    again = float32_copy(cache_view(40), "reuse-test")
    assert again.data_ptr() == longer.data_ptr()
    other_slot = float32_copy(cache_view(6), "reuse-test-v")
    assert other_slot.untyped_storage().data_ptr() != longer.untyped_storage().data_ptr()


def test_inference_mode_and_no_grad_share_the_memory():
    """The engine runs under inference_mode, a chapter's own model call under no_grad: either may come first."""
    for first, second in ((torch.inference_mode, torch.no_grad), (torch.no_grad, torch.inference_mode)):
        slot = f"mode-test-{first.__name__}"
        with first():
            a = float32_copy(cache_view(10), slot)
        with second():
            x = cache_view(10)
            b = float32_copy(x, slot)
        assert a.data_ptr() == b.data_ptr() and torch.equal(b, x.float())


@torch.inference_mode()
def test_each_thread_has_its_own_memory():
    pointers = []

    def copy_on_a_thread():
        pointers.append(float32_copy(cache_view(10), "thread-test").data_ptr())

    pointers.append(float32_copy(cache_view(10), "thread-test").data_ptr())
    thread = threading.Thread(target=copy_on_a_thread)
    thread.start()
    thread.join()
    assert pointers[0] != pointers[1]


def test_float32_input_and_autograd_get_no_reused_memory():
    x = torch.randn(2, 3)
    assert float32_copy(x, "k") is x
    with torch.enable_grad():  # autograd may keep its inputs for a backward pass: a fresh copy
        a, b = float32_copy(cache_view(10), "grad-test"), float32_copy(cache_view(10), "grad-test")
        assert a.data_ptr() != b.data_ptr()


@pytest.mark.parametrize("kv_heads", [4, 2])  # the article's kind (no GQA) and grouped-query attention
@torch.inference_mode()
def test_float16_logits_equal_those_of_fresh_copies(monkeypatch, kv_heads):
    cfg = small_config(heads=4, kv_heads=kv_heads, head_dim=16, tied=False, dtype="float16")
    model = build_model(cfg.model, random_weights(cfg.model, torch.float16, progress=False), torch.device("cpu"))
    prompt = torch.randint(0, cfg.model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))

    def run() -> list[torch.Tensor]:
        cache = KVCache(cfg.model, cfg.kv_cache, torch.device("cpu"))
        logits = [model(prompt, torch.arange(12), cache)]  # [1, 1, vocab]
        for step in range(5):  # the cache grows: the reused memory grows with it
            token = logits[-1][:, -1:].argmax(-1)  # [1, 1]
            logits.append(model(token, torch.tensor([12 + step]), cache))
        return logits

    reused = run()
    monkeypatch.setattr(attention, "float32_copy", lambda x, slot: x.float())
    fresh = run()
    for a, b in zip(reused, fresh, strict=True):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_memory_grows_by_a_quarter_so_a_growing_cache_reuses_it():
    """A decode step attends to one position more than the step before: growing by exactly that would hand out
    fresh memory on every step."""
    pointers = [float32_copy(cache_view(positions), "growth-test").data_ptr() for positions in range(40, 51)]
    assert len(set(pointers)) == 2  # 40 positions, then room for 50 when the 41st came


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@torch.inference_mode()
def test_blocks_of_positions_give_the_numbers_of_the_whole_cache(monkeypatch, dtype):
    """K and V are converted and multiplied KV_BLOCK positions at a time; with blocks of 4 positions, 17 to 21
    cached positions are 5 or 6 blocks, and the logits stay those of one block within float32's rounding (float16's
    for a float16 model, whose attention output is rounded to float16)."""
    cfg = small_config(heads=4, kv_heads=2, head_dim=16, tied=False, dtype=dtype)
    model = build_model(cfg.model, random_weights(cfg.model, getattr(torch, dtype), progress=False),
                        torch.device("cpu"))
    prompt = torch.randint(0, cfg.model.vocab_size, (1, 17), generator=torch.Generator().manual_seed(2))

    copies = []
    original = attention.float32_copy
    monkeypatch.setattr(attention, "float32_copy", lambda x, slot: copies.append(x.shape[2]) or original(x, slot))

    def run() -> list[torch.Tensor]:
        cache = KVCache(cfg.model, cfg.kv_cache, torch.device("cpu"))
        logits = [model(prompt, torch.arange(17), cache)]  # [1, 1, vocab]
        for step in range(4):
            logits.append(model(torch.tensor([[7 + step]]), torch.tensor([17 + step]), cache))
        return [x.float() for x in logits]

    whole = run()
    assert set(copies) == {17, 18, 19, 20, 21}  # one block: every position at once
    copies.clear()
    monkeypatch.setattr(attention, "KV_BLOCK", 4)
    blocked = run()
    assert set(copies) == {1, 2, 3, 4} and len(copies) == 2 * 2 * (5 + 5 + 5 + 5 + 6)  # K and V, 2 layers
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    for a, b in zip(whole, blocked, strict=True):
        torch.testing.assert_close(b, a, atol=tolerance, rtol=tolerance)
