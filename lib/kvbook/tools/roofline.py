"""A roofline of every op, for prefill and for one decode step: FLOPs and bytes moved computed from shapes and
dtypes, time measured per module (synchronized), achieved FLOP/s and bytes/s, against this machine's measured
peaks. `python -m kvbook bench --roofline --json` prints it; chapter 8 ("Latency") reads the same numbers.

Counting rules (one multiply-add = 2 FLOPs; bytes = what must cross the memory bus at least once):
  linear     2·T·in·out FLOPs;  in·out weight bytes + T·(in + out) activation bytes
  attention  4·H·T·S·d FLOPs (scores and weighted sum);  K and V of S positions read + scores written and read
  norm, act  a few FLOPs per element;  their inputs and outputs once
"""

from __future__ import annotations

import time

import torch

from ..config import Config, ModelConfig
from ..device import synchronize
from ..kernels import Phase
from ..model.weights import matrix_shapes
from ..runtime.engine import Engine
from ..tokenizer import build_prompt_ids
from .measure import time_linear

TIMED = ("input_layernorm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "rope", "o_proj",
         "post_attention_layernorm", "gate_proj", "up_proj", "down_proj", "self_attn", "mlp")


class ModuleTimer:
    """Forward pre/post hooks that time chosen modules, synchronizing the device around each."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device, self.ms, self.handles = device, {}, []
        for name, module in model.named_modules():
            if name.split(".")[-1] in TIMED or name in ("model.embed_tokens", "model.norm", "lm_head"):
                self.handles.append(module.register_forward_pre_hook(self._start))
                self.handles.append(module.register_forward_hook(self._stop(name)))
        self._started = {}

    def _start(self, module, args):
        synchronize(self.device)
        self._started[id(module)] = time.perf_counter()

    def _stop(self, name):
        def hook(module, args, output):
            synchronize(self.device)
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - self._started.pop(id(module))) * 1e3
        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


def prefill_flops(m: ModelConfig, t: int, computed: bool = False) -> int:
    """FLOPs of prefill's matrix products for t prompt positions, from the shapes: every layer matrix on t rows,
    attention's two products over the t x t square (as computed, masked), lm_head on the last position only. (Norms,
    RoPE and SwiGLU's few FLOPs per element are left out: well under 0.1%.) This is the compute floor's count.
    computed: what the engine computes, which is less: the last layer's K and V on t rows, its queries, attention
    and the matrices after it on the last row only (kvbook.model.qwen3)."""
    shapes = matrix_shapes(m)
    layer = {name.split(".")[-2]: out * width for name, (out, width) in shapes.items()
             if name.startswith("model.layers.0.")}  # one layer's parameters per matrix: q_proj, ..., down_proj
    attention = 4 * m.num_attention_heads * t * t * m.head_dim
    lm_head = 2 * shapes["lm_head.weight"][0] * shapes["lm_head.weight"][1]
    total = m.num_hidden_layers * (2 * t * sum(layer.values()) + attention) + lm_head
    if not computed:
        return total
    after_kv = sum(layer.values()) - layer["k_proj"] - layer["v_proj"]  # q_proj, o_proj and the MLP
    return total - 2 * (t - 1) * after_kv - 4 * m.num_attention_heads * (t - 1) * t * m.head_dim


def _linear(op, layer, t, module, act_dtype, dtype_of_weight):
    """A Linear's row: the bytes of the weight (or copy) the phase's dtype reads."""
    weight = getattr(module, "copies", {}).get(dtype_of_weight)  # prefill's copy (kvbook.kernels)
    act_bytes = torch.finfo(act_dtype).bits // 8
    if weight is None and hasattr(module, "qweight"):  # an int8 layer (kvbook.model.quant)
        weight_bytes = module.weight_bytes
    else:
        weight = module.weight if weight is None else weight
        weight_bytes = weight.numel() * weight.element_size()
    activations = t * (module.in_features + module.out_features) * act_bytes
    return {"op": op, "layer": layer, "flops": 2 * t * module.in_features * module.out_features,
            "bytes": weight_bytes + activations}


def op_costs(engine: Engine, t: int, s: int, act_dtype: torch.dtype, prefill: bool) -> list[dict]:
    """FLOPs and bytes of every op for T new positions attending to S positions, the matrices read in act_dtype
    (the phase's, kvbook.kernels) and lm_head's one row in the decode path's dtype. In prefill the last
    layer computes K and V for the T positions and the rest for the last one only (kvbook.model.qwen3)."""
    m, model = engine.config.model, engine.model
    a = torch.finfo(act_dtype).bits // 8
    d = act_dtype
    cache_bytes = torch.finfo(engine.dtype).bits // 8
    rows = [{"op": "embedding", "layer": None, "flops": 0, "bytes": 2 * t * m.hidden_size * a}]

    def norm(n):  # an RMSNorm over n positions
        return {"flops": 4 * n * m.hidden_size, "bytes": 2 * n * m.hidden_size * a}

    last = len(model.model.layers) - 1
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q = 1 if prefill and i == last else t  # positions that go on past K and V
        rows.append({"op": "input_layernorm", "layer": i, **norm(t)})
        rows.append(_linear("q_proj", i, q, attn.q_proj, d, d))
        rows += [_linear(name, i, t, getattr(attn, name), d, d) for name in ("k_proj", "v_proj")]
        heads = q * m.num_attention_heads + t * m.num_key_value_heads  # heads normed and rotated
        rows.append({"op": "qk_norm + rope", "layer": i, "flops": 10 * heads * m.head_dim,
                     "bytes": 4 * heads * m.head_dim * a})
        rows.append({"op": "attention", "layer": i,
                     "flops": 4 * m.num_attention_heads * q * s * m.head_dim,
                     "bytes": 2 * s * m.num_key_value_heads * m.head_dim * cache_bytes  # K and V read
                     + 2 * m.num_attention_heads * q * s * 4  # float32 scores written, then read
                     + 2 * q * m.num_attention_heads * m.head_dim * a})
        rows.append(_linear("o_proj", i, q, attn.o_proj, d, d))
        rows.append({"op": "post_attention_layernorm", "layer": i, **norm(q)})
        rows += [_linear(name, i, q, getattr(mlp, name), d, d) for name in ("gate_proj", "up_proj")]
        rows.append({"op": "silu * up", "layer": i, "flops": 5 * q * m.intermediate_size,
                     "bytes": 3 * q * m.intermediate_size * a})
        rows.append(_linear("down_proj", i, q, mlp.down_proj, d, d))
    rows.append({"op": "final norm", "layer": None, **norm(1)})
    rows.append(_linear("lm_head", None, 1, model.lm_head, engine.decode_dtype, engine.decode_dtype))  # one row
    return rows


def _measured_ms(timer: ModuleTimer, row: dict) -> float:
    layer = f"model.layers.{row['layer']}." if row["layer"] is not None else ""
    ms = timer.ms
    if row["op"] == "embedding":
        return ms["model.embed_tokens"]
    if row["op"] == "final norm":
        return ms["model.norm"]
    if row["op"] == "lm_head":
        return ms["lm_head"]
    if row["op"] in ("input_layernorm", "post_attention_layernorm"):
        return ms[layer + row["op"]]
    if row["op"].endswith("_proj"):
        part = "self_attn." if row["op"] in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp."
        return ms[layer + part + row["op"]]
    if row["op"] == "qk_norm + rope":
        return sum(ms[layer + "self_attn." + p] for p in ("q_norm", "k_norm", "rope"))
    if row["op"] == "attention":  # what the attention block spends outside its projections, norms and RoPE
        inside = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rope")
        return ms[layer + "self_attn"] - sum(ms[layer + "self_attn." + p] for p in inside)
    if row["op"] == "silu * up":
        return ms[layer + "mlp"] - sum(ms[layer + "mlp." + p] for p in ("gate_proj", "up_proj", "down_proj"))
    raise KeyError(row["op"])


def peak_compute_gflops(engine: Engine, repeats: int = 5, path: Phase | None = None) -> float:
    """Best FLOP/s of a 256 x 4096 x 11008 matrix product (one gate_proj of prefill) on the engine's device, in the
    arithmetic of one of its phases: prefill's by default; a batched decode step's may be FBGEMM's kernel
    (chapter 11 takes the best of the two)."""
    path = path or engine.kernels.prefill
    seconds = time_linear(256, 11008, 4096, path.dtype, engine.device, repeats, kernel=path.kernel)
    return 2 * 256 * 4096 * 11008 / seconds / 1e9


@torch.inference_mode()
def roofline(engine: Engine, prompt_len: int | None = None, repeats: int = 3) -> dict:
    """Per-op table for prefill (prompt_len positions) and one decode step after it (medians of repeats)."""
    config: Config = engine.config
    prompt_len = prompt_len or config.inference.input_len
    ids = torch.tensor([build_prompt_ids(prompt_len)], device=engine.device)
    positions = torch.arange(prompt_len, device=engine.device)
    phases = {}
    for phase in ("prefill", "decode"):
        runs = []
        for _ in range(repeats + 1):  # the first is a warm-up
            cache = engine.new_cache()
            if phase == "decode":  # the cache a decode step reads: the prompt, prefilled untimed
                engine.model(ids, positions, cache, compute_dtype=engine.prefill_dtype)
            timer = ModuleTimer(engine.model, engine.device)
            try:
                if phase == "prefill":
                    engine.model(ids, positions, cache, compute_dtype=engine.prefill_dtype)
                else:
                    engine.model(ids[:, -1:], torch.tensor([prompt_len], device=engine.device), cache,
                                 compute_dtype=engine.decode_dtype)
            finally:
                timer.remove()
                if hasattr(cache, "free"):
                    cache.free()
            runs.append(timer)
        prefill = phase == "prefill"
        t, s, dtype = (prompt_len, prompt_len, engine.prefill_dtype) if prefill else \
            (1, prompt_len + 1, engine.decode_dtype)
        rows = op_costs(engine, t, s, dtype, prefill)
        for row in rows:
            ms = sorted(_measured_ms(timer, row) for timer in runs[1:])[len(runs[1:]) // 2]
            row |= {"ms": ms, "intensity": row["flops"] / row["bytes"],
                    "gflops": row["flops"] / ms / 1e6 if ms > 0 else 0.0,
                    "gbps": row["bytes"] / ms / 1e6 if ms > 0 else 0.0}
        phases[phase] = rows
    decode_ms = sum(r["ms"] for r in phases["decode"])
    lm_head = next(r for r in phases["decode"] if r["op"] == "lm_head")
    return {"prefill": phases["prefill"], "decode": phases["decode"], "prompt_len": prompt_len,
            "peak_gflops": peak_compute_gflops(engine), "device": str(engine.device),
            "prefill_dtype": engine.kernels.prefill.label,
            "decode_dtype": engine.kernels.decode.label,
            "lm_head_share_of_decode": lm_head["ms"] / decode_ms,
            "intensity": {phase: sum(r["flops"] for r in rows) / sum(r["bytes"] for r in rows)
                          for phase, rows in phases.items()}}
