#!/usr/bin/env bash
# Call 8 (issue 18): the prefill kernel's S as FP8 MMAs (TQ_PREFILL_FP8_S: K tile of E5M2 bytes
# decoded by fp4x8_to_f16hi8 alone, Q as two E4M3 terms; FP4 keys at D 128) against the same tree
# without the flag (HEAD's prefill SASS): the prefill GPU tests and the error against the
# reference under the flag, then both builds timed in two rounds. Carry .prebuilt.
# (Run when FP8 S was behind the flag; since a8c3a2d it is the default and -DTQ_PREFILL_FP8_S=0
# builds the fp16-S kernel.)
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call8 +$((SECONDS - T0)) s] $*"; }
TURBOQUANT_CUDA_EXTRA_FLAGS="-DTQ_PREFILL_FP8_S" TESTS="prefill or sanitizer" TEST_TIMEOUT=200 gpu_tests gpu_tests_fp8s
phase tests done
for v in this: fp8s:-DTQ_PREFILL_FP8_S; do
  echo "error, ${v%%:*}:"
  TURBOQUANT_CUDA_EXTRA_FLAGS="${v#*:}" timeout 200 python benchmarks/results/h100-2026-11-28a/err_check.py 2>&1 | grep -v Warn
done
phase errors done
B=$(mktemp -d)
MT="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --multi-token ${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k}"
BUILDS=("this " "fp8s -DTQ_PREFILL_FP8_S")
for ((r = 0; r < 2; r++)); do
  for ((i = 0; i < 2; i++)); do
    read -r label fl <<< "${BUILDS[(i + r) % 2]}"
    # shellcheck disable=SC2086
    TURBOQUANT_CUDA_EXTRA_FLAGS="$fl" timeout 120 python -m turboquant bench $MT --out "$B/${label}_r$r" \
      > "$OUT/pf_${label}_r$r.log" 2>&1
    phase "round $r $label"
    grep -E "^ *32/8/128 " "$OUT/pf_${label}_r$r.log" | sort -u
  done
done
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls pf_*.log gpu_tests_*full.log) && rm -f "$OUT"/pf_*.log "$OUT"/gpu_tests_*full.log
