#!/usr/bin/env bash
# One device call for issue 18's prefill rows against FlashInfer: builds turboquant (full, and
# the prefill kernel's mma.sync path on SM90 for comparison) while FlashInfer JIT-compiles its
# prefill modules (each peer's correctness check on a small ragged causal problem runs then),
# the wgmma layout probe, the prefill kernel's reference tests, the multi-token rows with
# FlashInfer BF16 / FP8 paged prefill beside them (bench --peers), the variants on two chunk
# rows, and ncu on one chunk (instruction mix, pipes, stalls).
#   run: bash benchmarks/prefill_peers_check.sh   (writes under $OUT or ./out; carry .peers)
# Knobs: VARIANTS="name=flags;..." (default: base and the mma.sync build; "" none), PEERS=0 (no
# FlashInfer, no peer rows), TEST_FLAGS="flags;..." (the prefill tests again on a full build
# with each, e.g. -DTQ_PREFILL_MMA_SYNC), VROWS (the variants' rows), NCU=0.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
IFS=';' read -ra VARIANTS <<< "${VARIANTS-base=;mma_sync=-DTQ_PREFILL_MMA_SYNC}"
IFS=';' read -ra TEST_FLAGS <<< "${TEST_FLAGS:-}"
PEERS=${PEERS:-1}
(
  python -c "from turboquant._backends import cuda as c; print('tq build', c.ensure_loaded())" &
  for f in "${TEST_FLAGS[@]}"; do
    TURBOQUANT_CUDA_EXTRA_FLAGS="$f" python -c "from turboquant._backends import cuda as c; print('$f', c.ensure_loaded())" &
  done
  for fb in bf16:fa3 bf16:fa2 fp8:fa2; do
    [ "$PEERS" = 1 ] && python -c "import torch; from turboquant.bench import peers; print('$fb check:', peers.check_prefill('${fb%%:*}', '${fb#*:}', 32, 8, 128, 16, torch.device('cuda')))" &
  done
  for v in "${VARIANTS[@]}"; do
    TURBOQUANT_CUDA_EXTRA_FLAGS="-DTQ_ONLY_D128_BF16 ${v#*=}" python -c \
      "from turboquant._backends import cuda as c; print('${v%%=*}', c.ensure_loaded())" &
  done
  wait
) 2>&1 | grep -v Warning | tail -20 | tee "$OUT/prewarm.log"
python -m pytest -q -x -s tests/gpu/test_wgmma_layout.py 2>&1 | tail -8 | tee "$OUT/wgmma_layout.log"
python -m pytest -q -n 8 --maxfail=3 tests/gpu/test_cuda_backend.py -k "${TESTS:-prefill or sanitizer}" 2>&1 \
  | grep -E "^(FAILED|E  .*(error|assert)|[0-9]+ (passed|failed))" | tail -12 | tee "$OUT/gpu_tests.log"
for f in "${TEST_FLAGS[@]}"; do
  echo "== $f"
  TURBOQUANT_CUDA_EXTRA_FLAGS="$f" python -m pytest -q --maxfail=3 tests/gpu/test_cuda_backend.py -k prefill 2>&1 \
    | grep -E "^(FAILED|E  .*(error|assert)|[0-9]+ (passed|failed))" | tail -12
done 2>&1 | tee "$OUT/gpu_tests_flags.log"
if [ "$PEERS" = 1 ]; then
  python -m turboquant bench --no-decode --no-writer --shapes 32/8/128 --peers --out "$OUT/bench" \
    --multi-token "${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k,64x4@4k}" 2>&1 \
    | grep -v "kernel<\|flashinfer.jit\|capture_end\|Warning" | tee "$OUT/multi.log"
fi
for v in "${VARIANTS[@]}"; do
  echo "== ${v%%=*}"
  TURBOQUANT_CUDA_EXTRA_FLAGS="-DTQ_ONLY_D128_BF16 ${v#*=}" python -m turboquant bench --no-decode --no-writer \
    --no-sdpa --shapes 32/8/128 --multi-token "${VROWS:-1x2048@16k,1x512@4k}" --out "$OUT/var" 2>&1 \
    | grep -E "^ 32/8" | sort -u
done 2>&1 | tee "$OUT/variants.log"
# where a prefill kernel's time goes: ncu (clock control off) on 1 x 2048 @ 16k: instruction mix
# per opcode, pipe utilization, warp stalls
if [ "${NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
  timeout 240 ncu --clock-control none --kernel-name regex:prefill --launch-skip 2 --launch-count 1 \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --metrics sass__inst_executed_per_opcode,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    --print-metric-instances values python benchmarks/ncu_prefill_case.py > "$OUT/ncu_prefill.txt" 2>&1
  grep -vE "^==PROF==|Warning" "$OUT/ncu_prefill.txt" | tail -70
fi
