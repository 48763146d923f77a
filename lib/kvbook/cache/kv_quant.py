"""A quantized KV cache ([kv_cache] cache_dtype = "int8" or "float8_e4m3fn"). Explained in chapter 12.

Each position's K (and V) of each head, head_dim numbers, shares one float16 scale (max |x| / 127 for
int8, / 448 for float8 e4m3), so a position costs head_dim + 2 bytes per head instead of 2 x head_dim. Attention
reads the cache dequantized to float32, where its products run anyway
(kvbook.model.attention).
"""

from __future__ import annotations

import torch

from ..config import QuantizationError

KV_STORAGE = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
KV_MAX = {"int8": 127.0, "float8_e4m3fn": torch.finfo(torch.float8_e4m3fn).max}  # 127, 448
KV_SCALE_DTYPE = torch.float16


def is_quantized_cache(cache_dtype: str) -> bool:
    return cache_dtype in KV_STORAGE


def quantize_kv(x: torch.Tensor, cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in the cache's storage dtype, scale [..., 1] float16): one scale per
    position and head."""
    top = KV_MAX[cache_dtype]
    amax = x.float().abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = (amax / top).to(KV_SCALE_DTYPE).clamp(min=torch.finfo(KV_SCALE_DTYPE).smallest_normal * 2**-10)
    scaled = x.float() / scale.float()
    if cache_dtype == "int8":
        return scaled.round_().clamp_(-top, top).to(torch.int8), scale
    return scaled.clamp_(-top, top).to(KV_STORAGE[cache_dtype]), scale


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """-> float32 [..., D]: attention's products run in float32."""
    return values.float() * scale.float()


def check_cache_dtype(cache_dtype: str, device: torch.device) -> None:
    """Quantize and dequantize a few numbers on the device: one that cannot store cache_dtype fails here."""
    if not is_quantized_cache(cache_dtype):
        return
    try:
        dequantize_kv(*quantize_kv(torch.ones(2, 4, device=device), cache_dtype))
    except (RuntimeError, NotImplementedError, TypeError) as err:
        raise QuantizationError(f"[kv_cache] cache_dtype = {cache_dtype!r} does not run on {device} "
                                f"({str(err).splitlines()[0]}); use \"int8\" or \"float16\"") from None
