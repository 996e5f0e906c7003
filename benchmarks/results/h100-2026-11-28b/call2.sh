#!/usr/bin/env bash
# Call 2 (issue 18): the prefill kernel's S on FP8 tensor cores for K8V4 keys too (E4M3 key bytes
# reordered into the FP8 K tile, no conversion; wgmma_m64n64k32_e4m3_e4m3), against the same tree
# with fp16 S (-DTQ_PREFILL_FP8_S=0, the K8V4 kernel as before): the wgmma layout probe (six
# cases), the prefill / sanitizer / K8V4 GPU tests, the K8V4 error against the reference under
# both builds, then the K8V4 and FP4 prefill rows of both builds in two rounds. Carry .prebuilt.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call2 +$((SECONDS - T0)) s] $*"; }
python -m pytest -q -x -s tests/gpu/test_wgmma_layout.py 2>&1 | grep -E "of [0-9]+ wrong|passed|failed" | tee "$OUT/wgmma_layout.log"
TESTS="${TESTS:-prefill or sanitizer or k8v4}" TEST_TIMEOUT=240 gpu_tests gpu_tests_k8s
phase tests done
for v in fp8s: fp16s:-DTQ_PREFILL_FP8_S=0; do
  echo "error, ${v%%:*}:"
  TURBOQUANT_CUDA_EXTRA_FLAGS="${v#*:}" timeout 150 python benchmarks/results/h100-2026-11-28b/err_check_k8v4.py 2>&1 | grep -v Warn
done
phase errors done
B=$(mktemp -d)
MT="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --configs ${CONFIGS:-k8v4,default} --multi-token ${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k}"
BUILDS=("fp8s " "fp16s -DTQ_PREFILL_FP8_S=0")
for ((r = 0; r < 2; r++)); do
  for ((i = 0; i < 2; i++)); do
    read -r label fl <<< "${BUILDS[(i + r) % 2]}"
    # shellcheck disable=SC2086
    TURBOQUANT_CUDA_EXTRA_FLAGS="$fl" timeout 150 python -m turboquant bench $MT --out "$B/${label}_r$r" \
      > "$OUT/pf_${label}_r$r.log" 2>&1
    phase "round $r $label"
    grep -E "^ *32/8/128 " "$OUT/pf_${label}_r$r.log" | sort -u
  done
done
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls pf_*.log gpu_tests_*full.log) && rm -f "$OUT"/pf_*.log "$OUT"/gpu_tests_*full.log
