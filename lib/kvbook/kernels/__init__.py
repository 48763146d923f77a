"""Every kernel choice of the engine, in one place: how each phase multiplies by the weights on this device.

The model (kvbook.model) is plain torch: every product is one F.linear in the weights' dtype. A CPU computes some
of those products much faster another way, and those ways live here. The engine asks once, `choose(config,
device)`, prepares its model with the answer (`Kernels.prepare`) and enters a batched decode step through
`Kernels.batched_step()`. The rules:

- prefill multiplies a copy of the layers' matrices in bfloat16 where the CPU multiplies bfloat16 in hardware
  (AVX512-BF16 or AMX), else in float32, through F.linear or oneDNN's inner product, whichever one short
  timing finds faster (the one thing no rule decides);
- a lone decode step reads every weight once, in the weights' own dtype: no copy reads fewer bytes;
- a batched decode step multiplies float32 rows by the float16 weights packed for FBGEMM, where torch has it
  (x86), with its rows padded so that a sequence's numbers do not depend on its neighbours;
- freed memory stays with the process, large tensors go in huge pages (kvbook.kernels.memory).

On a GPU every phase computes in the weights' dtype. The appendix ("Making it fast on a CPU") shows each choice;
BENCHMARKS.md says what each is worth on which CPU.
"""

from .choice import Kernels, Phase, choose, cpu_flags
from .layers import fbgemm_available, onednn_linear, pack_float16, packed_linear, weight_bytes_kept
from .memory import enable_huge_pages, keep_freed_memory

__all__ = ["Kernels", "Phase", "choose", "cpu_flags", "enable_huge_pages", "fbgemm_available",
           "keep_freed_memory", "onednn_linear", "pack_float16", "packed_linear", "weight_bytes_kept"]
