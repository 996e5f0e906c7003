#!/usr/bin/env bash
# One call on the device machine: GPU tests, the benchmark table (the default config and the
# plain format in the same run), the main job.
#   run: bash benchmarks/device_check.sh   (writes logs and bench files under $OUT or ./out)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1 TURBOQUANT_BUILD_DIR=${TURBOQUANT_BUILD_DIR:-$PWD/.tqbuild}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -m pytest -q -rs tests/gpu 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
python -m turboquant bench --configs default,plain --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
python -m turboquant 2>&1 | tee "$OUT/main.log"
