#!/usr/bin/env bash
# One device call for a decode-kernel change (issue 19): the cuda GPU tests of this tree
# (TESTS: a pytest -k expression, default "not prefill"), the tests VARIANT_TESTS selects under
# every VARIANTS flag set ("label:flag,flag" words), then the decode rows (DEC: bench arguments)
# of this tree, of every variant and of every other tree (AB_TREES: "dir:label" words, copies
# of other commits named in the call's carry) in ROUNDS interleaved rounds, the order of the
# builds rotated each round so that no build always runs first on a warm or cold GPU. Carry
# .prebuilt (benchmarks/prebuild_cuda.py for every tree and flag set): nothing compiles here.
#   run: AB_TREES=".B:head" VARIANTS="st4:-DTQ_DECODE_STAGES=4" bash benchmarks/decode_ab.sh
#   a prefill change: VARIANTS="fp16s:-DTQ_PREFILL_FP8_S=0" TESTS="prefill or sanitizer" DEC="--shapes
#   32/8/128 --no-decode --no-writer --no-sdpa --configs default,k8v4 --multi-token 1x2048@16k,..."
#   (logs under $OUT or ./out, every bench's files in $OUT/bench.tgz)
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[decode_ab +$((SECONDS - T0)) s] $*"; }
python -c "from turboquant._backends import cuda; print('this build:', cuda.ensure_loaded() or 'ok')"
TESTS=${TESTS:-not prefill} TEST_TIMEOUT=${TEST_TIMEOUT:-420} gpu_tests gpu_tests
phase tests done
if [ -n "${VARIANT_TESTS:-}" ]; then
  for v in ${VARIANTS:-}; do
    TURBOQUANT_CUDA_EXTRA_FLAGS="$(variant_flags "$v")" TESTS="$VARIANT_TESTS" TEST_TIMEOUT=${TEST_TIMEOUT:-420} \
      gpu_tests "gpu_tests_${v%%:*}"
  done
fi
phase variant tests done
B=$(mktemp -d)
DEC=${DEC:-"--shapes 32/8/128 --batches 1,16,64 --contexts 4k,16k,32k --no-sdpa --no-writer"}
# builds: ". this" (flags ""), ". <variant>" (its flags), "<tree> <label>"
BUILDS=(". this ")
for v in ${VARIANTS:-}; do BUILDS+=(". ${v%%:*} $(variant_flags "$v")"); done
for t in ${AB_TREES:-}; do BUILDS+=("${t%%:*} ${t#*:} "); done
n=${#BUILDS[@]}
for ((r = 0; r < ${ROUNDS:-2}; r++)); do
  for ((i = 0; i < n; i++)); do
    read -r dir label fl <<< "${BUILDS[(i + r) % n]}"
    # shellcheck disable=SC2086
    (cd "$dir" && TURBOQUANT_CUDA_EXTRA_FLAGS="$fl" timeout "${BENCH_TIMEOUT:-300}" python -m turboquant bench $DEC \
      --out "$B/${label}_r$r" > "$OUT/decode_${label}_r$r.log" 2>&1)
    phase "round $r $label done"
  done
done
tar -czf "$OUT/bench.tgz" -C "$B" .
# the chained and single times of every build and round, side by side per row
python - "$B" <<'EOF'
import json, sys
from pathlib import Path
rows = {}
for f in sorted(Path(sys.argv[1]).glob("*/bench.json")):
    label = f.parent.name
    doc = json.loads(f.read_text())
    for rec in doc.get("rows", []):
        if rec.get("status") == "ok":
            key = f"{rec['batch']} x {rec['context']}"
            rows.setdefault(key, {})[label] = (rec["fp4_us"], rec["fp4_us_single"])
    for rec in doc.get("multi_token_rows", []):  # us / TFLOP/s of each multi-token row
        if rec.get("status") == "ok":
            key = f"{rec['shape']} {rec['config']} {rec['batch']} x {rec['query_len']} @ {rec['context']}"
            rows.setdefault(key, {})[label] = (rec["fp4_us"], rec["tflops"])
labels = sorted({l for r in rows.values() for l in r})
print("row | " + " | ".join(f"{l} chained/single us (multi-token: us / TFLOP/s)" for l in labels))
for key in sorted(rows):
    cells = [rows[key].get(l) for l in labels]
    print(f"{key} | " + " | ".join(f"{c[0]:.1f} / {c[1]:.1f}" if c else "-" for c in cells))
EOF
