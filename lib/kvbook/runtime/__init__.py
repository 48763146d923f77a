"""Running requests: the engine and its model runner (engine.py), the continuous-batching scheduler (scheduler.py),
one Sequence per request (sequence.py), sampling, CUDA graphs, and each phase's measured arithmetic (paths.py)."""
