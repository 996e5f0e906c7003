#!/usr/bin/env bash
# The device calls of this repository in one script (issue 41: it replaces 13 one-call scripts).
# Run from the repository root on the GPU machine; logs and bench files go under $OUT (./out).
# benchmarks/README.md maps every old script to its command here.
usage() {
  cat <<'EOF'
usage: bash benchmarks/device.sh [--dry-run] [-C DIR] COMMAND [ARGS...]

  tests [-k EXPR] [-n N] [PATH...]   pytest on the GPU (default PATH tests/gpu; -n 8 when
                                     pytest-xdist is there, -n 0 for one process)
  bench [PRESET] [BENCH ARGS...]     python -m turboquant bench; no arguments: the main
                                     preset, plus --peers where .peers/ was carried
  check                              tests, bench main, then the main job (python -m turboquant)
  engine                             the engine layer's, shared state's and transformers' tests,
                                     the engine steps under compute-sanitizer memcheck
  ab [-t DIR:LABEL]... [-v NAME=FLAGS]... [-r ROUNDS] [PRESET] [BENCH ARGS...]
                                     one bench per build (this tree, each flag set, each other
                                     tree) in ROUNDS (2) rounds, order rotated; a summary table
  variants [--shapes S] [--check] NAME=FLAGS...
                                     restricted D128 bf16 builds timed by tune_cuda.py --quick
  ncu [-t DIR:LABEL]... [--source] decode|spec|prefill|writer [PROBE ARGS...]
                                     ncu (clock control off) of one kernel of probe.py's case
  sanitize [--tool T] [-t DIR:LABEL]... [PYTEST ARGS...]
                                     compute-sanitizer (memcheck) on the GPU tests' sanitizer
                                     case, or on pytest PYTEST ARGS
  run CMD [ARGS...]                  any command under the device environment, logged
  (bench's own arguments: python -m turboquant bench --help)

PRESETS (bench and ab; arguments after a preset override its own): main decode peers k8v4
prefill prefill-peers spec writer. FLAGS: comma- or space-separated nvcc flags, e.g.
st4=-DTQ_DECODE_STAGES=4. -C DIR: run in the tree DIR (a copy of another commit).
--dry-run: print the commands instead of running them (works without a GPU).
Environment: OUT, TEST_TIMEOUT (300 s), BENCH_TIMEOUT (none for bench, 300 s per ab run),
SAN_TIMEOUT (400 s), NCU_ARGS (more ncu arguments), TURBOQUANT_CUDA_EXTRA_FLAGS.
EOF
}
set -uo pipefail
die() { echo "device.sh: $*" >&2; exit 2; }
cd "$(dirname "$0")/.." || exit 2
HERE=$PWD
TREE=.
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help|help) usage; exit 0 ;;
    --dry-run) export DEVICE_DRY_RUN=1; shift ;;
    -C) [ $# -ge 2 ] || die "-C needs a folder"; TREE=$2; shift 2 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { usage >&2; exit 2; }
CMD=$1; shift
source benchmarks/device_env.sh
cd "$TREE" || die "no tree $TREE"

if [ -n "${DEVICE_DRY_RUN:-}" ]; then
  # every tool that needs the GPU only says what it would run
  for t in python timeout ncu compute-sanitizer nvidia-smi; do
    eval "$t() { echo \"[dry-run] $t \$(printf '%q ' \"\$@\")\"; }"
  done
fi
need_gpu() {  # fail at once, and say why, where there is no GPU; else name it, once
  [ -n "${DEVICE_DRY_RUN:-}${GPU_SEEN:-}" ] && return 0
  GPU_SEEN=1
  command -v nvidia-smi >/dev/null || die "no nvidia-smi: '$CMD' runs on the GPU machine"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
    || die "nvidia-smi finds no GPU"
}
fresh() {  # NAME [EXT] -> $OUT/NAME.EXT unused (an empty folder counts), or NAME_2.EXT, ...
  local p="$OUT/$1${2:+.$2}" i=2  # (so several steps of one call keep their own files)
  while [ -e "$p" ] && ! rmdir "$p" 2>/dev/null; do p="$OUT/$1_$i${2:+.$2}"; i=$((i + 1)); done
  echo "$p"
}
T0=$SECONDS
phase() { echo "[device.sh $CMD +$((SECONDS - T0)) s] $*"; }  # where a call's time goes
build() {  # LABEL FLAGS [DIR]: load (or compile) the extension before anything times it
  (cd "${3:-.}" && TURBOQUANT_CUDA_EXTRA_FLAGS="$2" python -c \
    "from turboquant._backends import cuda; print('$1 build:', cuda.ensure_loaded() or 'ok')")
}
preset() {  # NAME -> its bench arguments; status 1 when NAME is none
  local dec="--shapes 32/8/128 --batches 1,16,64,128 --contexts 4k,16k,32k --no-sdpa --no-writer"
  case $1 in
    main) echo "--configs default,plain" ;;
    decode) echo "$dec" ;;
    peers) echo "$dec --configs default --peers" ;;
    k8v4) echo "--shapes 32/8/128 --batches 1,16,64 --contexts 4k,16k,32k --no-sdpa \
--configs default,plain,k8v4,k8v4/plain" ;;
    prefill) echo "--no-decode --no-writer --configs default --multi-token \
1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k,64x4@4k,16x4@16k,64x8@4k,128x2@4k" ;;
    prefill-peers) echo "--shapes 32/8/128 --no-decode --no-writer --peers --multi-token \
1x512@4k,1x2048@16k,1x8192@64k,4x2048@16k,1x2048+64x1@16k,64x1+1x2048@16k,64x4@4k" ;;
    spec) echo "--shapes 32/8/128 --no-decode --no-writer --no-sdpa --multi-token \
64x4@4k,16x4@16k,64x8@4k,128x2@4k,128x4@4k,16x8@16k,32x2@16k" ;;
    writer) echo "--shapes 32/8/128 --batches 64 --contexts 4k --no-sdpa \
--configs default,rotation,smooth,plain" ;;
    *) return 1 ;;
  esac
}
bench_args() {  # [PRESET] [ARGS...] -> BARGS (DEFAULT_PRESET when no arguments)
  BARGS=()
  [ $# -eq 0 ] && set -- "$DEFAULT_PRESET"
  if [[ $1 != -* ]]; then
    local p; p=$(preset "$1") || die "no preset '$1' (main decode peers k8v4 prefill \
prefill-peers spec writer)"
    read -ra BARGS <<< "$p"; shift
  fi
  BARGS+=("$@")
}
# FlashInfer's JIT and capture chatter, dropped from the printed output (the log keeps it)
NOISE="kernel<|flashinfer.jit|capture_end|Warning"
parse_trees() {  # collects -t DIR:LABEL into TREES; the rest in REST
  TREES=(); REST=()
  while [ $# -gt 0 ]; do
    case $1 in
      -t) [[ ${2:-} == *:* ]] || die "-t takes DIR:LABEL"
          [ -d "${2%%:*}" ] || [ -n "${DEVICE_DRY_RUN:-}" ] \
            || die "no tree ${2%%:*} (a copy of another commit, named in the call's carry)"
          TREES+=("$2"); shift 2 ;;
      *) REST+=("$1"); shift ;;
    esac
  done
}

cmd_tests() {
  local k=() n=() paths=()
  while [ $# -gt 0 ]; do
    case $1 in
      -k) [ $# -ge 2 ] || die "-k needs an expression"; k=(-k "$2"); shift 2 ;;
      -n) [ $# -ge 2 ] || die "-n needs a number"; n=(-n "$2"); shift 2 ;;
      -*) die "tests: unknown option $1" ;;
      *) paths+=("$1"); shift ;;
    esac
  done
  [ ${#paths[@]} -eq 0 ] && paths=(tests/gpu)
  if [ ${#n[@]} -eq 0 ] && command python -c "import xdist" 2>/dev/null; then n=(-n 8); fi
  [ "${n[*]}" = "-n 0" ] && n=()
  need_gpu
  local full; full=$(fresh tests_full log)
  timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -rfs "${n[@]}" "${paths[@]}" "${k[@]}" \
    > "$full" 2>&1
  echo "tests rc=$? (${paths[*]} ${k[*]})" >> "$full"
  # the end of the log, less pytest-benchmark's warning per xdist worker
  grep -vE "PytestBenchmarkWarning|warner\(|bringing up nodes|^$" "$full" | tail -30 \
    | tee "${full/tests_full/tests}"
}

cmd_bench() {
  DEFAULT_PRESET=main bench_args "$@"
  [ $# -eq 0 ] && [ -f .peers/peers_site.tar.xz ] && BARGS+=(--peers)
  need_gpu
  build this "${TURBOQUANT_CUDA_EXTRA_FLAGS:-}"
  local dir log; dir=$(fresh bench); log=$(fresh bench log)
  timeout "${BENCH_TIMEOUT:-0}" python -m turboquant bench --out "$dir" "${BARGS[@]}" 2>&1 \
    | tee "$log" | grep -vE "$NOISE"
}

cmd_check() {  # what device_check.sh did
  cmd_tests
  cmd_bench main
  python -m turboquant 2>&1 | tee "$(fresh main log)"
}

cmd_engine() {  # what engine_check.sh did: the layer the vLLM plugin runs, on the GPU
  need_gpu
  build this "${TURBOQUANT_CUDA_EXTRA_FLAGS:-}"
  timeout 200 python -m pytest -q -rfs tests/test_engine_layer.py 2>&1 | tail -6 \
    | tee "$OUT/engine_layer.log"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python -m pytest -q -x \
    tests/test_engine_layer.py -k cuda > "$OUT/memcheck_full.log" 2>&1
  echo "memcheck rc=$?" | tee "$OUT/memcheck.log"
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_full.log" | tail -3 \
    | tee -a "$OUT/memcheck.log"
  timeout 150 python -m pytest -q -rfs tests/test_shared_state.py 2>&1 | tail -6 \
    | tee "$OUT/shared_state.log"
  python -c "import transformers; print('transformers', transformers.__version__)"
  timeout 200 python -m pytest -q -rfs tests/test_transformers_integration.py 2>&1 | tail -6 \
    | tee "$OUT/transformers.log"
}

cmd_ab() {  # decode_ab.sh and spec_check.sh's rows: several builds, one bench each per round
  local variants=() rounds=2
  parse_trees "$@"; set -- "${REST[@]}"
  while [ $# -gt 0 ]; do
    case $1 in
      -v) [ $# -ge 2 ] || die "-v takes NAME=FLAGS"; variants+=("$2"); shift 2 ;;
      -r) [[ ${2:-} =~ ^[0-9]+$ ]] || die "-r takes a number"; rounds=$2; shift 2 ;;
      --) shift; break ;;
      *) break ;;
    esac
  done
  DEFAULT_PRESET=decode bench_args "$@"
  # builds: "DIR LABEL FLAGS": this tree, each flag set in this tree, each other tree
  local builds=(". this ${TURBOQUANT_CUDA_EXTRA_FLAGS:-}") v t
  for v in "${variants[@]}"; do builds+=(". $(variant_name "$v") $(variant_flags "$v")"); done
  for t in "${TREES[@]}"; do builds+=("${t%%:*} ${t#*:} ${TURBOQUANT_CUDA_EXTRA_FLAGS:-}"); done
  need_gpu
  local b dir label fl
  for b in "${builds[@]}"; do read -r dir label fl <<< "$b"; build "$label" "$fl" "$dir" & done
  wait
  phase builds done
  local B n=${#builds[@]} r i; B=$(if [ -n "${DEVICE_DRY_RUN:-}" ]; then echo "$OUT/ab_runs"; else mktemp -d; fi)  # the bench folders, packed into $OUT at the end
  for ((r = 0; r < rounds; r++)); do
    for ((i = 0; i < n; i++)); do
      read -r dir label fl <<< "${builds[(i + r) % n]}"
      (cd "$dir" && TURBOQUANT_CUDA_EXTRA_FLAGS="$fl" timeout "${BENCH_TIMEOUT:-300}" \
        python -m turboquant bench "${BARGS[@]}" --out "$B/${label}_r$r" \
        > "$OUT/ab_${label}_r$r.log" 2>&1)
      phase "round $r $label ($fl) rc=$?"
    done
  done
  tar -czf "$(fresh ab tgz)" -C "$B" .  # every bench's files
  # every row's time per build and round, side by side
  python - "$B" <<'EOF' | tee "$(fresh ab_summary txt)"
import json, sys
from pathlib import Path
rows = {}
def two(a, b, unit=""):  # "a / b" with "-" for a figure an older bench does not write
    return " / ".join("-" if x in (None, "") else f"{x:.1f}" for x in (a, b)) + unit
for f in sorted(Path(sys.argv[1]).glob("*/bench.json")):
    doc, label = json.loads(f.read_text()), f.parent.name
    for r in doc.get("rows", []):  # decode: chained / single-call us
        if r.get("status") == "ok":
            key = f"decode {r['shape']} {r['config']} {r['batch']} x {r['context']}"
            rows.setdefault(key, {})[label] = two(r["fp4_us"], r.get("fp4_us_single"))
    for r in doc.get("multi_token_rows", []):  # multi-token: us / TFLOP/s
        if r.get("status") == "ok":
            key = (f"multi {r['shape']} {r['config']} {r['batch']} x {r['query_len']}"
                   f" @ {r['context']}")
            rows.setdefault(key, {})[label] = two(r["fp4_us"], r.get("tflops"))
    for r in doc.get("writers", []):  # writer: us / % of bandwidth
        if r.get("status") == "ok":
            key = f"writer {r['config']} {r['num_tokens']} tokens"
            rows.setdefault(key, {})[label] = two(r["us"], r.get("pct_bw"), " %")
labels = sorted({l for r in rows.values() for l in r})
print("decode: chained / single us; multi: us / TFLOP/s; writer: us / % of bandwidth")
print("row | " + " | ".join(labels))
for key in sorted(rows):
    print(f"{key} | " + " | ".join(rows[key].get(l, "-") for l in labels))
EOF
}

cmd_variants() {  # variants_cuda.sh: restricted builds in parallel, then tune_cuda.py --quick each
  local tune=(--quick) v name flags
  while [ $# -gt 0 ]; do
    case $1 in
      --shapes) [ $# -ge 2 ] || die "--shapes needs BxCTX,..."; tune+=(--shapes "$2"); shift 2 ;;
      --check) tune+=(--check); shift ;;
      -*) die "variants: unknown option $1" ;;
      *) break ;;
    esac
  done
  [ $# -ge 1 ] || die "variants: give at least one NAME=FLAGS (base= for no flags)"
  need_gpu
  for v in "$@"; do build "$(variant_name "$v")" "-DTQ_ONLY_D128_BF16 $(variant_flags "$v")" & done
  wait
  for v in "$@"; do
    name=$(variant_name "$v"); flags="-DTQ_ONLY_D128_BF16 $(variant_flags "$v")"
    TURBOQUANT_CUDA_EXTRA_FLAGS="$flags" python benchmarks/tune_cuda.py "${tune[@]}" \
      > "$OUT/var_$name.log" 2>&1
    echo "== $name ($flags)"; grep -E "^(attn|cache|HBM)" "$OUT/var_$name.log" | sed 's/ of HBM.*//'
  done
}

# warp stall reasons, per issue, for the decode kernel's ncu runs
STALLS=$(for r in long_scoreboard short_scoreboard wait math_pipe_throttle not_selected selected \
  lg_throttle mio_throttle barrier dispatch_stall no_instruction branch_resolving drain misc; do
  printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$r"; done | sed 's/,$//')

cmd_ncu() {  # decode_diag / spec_check NCU=1|prefill / prefill_peers_check's ncu, one form
  local source=0
  parse_trees "$@"; set -- "${REST[@]}"
  [ "${1:-}" = --source ] && { source=1; shift; }
  [ $# -ge 1 ] || die "ncu: which kernel? decode, spec, prefill or writer"
  local kind=$1 kernel probe sections metrics skip=2; shift
  local common=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats)
  case $kind in
    decode|spec)  # the decode kernel: at 64 x 4k, or its 16-column form at 64 x 4 @ 4k
      kernel=regex:paged_attention_fp4_decode
      if [ "$kind" = decode ]; then probe=(ncu-decode "$@")  # BATCH CTX, default 64 4096
      else [ $# -eq 0 ] && set -- 64 4 4096; probe=(ncu-prefill "$@"); fi
      sections=(--section MemoryWorkloadAnalysis --section Occupancy --section InstructionStats)
      metrics=$STALLS ;;
    prefill)  # the prefill kernel at 1 x 2048 @ 16k: pipes, shared memory, opcodes, stall lines
      kernel=regex:fp4_prefill_kernel; probe=(ncu-prefill "$@")
      sections=(--section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
                --section SourceCounters --section InstructionStats)
      metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
      metrics+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__cycles_elapsed.avg
      metrics+=,sass__inst_executed_per_opcode,smsp__inst_executed.sum ;;
    writer)  # the cache writer under one config (probe.py writer --config C)
      kernel=regex:reshape; probe=(writer "$@"); skip=1
      sections=(--section MemoryWorkloadAnalysis --section Occupancy --section InstructionStats)
      metrics=$STALLS ;;
    *) die "ncu: no kernel '$kind' (decode spec prefill writer)" ;;
  esac
  need_gpu
  command -v ncu >/dev/null || [ -n "${DEVICE_DRY_RUN:-}" ] || die "no ncu on this machine"
  local t dir label rep
  for t in .:this "${TREES[@]}"; do
    dir=${t%%:*}; label=${t#*:}; rep="$OUT/ncu_${kind}_$label"
    build "$label" "${TURBOQUANT_CUDA_EXTRA_FLAGS:-}" "$dir"
    local export=(); [ $source = 1 ] && export=(-o "$rep" -f)
    # shellcheck disable=SC2086
    (cd "$dir" && timeout 240 ncu --clock-control none --kernel-name "$kernel" \
      --launch-skip $skip --launch-count 1 "${common[@]}" "${sections[@]}" --metrics "$metrics" \
      "${export[@]}" ${NCU_ARGS:-} python "$HERE/benchmarks/probe.py" "${probe[@]}") \
      > "$rep.txt" 2>&1
    echo "== ncu $kind $label (${probe[*]}): rc $?"
    if [ $source = 1 ]; then  # the source page for benchmarks/ncu_source_summary.py
      ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "${rep}_src.csv" 2>&1
      ncu -i "$rep.ncu-rep" > "$rep.txt" 2>&1
    fi
    grep -E "Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Warp|No Eligible|\
Eligible Warps|Active Warps|Executed Ipc|Registers|Pipe|hmma|wavefronts|L2 Hit|Occupancy|stalled" \
      "$rep.txt" | head -50
  done
}

cmd_sanitize() {  # spec_check's SYNCCHECK, and compute-sanitizer on any pytest selection
  local tool=memcheck
  parse_trees "$@"; set -- "${REST[@]}"
  if [ "${1:-}" = --tool ]; then [ $# -ge 2 ] || die "--tool needs a name"; tool=$2; shift 2; fi
  need_gpu
  local what=("$@")
  if [ $# -eq 0 ]; then  # the GPU tests' sanitizer case, written out by this tree's tests
    python -c "import sys; sys.path[:0] = ['$HERE/tests', '$HERE/tests/gpu']; \
import test_cuda_backend as t; open('$OUT/sanitizer_case.py', 'w').write(t.SANITIZER_CASE)" \
      || die "no SANITIZER_CASE in tests/gpu/test_cuda_backend.py"
    what=("$OUT/sanitizer_case.py")
  else
    what=(-m pytest -q -x "$@")
  fi
  local t dir label log
  for t in .:this "${TREES[@]}"; do
    dir=${t%%:*}; label=${t#*:}; log=$(fresh "${tool}_$label" log)
    (cd "$dir" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${SAN_TIMEOUT:-400}" \
      compute-sanitizer --tool "$tool" --error-exitcode 3 python "${what[@]}" > "$log" 2>&1)
    echo "$tool $label: rc $?"; tail -3 "$log"
  done
}

cmd_run() {  # any command under this environment, its output in $OUT/run.log
  [ $# -ge 1 ] || die "run: give a command"
  command -v nvidia-smi >/dev/null || echo "device.sh: no nvidia-smi here; running anyway" >&2
  "$@" 2>&1 | tee "$(fresh run log)"
}

case ${1:-} in -h|--help) usage; exit 0 ;; esac  # e.g. device.sh tests --help
case $CMD in
  tests|bench|check|engine|ab|variants|ncu|sanitize|run) "cmd_$CMD" "$@" ;;
  *) usage >&2; die "no command '$CMD'" ;;
esac
