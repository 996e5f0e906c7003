#!/usr/bin/env bash
# Call 7 (issue 18): the prefill rows of the final tree with FlashInfer's paged prefill beside
# them in the same run, FP4 (`default`) and K8V4 (`k8v4`) caches: each FlashInfer backend first
# checked against fp32 attention over its own bytes (the checks JIT-build its modules), then
# `bench --peers` (BF16 fa3 / fa2 and FP8 fa2 on the same K/V and pages; SDPA's dense BF16
# anchor). Carry .prebuilt and .peers (benchmarks/make_peers_site.sh).
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call7 +$((SECONDS - T0)) s] $*"; }
(
  python -c "from turboquant._backends import cuda as c; print('tq build', c.ensure_loaded())" &
  for fb in bf16:fa3 bf16:fa2 fp8:fa2; do
    python -c "import torch; from turboquant import peers; print('$fb check:', peers.check_prefill('${fb%%:*}', '${fb#*:}', 32, 8, 128, 16, torch.device('cuda')))" &
  done
  wait
) 2>&1 | grep -v Warning | tail -8
phase checks done
python -m turboquant bench --no-decode --no-writer --shapes 32/8/128 --peers --configs default,k8v4 --out "$OUT/bench" \
  --multi-token "${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k}" 2>&1 \
  | grep -v "kernel<\|flashinfer.jit\|capture_end\|Warning" | tee "$OUT/multi.log"
phase bench done
