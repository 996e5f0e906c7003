#!/usr/bin/env bash
# Call 5 (issue 18): K8V4 keys at D 64 on FP8 S too (every prefill instantiation now): the whole
# GPU suite on this tree, the K8V4 error at 64/8/64 under both builds, and the 64/8/64 K8V4
# prefill rows of this tree and of -DTQ_PREFILL_FP8_S=0 in two rounds. Carry .prebuilt.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call5 +$((SECONDS - T0)) s] $*"; }
timeout 400 python -m pytest -q -rfs -n 8 tests/gpu tests/test_states.py > "$OUT/gpu_suite_full.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_suite_full.log" | tail -15 | tee "$OUT/gpu_suite.log"
phase suite done
for v in fp8s: fp16s:-DTQ_PREFILL_FP8_S=0; do
  echo "error, ${v%%:*}:"
  TURBOQUANT_CUDA_EXTRA_FLAGS="${v#*:}" timeout 150 python benchmarks/results/h100-2026-11-28b/err_check_d64.py fp8_e4m3 2>&1 | grep -v Warn
done
phase errors done
B=$(mktemp -d)
MT="--shapes 64/8/64 --no-decode --no-writer --no-sdpa --configs k8v4 --multi-token ${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k}"
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
