#!/usr/bin/env bash
# The device check, for a machine with an NVIDIA GPU: the engine's trace, the bench against transformers (and
# without CUDA graphs), the captured graph against the ordinary decode step, the batch sweep, 8 concurrent
# requests through the server, and every chapter under nbval, all on cuda. Results go to $OUT (default
# gpu_results/); record them in BENCHMARKS.md. Run from a checkout with .venv set up (make venv), or with a
# python that has requirements.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
"$PY" -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name())" \
  > "$OUT/torch.txt" 2>&1
"$PY" -m kvbook trace --json > "$OUT/trace.json" 2> "$OUT/trace.err"; echo "trace: $?"
"$PY" -m kvbook bench --against transformers --json > "$OUT/bench.json" 2> "$OUT/bench.err"; echo "bench: $?"
"$PY" -m kvbook bench --no-cold --set inference.cuda_graphs=false --json > "$OUT/bench_eager.json" \
  2> "$OUT/bench_eager.err"; echo "bench without CUDA graphs: $?"
"$PY" -m pytest -q -p no:cacheprovider tests/test_full_size.py -k fixed_shape > "$OUT/graph_test.txt" 2>&1
echo "CUDA graph against the ordinary step: $?"
"$PY" -m kvbook bench --batch-sweep 1,2,4,8,16,32 --steps 8 --json > "$OUT/batch_sweep.json" \
  2> "$OUT/batch_sweep.err"; echo "batch sweep: $?"
"$PY" -m kvbook bench --concurrency 8 --max-tokens 64 --json > "$OUT/concurrency.json" 2> "$OUT/concurrency.err"
echo "concurrency: $?"
cat tests/nbval_sanitize.cfg tests/nbval_sanitize_gpu.cfg > "$OUT/sanitize.cfg"
"$PY" -m pytest -q -p no:cacheprovider --nbval chapters --nbval-sanitize-with "$OUT/sanitize.cfg" \
  > "$OUT/nbval.txt" 2>&1; echo "nbval: $?"
tail -3 "$OUT/nbval.txt"
