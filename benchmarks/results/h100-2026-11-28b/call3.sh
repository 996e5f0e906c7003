#!/usr/bin/env bash
# Call 3 (issue 18): the whole GPU suite on the tree of call 2 (K8V4 keys on FP8 S), with the
# lse test's tolerance for the FP8-S prefill kernel derived from Q's two-term E4M3 rounding
# (tests/gpu/test_cuda_backend.py _fp8_s_logit_bound). Carry .prebuilt.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout 540 python -m pytest -q -rfs -n 8 tests/gpu tests/test_states.py > "$OUT/gpu_suite_full.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_suite_full.log" | tail -15 | tee "$OUT/gpu_suite.log"
