"""Where the model runs: "cuda:0" when CUDA is there, else the CPU with one printed notice (never an error),
so the same config.toml runs on a reader's GPU and on a 2-core CI machine."""

from __future__ import annotations

import sys

import torch

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_notified: set[str] = set()


def resolve_device(requested: str) -> torch.device:
    if requested.startswith("cuda") and not torch.cuda.is_available():
        if requested not in _notified:
            _notified.add(requested)
            print(f"kvbook: device {requested!r} requested but CUDA is not available; running on the CPU",
                  file=sys.stderr)
        return torch.device("cpu")
    return torch.device(requested)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer measures the work and not just its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

