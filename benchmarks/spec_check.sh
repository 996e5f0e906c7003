#!/usr/bin/env bash
# One call on the device machine for speculative decoding through the decode kernel's
# 16-column form and the prefill kernel (issue 18). Builds in parallel: this tree, each VARIANTS
# build ("label:flag,flag" words; default: general:-DTQ_SPEC_MAX_COLS=0, where those calls run
# the general kernel as before) and every other tree: AB_TREES ("dir:label" words, each a copy
# of another tree, e.g. `git archive` of an earlier commit, named in the device call's carry) or
# AB_TREE (one dir, labelled before). Then the cuda GPU tests (TESTS: a pytest -k expression),
# the multi-token rows (ROWS) of this tree, of every variant and of every other tree, and
# (DECODE=1) the decode rows of this tree and of the other trees, all in the same run. NCU=1:
# only ncu (clock control off) of the decode kernel at 64 x 4k and of its 16-column form at
# 64 x 4 @ 4k (speed of light, warp states, stall reasons per issue); NCU=prefill: only ncu of
# the prefill kernel at 1 x 2048 @ 16k in this tree and every other one (pipes, shared memory,
# stall reasons, the source lines where warps stall: producer or row-warp code). After the rows:
# TEST_TREES=1 runs the tests in every other tree too, SYNCCHECK=1 compute-sanitizer synccheck
# on the GPU test's sanitizer case in this tree and every other one, VARIANT_TESTS (a pytest -k
# expression) the GPU tests it selects under every VARIANTS flag set. Carry .prebuilt
# (benchmarks/prebuild_cuda.py, every tree and VARIANTS flag set) and nothing is compiled here.
# TEST_TIMEOUT (300 s), BENCH_TIMEOUT (300 s, each bench process), SYNC_TIMEOUT (400 s): a
# kernel that hangs costs one of them, not the call.
#   run: AB_TREE=.ab bash benchmarks/spec_check.sh   (logs under $OUT or ./out, the bench
#   files of every run in $OUT/bench.tgz)
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if [ "${NCU:-0}" = 1 ]; then
  python -c "from turboquant._backends import cuda; print('build:', cuda.ensure_loaded() or 'ok')"
  STALLS=$(for r in long_scoreboard short_scoreboard wait math_pipe_throttle not_selected selected \
    lg_throttle mio_throttle barrier dispatch_stall no_instruction branch_resolving drain misc; do
    printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$r"; done | sed 's/,$//')
  for c in "ncu_case.py 64 4096" "ncu_prefill_case.py 64 4 4096"; do
    # shellcheck disable=SC2086
    timeout 200 ncu --clock-control none --kernel-name regex:paged_attention_fp4_decode --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section Occupancy --section InstructionStats --metrics "$STALLS" python benchmarks/$c \
      > "$OUT/ncu_${c%%.py*}.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Issue Slots Busy|Issued Warp|No Eligible|Eligible Warps|Active Warps|Executed Ipc|Registers|stalled" \
      "$OUT/ncu_${c%%.py*}.txt" | head -40
  done
  exit 0
fi
TREES=${AB_TREES:-${AB_TREE:+$AB_TREE:before}}
if [ "${NCU:-0}" = prefill ]; then
  METRICS=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__cycles_elapsed.avg
  for t in .:this $TREES; do
    (cd "${t%%:*}" && timeout 240 ncu --clock-control none --kernel-name regex:fp4_prefill_kernel --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section SourceCounters --metrics "$METRICS" \
      python benchmarks/ncu_prefill_case.py 1 2048 16384) > "$OUT/ncu_prefill_${t#*:}.txt" 2>&1
    grep -E "Duration|Throughput|Pipe|Issue Slots|Eligible|No Eligible|Stall|hmma|wavefronts|Warp Cycles" \
      "$OUT/ncu_prefill_${t#*:}.txt" | head -40
  done
  exit 0
fi
VARIANTS=${VARIANTS:-general:-DTQ_SPEC_MAX_COLS=0}
T0=$SECONDS
phase() { echo "[spec_check +$((SECONDS - T0)) s] $*"; }  # where a call's time goes
build() {  # flags, tree, label
  (cd "$2" && TURBOQUANT_CUDA_EXTRA_FLAGS="$1" python -c \
    "from turboquant._backends import cuda; print('$3 build:', cuda.ensure_loaded() or 'ok')")
}
build "" . this &
for v in $VARIANTS; do build "$(variant_flags "$v")" . "${v%%:*}" & done
for t in $TREES; do build "" "${t%%:*}" "${t#*:}" & done
wait
phase builds done
gpu_tests gpu_tests
phase tests done
B=$(mktemp -d)
ROWS=${ROWS:-64x4@4k,16x4@16k,64x8@4k,128x2@4k,128x4@4k,16x8@16k,32x2@16k}
MT="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --multi-token $ROWS"
for v in this:"" $VARIANTS; do
  TURBOQUANT_CUDA_EXTRA_FLAGS="$(variant_flags "$v")" timeout "${BENCH_TIMEOUT:-300}" python -m turboquant bench $MT \
    --out "$B/spec_${v%%:*}" 2>&1 | tee "$OUT/spec_${v%%:*}.log"
  phase "bench ${v%%:*} done"
done
for t in $TREES; do
  (cd "${t%%:*}" && timeout "${BENCH_TIMEOUT:-300}" python -m turboquant bench $MT --out "$B/spec_${t#*:}" 2>&1 | tee "$OUT/spec_${t#*:}.log")
  phase "bench ${t#*:} done"
done
if [ "${DECODE:-1}" = 1 ]; then
  DEC="--shapes 32/8/128 --batches 1,16,64,128 --contexts 4k,16k,32k --no-sdpa --no-writer"
  python -m turboquant bench $DEC --out "$B/decode_this" 2>&1 | tee "$OUT/decode_this.log"
  for t in $TREES; do
    (cd "${t%%:*}" && python -m turboquant bench $DEC --out "$B/decode_${t#*:}" 2>&1 | tee "$OUT/decode_${t#*:}.log")
  done
fi
tar -czf "$OUT/bench.tgz" -C "$B" .
if [ "${TEST_TREES:-0}" = 1 ]; then
  for t in $TREES; do (cd "${t%%:*}" && gpu_tests "gpu_tests_${t#*:}"); done
fi
if [ -n "${VARIANT_TESTS:-}" ]; then
  for v in $VARIANTS; do
    TURBOQUANT_CUDA_EXTRA_FLAGS="$(variant_flags "$v")" TESTS="$VARIANT_TESTS" gpu_tests "gpu_tests_${v%%:*}"
  done
fi
if [ "${SYNCCHECK:-0}" = 1 ]; then
  python -c "import sys; sys.path.insert(0, 'tests/gpu'); import test_cuda_backend as t; open('/tmp/case.py', 'w').write(t.SANITIZER_CASE)"
  for t in .:this $TREES; do
    (cd "${t%%:*}" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${SYNC_TIMEOUT:-400}" compute-sanitizer \
      --tool synccheck --error-exitcode 3 python /tmp/case.py > "$OUT/synccheck_${t#*:}.log" 2>&1
     echo "synccheck ${t#*:}: rc $?"; tail -3 "$OUT/synccheck_${t#*:}.log")
  done
fi
