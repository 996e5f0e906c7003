#!/usr/bin/env bash
# Device call 1 of 2026-11-27 (fourth): the wgmma probe, the four prefill variants timed against the tree, their prefill tests and synccheck.
set -uo pipefail
source benchmarks/device_env.sh
python -m pytest -q -rfs tests/gpu/test_wgmma_layout.py 2>&1 | tail -4 | tee "$OUT/wgmma_probe.log" &
P=$!
AB_TREES=".s_ahead:s_ahead .s_ahead_nd4:s_ahead_nd4 .s_ahead_mbarrier:s_ahead_mbarrier .s_ahead_mbarrier_nd4:mbarrier_nd4" \
  VARIANTS=" " DECODE=0 TESTS=prefill TEST_TIMEOUT=200 ROWS=1x512@4k,1x2048@16k,1x8192@64k bash benchmarks/spec_check.sh 2>&1 | tee "$OUT/all.log" | grep -E "build|passed|failed|x .*@|TFLOP" | head -60
wait $P
python -c "import sys; sys.path.insert(0, 'tests/gpu'); import test_cuda_backend as t; open('/tmp/case.py', 'w').write(t.SANITIZER_CASE)"
for v in s_ahead_mbarrier s_ahead_mbarrier_nd4 s_ahead s_ahead_nd4; do
  (cd .$v && echo "== $v" && timeout 150 python -m pytest -q -n 8 tests/gpu/test_cuda_backend.py -k "prefill or sanitizer" 2>&1 | tail -3
   case $v in *mbarrier*) PYTHONPATH=$PWD timeout 90 compute-sanitizer --tool synccheck python /tmp/case.py 2>&1 | tail -3;; esac) 2>&1 | tee -a "$OUT/variant_tests.log"
done
