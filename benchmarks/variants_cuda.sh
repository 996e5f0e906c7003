#!/bin/bash
# Build several tuning variants of the cuda backend in parallel (restricted D=128 bf16 builds),
# then time each with benchmarks/tune_cuda.py --quick. Usage (on the GPU machine):
#   bash benchmarks/variants_cuda.sh "NAME=-DFLAG=1 -DOTHER=2" "NAME2=..." ...
# SHAPES=1x32768,16x16384 picks the shapes (default: tune_cuda.py --quick), CHECK=1 adds the
# reference check. Output: one log per variant under ${OUT:-/tmp}, SUMMARY lines printed last.
export PYTHONUNBUFFERED=1 TURBOQUANT_BUILD_DIR=${TURBOQUANT_BUILD_DIR:-$PWD/.tqbuild}
out=${OUT:-/tmp}
for v in "$@"; do
  name=${v%%=*}; flags="-DTQ_ONLY_D128_BF16 ${v#*=}"
  TURBOQUANT_CUDA_EXTRA_FLAGS="$flags" python -c \
    "from turboquant._backends import cuda as c; print('$name', c.ensure_loaded())" &
done
wait
for v in "$@"; do
  name=${v%%=*}; flags="-DTQ_ONLY_D128_BF16 ${v#*=}"
  TURBOQUANT_CUDA_EXTRA_FLAGS="$flags" python benchmarks/tune_cuda.py --quick ${CHECK:+--check} ${SHAPES:+--shapes $SHAPES} \
    > "$out/var_$name.log" 2>&1
  echo "== $name ($flags)"; grep -E "^(attn|cache|HBM)" "$out/var_$name.log" | sed 's/ of HBM.*//'
done
