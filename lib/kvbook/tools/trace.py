"""A trace of a real run: forward hooks on every module record, per step, each module's input and output
shapes, plus cache lengths and step timings, into pandas DataFrames; optionally the attention weights and
the logits. Nothing is hooked outside a `with Tracer(model):` block, so untraced runs pay nothing.

Used by chapters 3-5 to print the article's shape table from a real run, and by `python -m kvbook trace`.
"""

from __future__ import annotations

import contextlib
import re

import pandas as pd
import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


def _model_class(module) -> str:
    """The model's own class name: kvbook.kernels gives a prepared layer a subclass whose forward picks the kernel,
    and which one it picks depends on the machine."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("kvbook.kernels")).__name__


def _shape(value):
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (tuple, list)):
        return [_shape(v) for v in value if isinstance(v, torch.Tensor)]
    return None


class Tracer:
    """with Tracer(engine.model, record_attention=True) as tracer: engine.generate(ids, tracer=tracer)"""

    def __init__(self, model: torch.nn.Module, record_attention: bool = False, record_logits: bool = False):
        self.model = model
        self.record_attention = record_attention
        self.record_logits = record_logits
        self.module_rows: list[dict] = []
        self.step_rows: list[dict] = []
        self.attention: dict[tuple[int, int], torch.Tensor] = {}  # (step, layer) -> [heads, T, S] float32
        self.logits: dict[int, torch.Tensor] = {}  # step -> [vocab] float32
        self._by_step_module: dict[tuple[int, str], dict] = {}
        self._handles = []
        self._phase, self._step = None, None

    def __enter__(self) -> Tracer:
        for name, module in self.model.named_modules():
            if name:
                self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        match = _LAYER.search(name + ".")
        layer = int(match.group(1)) if match else None

        def record(module, args, output):
            if self._phase is None:  # a forward outside engine steps (e.g. a chapter calling a layer)
                return
            row = {"phase": self._phase, "step": self._step, "module": name, "layer": layer,
                   "kind": _model_class(module), "input_shape": _shape(args[0]) if args else None,
                   "output_shape": _shape(output)}
            self.module_rows.append(row)
            self._by_step_module[(self._step, name)] = row
            if self.record_attention and name.endswith("self_attn.attn_weights"):
                self.attention[(self._step, layer)] = output[0].detach().float().cpu()
            if self.record_logits and name == "lm_head":
                self.logits[self._step] = output[0, -1].detach().float().cpu()

        return record

    @contextlib.contextmanager
    def step(self, phase: str, index: int):
        self._phase, self._step = phase, index
        try:
            yield
        finally:
            self._phase, self._step = None, None

    def add_step(self, step, prompt_len: int) -> None:
        self.step_rows.append({"phase": step.phase, "step": step.index, "token_id": step.token_id,
                               "positions_computed": step.positions_computed, "cache_len": step.cache_len,
                               "ms": step.ms, "prompt_len": prompt_len, "blocks": step.blocks})

    @property
    def modules(self) -> pd.DataFrame:
        """One row per module call: phase, step, module, layer, kind, input_shape, output_shape."""
        return pd.DataFrame(self.module_rows)

    @property
    def steps(self) -> pd.DataFrame:
        """One row per generated token: phase, step, token_id, positions_computed, cache_len, ms."""
        return pd.DataFrame(self.step_rows)

    def shape(self, step: int, module: str, which: str = "output_shape"):
        """The recorded shape of one module at one step, e.g. shape(1, "model.layers.0.self_attn.k_cached")."""
        if (step, module) not in self._by_step_module:
            raise KeyError(f"no record of {module!r} at step {step}")
        return self._by_step_module[(step, module)][which]

    def layer_table(self, step: int = 0, layer: int = 0) -> pd.DataFrame:
        """The article's per-layer shape table for one step, regenerated from the run (QK-norm and RoPE
        included)."""
        rows = [r for r in self.module_rows if r["step"] == step and r["layer"] == layer]
        return pd.DataFrame(rows)[["module", "kind", "input_shape", "output_shape"]].assign(
            module=lambda df: df["module"].str.replace(f"model.layers.{layer}.", "", regex=False))


def checklist(tracer: Tracer, output_ids: list[int]) -> dict:
    """The article's shape checklist from a traced run: what `python -m kvbook trace --json` prints."""
    steps = tracer.step_rows
    layers = sorted({r["layer"] for r in tracer.module_rows if r["layer"] is not None})
    attn = "model.layers.{}.self_attn.{}"

    def at(step, module, which="output_shape"):
        return tracer.shape(step, module, which)

    prefill = {
        "input_ids": [steps[0]["prompt_len"]],
        "embedding": at(0, "model.embed_tokens"),
        "layers": [{"layer": i, "output": at(0, f"model.layers.{i}")} for i in layers],
        "kv_cache": [{"layer": i, "k": at(0, attn.format(i, "k_cached")), "v": at(0, attn.format(i, "v_cached"))}
                     for i in layers],
        "attention_weights": at(0, attn.format(0, "attn_weights")),
        "logits": at(0, "lm_head"),
        "cache_len": steps[0]["cache_len"],
        "first_token": steps[0]["token_id"],
    }
    paged = steps[0]["blocks"] is not None
    if paged:
        prefill["blocks"] = steps[0]["blocks"]
    decode = []
    for row in steps[1:]:
        s = row["step"]
        decode.append({
            "step": s,
            "input": at(s, "model.embed_tokens"),
            "q": at(s, attn.format(0, "q_norm")),
            "k": at(s, attn.format(0, "k_cached")),
            "v": at(s, attn.format(0, "v_cached")),
            "attention_weights": at(s, attn.format(0, "attn_weights")),
            "output": at(s, f"model.layers.{layers[-1]}"),
            "logits": at(s, "lm_head"),
            "cache_len": row["cache_len"],
            "token": row["token_id"],
        } | ({"blocks": row["blocks"]} if paged else {}))
    return {"prefill": prefill, "decode": decode, "output_ids": list(output_ids)}
