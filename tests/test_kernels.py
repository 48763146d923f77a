"""The seam (kvbook.kernels): which arithmetic each phase runs, chosen by rules on the device and timings given here
(never a race between kernels), and the prepared layers, which change how a product is computed, not what."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvbook.kernels import Kernels, Phase, choose, fbgemm_available, weight_bytes_kept
from kvbook.kernels import choice as choice_module
from kvbook.kernels.choice import invariant_row_multiple, lone_row_phase
from kvbook.kernels.layers import FastLinear, fast_layers, onednn_available, pack_layers, packed_linear
from kvbook.model.linear import Linear
from kvbook.runtime.engine import Engine

from .conftest import small_config

PROMPT = list(range(3, 15))
CPU = torch.device("cpu")
LIB = Path(__file__).resolve().parents[1] / "lib" / "kvbook"
needs_fbgemm = pytest.mark.skipif(not fbgemm_available(CPU), reason="torch built without FBGEMM (not an x86 CPU)")
needs_onednn = pytest.mark.skipif(not onednn_available(CPU), reason="torch built without oneDNN")


@pytest.fixture
def timings(monkeypatch):
    """Fixed timings instead of a race: best_seconds answers with the seconds a test sets, by run name."""
    seconds: dict[str, float] = {}
    monkeypatch.setattr(choice_module, "best_seconds", lambda runs: {name: seconds[name] for name in runs})
    lone_row_phase.cache_clear()
    choice_module.float32_prefill_kernel.cache_clear()
    yield seconds
    lone_row_phase.cache_clear()
    choice_module.float32_prefill_kernel.cache_clear()


def half_config(**inference):
    cfg = small_config(dtype="float16")
    return cfg.replace(inference=inference) if inference else cfg


def test_bfloat16_instructions_choose_bfloat16_prefill_and_amx_a_bfloat16_batched_step(timings):
    timings.update({"float16 F.linear": 1.0, "bfloat16 torch.mv": 1.0})
    zen4 = choose(half_config(), CPU, flags=frozenset({"avx512f", "avx512_bf16"}))
    assert zen4.prefill == Phase(torch.bfloat16, "torch", zen4.prefill.reason) and "avx512_bf16" in zen4.prefill.reason
    assert zen4.batched_decode.label == ("fbgemm-float16" if fbgemm_available(CPU) else "float16")
    amx = choose(half_config(), CPU, flags=frozenset({"avx512_bf16", "amx_bf16"}))
    assert amx.prefill.dtype == torch.bfloat16 and amx.batched_decode == Phase(torch.bfloat16, "torch",
                                                                               amx.batched_decode.reason)


@needs_onednn
@pytest.mark.parametrize("torch_s,onednn_s,kernel", [(2.0, 1.0, "onednn"), (1.0, 2.0, "torch")])
def test_without_bfloat16_prefill_is_float32_through_the_faster_of_two_timed_kernels(timings, torch_s, onednn_s,
                                                                                      kernel):
    timings.update({"torch": torch_s, "onednn": onednn_s, "float16 F.linear": 1.0, "bfloat16 torch.mv": 1.0})
    chosen = choose(half_config(), CPU, flags=frozenset({"avx2", "fma"}))
    assert chosen.prefill.dtype == torch.float32 and chosen.prefill.kernel == kernel
    assert "F.linear 1000.0 ms" in chosen.prefill.reason or "F.linear 2000.0 ms" in chosen.prefill.reason


@pytest.mark.parametrize("mv_s,dtype,kernel", [(0.5, torch.bfloat16, "matvec"), (0.95, torch.float16, "torch")])
def test_a_lone_row_takes_a_bfloat16_copy_only_when_it_streams_faster_by_the_margin(timings, mv_s, dtype, kernel):
    timings.update({"float16 F.linear": 1.0, "bfloat16 torch.mv": mv_s})
    decode = choose(half_config(), CPU, flags=frozenset({"avx512_bf16"})).decode
    assert (decode.dtype, decode.kernel) == (dtype, kernel)
    assert "float16 F.linear 1000.0 ms" in decode.reason


def test_gpus_float32_weights_pins_and_int8_need_no_timing(timings):
    # no timing is set: any timing asked for would fail with a KeyError
    for device in (torch.device("cuda", 0), CPU):
        cfg = small_config(dtype="float32")
        chosen = choose(cfg, device, flags=frozenset())
        assert {chosen.prefill.dtype, chosen.decode.dtype, chosen.batched_decode.dtype} == {torch.float32}
    gpu = choose(half_config(), torch.device("cuda", 0))
    assert {p.label for p in (gpu.prefill, gpu.decode, gpu.batched_decode)} == {"float16"}
    timings.update({"float16 F.linear": 1.0, "bfloat16 torch.mv": 1.0})
    pinned = choose(half_config(prefill_dtype="float16"), CPU, flags=frozenset({"amx_bf16"}))
    assert pinned.prefill == Phase(torch.float16, reason="pinned by [inference] prefill_dtype")
    int8 = choose(half_config(weight_dtype="int8"), CPU, flags=frozenset({"amx_bf16"}))
    assert int8.decode.label == int8.batched_decode.label == "int8"


def test_a_fast_layer_uses_the_copy_in_the_inputs_dtype_and_the_weight_otherwise():
    layer = Linear(8, 4, dtype=torch.float16)
    torch.nn.init.normal_(layer.weight)
    (fast,) = fast_layers(torch.nn.Sequential(layer))
    assert fast is layer and isinstance(layer, FastLinear) and list(dict(layer.named_parameters())) == ["weight"]
    layer.copies[torch.bfloat16] = torch.zeros(4, 8, dtype=torch.bfloat16)  # a copy that is easy to recognise
    x = torch.ones(2, 8)
    assert torch.count_nonzero(layer(x.bfloat16())) == 0
    assert layer(x.half()).dtype == torch.float16 and torch.count_nonzero(layer(x.half())) > 0
    assert layer(x).dtype == torch.float16  # other dtypes are cast to the weight's
    layer.row_dtype = torch.bfloat16  # lm_head: a lone row computes in the decode step's dtype
    assert torch.count_nonzero(layer(x.half()[:1])) == 0 and torch.count_nonzero(layer(x.half())) > 0


def test_the_tracer_names_a_prepared_layer_by_the_models_class():
    from kvbook.tools.trace import Tracer

    model = torch.nn.Sequential(Linear(8, 4))
    fast_layers(model)
    with Tracer(model) as tracer, tracer.step("prefill", 0):
        model(torch.ones(1, 8))
    assert isinstance(model[0], FastLinear) and [row["kind"] for row in tracer.module_rows] == ["Linear"]


def test_a_lone_row_through_torch_mv_and_several_float32_rows_through_onednn_compute_the_same_product():
    torch.manual_seed(0)
    layer = Linear(256, 64, dtype=torch.float16)
    layer.weight.data = torch.randn(64, 256).half()
    fast_layers(torch.nn.Sequential(layer))
    layer.copies = {torch.bfloat16: layer.weight.bfloat16(), torch.float32: layer.weight.float()}
    row = torch.randn(1, 256).bfloat16()
    plain = torch.nn.functional.linear(row, layer.copies[torch.bfloat16])
    layer.matvec = True
    torch.testing.assert_close(layer(row), plain, atol=0.05, rtol=0.02)  # bfloat16's rounding of sums of 256
    if onednn_available(CPU):
        layer.onednn = True
        rows = torch.randn(5, 256)
        torch.testing.assert_close(layer(rows), torch.nn.functional.linear(rows, layer.copies[torch.float32]))


def test_plain_linear_gives_f_linear_a_2d_input(monkeypatch):
    shapes = []
    real = torch.nn.functional.linear
    monkeypatch.setattr("kvbook.model.linear.F.linear", lambda x, w: shapes.append(tuple(x.shape)) or real(x, w))
    layer = Linear(8, 4)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(2, 3, 8)
    out = layer(x)
    assert out.shape == (2, 3, 4) and shapes == [(6, 8)]
    torch.testing.assert_close(out, real(x, layer.weight))
    assert layer(torch.randn(1, 1, 8)).shape == (1, 1, 4) and shapes[-1] == (1, 8)  # lm_head's last position


def test_the_model_is_plain_torch_and_never_imports_the_seam():
    for path in (LIB / "model").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        assert not any("kernels" in name for name in imported), path.name
        assert "threading.local" not in path.read_text(), path.name  # no thread-local state in the model


@pytest.mark.parametrize("prefill,decode", [(Phase(torch.bfloat16), Phase(torch.float16)),
                                            (Phase(torch.float32), Phase(torch.bfloat16, "matvec")),
                                            (Phase(torch.float16), Phase(torch.float16))])
def test_every_choice_computes_the_float16_model(weight_cache, prefill, decode):
    cfg = small_config(dtype="float16")
    fast = Engine(cfg, progress=False, kernels=Kernels(prefill, decode, decode, CPU))
    plain = Engine(cfg, progress=False, kernels=Kernels(*[Phase(torch.float16)] * 3, CPU))
    q_proj, lm_head = fast.model.model.layers[0].self_attn.q_proj, fast.model.lm_head
    assert q_proj.weight.dtype == torch.float16  # the values stay the article's
    assert set(q_proj.copies) == {prefill.dtype, decode.dtype} - {torch.float16}
    assert set(lm_head.copies) == {decode.dtype} - {torch.float16}  # lm_head runs on one row in prefill too
    assert lm_head.row_dtype == decode.dtype
    exact = [copy for copy in q_proj.copies.values() if copy.dtype == torch.float32]  # float32 holds float16 exactly
    assert all(torch.equal(copy.half(), q_proj.weight) for copy in exact)
    assert fast.describe_kernels()["weight_bytes_kept"] >= plain.describe_kernels()["weight_bytes_kept"]
    a, b = fast.generate(PROMPT, 4, ignore_eos=True), plain.generate(PROMPT, 4, ignore_eos=True)
    assert a.output_ids[0] == b.output_ids[0]  # small random model: clear margins at the first token
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        x = fast.model(ids, torch.arange(12), fast.new_cache(), compute_dtype=prefill.dtype).float()
        y = plain.model(ids, torch.arange(12), plain.new_cache()).float()
    assert (x - y).abs().max() < 0.02 * y.abs().max()  # bfloat16 keeps 8 bits of mantissa


def test_a_shared_model_is_prepared_once_and_its_copies_are_counted_once(weight_cache):
    cfg = small_config(dtype="float16")
    kernels = Kernels(Phase(torch.float32), Phase(torch.float16), Phase(torch.float16), CPU)
    first = Engine(cfg, progress=False, kernels=kernels)
    layers = [m for m in first.model.modules() if isinstance(m, FastLinear)]
    values = sum(p.nbytes for p in first.model.parameters())
    copies = sum(4 * m.weight.numel() for m in layers if m is not first.model.lm_head)
    assert weight_bytes_kept(first.model) == values + copies
    copied = [m.copies[torch.float32] for m in layers if m is not first.model.lm_head]
    Engine(cfg, model=first.model, progress=False, kernels=kernels)
    assert [m.copies[torch.float32] for m in layers if m is not first.model.lm_head] == copied  # not made again
    assert weight_bytes_kept(first.model) == values + copies


@needs_fbgemm
def test_a_batched_step_multiplies_float32_rows_by_the_packed_float16_weight():
    layer = Linear(4096, 5000, dtype=torch.float16)  # more rows than one packed block (kvbook.kernels.layers)
    layer.weight.data = (torch.randn(5000, 4096) * 0.02).half()
    layers = fast_layers(torch.nn.Sequential(layer))
    layer.copies[torch.float32] = torch.zeros(5000, 4096)  # a copy that is easy to recognise
    pack_layers(layers)
    assert len(layer.packed) == 2
    x = torch.randn(3, 4096)
    exact = torch.nn.functional.linear(x.double(), layer.weight.double())
    phase = Phase(torch.float32, "fbgemm")
    kernels = Kernels(phase, phase, phase, CPU, batch_row_multiple=4)
    with kernels.batched_step():
        out = layer(x)
        assert layer(x.half()).dtype == torch.float16  # a float16 batched step keeps F.linear on the weight
    # float32 products and sums of 4096 terms of size ~0.02: within float32 rounding of the exact product
    assert out.dtype == torch.float32 and (out.double() - exact).abs().max() < 1e-4
    assert torch.count_nonzero(layer(x)) == 0  # outside a batched step: the float32 copy
    torch.testing.assert_close(packed_linear(x, layer.packed), out)


@needs_fbgemm
def test_packed_weights_are_made_when_a_batched_step_first_runs_and_counted(weight_cache):
    phase = Phase(torch.float32, "fbgemm")
    engine = Engine(small_config(dtype="float16"), progress=False,
                    kernels=Kernels(Phase(torch.bfloat16), Phase(torch.float16), phase, CPU))
    layers = [m for m in engine.model.modules() if isinstance(m, FastLinear)]
    before = weight_bytes_kept(engine.model)
    assert not any(m.packed for m in layers) and engine.kernels.batch_row_multiple is None
    cache = engine.new_cache()
    engine.prefill(cache, PROMPT)
    logits = engine.decode([7], [cache], batched=True)  # a batched step packs the weights first (chapter 11 calls it)
    assert logits.dtype == torch.float32 and logits.shape == (1, 1, engine.config.model.vocab_size)
    assert all(m.packed is not None for m in layers) and engine.kernels.batch_row_multiple in (1, 2, 4, 8)
    assert weight_bytes_kept(engine.model) == before + sum(2 * m.weight.numel() for m in layers)
    packed = [m.packed for m in layers]
    pack_layers(layers)
    assert [m.packed for m in layers] == packed  # a shared model is packed once
    assert "batched_decode: fbgemm-float16" in engine.kernels.describe()[2]


def test_padding_to_the_checked_multiple_gives_each_row_its_batched_numbers():
    cfg = small_config(hidden=256, heads=4, head_dim=64, kv_heads=2, dtype="float16")
    phase = Phase(torch.bfloat16)
    multiple, reason = invariant_row_multiple(cfg.model, phase, CPU, 8)
    assert multiple in (1, 2, 4, 8, 16) and reason.startswith("checked")
    layer = Linear(256, 512, dtype=torch.float16)
    layer.weight.data = torch.randn(512, 256).half()
    fast_layers(torch.nn.Sequential(layer))
    layer.copies[torch.bfloat16] = layer.weight.bfloat16()
    kernels = Kernels(phase, phase, phase, CPU, batch_row_multiple=multiple)
    x = torch.randn(8, 256).bfloat16()
    with kernels.batched_step():
        batched = layer(x)
        assert all(torch.equal(batched[:rows], layer(x[:rows])) for rows in range(1, 9))
    assert invariant_row_multiple(cfg.model, Phase(torch.float16, "int8"), CPU, 8)[0] == 1  # int8 rows: not padded


def test_generate_json_says_which_arithmetic_ran_and_why(tmp_path):
    from .test_cli import TINY

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    half = ["--set", "inference.dtype=float16", "--set", "kv_cache.cache_dtype=float16"]
    result = subprocess.run([sys.executable, "-m", "kvbook", "generate", "--input-ids", "9707,1879",
                             "--max-new-tokens", "3", "--json", *TINY, *half], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["dtype"] == "float16" and out["phases"]["decode"]["label"] in {"float16", "matvec-bfloat16"}
    assert out["phases"]["decode"]["reason"]  # why, in words
    assert out["phases"]["weight_bytes_kept"] >= out["phases"]["weight_bytes_values"] > 0
    assert out["phases_text"][1].startswith("decode: " + out["phases"]["decode"]["label"])
    assert not (tmp_path / "xdg" / "kvbook" / "paths").exists()  # nothing is measured into a cache any more
