#!/usr/bin/env bash
# One device call for the engine layer the vLLM plugin runs (turboquant/integration/vllm/layer.py):
# its tests on the GPU (engine steps against the API and fp32, decode and verification steps
# replayed from one CUDA graph), the same steps under compute-sanitizer memcheck, and the shared
# state's tests (the engine test on the cuda backend), and the transformers integration's tests
# (generation with PagedKVCache on the GPU). Carry .prebuilt (benchmarks/prebuild_cuda.py).
#   run: bash benchmarks/engine_check.sh   (logs under $OUT or ./out)
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "from turboquant._backends import cuda; print('this build:', cuda.ensure_loaded() or 'ok')"
timeout 200 python -m pytest -q -rfs tests/test_engine_layer.py 2>&1 | tail -6 | tee "$OUT/engine_layer.log"
timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python -m pytest -q -x \
  tests/test_engine_layer.py -k "cuda" > "$OUT/memcheck_full.log" 2>&1
echo "memcheck rc=$?" | tee "$OUT/memcheck.log"
grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_full.log" | tail -3 | tee -a "$OUT/memcheck.log"
timeout 150 python -m pytest -q -rfs tests/test_shared_state.py 2>&1 | tail -6 | tee "$OUT/shared_state.log"
python -c "import transformers; print('transformers', transformers.__version__)"
timeout 200 python -m pytest -q -rfs tests/test_transformers_integration.py 2>&1 | tail -6 | tee "$OUT/transformers.log"
