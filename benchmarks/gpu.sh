#!/usr/bin/env bash
# Everything a session lent a GPU runs, in ONE device call, in under 8 minutes on one H100 or
# H200 (jax with CUDA as installed there):
#   1. installs the carried wheels (.whl/: what the image lacks) into /tmp/site;
#   2. prints nvidia-smi and the versions;
#   3. benchmarks/bench_gpu.py: Flashbax, ours (default), ours (EQX_ON_ERROR=off), one process
#      each, in this order, alone on the GPU -> $OUT/gpu.json, $OUT/bench_gpu.log;
#   4. then, side by side: the fast test suite on the GPU (-m "not slow", 8 workers) with the
#      time left -> $OUT/tests.log, and benchmarks/bench_programs.py compiled for the GPU
#      (host callbacks and conditionals per program, EQX_ON_ERROR unset and off, at once)
#      -> $OUT/programs_gpu_default.json, $OUT/programs_gpu_off.json.
#
# Before the call, on the CPU machine, from the project root (see benchmarks/README.md):
#   bash ../shared/gpu/wheels.sh        # the missing wheels into .whl/ (ignored by git)
# The device call: command `bash benchmarks/gpu.sh`, carry [".whl"], timeout_s 500.
# Then copy $OUT/gpu.json to benchmarks/results/gpu.json and commit it with the card's name.
#
# Knobs (environment): SITE (where the wheels go, /tmp/site), BUDGET_S (whole script, default 450 s), SIDE_S (one side of the
# benchmark, default 120 s), BENCH_ARGS (e.g. --quick, for a dry run on a CPU), WORKERS (8),
# TESTS (the test paths, default tests).
set -u
OUT=${OUT:-/tmp/gpu-out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-450} - ($(date +%s) - start) )); }

if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl > "$OUT/pip.log" 2>&1 || echo "pip install failed: see pip.log"
else
  echo "no wheels in .whl/ (run ../shared/gpu/wheels.sh and carry .whl): using what is installed"
fi
export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  python3 -c "
import importlib.metadata as m, jax
print('jax', jax.__version__, jax.devices())
print({p: m.version(p) for p in ('jaxlib', 'equinox', 'flashbax', 'optax', 'zarr', 'beartype')})"
} 2>&1 | tee "$OUT/versions.txt"

echo "== bench_gpu ($(left) s left)"
timeout -k 5 $(( $(left) - 60 )) python3 -m benchmarks.bench_gpu --side-timeout "${SIDE_S:-120}" \
  --json "$OUT/gpu.json" ${BENCH_ARGS:-} 2>&1 | grep -v -i "warn" > "$OUT/bench_gpu.log"
echo "bench_gpu rc=${PIPESTATUS[0]}"
sed -n '/^per op in one jitted scan/,$p' "$OUT/bench_gpu.log"

s=$(date +%s)
tests_s=$(( $(left) - 10 ))
echo "== tests and bench_programs (${tests_s} s left for them)"
for mode in default off; do  # one process per mode, at once (each compiles 71 programs)
  timeout -k 5 "$tests_s" python3 -m benchmarks.bench_programs --modes "$mode" \
    --json "$OUT/programs_gpu_$mode.json" > "$OUT/programs_gpu_$mode.log" 2>&1 &
done
timeout -k 5 "$tests_s" python3 -m pytest -m "not slow" -v -n "${WORKERS:-8}" -p no:cacheprovider \
  -p no:benchmark --ignore tests/test_archive_s3.py --ignore tests/test_notebooks.py \
  ${TESTS:-tests} > "$OUT/tests.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - s )) s (124: stopped by the timeout)"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-200 | head -20
tail -n 1 "$OUT/tests.log"
wait
for mode in default off; do
  if [ -f "$OUT/programs_gpu_$mode.json" ]; then
    grep -A 3 "^summary" "$OUT/programs_gpu_$mode.log" | tail -n +2
  else
    echo "bench_programs $mode: no result (stopped by the timeout?); see programs_gpu_$mode.log"
  fi
done
echo "== done in $(( $(date +%s) - start )) s; in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
