#!/usr/bin/env bash
# One call on a two-GPU device machine for context-parallel decode (issue 21): the attention-
# state GPU tests (the merge kernel against the reference, views of one buffer under a CUDA
# graph, split calls merged into one), then benchmarks/context_parallel.py with NCCL's own
# protocol choice and with NCCL_PROTO=LL (the low-latency protocol for small messages), each
# with the one-GPU baseline measured in the same run.
#   run: bash benchmarks/context_parallel_check.sh   (logs and JSON under $OUT or ./out)
set -uo pipefail
source benchmarks/device_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "from turboquant._backends import cuda; print('cuda backend:', cuda.ensure_loaded() or 'built')"
python -m pytest -q -rs tests/test_states.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
SHAPES=${SHAPES:-1x1M,8x256k}
python benchmarks/context_parallel.py --shapes "$SHAPES" --out "$OUT/cp" 2>&1 | tee "$OUT/cp.log"
NCCL_PROTO=LL python benchmarks/context_parallel.py --shapes "$SHAPES" --out "$OUT/cp_ll" \
    --port 29534 2>&1 | tee "$OUT/cp_ll.log"
