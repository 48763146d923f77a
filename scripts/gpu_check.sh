#!/usr/bin/env bash
# The device check, for a machine with an NVIDIA GPU, most important first: the captured CUDA graph against the
# ordinary decode step, the bench against transformers (and without CUDA graphs), every chapter under nbval, the
# engine's trace, the batch sweep and 8 concurrent requests through the server, all on cuda. Each step has its own
# time limit in seconds (below; STEP_LIMIT=N sets every one to N) and prints its exit status and duration; results
# go to $OUT (default gpu_results/). Record them in BENCHMARKS.md. Run from a checkout with .venv set up (make venv),
# or with a python that has requirements.txt: PY=python scripts/gpu_check.sh. Exits 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
failed=()

step() {  # step NAME LIMIT OUTPUT-FILE COMMAND...: stdout to OUTPUT-FILE, stderr to NAME.err
  local name=$1 limit=${STEP_LIMIT:-$2} output=$3 started=$SECONDS status
  shift 3
  # SIGINT first, so that pytest tears down the Jupyter kernels it started (they run in sessions of their own,
  # out of reach of a signal to this step), then SIGKILL 30 s later if the step is still running
  timeout --signal=INT --kill-after=30 "$limit" "$@" > "$OUT/$output" 2> "$OUT/$name.err"
  status=$?
  echo "$name: exit $status in $((SECONDS - started)) s"
  [ "$status" -eq 0 ] || failed+=("$name")
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# A venv made on a CPU machine holds torch's CPU build, which pip counts as torch==2.13.0: every step would then
# run on the CPU and time out. Stop here instead.
if ! "$PY" -c "import torch; assert torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name())" \
    > "$OUT/torch.txt" 2>&1; then
  echo "gpu_check: torch in $PY sees no CUDA device ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1));" \
    "install torch==2.13.0 from PyTorch's CUDA wheel index into that environment and run again" >&2
  exit 1
fi
step graph_test 300 graph_test.txt "$PY" -m pytest -q -p no:cacheprovider tests/test_full_size.py -k fixed_shape
step bench 900 bench.json "$PY" -m kvbook bench --against transformers --json
step bench_eager 300 bench_eager.json "$PY" -m kvbook bench --no-cold --set inference.cuda_graphs=false --json
step nbval 1800 nbval.txt "$PY" -m pytest -q -p no:cacheprovider --nbval chapters \
  --nbval-sanitize-with tests/nbval_sanitize.cfg
tail -3 "$OUT/nbval.txt"
step trace 300 trace.json "$PY" -m kvbook trace --json
step batch_sweep 600 batch_sweep.json "$PY" -m kvbook bench --batch-sweep 1,2,4,8,16,32 --steps 8 --json
step concurrency 600 concurrency.json "$PY" -m kvbook bench --concurrency 8 --max-tokens 64 --json
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: failed: ${failed[*]} (their .err files in $OUT say why)" >&2
  exit 1
fi
