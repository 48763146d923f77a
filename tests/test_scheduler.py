"""Continuous batching (kvbook.runtime.scheduler): sequences join after their prefill and leave when they finish, each
with exactly the tokens it gets alone; admission by the pool's free blocks; aborts free at once."""

import pytest
import torch
from kvbook.device import TORCH_DTYPES
from kvbook.kernels import Kernels, Phase, fbgemm_available
from kvbook.kernels.choice import invariant_row_multiple
from kvbook.kernels.layers import fast_layers, pack_layers
from kvbook.model.linear import Linear
from kvbook.runtime.engine import Engine
from kvbook.runtime.scheduler import Scheduler

from .conftest import small_config

PROMPTS = [list(range(1000, 1012)), list(range(2000, 2031)), [9707], list(range(3000, 3016)),
           list(range(4000, 4040))]


def make_engine(dtype="float32", max_cache_len=128, kernels=None, **kv_options):
    cfg = small_config(vocab=151936, max_cache_len=max_cache_len, dtype=dtype).replace(
        kv_cache={"layout": "paged", **kv_options})
    return Engine(cfg, progress=False, kernels=kernels)


def alone(engine, prompt, n, **options):
    scheduler = Scheduler(engine, max_num_seqs=8)
    seq = scheduler.add(prompt, n, **options)
    scheduler.run_until_done()
    return seq.output_ids


def test_late_arrivals_join_the_running_batch_and_get_the_tokens_they_get_alone(weight_cache):
    engine = make_engine()
    scheduler = Scheduler(engine, max_num_seqs=8, record_timeline=True)
    first = scheduler.add(PROMPTS[0], 12, ignore_eos=True)
    for _ in range(4):  # prefill + 3 decode steps of the first sequence alone
        scheduler.step()
    late = [scheduler.add(p, 8, ignore_eos=True) for p in PROMPTS[1:4]]
    scheduler.run_until_done()
    timeline = scheduler.timeline
    assert [s.phase for s in timeline[:4]] == ["prefill", "decode", "decode", "decode"]
    assert [s.phase for s in timeline[4:7]] == ["prefill"] * 3  # new arrivals are prefilled first
    assert timeline[7].phase == "decode" and timeline[7].seq_ids == (0, 1, 2, 3)  # then decoded together
    assert max(len(s.seq_ids) for s in timeline) == 4
    assert first.output_ids == alone(engine, PROMPTS[0], 12, ignore_eos=True)
    for seq, prompt in zip(late, PROMPTS[1:4], strict=True):
        assert seq.output_ids == engine.generate(prompt, 8, ignore_eos=True).output_ids
        assert [s.positions_computed for s in seq.steps] == [len(prompt)] + [1] * 7
    assert engine.pool.used_blocks == 0


@pytest.mark.parametrize("batched", ["chosen", "float16", "bfloat16", "float32", "fbgemm"])
def test_float16_on_cpu_batched_rows_are_bitwise_what_they_are_alone(weight_cache, batched):
    # float16 weights: batched steps compute as kvbook.kernels chose for this machine, or as another machine would
    # (fbgemm: float32 rows, float16 weights packed for FBGEMM); a sequence alone in the scheduler gets the same
    # numbers (as two rows)
    kernels = None
    if batched != "chosen":
        kernel = "fbgemm" if batched == "fbgemm" else "torch"
        dtype = torch.float32 if batched == "fbgemm" else TORCH_DTYPES[batched]
        if kernel == "fbgemm" and not fbgemm_available(torch.device("cpu")):
            pytest.skip("torch built without FBGEMM (not an x86 CPU)")
        kernels = Kernels(Phase(torch.bfloat16), Phase(torch.float16), Phase(dtype, kernel), torch.device("cpu"))
    engine = make_engine(dtype="float16", kernels=kernels)
    scheduler = Scheduler(engine, max_num_seqs=8)
    assert scheduler.batched  # its decode steps compute in engine.batched_decode_dtype, rows padded
    seqs = [scheduler.add(p, 10, ignore_eos=True) for p in PROMPTS]
    scheduler.run_until_done()
    assert [s.output_ids for s in seqs] == [alone(engine, p, 10, ignore_eos=True) for p in PROMPTS]


def test_one_sequence_at_a_time_decodes_in_the_lone_steps_dtype_like_engine_stream(weight_cache):
    engine = make_engine(dtype="float16")
    scheduler = Scheduler(engine, max_num_seqs=1, record_timeline=True)
    assert not scheduler.batched  # its decode steps compute in engine.decode_dtype, as a lone stream's
    seqs = [scheduler.add(p, 6, ignore_eos=True) for p in PROMPTS[:2]]
    scheduler.run_until_done()
    assert all(len(step.seq_ids) == 1 for step in scheduler.timeline)
    assert [s.output_ids for s in seqs] == [engine.generate(p, 6, ignore_eos=True).output_ids for p in PROMPTS[:2]]


def test_sampled_sequences_keep_their_own_seeded_generator(weight_cache):
    engine = make_engine()
    options = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    scheduler = Scheduler(engine, max_num_seqs=8)
    seqs = [scheduler.add(p, 10, **options) for p in PROMPTS[:3]]
    scheduler.run_until_done()
    assert [s.output_ids for s in seqs] == [engine.generate(p, 10, **options).output_ids for p in PROMPTS[:3]]


def test_admission_waits_for_free_blocks_and_nothing_leaks(weight_cache):
    engine = make_engine(max_cache_len=160)  # a pool of 10 blocks of 16 positions
    scheduler = Scheduler(engine, max_num_seqs=8, record_timeline=True)
    prompt = list(range(5000, 5040))  # 40 + 40 - 1 positions: 5 blocks at worst, so two fit at once
    seqs = [scheduler.add([t + 100 * i for t in prompt], 40, ignore_eos=True) for i in range(3)]
    scheduler.run_until_done()
    assert engine.pool.num_blocks == 10
    assert max(len(step.cache_lens) for step in scheduler.timeline) == 2
    assert all(len(s.output_ids) == 40 for s in seqs)
    assert engine.pool.used_blocks == 0


def test_max_num_seqs_caps_the_batch(weight_cache):
    scheduler = Scheduler(make_engine(), max_num_seqs=2, record_timeline=True)
    for p in PROMPTS:
        scheduler.add(p, 5, ignore_eos=True)
    scheduler.run_until_done()
    assert max(len(step.seq_ids) for step in scheduler.timeline) == 2


def test_an_aborted_sequence_leaves_at_the_next_step_and_frees_its_blocks(weight_cache):
    engine = make_engine()
    scheduler = Scheduler(engine, max_num_seqs=8)
    keep, drop = scheduler.add(PROMPTS[1], 20, ignore_eos=True), scheduler.add(PROMPTS[4], 20, ignore_eos=True)
    for _ in range(4):
        scheduler.step()
    scheduler.abort(drop)
    scheduler.step()
    assert drop.finish_reason == "abort" and drop not in scheduler.running
    assert engine.pool.used_blocks == keep.cache.num_blocks
    scheduler.run_until_done()
    assert keep.output_ids == engine.generate(PROMPTS[1], 20, ignore_eos=True).output_ids
    assert engine.pool.used_blocks == 0


def test_a_bad_request_is_refused_when_added(weight_cache):
    scheduler = Scheduler(make_engine(), max_num_seqs=8)
    with pytest.raises(ValueError, match="max_position_embeddings is 256"):
        scheduler.add(list(range(200)), 100)
    assert not scheduler.has_work


@pytest.mark.parametrize("out_features", [1024, 4096])  # k_proj's and q_proj's shapes below
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, "fbgemm"])
def test_a_row_computes_the_same_alone_as_in_a_batch(dtype, out_features):
    # at real widths a CPU's kernel for one row may round differently from the one for several rows (FBGEMM's
    # float16 kernel does for 1, 2, 7 and 14 of 16 rows on an AMD EPYC Zen 3; bfloat16 does for 4096 output rows and
    # not for 256 on a Zen 5); inside a batched step kvbook.kernels pads rows to the multiple it checked for the
    # kernel on the model's shapes, so a decode step does not depend on the batch
    kernel = "torch"
    if dtype == "fbgemm":
        if not fbgemm_available(torch.device("cpu")):
            pytest.skip("torch built without FBGEMM (not an x86 CPU)")
        kernel, dtype = "fbgemm", torch.float32
    torch.manual_seed(0)
    layer = Linear(4096, out_features, dtype=torch.float16)
    layer.weight.data = (torch.randn(out_features, 4096) * 0.02).half()
    layers = fast_layers(torch.nn.Sequential(layer))
    if kernel == "fbgemm":
        pack_layers(layers)
    else:
        layer.copies[dtype] = layer.weight.to(dtype)
    x = torch.randn(8, 1, 4096).to(dtype)  # [B, 1, hidden]: one decode position per sequence
    cfg = small_config(hidden=4096, heads=32, head_dim=128, kv_heads=8).replace(model={"intermediate_size": 4096})
    phase = Phase(dtype, kernel)
    kernels = Kernels(phase, phase, phase, torch.device("cpu"))
    kernels.batch_row_multiple, _ = invariant_row_multiple(cfg.model, phase, torch.device("cpu"), 8)
    with kernels.batched_step():
        batched = layer(x)
        assert all(torch.equal(batched[b:b + 1], layer(x[b:b + 1])) for b in range(8))
        assert all(torch.equal(batched[:b], layer(x[:b])) for b in range(1, 8))


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_interleaves_decode_steps_and_gives_the_same_tokens(weight_cache, layout, chunk):
    engine = make_engine(layout=layout)
    scheduler = Scheduler(engine, max_num_seqs=8, record_timeline=True, prefill_chunk=chunk)
    running = scheduler.add(PROMPTS[0], 60, ignore_eos=True)  # still decoding when the long prompt is done
    for _ in range(3):  # its own prefill chunks and first decode steps
        scheduler.step()
    long = scheduler.add(PROMPTS[4], 6, ignore_eos=True)  # 40 prompt positions, in chunks
    scheduler.run_until_done()
    chunks = -(-len(PROMPTS[4]) // chunk)
    passes = [s for s in scheduler.timeline if long.seq_id in s.seq_ids]
    assert [s.phase for s in passes[:chunks]] == ["prefill"] * chunks and passes[chunks].phase == "decode"
    assert [s.cache_lens[long.seq_id] for s in passes[:chunks]] == \
        [min(len(PROMPTS[4]), chunk * (i + 1)) for i in range(chunks)]
    between = scheduler.timeline[passes[0].index:passes[chunks - 1].index + 1]
    assert all(s.phase == "decode" for s in between[1::2]) and len(between) == 2 * chunks - 1  # chunk, step, chunk
    assert long.steps[0].positions_computed == len(PROMPTS[4])
    assert long.steps[0].ms == pytest.approx(sum(s.ms for s in passes[:chunks]))
    assert long.output_ids == engine.generate(PROMPTS[4], 6, ignore_eos=True).output_ids
    assert running.output_ids == engine.generate(PROMPTS[0], 60, ignore_eos=True).output_ids


def test_chunked_prefill_after_a_prefix_cache_hit(weight_cache):
    engine = make_engine(prefix_caching=True)
    first = Scheduler(engine, max_num_seqs=8)
    first.add(PROMPTS[4], 2, ignore_eos=True)
    first.run_until_done()
    scheduler = Scheduler(engine, max_num_seqs=8, record_timeline=True, prefill_chunk=5)
    prompt = PROMPTS[4][:32] + list(range(600, 611))  # 2 cached blocks, then 11 new positions: 3 chunks
    seq = scheduler.add(prompt, 4, ignore_eos=True)
    scheduler.run_until_done()
    assert seq.cached_positions == 32 and seq.steps[0].positions_computed == 11
    assert [s.cache_lens[0] for s in scheduler.timeline if s.phase == "prefill"] == [37, 42, 43]
    assert seq.output_ids == make_engine().generate(prompt, 4, ignore_eos=True).output_ids
