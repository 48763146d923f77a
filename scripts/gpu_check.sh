#!/usr/bin/env bash
# The device check, for a machine with an NVIDIA GPU, most important first: the captured CUDA graph against the
# ordinary decode step, the bench against transformers (and without CUDA graphs), every chapter under nbval, the
# engine's trace, the batch sweep and 8 concurrent requests through the server, all on cuda. Each step has its own
# time limit (STEP_LIMIT seconds, default 300) and prints its exit status and duration; results go to $OUT
# (default gpu_results/). Record them in BENCHMARKS.md. Run from a checkout with .venv set up (make venv), or
# with a python that has requirements.txt: PY=python scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
PY=${PY:-.venv/bin/python}
STEP_LIMIT=${STEP_LIMIT:-300}
mkdir -p "$OUT"

step() {  # step NAME OUTPUT-FILE COMMAND...: stdout to OUTPUT-FILE, stderr to NAME.err
  local name=$1 output=$2 started=$SECONDS
  shift 2
  timeout "$STEP_LIMIT" "$@" > "$OUT/$output" 2> "$OUT/$name.err"
  echo "$name: exit $? in $((SECONDS - started)) s"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
"$PY" -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name())" \
  > "$OUT/torch.txt" 2>&1
step graph_test graph_test.txt "$PY" -m pytest -q -p no:cacheprovider tests/test_full_size.py -k fixed_shape
step bench bench.json "$PY" -m kvbook bench --against transformers --json
step bench_eager bench_eager.json "$PY" -m kvbook bench --no-cold --set inference.cuda_graphs=false --json
step nbval nbval.txt "$PY" -m pytest -q -p no:cacheprovider --nbval chapters --nbval-sanitize-with tests/nbval_sanitize.cfg
tail -3 "$OUT/nbval.txt"
step trace trace.json "$PY" -m kvbook trace --json
step batch_sweep batch_sweep.json "$PY" -m kvbook bench --batch-sweep 1,2,4,8,16,32 --steps 8 --json
step concurrency concurrency.json "$PY" -m kvbook bench --concurrency 8 --max-tokens 64 --json
