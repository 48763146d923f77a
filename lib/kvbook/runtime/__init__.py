"""Running requests: the engine and its model runner (engine.py), the continuous-batching scheduler (scheduler.py),
one Sequence per request (sequence.py), sampling and CUDA graphs. How each phase multiplies on this device is
kvbook.kernels'."""
