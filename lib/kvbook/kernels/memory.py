"""Two process-wide memory settings that make a CPU engine faster: huge pages and freed memory kept."""

from __future__ import annotations

import ctypes
import os
import platform
import sys

# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on a 64-bit machine
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20
FREE_HEAP_KEPT = 1 * 2**30  # bytes of freed heap the process keeps rather than handing back to the OS


def enable_huge_pages() -> None:
    """Large tensors in transparent huge pages: fewer page faults when the weights are drawn or copied.

    PyTorch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at the process's first CPU tensor allocation, so the
    entry points call this first (kvbook.tools.cli.main, kvbook.tools.book.book_config, tests/conftest.py), and so
    does Engine, for a script whose first tensors are the engine's. A value the user chose is kept. Importing
    kvbook does not call it."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def keep_freed_memory() -> bool:
    """Freed tensors' memory stays with the process for the next tensors (glibc's malloc; elsewhere nothing
    changes, and False is returned).

    By default glibc gives a freed block of more than 128 KiB back to the OS, and the next tensor of that size
    faults its pages in again, zeroed by the kernel. A prefill allocates and frees tens of MB of activations per
    layer, and on a virtual machine each page fault is slow. Here blocks up to 32 MiB come from the heap and up to
    FREE_HEAP_KEPT of its free memory stays mapped; larger tensors (the weights) are mapped as before."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library the interpreter runs on
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                       FREE_HEAP_KEPT))
