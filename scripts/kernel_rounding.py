"""Which CPU kernels round differently under other settings: prints a hash of the result of each op the model
uses (float16/bfloat16/float32 products of 1 and 256 rows, softmax, RMSNorm). Run it plain and under a setting:

    .venv/bin/python scripts/kernel_rounding.py
    ATEN_CPU_CAPABILITY=default .venv/bin/python scripts/kernel_rounding.py

A hash that changes means that setting makes torch take another kernel for that op (the Makefile's
OTHER_KERNELS, used to run the token-printing chapters as another CPU would).
"""

import hashlib
import os

import torch
from torch.nn import functional as F


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.float().contiguous().numpy().tobytes()).hexdigest()[:8]


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 4096, generator=generator) * 0.02  # [out, in]
    x = torch.randn(256, 4096, generator=generator)  # [T, in]
    results = {
        "float16, 1 row": F.linear(x[:1].half(), weight.half()),
        "float16, 256 rows": F.linear(x.half(), weight.half()),
        "bfloat16, 1 row": F.linear(x[:1].bfloat16(), weight.bfloat16()),
        "bfloat16, 256 rows": F.linear(x.bfloat16(), weight.bfloat16()),
        "float32, 1 row": F.linear(x[:1], weight),
        "float32, 256 rows": F.linear(x, weight),
        "softmax": torch.softmax(x @ x[:64].T, dim=-1),
        "RMSNorm": x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    }
    settings = {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {settings}")
    for name, result in results.items():
        print(f"  {name:20s} {digest(result)}")


if __name__ == "__main__":
    main()
