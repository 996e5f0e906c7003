#!/usr/bin/env bash
# Call 5 (issue 18): latency-hiding variants of the prefill kernel, against HEAD (.H), all
# timed in one call, in two rounds with the order rotated: qs (Q's rows in shared memory, S from
# descriptors), qsw (qs + the step's K-scale / vmax / NaN words loaded under the S MMA), raw (the
# producers load their raw words before waiting for the tile), all (qsw + raw). The prefill GPU
# tests under qsw and all first. Carry .prebuilt .H.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call5 +$((SECONDS - T0)) s] $*"; }
for v in qsw:-DTQ_PREFILL_Q_SMEM,-DTQ_PREFILL_WORDS_EARLY all:-DTQ_PREFILL_Q_SMEM,-DTQ_PREFILL_WORDS_EARLY,-DTQ_PREFILL_RAW_EARLY; do
  TURBOQUANT_CUDA_EXTRA_FLAGS="$(variant_flags "$v")" TESTS="prefill or sanitizer" TEST_TIMEOUT=200 gpu_tests "gpu_tests_${v%%:*}"
  phase "tests ${v%%:*} done"
done
B=$(mktemp -d)
MT="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --multi-token ${ROWS:-1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k}"
BUILDS=(".H head " ". this " ". qs -DTQ_PREFILL_Q_SMEM" ". qsw -DTQ_PREFILL_Q_SMEM -DTQ_PREFILL_WORDS_EARLY"
        ". raw -DTQ_PREFILL_RAW_EARLY" ". all -DTQ_PREFILL_Q_SMEM -DTQ_PREFILL_WORDS_EARLY -DTQ_PREFILL_RAW_EARLY")
n=${#BUILDS[@]}
for ((r = 0; r < 2; r++)); do
  for ((i = 0; i < n; i++)); do
    read -r dir label fl <<< "${BUILDS[(i + r) % n]}"
    # shellcheck disable=SC2086
    (cd "$dir" && TURBOQUANT_CUDA_EXTRA_FLAGS="$fl" timeout 120 python -m turboquant bench $MT \
      --out "$B/${label}_r$r" > "$OUT/pf_${label}_r$r.log" 2>&1)
    phase "round $r $label"
    grep -E "^ *32/8/128 " "$OUT/pf_${label}_r$r.log" | sort -u
  done
done
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls pf_*.log gpu_tests_*full.log) && rm -f "$OUT"/pf_*.log "$OUT"/gpu_tests_*full.log
