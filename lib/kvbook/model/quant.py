"""Reading fewer bytes: int8 weights ([inference] weight_dtype = "int8").

At batch 1 a decode step reads every weight once and does two FLOPs per weight read: no float16 engine gets below
weight bytes / memory bandwidth (chapter 8's roofline). Storing the matrices in int8 halves those bytes.

Weights, per output channel (one row of a [out, in] matrix):
    scale = max(|row|) / 127,  q = round(row / scale) in -127..127,  row ~ q * scale.
Activations stay floating point (weight-only quantization): y = (x @ q.T) * scale, the scale applied once per output.

The kernel is torch's own `torch.ops.aten._weight_int8pack_mm(x, q, scale)` (int8 [out, in], a scale per output
in x's dtype; a CPU and a CUDA implementation ship with torch). torchao (0.18.0, the maintained library for this)
installs without pulling another torch, but on the CPU its Int8WeightOnlyConfig dequantizes the whole weight and
runs a floating matrix product on every call, which reads more bytes, not fewer. The CPU kernel is fast only with
bfloat16 activations (float16 and float32 ones are many times slower), so on the CPU the rows are converted to
bfloat16 for it and the result back to the caller's dtype.

Prefill (more than DECODE_ROWS rows) is a matrix product, where this kernel is not the fast path: it multiplies by
the layer's floating weight, which the layer keeps (kvbook.kernels may give it a faster copy). lm_head is quantized
too (a third of the weights; it runs on one position in prefill as well); the embedding stays in [inference] dtype:
a lookup reads one row per token.
The quantized KV cache's numbers are in kvbook.cache.kv_quant.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from ..config import QuantizationError
from .linear import Linear

INT8_MAX = 127
# a decode step of up to this many sequences reads the int8 weights; more rows (prefill) use the floating path
DECODE_ROWS = 16
# bytes: where the int8 kernel's matrix must start. It crashed (a segmentation fault, not an error) for 2 to 16 rows on
# a matrix mapped from a safetensors file, which starts wherever the file's header ends; the cached matrices are
# copied into torch's own allocations, which are aligned (quantize_model)
KERNEL_ALIGNMENT = 64
# weights quantized at a time: the float32 temporaries of a chunk (4 MiB) stay in a CPU's cache between the
# passes over it
QUANTIZE_CHUNK_WEIGHTS = 2**20


def activation_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype for the int8 kernel: bfloat16 on a CPU (its only fast variant there), else dtype."""
    return torch.bfloat16 if device.type == "cpu" else dtype


def quantize_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype,
                         name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q int8 [out, in], scale [out] in scale_dtype) with q * scale ~ weight.

    The scale is rounded to scale_dtype first and q computed with the rounded scale, so dequantize() is the best
    int8 approximation the stored numbers can give."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise QuantizationError(f"[inference] weight_dtype = \"int8\": {name} is {weight.dtype} "
                                f"{list(weight.shape)}, only 2-D floating matrices can be quantized; use "
                                "weight_dtype = \"auto\" for this checkpoint")
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=scale_dtype, device=weight.device)
    chunk = max(1, QUANTIZE_CHUNK_WEIGHTS // weight.shape[1])
    # one float32 buffer for every chunk: fresh temporaries per chunk took 2-3x the time of the arithmetic
    buffer = torch.empty(min(chunk, weight.shape[0]), weight.shape[1], device=weight.device)  # [chunk, in]
    for start in range(0, weight.shape[0], chunk):
        stop = min(start + chunk, weight.shape[0])
        rows = buffer[:stop - start].copy_(weight[start:stop])  # [chunk, in] float32
        amax = torch.maximum(rows.amax(dim=1), -rows.amin(dim=1))  # [chunk]: max |row|, NaN if the row has one
        if not torch.isfinite(amax).all():
            raise QuantizationError(f"[inference] weight_dtype = \"int8\": {name} holds inf or NaN (row "
                                    f"{start + int((~torch.isfinite(amax)).nonzero()[0])}), which no scale "
                                    "represents; use weight_dtype = \"auto\" for this checkpoint")
        # an all-zero row gets the smallest scale: its q is 0 and dequantizes to 0
        row_scale = (amax / INT8_MAX).to(scale_dtype).clamp(min=torch.finfo(scale_dtype).tiny)
        q[start:stop].copy_(rows.div_(row_scale.float()[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX))
        scale[start:stop] = row_scale
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [out, in] and scale [out] -> the matrix in dtype (computed in float32, rounded once)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


class Int8Linear(nn.Module):
    """A bias-free linear layer with int8 weights and one scale per output channel (weight-only), for a few rows;
    more rows (prefill) multiply by the floating weight it keeps."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, weight: nn.Parameter):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q)  # int8 [out, in]
        self.register_buffer("scale", scale)  # [out], in the kernel's activation dtype
        self.weight = weight  # the floating [out, in] matrix: prefill's

    @classmethod
    def from_linear(cls, linear: Linear, act_dtype: torch.dtype, name: str = "weight") -> Int8Linear:
        q, scale = quantize_per_channel(linear.weight, act_dtype, name)
        return cls(q, scale, linear.weight)

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads: the int8 matrix and its scales."""
        return self.qweight.nbytes + self.scale.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], in x's dtype
        flat = x.reshape(-1, self.in_features)  # [rows, in]
        if flat.shape[0] > DECODE_ROWS:  # prefill: a matrix product on the floating weight
            out = F.linear(flat.to(self.weight.dtype), self.weight)
        else:
            out = int8_matmul(flat.to(self.scale.dtype), self.qweight, self.scale)  # [rows, out]
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def int8_cache_path(model_cfg, dtype: torch.dtype, act_dtype: torch.dtype) -> Path:
    """Where the int8 matrices of the random weights are cached, beside the weights' own file."""
    from .weights import random_weights_path  # kvbook.model.weights imports the model, which imports this module

    path = random_weights_path(model_cfg, dtype)
    return path.with_name(f"{path.stem}.int8-{str(act_dtype).removeprefix('torch.')}.safetensors")


def quantize_model(model: nn.Module, device: torch.device, dtype: torch.dtype, drawn_from=None,
                   writes=None) -> int:
    """Replace every Linear of the decoder layers and lm_head with an Int8Linear, in place -> weight bytes after.

    A model already quantized (shared by another Engine) is left as it is. A tied lm_head (Qwen3's small sizes)
    gets its own int8 copy: the embedding stays floating for the lookup. drawn_from: the ModelConfig of random
    weights (kvbook.model.weights): their int8 matrices are read from the weight cache, or quantized and then written
    there, as the weights themselves are (queued on writes, a weights.CacheWrites, when given)."""
    from .weights import cache_write

    act_dtype = activation_dtype(device, dtype)
    check_int8_kernel(device, act_dtype)
    path = int8_cache_path(drawn_from, dtype, act_dtype) if drawn_from is not None else None
    # copied out of the file's mapping: the kernel needs aligned matrices (KERNEL_ALIGNMENT)
    cached = None
    if path is not None and path.exists():
        cached = {name: tensor.to(device, copy=True) for name, tensor in load_file(str(path)).items()}
    computed = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            if cached is not None:
                q, scale = cached[f"{name}.qweight"], cached[f"{name}.scale"]
            else:
                q, scale = quantize_per_channel(module.weight, act_dtype, f"{name}.weight")
                computed |= {f"{name}.qweight": q, f"{name}.scale": scale}
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, Int8Linear(q, scale, module.weight))
    if path is not None and cached is None and computed:
        cache_write({name: t.cpu() for name, t in computed.items()}, path, False, writes)
    return quantized_weight_bytes(model)


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight a decode step reads: int8 matrices with their scales, and the rest as stored (the
    embedding counts whole, though a step reads only one row of it)."""
    int8 = sum(m.weight_bytes for m in model.modules() if isinstance(m, Int8Linear))
    # an int8 layer's floating weight is prefill's: a decode step never reads it (a tied lm_head's is the embedding's)
    return int8 + sum(p.nbytes for m in model.modules() if not isinstance(m, Int8Linear)
                      for p in m.parameters(recurse=False))


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [B, in] @ (q [out, in] * scale [out]).T -> [B, out] in x's dtype (torch's int8 weight-only kernel)."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


def int8_weight_bytes(model_cfg, float_size: int, scale_size: int = 2, decode: bool = True) -> int:
    """Bytes of the weights with int8 matrices (one scale of scale_size bytes per output channel) and norms in
    the floating dtype. decode=True: what a decode step reads (the embedding contributes one row, counted as
    none); False: what the model keeps (the embedding whole, in the floating dtype; no prefill copies)."""
    from .weights import expected_shapes  # kvbook.model.weights imports the model, which imports this module

    total = 0
    for name, shape in expected_shapes(model_cfg).items():
        if name == "model.embed_tokens.weight":
            total += 0 if decode else shape[0] * shape[1] * float_size
        elif len(shape) == 2:
            total += shape[0] * shape[1] + shape[0] * scale_size
        else:
            total += shape[0] * float_size
    if model_cfg.tie_word_embeddings:  # lm_head: its own int8 copy of the table
        total += model_cfg.vocab_size * (model_cfg.hidden_size + scale_size)
    return total


def check_int8_kernel(device: torch.device, act_dtype: torch.dtype) -> None:
    """Run the int8 kernel once on a tiny matrix: a device without it fails here, naming the key."""
    try:
        x = torch.ones(1, 32, dtype=act_dtype, device=device)
        q = torch.ones(8, 32, dtype=torch.int8, device=device)
        int8_matmul(x, q, torch.ones(8, dtype=act_dtype, device=device))
    except (RuntimeError, NotImplementedError) as err:
        raise QuantizationError(f"[inference] weight_dtype = \"int8\": the int8 kernel does not run on {device} "
                                f"with {act_dtype} activations ({str(err).splitlines()[0]}); use weight_dtype = "
                                "\"auto\"") from None
