#!/usr/bin/env bash
set -uo pipefail
source benchmarks/device_env.sh
S=$SECONDS
ls .tqbuild 2>/dev/null; find .tqbuild -name lock -print -delete 2>/dev/null
python -c "import sys; sys.path.insert(0, 'tests/gpu'); import test_cuda_backend as t; open('/tmp/case.py', 'w').write(t.SANITIZER_CASE)"
for t in . .s_ahead_mbarrier_nd4 .nd4; do (cd $t && python -c "from turboquant._backends import cuda; print('$t build:', cuda.ensure_loaded() or 'ok')") & done; wait
echo "builds done at $((SECONDS-S)) s"
MT="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --multi-token 1x512@4k,1x2048@16k"
for t in . .s_ahead_mbarrier_nd4 .nd4; do
  (cd $t && timeout 100 python -m turboquant bench $MT --out /tmp/b_$t 2>&1 | grep -A3 "^multi-token rows:" | sed "s|^|$t |" | tee -a $OUT/times.log)
done
echo "benches done at $((SECONDS-S)) s"
cd .s_ahead_mbarrier_nd4
PYTHONPATH=$PWD timeout 90 compute-sanitizer --tool synccheck python /tmp/case.py 2>&1 | tail -3 | tee $OUT/synccheck.log
echo "synccheck done at $((SECONDS-S)) s"
timeout $((560-(SECONDS-S))) python -m pytest -q -n 8 -rf tests/gpu/test_cuda_backend.py -k "prefill or sanitizer" 2>&1 | tail -6 | tee $OUT/tests.log
