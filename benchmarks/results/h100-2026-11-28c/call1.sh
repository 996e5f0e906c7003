#!/usr/bin/env bash
# Call 1 (issues 18 and 19): upper bounds of the routes left, by timing-only probes of HEAD's
# kernels (.P = HEAD + probes_ub.diff; results are wrong by design, nothing is checked):
#   prefill: TQ_PROBE_PV8 (P V at an FP8 P V's cost: half the k16 wgmmas; the producers' V
#     decode as E5M2-style bytes + two 4x4 byte transposes, half the stores), TQ_PROBE_Q1 (S with
#     one E4M3 term of Q: half the QGMMAs), TQ_PROBE_NO_SOFTMAX / TQ_PROBE_NO_DECODE (the
#     eighth session's removals);
#   decode kernel (decode rows and the 16-column spec form): TQ_PROBE_DEC_K8 (K at an FP8 K's
#     cost: hi bytes without the fp16 prmts, one MMA per 32 elements), TQ_PROBE_DEC_NO_KDEC /
#     TQ_PROBE_DEC_NO_VDEC (no K / V decode: raw words masked finite).
# Builds (flags of both kernels in one library; the rows tell which kernel ran):
#   head: none; vA: PV8 + DEC_K8; vB: PV8 + Q1 + DEC_NO_KDEC + DEC_NO_VDEC;
#   vC: PV8 + Q1 + NO_SOFTMAX + NO_DECODE + DEC_NO_KDEC; vD: NO_SOFTMAX + NO_DECODE + DEC_NO_VDEC.
# Carry .prebuilt .P.
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
T0=$SECONDS
phase() { echo "[call1 +$((SECONDS - T0)) s] $*"; }
B=$(mktemp -d)
BUILDS=("head:" "vA:-DTQ_PROBE_PV8 -DTQ_PROBE_DEC_K8"
  "vB:-DTQ_PROBE_PV8 -DTQ_PROBE_Q1 -DTQ_PROBE_DEC_NO_KDEC -DTQ_PROBE_DEC_NO_VDEC"
  "vC:-DTQ_PROBE_PV8 -DTQ_PROBE_Q1 -DTQ_PROBE_NO_SOFTMAX -DTQ_PROBE_NO_DECODE -DTQ_PROBE_DEC_NO_KDEC"
  "vD:-DTQ_PROBE_NO_SOFTMAX -DTQ_PROBE_NO_DECODE -DTQ_PROBE_DEC_NO_VDEC")
MT="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --bw-repeats 5 --multi-token ${MROWS:-1x512@4k,1x2048@16k,4x2048@16k,64x4@4k,16x4@16k,128x2@4k,128x4@4k}"
DEC="--shapes 32/8/128 --no-writer --no-sdpa --bw-repeats 5 --batches ${BATCHES:-16,64,128} --contexts ${CONTEXTS:-4k,16k}"
run_round() {  # kind args round
  local n=${#BUILDS[@]}
  for ((i = 0; i < n; i++)); do
    local b=${BUILDS[(i + $3) % n]} label fl
    label=${b%%:*}; fl=${b#*:}
    (cd .P && TURBOQUANT_CUDA_EXTRA_FLAGS="$fl" timeout "${BENCH_TIMEOUT:-150}" python -m turboquant bench $2 \
      --out "$B/$1_${label}_r$3" > "$OUT/$1_${label}_r$3.log" 2>&1)
    phase "$1 round $3 $label done"
  done
}
run_round mt "$MT" 0
run_round dec "$DEC" 0
run_round mt "$MT" 1
if (( SECONDS - T0 < ${DEC2_BEFORE:-330} )); then run_round dec "$DEC" 1; fi
tar -czf "$OUT/bench.tgz" -C "$B" .
python - "$B" <<'PY'
import json, sys
from pathlib import Path
rows = {}
for f in sorted(Path(sys.argv[1]).glob("*/bench.json")):
    label = f.parent.name.split("_", 1)[1]
    doc = json.loads(f.read_text())
    for rec in doc.get("rows", []):
        if rec.get("status") == "ok":
            rows.setdefault(f"{rec['batch']} x {rec['context']}", {})[label] = f"{rec['fp4_us']:.1f} us {rec.get('fp4_pct_bw', rec.get('pct_bw', 0)) or 0:.1f}%"
    for rec in doc.get("multi_token_rows", []):
        if rec.get("status") == "ok":
            key = f"{rec['batch']} x {rec['query_len']} @ {rec['context']}"
            rows.setdefault(key, {})[label] = f"{rec['fp4_us']:.1f} us {rec['tflops']:.1f} TF {rec.get('pct_bw', 0) or 0:.1f}%"
labels = sorted({l for r in rows.values() for l in r})
print("row | " + " | ".join(labels))
for key in sorted(rows):
    print(f"{key} | " + " | ".join(rows[key].get(l, "-") for l in labels))
PY
