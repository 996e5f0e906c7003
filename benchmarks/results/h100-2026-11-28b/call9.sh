#!/usr/bin/env bash
# Call 9 (issue 18): the SM90a prefill kernel's raw-code ring at 6 and 7 stages (copies 5 and 6
# steps ahead; FP8 S freed 32 KB per CTA: 150 KB with 5 stages) against the default 5: the prefill
# reference tests under each variant, then FP4 and K8V4 rows (32/8/128) of the three builds in
# two rounds, order rotated. (The eighth session's ncu put 15 % of the producers' stall samples on
# their own copies' wait.) Carry .prebuilt.
set -uo pipefail
source benchmarks/device_env.sh
T0=$SECONDS
phase() { echo "[call9 +$((SECONDS - T0)) s] $*"; }
for v in st6:-DTQ_PREFILL_STAGES=6 st7:-DTQ_PREFILL_STAGES=7; do
  TURBOQUANT_CUDA_EXTRA_FLAGS="${v#*:}" TESTS="prefill_kernel_matches_reference or structured_keys" TEST_TIMEOUT=100 \
    gpu_tests "gpu_tests_${v%%:*}" > /dev/null
  echo "${v%%:*}: $(tail -1 "$OUT/gpu_tests_${v%%:*}.log")"
done
phase tests done
B=$(mktemp -d)
MT="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --configs default,k8v4 --multi-token ${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k}"
BUILDS=("st5 " "st6 -DTQ_PREFILL_STAGES=6" "st7 -DTQ_PREFILL_STAGES=7")
for ((r = 0; r < 2; r++)); do
  for ((i = 0; i < 3; i++)); do
    read -r label fl <<< "${BUILDS[(i + r) % 3]}"
    # shellcheck disable=SC2086
    TURBOQUANT_CUDA_EXTRA_FLAGS="$fl" timeout 100 python -m turboquant bench $MT --out "$B/${label}_r$r" \
      > "$OUT/pf_${label}_r$r.log" 2>&1
    phase "round $r $label"
    grep -E "^ *32/8/128 " "$OUT/pf_${label}_r$r.log" | sort -u | awk '{print $2, $3, $4, $5, $6, $NF}'
  done
done
