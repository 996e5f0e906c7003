#!/usr/bin/env bash
# Call 2 (issue 18): the prefill kernel with two decoded tiles per row-warp step (.P, Q in shared
# memory), the same with one tile (.P1: Q in shared memory only) and HEAD (.), plus timing-only
# probes of HEAD's kernel (TQ_PROBE_NO_SOFTMAX: S packed into P' directly; TQ_PROBE_NO_DECODE:
# the producers copy but do not decode). The prefill GPU tests in .P first. Carry .prebuilt .P .P1.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call2 +$((SECONDS - T0)) s] $*"; }
(cd .P && TESTS="prefill or sanitizer" TEST_TIMEOUT=${TEST_TIMEOUT:-240} gpu_tests gpu_tests_pair)
phase tests done
B=$(mktemp -d)
MT="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --multi-token ${ROWS:-1x512@4k,1x2048@16k,4x2048@16k}"
one() {  # dir label flags
  # shellcheck disable=SC2086
  (cd "$1" && TURBOQUANT_CUDA_EXTRA_FLAGS="$3" timeout "${BENCH_TIMEOUT:-110}" python -m turboquant bench $MT \
    --out "$B/$2" > "$OUT/pf_$2.log" 2>&1)
  phase "$2 done"
  grep -E "^ *32/8/128 " "$OUT/pf_$2.log" | sort -u
}
one .P pair ""
one . head ""
one .P1 ct1 ""
one . nosm "-DTQ_PROBE_NO_SOFTMAX"
one . both "-DTQ_PROBE_NO_SOFTMAX -DTQ_PROBE_NO_DECODE"
one . nodec "-DTQ_PROBE_NO_DECODE"
tar -czf "$OUT/bench.tgz" -C "$B" .
