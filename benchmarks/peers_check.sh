#!/usr/bin/env bash
# One call on the device machine for issue 19's peer rows: turboquant next to FlashInfer's paged
# decode over BF16, FP8 and NVFP4 caches of the same K/V and pages (bench --peers).
# FlashInfer is not in the device image and nothing can be fetched there: it travels as
# .peers/peers_site.tar.xz (flashinfer-python 0.7.2.post1 and apache-tvm-ffi 0.1.12 for
# CPython 3.12, unpacked, with the kernel sources decode does not use removed, xz-compressed);
# its JIT cache lives in .fiws/ (kept while the machine stays warm). Build .peers/ here first
# with benchmarks/make_peers_site.sh and name it in the call's carry.
#   run: bash benchmarks/peers_check.sh   (writes under $OUT or ./out)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
python -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
python -m turboquant bench --shapes ${SHAPES:-32/8/128} --batches ${BATCHES:-1,16,64,128} \
    --contexts ${CONTEXTS:-4k,16k,32k} --configs ${CONFIGS:-default} --peers --no-sdpa \
    --no-writer --out "$OUT/bench" 2>&1 | grep -v "kernel<" | tee "$OUT/bench.log"
