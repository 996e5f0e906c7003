#!/bin/bash
# Issue 19 diagnostics in one device call: where the FP4 decode kernel's last 10 % of HBM
# bandwidth goes. (1) ring depth and warps-per-CTA variants (restricted D128 bf16 builds, built
# in parallel, benchmarks/variants_cuda.sh) on the >= 256k-token shapes and the small ones, with
# one call per graph replay beside 8 calls per replay; (2) the base build over block sizes
# 16 / 32 / 64 (does the 1 KB K and V chunk of a 16-token block cost DRAM efficiency?);
# (3) ncu (clock control off) of the base decode kernel at 64 x 16k and 16 x 4k: DRAM
# throughput, issue activity, warp stall reasons.
#   run: bash benchmarks/decode_diag.sh   (writes under $OUT or ./out)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TURBOQUANT_BUILD_DIR=${TURBOQUANT_BUILD_DIR:-$PWD/.tqbuild}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
SHAPES=${SHAPES:-16x4096,16x16384,16x32768,64x4096,64x16384,128x16384,1x32768,1x4096}
VARIANTS=${VARIANTS:-"base= st4=-DTQ_DECODE_STAGES=4 st5=-DTQ_DECODE_STAGES=5 st6=-DTQ_DECODE_STAGES=6"}
# shellcheck disable=SC2086
SHAPES=$SHAPES bash benchmarks/variants_cuda.sh $VARIANTS 2>&1 | tee "$OUT/variants.log"
export TURBOQUANT_CUDA_EXTRA_FLAGS="-DTQ_ONLY_D128_BF16"
for bs in ${BLOCK_SIZES:-32 64}; do
  python benchmarks/tune_cuda.py --shapes 16x16384,64x16384,64x4096 --block-size "$bs" 2>&1 \
    | grep -E "^(attn|HBM)" | tee -a "$OUT/block_sizes.log"
done
STALLS=$(for r in long_scoreboard short_scoreboard wait math_pipe_throttle not_selected selected \
  lg_throttle mio_throttle barrier dispatch_stall no_instruction branch_resolving drain misc; do
  printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$r"; done | sed 's/,$//')
if command -v ncu >/dev/null; then
  for shape in ${NCU_SHAPES:-"64 16384" "16 4096"}; do
    # shellcheck disable=SC2086
    timeout 150 ncu --clock-control none --kernel-name regex:paged_attention_fp4_decode --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --metrics "$STALLS" python benchmarks/ncu_case.py $shape \
      > "$OUT/ncu_${shape// /x}.txt" 2>&1
    grep -E "DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Warp|No Eligible|Eligible Warps|Active Warps|Stall|Duration|L2 Hit|Achieved Occupancy|Mem Busy|Max Bandwidth|stalled" \
      "$OUT/ncu_${shape// /x}.txt" | head -60
  done
fi
