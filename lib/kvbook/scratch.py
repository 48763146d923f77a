"""Memory each thread reuses for the large temporaries that every decode step makes again.

A tensor of more than 32 MiB does not come from the heap that kvbook.device.keep_freed_memory keeps: the C
allocator maps it as fresh pages, each faulted in (and zeroed by the kernel) on its first write. Users: attention's
float32 copies of K and V (kvbook.model.attention.float32_copy) and the paged cache's gather through the block table
(kvbook.cache.paged), twice a layer on every step: at thousands of cached positions fresh pages cost a paged decode
step a large share of its time (BENCHMARKS.md). Told in chapter 11 and the appendix
("Making it fast on a CPU").

A tensor from here is valid until the next call for the same slot on the same thread. The memory is kept, per slot
and thread: a quarter more than the largest tensor asked for, since a decode step asks for one position more than
the step before, and memory that grew by exactly that much would be fresh pages again on every step.
"""

from __future__ import annotations

import threading

import torch

_reused = threading.local()  # per thread: one model may serve engines on several threads (a server, a notebook)


def reusable(device: torch.device) -> bool:
    """Whether a temporary on `device` may live in reused memory now: on a CPU (a GPU's allocator caches already),
    outside autograd (which may keep its inputs for a backward pass)."""
    return device.type == "cpu" and not torch.is_grad_enabled()


def empty(shape: list[int] | tuple[int, ...], dtype: torch.dtype, slot: str) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor in the memory this thread keeps for `slot`, grown when too small."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    buffer = getattr(_reused, slot, None)
    if buffer is None or buffer.numel() < nbytes:
        capacity = nbytes if buffer is None else max(nbytes, buffer.numel() * 5 // 4)
        with torch.inference_mode(False):  # a normal tensor: written under inference_mode and under no_grad alike
            buffer = torch.empty(capacity, dtype=torch.uint8)
        setattr(_reused, slot, buffer)
    return buffer[:nbytes].view(dtype).view(shape)
