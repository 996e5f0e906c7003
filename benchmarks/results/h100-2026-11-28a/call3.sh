#!/usr/bin/env bash
# Call 3 (issue 18): the probes on the two-tile tree (.P) beside HEAD's, and ncu source counters
# of HEAD's kernel with one side removed (nosm: the producers' path alone; nodec: the row
# warps' path alone), 1 x 2048 @ 16k. Carry .prebuilt .P.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call3 +$((SECONDS - T0)) s] $*"; }
B=$(mktemp -d)
MT="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --multi-token ${ROWS:-1x512@4k,1x2048@16k,4x2048@16k}"
one() {  # dir label flags
  # shellcheck disable=SC2086
  (cd "$1" && TURBOQUANT_CUDA_EXTRA_FLAGS="$3" timeout "${BENCH_TIMEOUT:-110}" python -m turboquant bench $MT \
    --out "$B/$2" > "$OUT/pf_$2.log" 2>&1)
  phase "$2 done"
  grep -E "^ *32/8/128 " "$OUT/pf_$2.log" | sort -u
}
one . head ""
one .P pair_both "-DTQ_PROBE_NO_SOFTMAX -DTQ_PROBE_NO_DECODE"
one . head_both "-DTQ_PROBE_NO_SOFTMAX -DTQ_PROBE_NO_DECODE"
one .P pair_nodec "-DTQ_PROBE_NO_DECODE"
one . head_nodec "-DTQ_PROBE_NO_DECODE"
one .P pair_nosm "-DTQ_PROBE_NO_SOFTMAX"
one . head_nosm "-DTQ_PROBE_NO_SOFTMAX"
for v in nosm:-DTQ_PROBE_NO_SOFTMAX nodec:-DTQ_PROBE_NO_DECODE head:; do
  TURBOQUANT_CUDA_EXTRA_FLAGS="${v#*:}" timeout 200 ncu --clock-control none --kernel-name regex:fp4_prefill_kernel \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section SourceCounters -o "/tmp/ncu_${v%%:*}" python benchmarks/ncu_prefill_case.py 1 2048 16384 \
    > "$OUT/ncu_${v%%:*}.txt" 2>&1
  ncu -i "/tmp/ncu_${v%%:*}.ncu-rep" --page source --csv --print-source sass > "/tmp/src_${v%%:*}.csv" 2>&1
  ncu -i "/tmp/ncu_${v%%:*}.ncu-rep" --page details >> "$OUT/ncu_${v%%:*}.txt" 2>&1
  phase "ncu ${v%%:*} done"
done
tar -czf "$OUT/src.tgz" -C /tmp src_nosm.csv src_nodec.csv src_head.csv
ls -la "$OUT"
