#!/usr/bin/env bash
# One device call for issue 18's prefill rows against FlashInfer: builds turboquant (full and
# two tuning variants of the prefill kernel) while FlashInfer JIT-compiles its prefill modules
# (each peer's correctness check on a small ragged causal problem runs then), the prefill
# kernel's reference tests (a subset), the multi-token rows with FlashInfer BF16 / FP8 paged
# prefill beside them (bench --peers), then the variants on one chunk row.
#   run: bash benchmarks/prefill_peers_check.sh   (writes under $OUT or ./out; carry .peers)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
VARIANTS=("base=" "w8t32=-DTQ_PREFILL_TILE=32" "w4t32=-DTQ_PREFILL_WARPS=4 -DTQ_PREFILL_TILE=32")
(
  python -c "from turboquant._backends import cuda as c; print('tq build', c.ensure_loaded())" &
  for fb in bf16:fa3 bf16:fa2 fp8:fa2; do
    python -c "import torch; from turboquant import peers; print('$fb check:', peers.check_prefill('${fb%%:*}', '${fb#*:}', 32, 8, 128, 16, torch.device('cuda')))" &
  done
  for v in "${VARIANTS[@]}"; do
    TURBOQUANT_CUDA_EXTRA_FLAGS="-DTQ_ONLY_D128_BF16 ${v#*=}" python -c \
      "from turboquant._backends import cuda as c; print('${v%%=*}', c.ensure_loaded())" &
  done
  wait
) 2>&1 | grep -v Warning | tail -20 | tee "$OUT/prewarm.log"
python -m pytest -q -x tests/gpu/test_cuda_backend.py \
  -k "${TESTS:-prefill_kernel_matches_reference and (ragged or MHA) or structured}" 2>&1 | tail -2 | tee "$OUT/gpu_tests.log"
python -m turboquant bench --no-decode --no-writer --shapes 32/8/128 --peers --out "$OUT/bench" \
  --multi-token "${ROWS:-1x512@4k,1x2048@16k,4x2048@16k,64x4@4k}" 2>&1 \
  | grep -v "kernel<\|flashinfer.jit\|capture_end\|Warning" | tee "$OUT/multi.log"
for v in "${VARIANTS[@]}"; do
  echo "== ${v%%=*}"
  TURBOQUANT_CUDA_EXTRA_FLAGS="-DTQ_ONLY_D128_BF16 ${v#*=}" python -m turboquant bench --no-decode --no-writer \
    --no-sdpa --shapes 32/8/128 --multi-token 1x2048@16k,1x512@4k --out "$OUT/var" 2>&1 | grep -E "^ 32/8" | head -2
done 2>&1 | tee "$OUT/variants.log"
