#!/usr/bin/env bash
# One call on the device machine for speculative decoding through the decode kernel's
# 16-column form (issue 18, item 2). Builds in parallel: this tree, each VARIANTS build
# ("label:flag,flag" words; default: general:-DTQ_SPEC_MAX_COLS=0, where those calls run the
# general kernel as before) and, when AB_TREE names a copy of an earlier tree, that tree. Then
# the cuda GPU tests (TESTS: a pytest -k expression), the multi-token rows (ROWS) of this tree
# and of every variant, and (DECODE=1) the decode rows of this tree and of AB_TREE, all in the
# same run.
#   run: AB_TREE=.ab bash benchmarks/spec_check.sh   (logs under $OUT or ./out, the bench
#   files of every run in $OUT/bench.tgz)
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
VARIANTS=${VARIANTS:-general:-DTQ_SPEC_MAX_COLS=0}
build() {  # flags, tree, label
  (cd "$2" && TURBOQUANT_CUDA_EXTRA_FLAGS="$1" python -c \
    "from turboquant._backends import cuda; print('$3 build:', cuda.ensure_loaded() or 'ok')")
}
build "" . this &
for v in $VARIANTS; do build "$(echo "${v#*:}" | tr , ' ')" . "${v%%:*}" & done
[ -n "${AB_TREE:-}" ] && build "" "$AB_TREE" before &
wait
timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -rs -n 8 tests/gpu/test_cuda_backend.py ${TESTS:+-k "$TESTS"} \
  2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
B=$(mktemp -d)
ROWS=${ROWS:-64x4@4k,16x4@16k,64x8@4k,128x2@4k,128x4@4k,16x8@16k,32x2@16k}
for v in this:"" $VARIANTS; do
  TURBOQUANT_CUDA_EXTRA_FLAGS="$(echo "${v#*:}" | tr , ' ')" python -m turboquant bench --shapes 32/8/128 --no-decode --no-writer \
    --no-sdpa --multi-token "$ROWS" --out "$B/spec_${v%%:*}" 2>&1 | tee "$OUT/spec_${v%%:*}.log"
done
if [ "${DECODE:-1}" = 1 ]; then
  DEC="--shapes 32/8/128 --batches 1,16,64,128 --contexts 4k,16k,32k --no-sdpa --no-writer"
  python -m turboquant bench $DEC --out "$B/decode_this" 2>&1 | tee "$OUT/decode_this.log"
  [ -n "${AB_TREE:-}" ] && (cd "$AB_TREE" && python -m turboquant bench $DEC --out "$B/decode_before" 2>&1 \
    | tee "$OUT/decode_before.log")
fi
tar -czf "$OUT/bench.tgz" -C "$B" .
