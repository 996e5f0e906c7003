#!/usr/bin/env bash
# Call 6 (issue 18): compute-sanitizer memcheck and racecheck on the final tree, whose case list
# now holds a D 64 K8V4 prefill call (the new chunk map), with the prefill and K8V4 reference
# tests. Carry .prebuilt.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
TESTS="sanitizer or prefill or k8v4" TEST_TIMEOUT=500 gpu_tests gpu_tests_final
