#!/usr/bin/env bash
# One device call for issue 39 (the shared state, the default config): the cuda backend's GPU
# tests, the shared state's tests (the engine test on the cuda backend, against the reference
# each step), the cost of the shared state's records in a graphed decode call
# (benchmarks/shared_state_cost.py), and the sm120 kernel's emulation tests (SM120_TIMEOUT).
# Carry .prebuilt (benchmarks/prebuild_cuda.py): nothing compiles there.
#   run: bash benchmarks/shared_state_check.sh   (logs under $OUT or ./out)
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "from turboquant._backends import cuda; print('this build:', cuda.ensure_loaded() or 'ok')"
TEST_TIMEOUT=${TEST_TIMEOUT:-300} gpu_tests gpu_tests
timeout 150 python -m pytest -q -rfs tests/test_shared_state.py 2>&1 | tail -8 | tee "$OUT/shared_state_tests.log"
timeout "${COST_TIMEOUT:-200}" python benchmarks/shared_state_cost.py ${COST_ARGS:-} --json "$OUT/cost.json" 2>&1 | tee "$OUT/cost.log"
timeout "${SM120_TIMEOUT:-240}" python -m pytest -q -rfs tests/gpu/test_sm120_emulation.py \
  > "$OUT/sm120_full.log" 2>&1
tail -12 "$OUT/sm120_full.log" | tee "$OUT/sm120.log"
