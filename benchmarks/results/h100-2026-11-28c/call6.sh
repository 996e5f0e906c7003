#!/usr/bin/env bash
# Call 6 (issue 19): the standing decode table on the final tree, one run: turboquant (default
# config) next to FlashInfer's paged decode over BF16, FP8 and NVFP4 caches of the same K/V and
# pages (each checked against fp32 over its own bytes first), single-call and chained timings,
# and the cache writer's row (64k tokens, default transforms). Carry .prebuilt .peers.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
timeout 540 python -m turboquant bench --shapes 32/8/128 --batches 1,16,64,128 --contexts 4k,16k,32k \
  --configs default --peers --no-sdpa --out "$OUT/bench" 2>&1 | grep -v "kernel<\|Warning" | tee "$OUT/bench.log" | tail -40
