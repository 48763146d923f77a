"""int8 weights and a quantized KV cache (kvbook.model.quant): the int8 path against a dequantized reference, the int8
and float8 caches against a float one, the pool that holds about twice the positions for the same memory, and the
errors that name the key. Small float32 configs; what quantization costs on the full model is measured by
kvbook.tools.quant_cost (chapter 12) and recorded in BENCHMARKS.md, not asserted here."""

import copy

import pytest
import torch
from kvbook.cache import kv_quant
from kvbook.cache.memory import blocks_for_budget, kv_cache_bytes
from kvbook.cache.paged import BlockPool
from kvbook.config import Config, ConfigError, KVCacheConfig, ModelConfig, load_config
from kvbook.kernels import weight_bytes_kept
from kvbook.kernels.layers import fast_layers
from kvbook.model import quant
from kvbook.model.linear import Linear
from kvbook.runtime.engine import Engine
from kvbook.runtime.scheduler import Scheduler
from kvbook.tools import quant_cost

from .conftest import small_config

# The CPU kernel takes bfloat16 rows and rounds its output to bfloat16: relative error 2**-9 per output, and
# the rows' own rounding to bfloat16 (2**-9 each) before the dot product. 2**-7 covers both with room.
KERNEL_RTOL = 2**-7


def int8_engine(cfg: Config, **inference) -> Engine:
    return Engine(cfg.replace(inference={"weight_dtype": "int8", **inference}), progress=False)


def dequantized_reference(model: torch.nn.Module) -> torch.nn.Module:
    """The int8 model with every Int8Linear turned back into a float32 Linear holding q * scale."""
    reference = copy.deepcopy(model)
    for name, module in list(reference.named_modules()):
        if isinstance(module, quant.Int8Linear):
            linear = Linear(module.in_features, module.out_features, dtype=torch.float32)
            linear.weight = torch.nn.Parameter(quant.dequantize(module.qweight, module.scale, torch.float32),
                                               requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent) if parent else reference, child, linear)
    return reference


def test_per_channel_quantization_rounds_each_row_to_its_own_scale():
    weight = torch.randn(96, 64) * 0.02
    weight[3] = 0  # an all-zero row must not divide by zero
    weight[5, 7] = 1.0  # one outlier sets only its own row's scale
    q, scale = quant.quantize_per_channel(weight, torch.bfloat16)
    assert q.dtype == torch.int8 and q.shape == (96, 64) and scale.shape == (96,)
    assert int(q.abs().max()) == 127 and int(q[3].abs().max()) == 0
    error = (weight - quant.dequantize(q, scale, torch.float32)).abs()
    assert bool((error <= scale.float()[:, None] * 0.5 * (1 + 1e-6)).all())  # at most half a step per row
    assert float(scale[5]) > 10 * float(scale[4])


def test_quantizing_in_chunks_gives_the_whole_matrix_result(monkeypatch):
    weight = torch.randn(96, 64) * 0.02
    whole = quant.quantize_per_channel(weight, torch.bfloat16)
    monkeypatch.setattr(quant, "QUANTIZE_CHUNK_WEIGHTS", 5 * 64 + 10)  # chunks of 5 rows, the last one of 1
    chunked = quant.quantize_per_channel(weight, torch.bfloat16)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
    weight[93, 2] = float("nan")  # in the 19th chunk: the row named is the matrix's, not the chunk's
    with pytest.raises(ConfigError, match=r"holds inf or NaN \(row 93\)"):
        quant.quantize_per_channel(weight, torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 3, quant.DECODE_ROWS])
def test_int8_linear_equals_a_dequantized_matrix_product(rows):
    torch.manual_seed(0)
    linear = Linear(256, 96, dtype=torch.float32)
    linear.weight = torch.nn.Parameter(torch.randn(96, 256) * 0.02, requires_grad=False)
    int8 = quant.Int8Linear.from_linear(linear, torch.bfloat16)
    x = torch.randn(1, rows, 256)
    reference = x.to(torch.bfloat16).float() @ quant.dequantize(int8.qweight, int8.scale, torch.float32).T
    out = int8(x)
    assert out.shape == (1, rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=KERNEL_RTOL, atol=1e-6)
    # a row's result does not depend on the rows beside it (batch invariance of a batched decode step)
    alone = torch.cat([int8(x[:, i:i + 1]) for i in range(rows)], dim=1)
    assert torch.equal(alone, out)


def test_prefill_rows_use_the_floating_weight_or_its_copy():
    linear = Linear(64, 32, dtype=torch.float32)
    linear.weight = torch.nn.Parameter(torch.randn(32, 64) * 0.02, requires_grad=False)
    x = torch.randn(1, quant.DECODE_ROWS + 1, 64)
    int8 = quant.Int8Linear.from_linear(linear, torch.bfloat16)
    assert int8.weight is linear.weight
    assert torch.equal(int8(x), torch.nn.functional.linear(x, linear.weight))
    fast_layers(torch.nn.Sequential(int8))  # kvbook.kernels' prefill copy, as an engine makes it
    int8.copies[torch.bfloat16] = linear.weight.to(torch.bfloat16)
    assert torch.equal(int8(x.to(torch.bfloat16)), torch.nn.functional.linear(x.to(torch.bfloat16),
                                                                               int8.copies[torch.bfloat16]))
    # a decode step's rows still read the int8 matrices
    rows = x[:, :quant.DECODE_ROWS].to(torch.bfloat16)
    assert torch.equal(int8(rows), quant.Int8Linear.forward(int8, rows))


def test_engine_quantizes_layers_and_lm_head_and_keeps_the_embedding(weight_cache):
    cfg = small_config()
    engine = int8_engine(cfg)
    model = engine.model
    int8 = [name for name, m in model.named_modules() if isinstance(m, quant.Int8Linear)]
    assert len(int8) == 7 * cfg.model.num_hidden_layers + 1 and "lm_head" in int8
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert model.model.embed_tokens.weight.dtype == torch.float32
    # matrices: 1 byte per weight instead of 4, plus one bfloat16 scale per output channel
    int8 = [m for m in model.modules() if isinstance(m, quant.Int8Linear)]
    matrices = sum(m.in_features * m.out_features + 2 * m.out_features for m in int8)
    # what a decode step reads: the int8 matrices, the embedding and the norms' weights
    read = 4 * (cfg.model.vocab_size * cfg.model.hidden_size + sum(
        p.numel() for name, p in model.named_parameters() if name.endswith("norm.weight")))
    assert quant.quantized_weight_bytes(model) == matrices + read
    # what the model keeps: also each int8 layer's floating weight, prefill's (the bench's RSS ratio)
    floating = sum(p.nbytes for p in model.parameters())
    assert floating == read + 4 * sum(m.weight.numel() for m in int8)
    assert weight_bytes_kept(model) == matrices + floating
    # and the engine says that its decode steps, alone or batched, read the int8 matrices
    for phase in (engine.kernels.decode, engine.kernels.batched_decode):
        assert phase.label == "int8" and phase.reason.startswith('[inference] weight_dtype = "int8": torch\'s int8')
    assert "rows are not padded" not in engine.kernels.describe()[-1]  # checked when a batched step first runs
    engine.prepare_batched_decode()
    assert "int8 weights: rows are not padded" in engine.kernels.describe()[-1]


def test_int8_matrices_are_cached_beside_the_random_weights(weight_cache):
    cfg = small_config()
    first = int8_engine(cfg)
    first.cache_writes.wait()
    assert [path.name.split(".", 1)[1] for path in weight_cache.glob("*.int8-*")] == ["int8-bfloat16.safetensors"]
    second = int8_engine(cfg)  # reads them back instead of quantizing again
    pairs = [(a, b) for a, b in zip(first.model.modules(), second.model.modules(), strict=True)
             if isinstance(a, quant.Int8Linear)]
    assert len(pairs) == 7 * cfg.model.num_hidden_layers + 1
    assert all(torch.equal(a.qweight, b.qweight) and torch.equal(a.scale, b.scale) for a, b in pairs)


def test_int8_matrices_read_back_from_a_misaligned_file_are_multiplied_safely(weight_cache):
    # a safetensors file's tensors start where its header ends, a multiple of 8 bytes; torch's int8 kernel crashed the
    # process (a segmentation fault) on a matrix not 64-byte aligned, for a few rows (a batched step, a short
    # prompt), on an AMD EPYC Zen 5. This config's file is such a one.
    import struct

    cfg = small_config(dtype="float16")
    int8_engine(cfg).cache_writes.wait()
    (path,) = weight_cache.glob("*.int8-*")
    with path.open("rb") as file:
        header = struct.unpack("<Q", file.read(8))[0]
    assert (8 + header) % quant.KERNEL_ALIGNMENT != 0  # the tensors in the file are misaligned
    again = int8_engine(cfg)  # reads them back
    layers = [m for m in again.model.modules() if isinstance(m, quant.Int8Linear)]
    assert layers and all(m.qweight.data_ptr() % quant.KERNEL_ALIGNMENT == 0 for m in layers)
    prompts = [list(range(100, 112)), list(range(300, 309))]  # 12 and 9 rows through the int8 kernel
    batched = again.generate_batch(prompts, 3, ignore_eos=True)
    assert [run.output_ids for run in batched] == [again.generate(p, 3, ignore_eos=True).output_ids for p in prompts]


def test_int8_engine_equals_its_dequantized_reference(weight_cache):
    """The whole decode path (prefill, cached decode steps, lm_head) against float32 matrices holding q * scale:
    the only difference left is the kernel's bfloat16 rounding of rows and outputs. Prefill multiplies an int8
    layer's floating weight; here that weight is set to q * scale too, so that both engines cache the same K and V."""
    cfg = small_config(max_cache_len=128)
    engine = int8_engine(cfg)
    for m in engine.model.modules():
        if isinstance(m, quant.Int8Linear):
            m.weight = torch.nn.Parameter(quant.dequantize(m.qweight, m.scale, torch.float32), requires_grad=False)
    reference = Engine(cfg, model=dequantized_reference(engine.model), progress=False)
    prompt = list(range(100, 140))
    tokens = reference.generate(prompt, 24, ignore_eos=True).output_ids[:-1]
    ours = quant_cost.teacher_forced_logits(engine, prompt, tokens)
    theirs = quant_cost.teacher_forced_logits(reference, prompt, tokens)
    assert ours.shape == (24, cfg.model.vocab_size)
    spread = float(theirs.std(dim=-1).mean())
    assert quant_cost.logit_error(theirs, ours)["max_abs_error"] <= 0.02 * spread


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize(("cache_dtype", "tolerance"), [("int8", 0.05), ("float8_e4m3fn", 0.5)])
def test_quantized_cache_logits_stay_close_to_a_float_cache(weight_cache, layout, cache_dtype, tolerance):
    """Stated tolerances, as a share of the logits' spread: int8 keeps 8 bits per number, float8 e4m3 only 4."""
    cfg = small_config(max_cache_len=128)
    floating = Engine(cfg, progress=False)
    quantized = Engine(cfg.replace(kv_cache={"cache_dtype": cache_dtype, "layout": layout}), model=floating.model,
                       progress=False)
    prompt = list(range(100, 140))
    tokens = floating.generate(prompt, 24, ignore_eos=True).output_ids[:-1]
    reference = quant_cost.teacher_forced_logits(floating, prompt, tokens)
    error = quant_cost.logit_error(reference, quant_cost.teacher_forced_logits(quantized, prompt, tokens))
    assert 0 < error["relative_error"] <= tolerance


def test_quantized_cache_round_trip_is_within_half_a_step_per_position_and_head():
    x = torch.randn(1, 4, 10, 16)
    values, scale = kv_quant.quantize_kv(x, "int8")
    assert values.dtype == torch.int8 and scale.shape == (1, 4, 10, 1) and scale.dtype == torch.float16
    assert bool(((kv_quant.dequantize_kv(values, scale) - x).abs() <= scale.float() * 0.5 * (1 + 1e-3)).all())


def test_int8_cache_bytes_follow_the_formula_and_half_the_float16_ones(weight_cache):
    cfg = small_config(dtype="float32", max_cache_len=128)
    engine = Engine(cfg.replace(kv_cache={"cache_dtype": "int8"}), progress=False)
    cache = engine.new_cache()
    engine.prefill(cache, list(range(100, 137)))
    assert cache.filled_bytes() == kv_cache_bytes(cfg.model, 37, "int8")
    stored = sum(t.nbytes for layer in cache.layers for t in (layer.k, layer.v, layer.k_scale, layer.v_scale))
    assert cache.reserved_bytes() == stored == kv_cache_bytes(cfg.model, 128, "int8")
    # the article's model: head_dim 128 numbers in 1 byte + a 2-byte scale, against 2 bytes each
    article = ModelConfig()
    assert kv_cache_bytes(article, 256, "int8") / kv_cache_bytes(article, 256, "float16") == 130 / 256


def test_the_pool_holds_about_twice_the_positions_for_the_same_memory():
    article = ModelConfig()
    float16 = KVCacheConfig(layout="paged", pool_mib=1024)
    int8 = KVCacheConfig(layout="paged", pool_mib=1024, cache_dtype="int8")
    blocks16, blocks8 = blocks_for_budget(article, float16), blocks_for_budget(article, int8)
    assert blocks16 == 1024 * 2**20 // kv_cache_bytes(article, 16, "float16") == 1365
    assert blocks8 == 1024 * 2**20 // kv_cache_bytes(article, 16, "int8") == 2688  # 1.97x: 256 / 130 bytes
    small = small_config()
    pool = BlockPool(small.model, KVCacheConfig(layout="paged", pool_mib=1, cache_dtype="int8"), torch.device("cpu"))
    stored = sum(t.nbytes for tensors in (pool.k, pool.v, pool.k_scale, pool.v_scale) for t in tensors)
    assert stored == pool.reserved_bytes() <= 2**20


def test_the_scheduler_admits_more_sequences_into_an_int8_pool(weight_cache):
    """The same pool_mib: 9 sequences of 207 positions fit in float32 blocks, 35 in int8 ones (with scales)."""
    cfg = small_config(max_cache_len=256)
    admitted = {}
    model = None
    for cache_dtype in ("float32", "int8"):
        engine = Engine(cfg.replace(kv_cache={"cache_dtype": cache_dtype, "layout": "paged", "pool_mib": 1}),
                        model=model, progress=False)
        model = engine.model
        scheduler = Scheduler(engine, max_num_seqs=64)
        for i in range(40):
            scheduler.add([100 + i] * 200, 8, ignore_eos=True)
        peak = 0
        while scheduler.has_work:
            scheduler.step()
            peak = max(peak, len(scheduler.running))
        admitted[cache_dtype] = peak
    assert admitted == {"float32": 128 // 13, "int8": 455 // 13}


def test_int8_batched_decode_gives_each_sequence_its_tokens_alone(weight_cache):
    cfg = small_config(max_cache_len=128)
    engine = int8_engine(cfg)
    prompts = [list(range(100, 130)), list(range(300, 320)), list(range(500, 545))]
    batched = engine.generate_batch(prompts, 12, ignore_eos=True)
    for prompt, run in zip(prompts, batched, strict=True):
        assert run.output_ids == engine.generate(prompt, 12, ignore_eos=True).output_ids


@pytest.mark.parametrize(("override", "message"), [
    ("inference.weight_dtype=int4", "[inference] weight_dtype = 'int4': must be one of 'auto', 'int8'"),
    ("inference.weight_dtype=float32", "[inference] weight_dtype = 'float32': floating weights are stored in "
                                       "[inference] dtype = 'float16'; set weight_dtype = \"auto\""),
    ("kv_cache.cache_dtype=int4", "[kv_cache] cache_dtype = 'int4': must be one of"),
])
def test_bad_quantization_keys_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_device_without_the_int8_kernel_names_the_key(weight_cache, monkeypatch):
    def missing(*args):
        raise NotImplementedError("Could not run 'aten::_weight_int8pack_mm' with arguments from this backend")

    monkeypatch.setattr(quant, "int8_matmul", missing)
    with pytest.raises(ConfigError, match=r"^\[inference\] weight_dtype = \"int8\": the int8 kernel does not run "
                                          r"on cpu with torch.bfloat16 activations \(Could not run"):
        int8_engine(small_config())


def test_a_device_without_the_cache_dtype_names_the_key(weight_cache, monkeypatch):
    def missing(*args):
        raise RuntimeError("\"copy_\" not implemented for 'Float8_e4m3fn'")

    monkeypatch.setattr(kv_quant, "quantize_kv", missing)
    with pytest.raises(ConfigError, match=r"^\[kv_cache\] cache_dtype = 'float8_e4m3fn' does not run on cpu"):
        Engine(small_config().replace(kv_cache={"cache_dtype": "float8_e4m3fn"}), progress=False)


def test_a_checkpoint_with_inf_cannot_be_quantized_and_says_which_tensor(weight_cache):
    floating = Engine(small_config(), progress=False)
    model = copy.deepcopy(floating.model)
    model.model.layers[1].mlp.up_proj.weight[7, 3] = float("inf")
    with pytest.raises(ConfigError) as err:
        Engine(small_config().replace(inference={"weight_dtype": "int8"}), model=model, progress=False)
    assert str(err.value).startswith("[inference] weight_dtype = \"int8\": model.layers.1.mlp.up_proj.weight "
                                     "holds inf or NaN (row 7)")


def test_the_fixed_shape_step_writes_and_reads_an_int8_cache_like_the_ordinary_step(weight_cache):
    """The step CUDA graphs replay (kvbook.runtime.cuda_graph), run eagerly: same quantized cache, same logits."""
    from kvbook.runtime.cuda_graph import GraphedDecoder

    engine = Engine(small_config(output_len=20).replace(kv_cache={"cache_dtype": "int8"}), progress=False)
    decoder = GraphedDecoder(engine, bucket_size=8, capture=False)
    plain = engine.new_cache()
    prompt = list(range(3, 8))
    assert decoder.acquire() is decoder.cache
    engine.prefill(decoder.cache, prompt)
    logits, _ = engine.prefill(plain, prompt)
    token = int(logits[0, -1].argmax())
    with torch.inference_mode():
        for position in range(len(prompt), len(prompt) + 12):  # buckets 8 and 16
            fixed = decoder.step(token)
            ordinary = engine.model(torch.tensor([[token]]), torch.tensor([position]), plain)
            torch.testing.assert_close(fixed, ordinary, atol=1e-5, rtol=1e-5)
            token = int(ordinary[0, -1].argmax())
    for fixed_layer, plain_layer in zip(decoder.cache.layers, plain.layers, strict=True):
        assert torch.equal(fixed_layer.k[:, :, :plain_layer.length], plain_layer.k[:, :, :plain_layer.length])
        assert torch.equal(fixed_layer.v_scale[:, :, :plain_layer.length],
                           plain_layer.v_scale[:, :, :plain_layer.length])
