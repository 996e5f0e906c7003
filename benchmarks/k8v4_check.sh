#!/usr/bin/env bash
# One call on the device machine for the K8V4 key format (issue 17): the GPU tests (every
# cuda test, K8V4 included, and the attention-state tests), then the benchmark with FP4
# (default config) and K8V4 rows side by side in the same run, writer rows included.
#   run: bash benchmarks/k8v4_check.sh   (writes logs and bench files under $OUT or ./out)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1 TURBOQUANT_BUILD_DIR=${TURBOQUANT_BUILD_DIR:-$PWD/.tqbuild}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -m pytest -q -rs tests/gpu tests/test_states.py 2>&1 | grep -v DEBUG | tail -40 | tee "$OUT/gpu_tests.log"
python -m turboquant bench --shapes 32/8/128 --batches 1,16,64 --contexts 4k,16k,32k \
    --configs default,plain,k8v4,k8v4/plain --no-sdpa --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
