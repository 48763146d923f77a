"""The speed paths (kvbook.runtime.paths, kvbook.model.linear): each phase's arithmetic dtype, measured once per
machine and cached; copies of the weights in that dtype; always-2-D inputs; down_proj as column blocks. They change
how the arithmetic is done, not what is computed: checked against the plain float16/float32 path."""

import dataclasses
import json
from shutil import rmtree

import kvbook.runtime.paths
import pytest
import torch
from kvbook.model.linear import (
    Linear,
    add_copies,
    batch_invariant_rows,
    fbgemm_available,
    onednn_available,
    onednn_linear,
    pack_model,
    packed_linear,
    packed_products,
    split_long_inputs,
    use_matvec,
    use_onednn,
    weight_bytes_kept,
)
from kvbook.model.weights import load_random_weights, prefill_weight_names, random_weights_path, wait_for_saves
from kvbook.runtime.engine import Engine
from kvbook.runtime.paths import (
    PHASES,
    candidates,
    choose_paths,
    cpu_identity,
    fixed_paths,
    matrix_groups,
    paths_cache_dir,
)

from .conftest import small_config

PROMPT = list(range(3, 15))
CPU = torch.device("cpu")


def test_candidates_hold_the_weights_values():
    assert candidates(torch.float16) == [torch.float16, torch.bfloat16, torch.float32]
    assert candidates(torch.bfloat16) == [torch.bfloat16, torch.float32]
    assert candidates(torch.float32) == [torch.float32]  # no lower precision for float32 weights


def test_paths_are_measured_once_per_machine_and_cached(weight_cache, monkeypatch):
    from kvbook.runtime import paths

    monkeypatch.setattr(paths, "_busy_cpu_seconds", lambda: 0.0)  # a quiet machine (a busy one: the next test)
    cfg = small_config(dtype="float16")
    first = choose_paths(cfg, CPU)
    assert first.source == "measured" and first.measured_s > 0
    for phase in PHASES:
        path = getattr(first, phase)
        assert path.dtype in candidates(torch.float16)
        # a batched step may also multiply float32 rows by float16 weights packed for FBGEMM (an x86 torch has it)
        fbgemm = {"fbgemm-float16"} if phase == "batched_decode" and fbgemm_available(CPU) else set()
        # prefill may multiply its float32 copy through oneDNN's inner product (a CPU build of torch has it)
        onednn = {"onednn-float32"} if phase == "prefill" and onednn_available(CPU) else set()
        # a lone row may go through torch.mv instead of F.linear, in any dtype
        matvec = {"matvec-float16", "matvec-bfloat16", "matvec-float32"} if phase == "decode" else set()
        assert set(path.estimated_ms) == {"float16", "bfloat16", "float32"} | fbgemm | onednn | matvec
        assert (path.kernel == "fbgemm") == (path.label == "fbgemm-float16")
        assert (path.kernel == "onednn") == (path.label == "onednn-float32")
        assert (path.kernel == "matvec") == path.label.startswith("matvec-")
        assert path.kernel in ("torch", "matvec") or path.dtype == torch.float32
        # which candidate won is a race between kernels (their rounded estimates may even tie): not asserted
        # here; test_the_choice_follows_fixed_timings checks the rule on timings that cannot change
        assert path.label in path.estimated_ms and path.reason.startswith("measured")
    files = list(paths_cache_dir().iterdir())
    assert len(files) == 1 and json.loads(files[0].read_text())["machine"] == cpu_identity()
    again = choose_paths(cfg, CPU)
    assert again.source == "cached" and again.to_json() | {"source": "measured", "measured_s": 0} == \
        first.to_json() | {"source": "measured", "measured_s": 0}
    assert len(first.describe()) == 6 and first.describe()[1].startswith("decode: ")
    # a prefill on packed weights is measured only where a batched step packs them
    if first.batched_decode.kernel == "fbgemm":
        assert first.packed_prefill_reason.startswith("measured, prompt rows")
    else:
        assert first.packed_prefill_rows == 0 and "does not pack" in first.packed_prefill_reason


def test_the_choice_follows_fixed_timings(monkeypatch):
    # fixed timings per (dtype, kernel): the fastest candidate wins, except that the weights' own dtype is kept
    # when it is within COPY_MARGIN of the fastest (no copy needed)
    from kvbook.runtime import paths

    fixed = {(torch.float16, "torch"): 10.0, (torch.bfloat16, "torch"): 9.5, (torch.float32, "torch"): 4.0,
             (torch.float32, "fbgemm"): 2.0, (torch.float32, "onednn"): 3.0,
             (torch.float16, "matvec"): 9.8, (torch.bfloat16, "matvec"): 9.6, (torch.float32, "matvec"): 12.0}

    def estimate(config, rows, dtype, device, *args, kernel="torch", **kwargs):
        if rows == 1 and (dtype, kernel) == (torch.float32, "torch"):
            return 12.0  # a lone row: float32 reads twice the bytes
        return fixed[(dtype, kernel)]

    monkeypatch.setattr(paths, "estimate_ms", estimate)
    monkeypatch.setattr(paths, "estimate_prefill_ms", estimate)
    monkeypatch.setattr(paths, "time_wide_rows", lambda *args, **kwargs: (2.0, 1.0))
    monkeypatch.setattr(paths, "packed_prefill_rows", lambda *args, **kwargs: (0, "fixed"))
    chosen = paths._measure_paths(small_config(dtype="float16"), CPU)
    assert chosen.prefill.label == ("onednn-float32" if onednn_available(CPU) else "float32")
    assert chosen.batched_decode.label == ("fbgemm-float16" if fbgemm_available(CPU) else "float32")
    # every other lone-row candidate is within 10% of float16's 10.0 ms: the weights' own dtype, no copy
    assert chosen.decode.label == "matvec-float16" and "needs no copy" in chosen.decode.reason
    assert chosen.split_wide_rows


def test_a_cpu_that_hides_amx_gets_its_own_measured_paths(monkeypatch):
    # two virtual machines of one processor model (Intel Xeon, family 6 model 207), one with AMX and one without:
    # torch names both AVX512, their fastest prefills differ, so they must not share a cached choice
    paths = kvbook.runtime.paths
    base = "fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni"
    info = {"model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "207"}
    cfg = small_config(dtype="float16")
    identities, files = [], []
    for flags in (base, base + " avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"):
        monkeypatch.setattr(paths, "_cpuinfo", lambda flags=flags: {**info, "flags": flags})
        identities.append(cpu_identity())
        files.append(paths._cache_path(cfg))
    assert identities[0]["vector_flags"] == ["avx", "avx2", "avx512_vnni", "avx512bw", "avx512f", "f16c", "fma"]
    assert set(identities[1]["vector_flags"]) - set(identities[0]["vector_flags"]) == \
        {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"}
    assert identities[0]["isa"] == identities[1]["isa"] and files[0] != files[1]


def test_a_choice_timed_on_a_busy_machine_is_used_but_not_cached(weight_cache, monkeypatch):
    paths = kvbook.runtime.paths
    with paths.OthersLoad() as load:  # the real /proc/stat: a share of the machine
        sum(range(10**6))
    assert load.share is None or 0 <= load.share <= 1
    monkeypatch.setattr(paths, "_busy_cpu_seconds", lambda: 0.0)  # a quiet machine: nobody else used a CPU
    assert choose_paths(small_config(dtype="float16", layers=1), CPU).others_cpu_share == 0
    busy_seconds = iter([0.0, 1e6])  # as if other processes had kept every CPU busy all the while
    monkeypatch.setattr(paths, "_busy_cpu_seconds", lambda: next(busy_seconds))
    busy = choose_paths(small_config(dtype="float16"), CPU)
    assert busy.others_cpu_share > paths.BUSY_SHARE and busy.source == "measured on a busy machine, not cached"
    assert len(list(paths_cache_dir().iterdir())) == 1  # the quiet one only
    monkeypatch.setattr(paths, "_busy_cpu_seconds", lambda: 0.0)
    assert choose_paths(small_config(dtype="float16"), CPU).source == "measured"  # measured again, then cached
    assert len(list(paths_cache_dir().iterdir())) == 2


def test_an_engine_says_on_stderr_that_it_times_the_paths_and_what_it_chose(weight_cache, capsys, monkeypatch):
    # a quiet machine, whatever else runs: a choice timed while others are busy is not cached (tested above)
    monkeypatch.setattr(kvbook.runtime.paths, "_busy_cpu_seconds", lambda: 0.0)
    cfg = small_config(dtype="float16")
    engine = Engine(cfg)  # an empty paths cache: measured now
    lines = [line for line in capsys.readouterr().err.splitlines() if "timing" in line or "timed in" in line]
    paths = engine.paths
    assert lines[0].startswith("kvbook: timing each phase's candidate kernels on this CPU") and len(lines) == 2
    assert lines[1].startswith("kvbook: timed in ") and lines[1].endswith(
        f"prefill {paths.prefill.label}, decode {paths.decode.label}, batched decode {paths.batched_decode.label}")
    Engine(cfg, model=engine.model)  # cached: nothing to say
    assert "timing" not in capsys.readouterr().err
    rmtree(paths_cache_dir())
    Engine(cfg, model=engine.model, progress=False)  # measured again, silently
    assert capsys.readouterr().err == ""


def test_float32_weights_and_gpus_are_not_measured(weight_cache, monkeypatch):
    paths = choose_paths(small_config(dtype="float32"), CPU)
    assert paths.source == "capability" and paths.dtypes() == {torch.float32}
    assert paths.batch_row_reason.startswith("measured")  # batch invariance is measured on a CPU all the same
    asked = []  # on a GPU too, on the GPU (cuBLAS may also pick another kernel for another row count)
    monkeypatch.setattr(kvbook.runtime.paths, "invariant_row_multiple",
                        lambda config, dtype, device, rows: asked.append((device, dtype, rows)) or (4, "measured"))
    gpu = choose_paths(small_config(dtype="float16"), torch.device("cuda", 0))
    assert gpu.source == "capability" and gpu.dtypes() == {torch.float16}
    assert asked == [(torch.device("cuda", 0), torch.float16, 8)] and gpu.batch_row_multiple == 4
    assert not paths_cache_dir().exists()


def test_prefill_dtype_pins_prefill(weight_cache):
    cfg = small_config(dtype="float16").replace(inference={"prefill_dtype": "float32"})
    paths = choose_paths(cfg, CPU)
    assert paths.prefill.dtype == torch.float32 and "pinned" in paths.prefill.reason


def test_matrix_groups_count_every_parameter_of_a_step():
    cfg = small_config(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=1000)
    m = cfg.model
    layer = (4 * 16 + 2 * 2 * 16 + 2 * 128) * 64 + 64 * 64 + 64 * 128  # q, k, v, gate, up; o; down
    assert sum(p for _, p in matrix_groups(cfg, lm_head=False)) == 2 * layer
    assert sum(p for _, p in matrix_groups(cfg, lm_head=True)) == 2 * layer + m.vocab_size * m.hidden_size
    full = small_config(layers=3, hidden=4096, heads=32, kv_heads=32, head_dim=128, vocab=151936).replace(
        model={"intermediate_size": 11008})
    assert sorted(w for (_, w), _ in matrix_groups(full, lm_head=True)) == [4096, 11008]  # o_proj is 4096 wide


def test_linear_uses_the_copy_in_the_inputs_dtype_and_the_weight_otherwise():
    layer = Linear(8, 4, dtype=torch.float16)
    torch.nn.init.normal_(layer.weight)
    layer.copies[torch.bfloat16] = torch.zeros(4, 8, dtype=torch.bfloat16)  # a copy that is easy to recognise
    x = torch.ones(1, 8)
    assert torch.count_nonzero(layer(x.bfloat16())) == 0
    assert layer(x.half()).dtype == torch.float16 and torch.count_nonzero(layer(x.half())) > 0
    assert layer(x).dtype == torch.float16  # other dtypes are cast to the weight's
    layer.row_dtype = torch.bfloat16  # lm_head: a lone row computes in the decode dtype
    assert torch.count_nonzero(layer(x.half())) == 0 and torch.count_nonzero(layer(x.half().repeat(2, 1))) > 0


def test_linear_gives_f_linear_a_2d_input(monkeypatch):
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


def test_weight_blocks_compute_the_same_product():
    layer = Linear(20000, 16, dtype=torch.float32)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(1, 20000)
    plain = layer(x)
    layer.split_input()
    blocks = layer.blocks[torch.float32]
    assert len(blocks) == 3 and all(b.is_contiguous() for b in blocks)
    torch.testing.assert_close(layer(x), plain, atol=1e-3, rtol=1e-4)  # sums of 20000 terms of size ~1
    small = Linear(64, 16)
    split_long_inputs(torch.nn.Sequential(small))
    assert small.blocks == {}  # only wide inputs are split


def test_copies_are_counted_once_in_the_bytes_kept():
    model = torch.nn.Sequential(Linear(64, 32, dtype=torch.float16), Linear(32, 64, dtype=torch.float16))
    for m in model:
        torch.nn.init.normal_(m.weight)
    values = 2 * 64 * 32 * 2
    assert weight_bytes_kept(model) == values
    add_copies(model, torch.float32)
    add_copies(model, torch.float32)  # idempotent
    assert weight_bytes_kept(model) == values + 2 * 64 * 32 * 4
    assert all(torch.equal(m.copies[torch.float32].half(), m.weight) for m in model)  # float32 is exact


@pytest.mark.parametrize("prefill,decode", [(torch.bfloat16, torch.float16), (torch.float32, torch.float32),
                                            (torch.float16, torch.bfloat16)])
def test_every_path_computes_the_float16_model(weight_cache, prefill, decode):
    cfg = small_config(dtype="float16")
    fast = Engine(cfg, progress=False, paths=fixed_paths(prefill, decode, decode))
    plain = Engine(cfg, progress=False, paths=fixed_paths(torch.float16, torch.float16, torch.float16))
    assert fast.prefill_dtype == prefill and fast.decode_dtype == decode
    q_proj = fast.model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.float16  # the values stay the article's
    assert q_proj.weight_in(prefill) is not None and q_proj.weight_in(decode) is not None
    assert fast.model.lm_head.weight_in(decode) is not None and fast.model.lm_head.row_dtype == decode
    assert fast.describe_paths()["weight_bytes_kept"] >= plain.describe_paths()["weight_bytes_kept"]
    a, b = fast.generate(PROMPT, 4, ignore_eos=True), plain.generate(PROMPT, 4, ignore_eos=True)
    assert a.output_ids[0] == b.output_ids[0]  # small random model: clear margins at the first token
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        x = fast.model(ids, torch.arange(12), fast.new_cache(), compute_dtype=prefill).float()
        y = plain.model(ids, torch.arange(12), plain.new_cache()).float()
    assert (x - y).abs().max() < 0.02 * y.abs().max()  # bfloat16 keeps 8 bits of mantissa


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


def test_generate_json_says_which_path_ran_and_why(tmp_path):
    import os
    import subprocess
    import sys

    from .test_cli import TINY

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    half = ["--set", "inference.dtype=float16", "--set", "kv_cache.cache_dtype=float16"]
    result = subprocess.run([sys.executable, "-m", "kvbook", "generate", "--input-ids", "9707,1879",
                             "--max-new-tokens", "3", "--json", *TINY, *half], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    # "measured", or "measured on a busy machine, not cached" where other processes took the CPUs meanwhile
    assert out["dtype"] == "float16" and out["paths"]["source"].startswith("measured")
    assert out["paths"]["decode"]["dtype"] in {"float16", "bfloat16", "float32"}
    assert out["paths"]["decode"]["reason"].startswith("measured")
    assert out["paths"]["weight_bytes_kept"] >= out["paths"]["weight_bytes_values"] > 0
    # the label names the kernel too where it is not F.linear ("matvec-float32": a tiny model's timings may pick it)
    assert out["paths"]["decode"]["label"].endswith(out["paths"]["decode"]["dtype"])
    assert out["paths_text"][1].startswith("decode: " + out["paths"]["decode"]["label"])


needs_fbgemm = pytest.mark.skipif(not fbgemm_available(CPU), reason="torch built without FBGEMM (not an x86 CPU)")


@needs_fbgemm
def test_a_batched_step_multiplies_float32_rows_by_the_packed_float16_weight():
    layer = Linear(4096, 5000, dtype=torch.float16)  # more rows than one packed block (kvbook.model.linear.PACK_ROWS)
    layer.weight.data = (torch.randn(5000, 4096) * 0.02).half()
    layer.copies[torch.float32] = torch.zeros(5000, 4096)  # a copy that is easy to recognise
    x = torch.randn(3, 4096)
    layer.pack()
    assert len(layer.packed) == 2
    exact = torch.nn.functional.linear(x.double(), layer.weight.double())
    with batch_invariant_rows(4), packed_products():
        out = layer(x)
    # float32 products and sums of 4096 terms of size ~0.02: within float32 rounding of the exact product
    assert out.dtype == torch.float32 and (out.double() - exact).abs().max() < 1e-4
    assert torch.count_nonzero(layer(x)) == 0  # outside packed_products: the float32 copy, as before
    with batch_invariant_rows(4):
        assert torch.count_nonzero(layer(x)) == 0  # padded rows alone do not choose the kernel
    with packed_products():  # a prefill pass: no padding
        torch.testing.assert_close(layer(x), out, atol=0, rtol=0)
    assert layer(x.half()).dtype == torch.float16  # a float16 batched step keeps F.linear on the weight
    torch.testing.assert_close(packed_linear(x, layer.packed), out)


@needs_fbgemm
def test_packed_weights_are_counted_and_made_once(weight_cache):
    engine = Engine(small_config(dtype="float16"), progress=False,
                    paths=fixed_paths(torch.float16, torch.float16, torch.float32, batched_kernel="fbgemm"))
    before = weight_bytes_kept(engine.model)
    cache = engine.new_cache()
    engine.prefill(cache, PROMPT)
    logits = engine.decode([7], [cache], batched=True)  # a batched step packs the weights first (chapter 11 calls it)
    assert logits.dtype == torch.float32 and logits.shape == (1, 1, engine.config.model.vocab_size)
    layers = [m for m in engine.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None for m in layers) and not any(m.copies for m in layers)
    assert weight_bytes_kept(engine.model) == before + sum(2 * m.weight.numel() for m in layers)
    packed = [m.packed for m in layers]
    pack_model(engine.model)
    assert [m.packed for m in layers] == packed  # a shared model is packed once
    assert engine.paths.batched_decode.label == "fbgemm-float16" and "fbgemm-float16" in engine.paths.describe()[2]


@needs_fbgemm
def test_a_batching_schedulers_short_prompts_are_prefilled_on_the_packed_weights(weight_cache, monkeypatch):
    from kvbook.model import linear
    from kvbook.runtime.scheduler import Scheduler

    paths = dataclasses.replace(fixed_paths(torch.float32, torch.float16, torch.float32, batched_kernel="fbgemm"),
                                packed_prefill_rows=12, packed_prefill_reason="as if measured")
    engine = Engine(small_config(dtype="float16"), progress=False, paths=paths)
    assert "prompt passes of up to 12 rows (as if measured)" in engine.paths.describe()[-1]
    assert engine.prefill_path_for(True, 12).label == "fbgemm-float16"
    assert engine.prefill_path_for(True, 13).label == engine.prefill_path_for(False, 5).label == "float32"
    calls = []
    monkeypatch.setattr(linear, "packed_linear", lambda x, packed: calls.append(x.shape[0]) or
                        torch.ops.quantized.linear_dynamic_fp16(x, packed[0]))
    outputs = {}
    for prompt in (PROMPT, PROMPT + [15]):  # 12 rows: packed; 13 rows: prefill's float32 copy
        calls.clear()
        cache = engine.new_cache()
        logits, _ = engine.prefill(cache, prompt, batched=True)
        # every layer matrix on the prompt's rows, but the last layer's past K and V on its last row only
        # (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; lm_head computes its one row in the decode
        # dtype, as ever)
        last_layer = [1, len(prompt), len(prompt), 1, 1, 1, 1]
        layers = [len(prompt)] * 7 * (engine.config.model.num_hidden_layers - 1) + last_layer
        assert calls == (layers if len(prompt) == 12 else [])
        outputs[len(prompt)] = logits
        torch.testing.assert_close(logits, engine.prefill(engine.new_cache(), prompt)[0], atol=1e-3, rtol=1e-3)
    # a scheduler that batches prefills through it too, alone or among others, so its tokens stay its own
    alone = Scheduler(engine, max_num_seqs=4)
    seq = alone.add(PROMPT, 4, ignore_eos=True)
    calls.clear()
    alone.run_until_done()
    assert calls.count(12) == 7 * engine.config.model.num_hidden_layers - 5  # its prefill, on the packed weights
    together = Scheduler(engine, max_num_seqs=4)
    seqs = [together.add(p, 4, ignore_eos=True) for p in (PROMPT, PROMPT[::-1], PROMPT + [15])]
    together.run_until_done()
    assert seqs[0].output_ids == seq.output_ids


def test_pinning_prefill_turns_the_packed_prefill_off(weight_cache, monkeypatch):
    from kvbook.runtime import paths

    measured = dataclasses.replace(fixed_paths(torch.float32, torch.float16, torch.float32, batched_kernel="fbgemm"),
                                   packed_prefill_rows=256, packed_prefill_reason="as if measured")
    monkeypatch.setattr(paths, "measure_paths", lambda config, device: measured)
    cfg = small_config(dtype="float16").replace(inference={"prefill_dtype": "bfloat16"})
    pinned = paths.choose_paths(cfg, CPU)
    assert pinned.prefill.dtype == torch.bfloat16 and pinned.packed_prefill_rows == 0
    assert "prefill pinned by [inference] prefill_dtype" in pinned.describe()[-1]


def test_packed_prefill_rows_is_the_longest_prompt_fbgemm_wins_at(monkeypatch):
    from kvbook.runtime import paths

    cfg = small_config(dtype="float16", max_positions=4096)
    cases = {  # FBGEMM's ms per probe of 16, 64, 128, 256 rows (prefill's own: 10 ms each) -> rows
        (5, 5, 5, 5): 4096, (5, 5, 5, 20): 128, (5, 5, 20, 5): 64, (5, 20, 5, 5): 16, (20, 5, 5, 5): 0}
    for packed_ms, rows in cases.items():
        timed = dict(zip(paths.PACKED_PREFILL_PROBES, packed_ms, strict=True))
        monkeypatch.setattr(paths, "estimate_prefill_ms", lambda config, n, dtype, device, best_ms=0, weights=None,
                            kernel="torch", timed=timed: timed[n] if kernel == "fbgemm" else 10.0)
        found, reason = paths.packed_prefill_rows(cfg, paths.PhasePath(torch.float32, "fixed"), CPU)
        assert found == rows and reason.startswith("measured") and "16 rows fbgemm-float16" in reason


needs_onednn = pytest.mark.skipif(not onednn_available(CPU), reason="torch built without oneDNN")


def test_onednn_is_a_candidate_only_where_its_product_runs(monkeypatch):
    import kvbook.model.linear as linear

    def no_primitive(x, weight):  # what another architecture's oneDNN build may answer
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setattr(linear, "onednn_linear", no_primitive)
    linear._onednn_runs.cache_clear()
    try:
        assert not linear.onednn_available(CPU)  # the paths then offer prefill no oneDNN candidate
    finally:
        linear._onednn_runs.cache_clear()
    assert not linear.onednn_available(torch.device("meta"))  # not a CPU


@needs_onednn
def test_a_layer_marked_for_onednn_multiplies_several_float32_rows_through_it():
    layer = Linear(4096, 512, dtype=torch.float16)
    layer.weight.data = (torch.randn(512, 4096) * 0.02).half()
    copy = layer.weight.float()
    layer.copies[torch.float32] = copy
    x = torch.randn(1, 20, 4096)  # [batch, prompt rows, in], as prefill passes it
    assert torch.equal(layer(x), torch.nn.functional.linear(x[0], copy)[None])  # not marked: F.linear
    use_onednn(layer, torch.float32)
    assert layer.onednn_dtype == torch.float32
    out = layer(x)
    # the same values up to the order of the sums: within float32 rounding of the exact product
    exact = torch.nn.functional.linear(x[0].double(), copy.double())
    assert out.shape == (1, 20, 512) and (out[0].double() - exact).abs().max() < 1e-4
    assert torch.equal(out[0], onednn_linear(x[0], copy))  # exactly oneDNN's product
    # a lone row and a batched step keep F.linear, as kvbook.runtime.paths measured them
    assert torch.equal(layer(x[0, :1]), torch.nn.functional.linear(x[0, :1], copy))
    with batch_invariant_rows(4):
        assert torch.equal(layer(x[0, :4]), torch.nn.functional.linear(x[0, :4], copy))
    assert torch.equal(layer(x.half()), torch.nn.functional.linear(x.half(), layer.weight))  # other dtypes too


def test_a_layer_marked_for_matvec_multiplies_a_lone_row_through_torch_mv(monkeypatch):
    layer = Linear(4096, 512, dtype=torch.float16)
    layer.weight.data = (torch.randn(512, 4096) * 0.02).half()
    copy = layer.weight.bfloat16()
    layer.copies[torch.bfloat16] = copy
    row, rows = torch.randn(1, 1, 4096).bfloat16(), torch.randn(1, 6, 4096).bfloat16()  # [batch, rows, in]
    assert torch.equal(layer(row), torch.nn.functional.linear(row[0], copy)[None])  # not marked: F.linear
    use_matvec(torch.nn.Sequential(layer), True)
    calls = []
    real = torch.mv
    monkeypatch.setattr("kvbook.model.linear.torch.mv", lambda w, v: calls.append(w) or real(w, v))
    out = layer(row)
    assert out.shape == (1, 1, 512) and calls == [copy]  # the copy in the row's dtype, read whole
    assert torch.equal(out[0, 0], real(copy, row[0, 0]))  # exactly torch.mv's product
    exact = torch.nn.functional.linear(row[0].double(), copy.double())
    assert (out[0].double() - exact).abs().max() < 0.02 * exact.abs().max()  # the same product, rounded to bfloat16
    # several rows, and a batched step's rows (padded for batch invariance) keep their own kernels
    assert torch.equal(layer(rows), torch.nn.functional.linear(rows[0], copy)[None])
    with batch_invariant_rows(2):
        assert torch.equal(layer(row[0]), torch.nn.functional.linear(torch.cat([row[0], 0 * row[0]]), copy)[:1])
    assert len(calls) == 1
    use_matvec(torch.nn.Sequential(layer), False)
    assert torch.equal(layer(row), torch.nn.functional.linear(row[0], copy)[None]) and len(calls) == 1


def test_a_lone_row_through_torch_mv_reads_a_split_matrix_block_by_block(monkeypatch):
    layer = Linear(20000, 16, dtype=torch.float16)
    layer.weight.data = (torch.randn(16, 20000) * 0.02).half()
    x = torch.randn(1, 1, 20000).half()  # [batch, rows, in]
    use_matvec(torch.nn.Sequential(layer), True)
    whole = layer(x)
    layer.split_input()
    blocks = layer.blocks[torch.float16]
    calls = []
    real = torch.mv
    monkeypatch.setattr("kvbook.model.linear.torch.mv", lambda w, v: calls.append(w) or real(w, v))
    out = layer(x)
    assert [w.data_ptr() for w in calls] == [b.data_ptr() for b in blocks]  # each block once, not the whole matrix
    parts = x[0].split(blocks[0].shape[1], dim=-1)
    assert torch.equal(out[0], sum(real(b, p[0]) for b, p in zip(blocks, parts, strict=True))[None])
    torch.testing.assert_close(out, whole, atol=2e-3, rtol=1e-2)  # the same product, summed in another order
    with batch_invariant_rows(2):  # a batched step's rows keep F.linear on the whole matrix
        assert torch.equal(layer(x[0]), torch.nn.functional.linear(torch.cat([x[0], 0 * x[0]]), layer.weight)[:1])
    assert len(calls) == len(blocks)


@pytest.mark.parametrize("kernel", ["torch", "matvec"])
def test_down_projs_column_blocks_are_timed_through_the_lone_rows_kernel(monkeypatch, kernel):
    from kvbook.runtime import paths

    cfg = small_config(dtype="float16").replace(model={"intermediate_size": 9000})  # wider than SPLIT_WIDTH
    calls = []
    real_mv, real_linear = torch.mv, torch.nn.functional.linear
    monkeypatch.setattr("kvbook.model.linear.torch.mv",
                        lambda w, v: calls.append(("matvec", w.shape[1])) or real_mv(w, v))
    monkeypatch.setattr("kvbook.model.linear.F.linear",
                        lambda x, weight: calls.append(("torch", weight.shape[1])) or real_linear(x, weight))
    plain_ms, split_ms = paths.time_wide_rows(cfg, torch.float16, CPU, kernel=kernel)
    assert plain_ms > 0 and split_ms > 0
    assert set(calls) == {(kernel, 9000), (kernel, 4500)}  # whole, and as two blocks, through the kernel asked for
    assert paths.time_wide_rows(small_config(dtype="float16"), torch.float16, CPU) is None  # nothing that wide


def test_int8_steps_read_their_matrices_whole_whatever_the_floating_split():
    measured = dataclasses.replace(fixed_paths(torch.bfloat16, torch.float16, torch.float16), split_wide_rows=True)
    int8 = kvbook.runtime.paths.int8_decode_paths(measured, torch.bfloat16)
    assert int8.split_wide_rows is False and "int8" in int8.split_reason
    assert "down_proj as column blocks for one row: no (int8 weights" in "\n".join(int8.describe())


def test_an_engine_whose_decode_measured_matvec_fastest_sends_every_lone_row_through_it(weight_cache, monkeypatch):
    cfg = small_config(dtype="float16", max_positions=64)
    matvec = Engine(cfg, progress=False, paths=fixed_paths(torch.float32, torch.bfloat16, torch.bfloat16,
                                                           decode_kernel="matvec"))
    assert matvec.paths.decode.label == "matvec-bfloat16" and "decode: matvec-bfloat16" in matvec.paths.describe()[1]
    assert {m.lone_row_matvec for m in matvec.model.modules() if isinstance(m, Linear)} == {True}
    plain = Engine(cfg, progress=False, paths=fixed_paths(torch.float32, torch.bfloat16, torch.bfloat16))
    assert {m.lone_row_matvec for m in plain.model.modules() if isinstance(m, Linear)} == {False}
    shapes = []
    real = torch.mv
    monkeypatch.setattr("kvbook.model.linear.torch.mv", lambda w, v: shapes.append(tuple(w.shape)) or real(w, v))
    run = matvec.generate(PROMPT, 3, ignore_eos=True)
    m = cfg.model
    # prefill's last position: the last layer's q_proj, o_proj and MLP, and lm_head; then every matrix of each of
    # the 2 decode steps, lm_head included
    per_step = m.num_hidden_layers * 7 + 1
    assert shapes[:6] == [(m.num_attention_heads * m.head_dim, m.hidden_size),
                          (m.hidden_size, m.num_attention_heads * m.head_dim),
                          (m.intermediate_size, m.hidden_size), (m.intermediate_size, m.hidden_size),
                          (m.hidden_size, m.intermediate_size), (m.vocab_size, m.hidden_size)]
    assert len(shapes) == 6 + 2 * per_step
    assert run.output_ids == plain.generate(PROMPT, 3, ignore_eos=True).output_ids  # small model: clear margins


@needs_onednn
def test_an_onednn_prefill_is_the_models_so_a_hand_run_call_gets_the_engines_numbers(weight_cache):
    # chapters 3, 4 and 5 compare the engine's prefill with their own engine.model(...) call exactly
    paths = fixed_paths(torch.float32, torch.float16, torch.float16, prefill_kernel="onednn")
    engine = Engine(small_config(dtype="float16", max_positions=64), progress=False, paths=paths)
    assert engine.paths.prefill.label == "onednn-float32" and "prefill: onednn-float32" in engine.paths.describe()[0]
    marked = [m.onednn_dtype for m in engine.model.modules() if isinstance(m, Linear)]
    assert marked and set(marked) == {torch.float32}
    logits, _ = engine.prefill(engine.new_cache(), PROMPT)
    ids, positions = torch.tensor([PROMPT]), torch.arange(len(PROMPT))
    by_hand = engine.model(ids, positions, engine.new_cache(), compute_dtype=engine.prefill_dtype)
    assert torch.equal(logits, by_hand)
    plain = Engine(small_config(dtype="float16", max_positions=64), progress=False,
                   paths=fixed_paths(torch.float32, torch.float16, torch.float16))
    assert {m.onednn_dtype for m in plain.model.modules() if isinstance(m, Linear)} == {None}
    torch.testing.assert_close(plain.prefill(plain.new_cache(), PROMPT)[0], logits, atol=1e-4, rtol=1e-4)
    # an engine built on the first one's model takes its own kernel, as it takes its own copies
    shared = Engine(small_config(dtype="float16", max_positions=64), model=engine.model, progress=False,
                    paths=fixed_paths(torch.float32, torch.float16, torch.float16))
    assert {m.onednn_dtype for m in shared.model.modules() if isinstance(m, Linear)} == {None}
    assert torch.equal(shared.prefill(shared.new_cache(), PROMPT)[0], plain.prefill(plain.new_cache(), PROMPT)[0])


def test_a_copy_laid_out_for_onednn_gives_f_linears_numbers():
    # where oneDNN's product on a weight reordered once is F.linear's, bit for bit (bfloat16 on an AMD EPYC Zen 5),
    # prefill's copy is laid out so once; every product on it, of any row count, keeps F.linear's numbers. Where it
    # is not (a CPU without AVX512-BF16: the engine keeps plain copies), the routing is checked on a float32 copy,
    # whose oneDNN product every x86 CPU runs (onednn-float32), against oneDNN itself
    from kvbook.model.linear import reorder_copies, reorder_keeps_numbers

    same_as_f_linear = reorder_keeps_numbers(torch.bfloat16)
    dtype = torch.bfloat16 if same_as_f_linear else torch.float32
    torch.manual_seed(0)
    layer = Linear(4096, 512, dtype=torch.float16)
    layer.weight.data = (torch.randn(512, 4096) * 0.02).half()
    plain = layer.weight.to(dtype)
    layer.copies[dtype] = plain
    bytes_before = weight_bytes_kept(layer)
    reorder_copies(layer, dtype)
    reordered = layer.copies[dtype]
    assert reordered.is_mkldnn and weight_bytes_kept(layer) == bytes_before

    def expected(x):
        return torch.nn.functional.linear(x, plain) if same_as_f_linear else onednn_linear(x, reordered)

    for rows in (1, 5, 64):
        x = torch.randn(rows, 4096).to(dtype)
        assert torch.equal(layer(x), expected(x))
    with batch_invariant_rows(4):  # padded rows too
        x = torch.randn(3, 4096).to(dtype)
        assert torch.equal(layer(x), expected(x))
    layer.split_input(dtype, max_width=1024)  # a lone row's column blocks are cut from plain copies only
    assert dtype not in layer.blocks


@pytest.mark.parametrize("weight_dtype", ["float16", "int8"])
def test_an_engine_lays_out_prefills_copy_for_onednn_only_where_that_changes_no_number(weight_cache, monkeypatch,
                                                                                       weight_dtype):
    from kvbook.model import linear as linear_module

    def build(paths):
        cfg = small_config(dtype="float16").replace(inference={"weight_dtype": weight_dtype})
        return Engine(cfg, progress=False, paths=paths)

    def reordered(engine):
        return {m.copies[torch.bfloat16].is_mkldnn for m in engine.model.modules()
                if torch.bfloat16 in getattr(m, "copies", {})}

    prefill_only = fixed_paths(torch.bfloat16, torch.float16, torch.float16)
    engine = build(prefill_only)
    assert reordered(engine) == {linear_module.reorder_keeps_numbers(torch.bfloat16)}
    assert engine.describe_paths()["prefill_copy_reordered_for_onednn"] == linear_module.reorder_keeps_numbers(
        torch.bfloat16)
    # a lone step that computes in the same dtype was timed on F.linear: its copy stays plain
    assert reordered(build(fixed_paths(torch.bfloat16, torch.bfloat16, torch.bfloat16))) == {False}
    monkeypatch.setattr(kvbook.runtime.paths, "reorder_keeps_numbers", lambda dtype: False)
    plain = build(prefill_only)
    assert reordered(plain) == {False}
    logits, _ = engine.prefill(engine.new_cache(), PROMPT)
    torch.testing.assert_close(logits, plain.prefill(plain.new_cache(), PROMPT)[0], atol=1e-3, rtol=1e-3)
    assert engine.generate(PROMPT, 4, ignore_eos=True).output_ids[0] == \
        plain.generate(PROMPT, 4, ignore_eos=True).output_ids[0]
    assert engine.describe_paths()["weight_bytes_kept"] == plain.describe_paths()["weight_bytes_kept"]
