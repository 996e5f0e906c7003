#!/usr/bin/env bash
# Call 7 (issue 18): the table on the final tree, one run: the chunk rows and the
# speculative-decoding rows (4 tokens: the 16-column form; 2 tokens: the 8-column form) with
# FlashInfer's paged prefill (BF16 fa3 / fa2, FP8 fa2; each backend first checked against fp32
# over its own bytes, the checks JIT-build its modules) and SDPA's dense BF16 anchor beside them.
# Carry .prebuilt .peers.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call7 +$((SECONDS - T0)) s] $*"; }
(
  for fb in bf16:fa3 bf16:fa2 fp8:fa2; do
    python -c "import torch; from turboquant import peers; print('$fb check:', peers.check_prefill('${fb%%:*}', '${fb#*:}', 32, 8, 128, 16, torch.device('cuda')))" &
  done
  wait
) 2>&1 | grep -v Warning | tail -8
phase checks done
timeout 420 python -m turboquant bench --no-decode --no-writer --shapes 32/8/128 --peers --configs default --out "$OUT/bench" \
  --multi-token "${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k,64x4@4k,128x2@4k,64x2@16k,16x2@16k}" 2>&1 \
  | grep -v "kernel<\|flashinfer.jit\|capture_end\|Warning" | tee "$OUT/multi.log" | tail -30
phase bench done
