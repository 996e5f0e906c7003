#!/usr/bin/env bash
# One device call for the cache writer: builds the given tuning variants (restricted D=128 bf16
# builds) while the GPU tests run, then times the writer of every config in each variant, twice,
# interleaved (65536 tokens x 8 kv heads x D 128 bf16, CUDA graph).
#   OUT=dir bash benchmarks/writer_variants.sh "NAME=-DFLAG=1" ...   (the base build is "base")
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TURBOQUANT_BUILD_DIR=${TURBOQUANT_BUILD_DIR:-$PWD/.tqbuild}
CONFIGS=${CONFIGS:-default,rotation,smooth,plain}
variants=("base=" "$@")
for v in "${variants[@]:1}"; do
  TURBOQUANT_CUDA_EXTRA_FLAGS="-DTQ_ONLY_D128_BF16 ${v#*=}" python -c \
    "from turboquant._backends import cuda as c; print('${v%%=*}', c.ensure_loaded())" &
done
python -m pytest -q -rs tests/gpu 2>&1 | grep -v DEBUG | tail -12 > "$OUT/gpu_tests.log"
wait
tail -3 "$OUT/gpu_tests.log"
for round in 1 2; do
  for v in "${variants[@]}"; do
    flags=${v#*=}
    [ -n "$flags" ] && flags="-DTQ_ONLY_D128_BF16 $flags"
    echo "== round $round: ${v%%=*} ($flags)"
    TURBOQUANT_CUDA_EXTRA_FLAGS="$flags" python -m turboquant bench --shapes 32/8/128 --batches 64 \
      --contexts 4k --no-sdpa --configs "$CONFIGS" --out /tmp/writer_bench 2>&1 \
      | grep -E "^cache writer \(|^ 32/8/128" | sed 's/ (bytes.*//'
  done
done
