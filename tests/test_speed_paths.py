"""The CPU speed paths: a bfloat16 prefill copy of the layers' matrices and down_proj stored as column blocks.
They change how the arithmetic is done, not what is computed: checked against the plain float16/float32 path."""

import torch
from kvbook.device import resolve_prefill_dtype
from kvbook.engine import Engine
from kvbook.linear import Linear, split_long_inputs
from kvbook.weights import load_random_weights, prefill_weight_names, random_weights_path, wait_for_saves

from .conftest import small_config

PROMPT = list(range(3, 15))


def test_prefill_dtype_auto_is_bfloat16_only_for_float16_on_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_prefill_dtype("auto", "float16", cpu) == torch.bfloat16
    assert resolve_prefill_dtype("auto", "float16", cuda) == torch.float16
    assert resolve_prefill_dtype("auto", "float32", cpu) == torch.float32
    assert resolve_prefill_dtype("float16", "float16", cpu) == torch.float16


def test_linear_uses_the_prefill_copy_for_its_dtype_and_the_weight_otherwise():
    layer = Linear(8, 4, dtype=torch.float16)
    torch.nn.init.normal_(layer.weight)
    layer.prefill_weight = torch.zeros(4, 8, dtype=torch.bfloat16)  # a copy that is easy to recognise
    x = torch.ones(1, 8)
    assert torch.count_nonzero(layer(x.bfloat16())) == 0
    assert layer(x.half()).dtype == torch.float16 and torch.count_nonzero(layer(x.half())) > 0
    assert layer(x).dtype == torch.float16  # other dtypes are cast to the weight's


def test_weight_blocks_compute_the_same_product():
    layer = Linear(20000, 16, dtype=torch.float32)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(3, 20000)
    plain = layer(x)
    layer.split_input()
    assert len(layer.weight_blocks) == 3 and all(b.is_contiguous() for b in layer.weight_blocks)
    torch.testing.assert_close(layer(x), plain, atol=1e-3, rtol=1e-4)  # sums of 20000 terms of size ~1
    small = Linear(64, 16)
    split_long_inputs(torch.nn.Sequential(small))
    assert small.weight_blocks is None  # only wide inputs are split


def test_float16_engine_on_cpu_prefills_in_bfloat16_and_matches_float16_prefill(weight_cache):
    fast = Engine(small_config(dtype="float16"), progress=False)
    plain = Engine(small_config(dtype="float16").replace(inference={"prefill_dtype": "float16"}), progress=False)
    assert fast.prefill_dtype == torch.bfloat16 and plain.prefill_dtype == torch.float16
    q_proj = fast.model.model.layers[0].self_attn.q_proj
    assert q_proj.prefill_weight.dtype == torch.bfloat16
    torch.testing.assert_close(q_proj.prefill_weight.half(), q_proj.weight, atol=2e-3, rtol=1e-2)
    assert fast.model.lm_head.prefill_weight is None  # one position: read, not computed
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        a = fast.model(ids, torch.arange(12), fast.new_cache(), compute_dtype=torch.bfloat16).float()
        b = plain.model(ids, torch.arange(12), plain.new_cache()).float()
    assert (a - b).abs().max() < 0.02 * b.abs().max()  # bfloat16 keeps 8 bits of mantissa
    assert a.argmax() == b.argmax()


def test_prefill_copy_is_cached_and_reloaded(weight_cache):
    cfg = small_config(dtype="float16").model
    weights, prefill = load_random_weights(cfg, torch.float16, torch.bfloat16, progress=False)
    wait_for_saves()
    path = random_weights_path(cfg, torch.float16)
    assert sorted(p.name for p in weight_cache.iterdir()) == sorted([path.name, path.stem +
                                                                    ".prefill-bfloat16.safetensors"])
    again, prefill_again = load_random_weights(cfg, torch.float16, torch.bfloat16, progress=False)
    assert set(prefill_again) == set(prefill_weight_names(cfg))
    assert all(torch.equal(prefill[k], prefill_again[k]) and torch.equal(prefill[k], weights[k].bfloat16())
               for k in prefill)
