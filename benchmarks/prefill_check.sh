#!/usr/bin/env bash
# One call on the device machine for issue 18's prefill kernel: its GPU tests (reference
# comparisons on ragged chunks, the structured one-hot probe, NaN / bad-block semantics,
# compute-sanitizer), then the multi-token rows of the benchmark (chunked prefill and
# speculative decoding, TFLOP/s and % of bandwidth, SDPA on dense BF16 in the same run).
#   run: bash benchmarks/prefill_check.sh   (writes under $OUT or ./out; TESTS: the pytest -k
#   expression, CONFIGS: bench --configs, e.g. default,k8v4)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1 TURBOQUANT_BUILD_DIR=${TURBOQUANT_BUILD_DIR:-$PWD/.tqbuild}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -m pytest -q -x -rs tests/gpu/test_cuda_backend.py -k "${TESTS:-prefill or sanitizer or multi_token}" 2>&1 \
  | tail -25 | tee "$OUT/gpu_tests.log"
python -m turboquant bench --no-decode --no-writer --configs "${CONFIGS:-default}" --out "$OUT/bench" \
  --multi-token ${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k,64x4@4k,16x4@16k,64x8@4k,128x2@4k} \
  2>&1 | tee "$OUT/multi.log"
