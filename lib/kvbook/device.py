"""Where the model runs: "cuda:0" when CUDA is there, else the CPU with one printed notice (never an error),
so the same config.toml runs on a reader's GPU and on a 2-core CI machine."""

from __future__ import annotations

import ctypes
import os
import platform
import sys

import torch

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_notified: set[str] = set()
# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on a 64-bit machine
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20
FREE_HEAP_KEPT = 1 * 2**30  # bytes of freed heap the process keeps rather than handing back to the OS


def enable_huge_pages() -> None:
    """Large tensors in transparent huge pages: drawing the 1.85B random weights is faster (fewer page faults;
    BENCHMARKS.md, "Numbers from code comments").

    PyTorch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at the process's first CPU tensor allocation, so a
    call after that changes nothing. It cannot be set late: the entry points call this first (kvbook.tools.cli.main,
    kvbook.tools.book.book_config, tests/conftest.py), and Engine construction calls it before loading weights, which
    helps a script whose first tensors are the engine's. Kept when the user has chosen a value. `import kvbook` does
    not call it (no side effect at import)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def keep_freed_memory() -> bool:
    """Freed tensors' memory stays with the process for the next tensors (glibc's malloc; elsewhere nothing changes,
    and False is returned).

    By default glibc gives a freed block of more than 128 KiB (a threshold that grows up to 32 MiB as it goes)
    back to the OS, and trims the heap's free top; the next tensor of that size then faults its pages in again,
    zeroed by the kernel. A prefill allocates and frees tens of MB of activations per layer, so a 256-token prefill
    of the article's model took tens of thousands of page faults, and on a virtual machine each costs microseconds:
    its attention took several times longer than with this setting (BENCHMARKS.md). Here
    blocks up to 32 MiB come from the heap and up to FREE_HEAP_KEPT of its free memory stays mapped; larger
    tensors (the weights) are mapped as before. Process-wide, like enable_huge_pages; called by Engine."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library the interpreter runs on
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                       FREE_HEAP_KEPT))


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

