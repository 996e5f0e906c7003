#!/usr/bin/env bash
# Call 4 (issue 18): the prefill kernel's S on FP8 tensor cores for FP4 keys at D 64 (gpt-oss's
# head dim; K rows of 128 bytes half used, a conflict-free chunk map for them) against the same
# tree with fp16 S (-DTQ_PREFILL_FP8_S=0): the prefill / sanitizer / K8V4 / states GPU tests,
# the error against the reference at 64/8/64 under both builds, then the 64/8/64 prefill rows
# of both builds in two rounds (FP4 default and K8V4, which keeps fp16 S at D 64). Carry .prebuilt.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call4 +$((SECONDS - T0)) s] $*"; }
TESTS="${TESTS:-prefill or sanitizer or k8v4 or states}" TEST_TIMEOUT=240 gpu_tests gpu_tests_d64
phase tests done
for v in fp8s: fp16s:-DTQ_PREFILL_FP8_S=0; do
  echo "error, ${v%%:*}:"
  TURBOQUANT_CUDA_EXTRA_FLAGS="${v#*:}" timeout 150 python benchmarks/results/h100-2026-11-28b/err_check_d64.py 2>&1 | grep -v Warn
done
phase errors done
B=$(mktemp -d)
MT="--shapes 64/8/64 --no-decode --no-writer --no-sdpa --configs ${CONFIGS:-default,k8v4} --multi-token ${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k}"
BUILDS=("fp8s " "fp16s -DTQ_PREFILL_FP8_S=0")
for ((r = 0; r < 2; r++)); do
  for ((i = 0; i < 2; i++)); do
    read -r label fl <<< "${BUILDS[(i + r) % 2]}"
    # shellcheck disable=SC2086
    TURBOQUANT_CUDA_EXTRA_FLAGS="$fl" timeout 150 python -m turboquant bench $MT --out "$B/${label}_r$r" \
      > "$OUT/pf_${label}_r$r.log" 2>&1
    phase "round $r $label"
    grep -E "^ *64/8/64 " "$OUT/pf_${label}_r$r.log" | sort -u
  done
done
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls pf_*.log gpu_tests_*full.log) && rm -f "$OUT"/pf_*.log "$OUT"/gpu_tests_*full.log
