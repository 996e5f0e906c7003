#!/usr/bin/env bash
# Call 8 (issue 18): the prefill kernel's one-hot probe at D 64 too (FP4 and K8V4 keys: the FP8-S
# K rows half used, the new chunk maps) with the lse tests, on the final kernels. Carry .prebuilt.
set -uo pipefail
source benchmarks/device_env.sh
TESTS="structured_keys or states_and_k8v4" TEST_TIMEOUT=200 gpu_tests gpu_tests_onehot
