#!/usr/bin/env bash
# Call 1 (issue 18): the prefill producers' K / V codes by bulk copies (tuning::PREFILL_BULK_COPY,
# the default in this tree) against the per-thread cp.async copies (-DTQ_PREFILL_BULK_COPY=0):
# the prefill and sanitizer GPU tests on the default build, both builds timed in two rounds
# (order rotated), then ncu source counters of both on 1 x 2048 @ 16k (instructions per warp
# role). Carry .prebuilt.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call1 +$((SECONDS - T0)) s] $*"; }
TESTS="${TESTS:-prefill or sanitizer}" TEST_TIMEOUT=240 gpu_tests gpu_tests_bulk
phase tests done
B=$(mktemp -d)
MT="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --multi-token ${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k}"
BUILDS=("bulk " "nobulk -DTQ_PREFILL_BULK_COPY=0")
for ((r = 0; r < 2; r++)); do
  for ((i = 0; i < 2; i++)); do
    read -r label fl <<< "${BUILDS[(i + r) % 2]}"
    # shellcheck disable=SC2086
    TURBOQUANT_CUDA_EXTRA_FLAGS="$fl" timeout 120 python -m turboquant bench $MT --out "$B/${label}_r$r" \
      > "$OUT/pf_${label}_r$r.log" 2>&1
    phase "round $r $label"
    grep -E "^ *32/8/128 " "$OUT/pf_${label}_r$r.log" | sort -u
  done
done
if [ "${NCU:-1}" = 1 ]; then
  for v in bulk: nobulk:-DTQ_PREFILL_BULK_COPY=0; do
    TURBOQUANT_CUDA_EXTRA_FLAGS="${v#*:}" timeout 150 ncu --clock-control none --kernel-name regex:fp4_prefill_kernel \
      --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
      -o "/tmp/ncu_${v%%:*}" python benchmarks/ncu_prefill_case.py 1 2048 16384 > "$OUT/ncu_${v%%:*}.txt" 2>&1
    ncu -i "/tmp/ncu_${v%%:*}.ncu-rep" --page source --csv --print-source sass > "/tmp/src_${v%%:*}.csv" 2>&1
    python benchmarks/ncu_source_summary.py "/tmp/src_${v%%:*}.csv" --warp-steps 983040 2>&1 | head -40
    phase "ncu ${v%%:*} done"
  done
  tar -czf "$OUT/src.tgz" -C /tmp src_bulk.csv src_nobulk.csv
fi
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls pf_*.log gpu_tests_*full.log) && rm -f "$OUT"/pf_*.log "$OUT"/gpu_tests_*full.log
