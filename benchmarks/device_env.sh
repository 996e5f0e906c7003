# Sourced by the device scripts: $OUT (./out when unset) with a bench/ folder, unbuffered Python,
# the extension's build folder, FlashInfer's JIT folder and build jobs, and FlashInfer itself
# where .peers/ was carried (benchmarks/make_peers_site.sh builds it), and the libraries built
# before the call where .prebuilt/ was carried (benchmarks/prebuild_cuda.py: no nvcc on the device
# for the trees and flag variants built there; any other build still compiles).
OUT=${OUT:-out}
mkdir -p "$OUT/bench"
OUT=$(cd "$OUT" && pwd)  # absolute: scripts write logs from inside other trees too
export PYTHONUNBUFFERED=1 TURBOQUANT_BUILD_DIR=${TURBOQUANT_BUILD_DIR:-$PWD/.tqbuild}
if [ -d .prebuilt ]; then export TURBOQUANT_PREBUILT_DIR=$PWD/.prebuilt; fi
# a build's lock left by a command killed while loading (timeout) makes every later load wait
# forever (torch's FileBaton): none can be in use when a call starts
find "$TURBOQUANT_BUILD_DIR" -name lock -delete 2>/dev/null || true
export FLASHINFER_WORKSPACE_BASE=$PWD/.fiws MAX_JOBS=${MAX_JOBS:-16}
if [ -f .peers/peers_site.tar.xz ]; then
  tar -xJf .peers/peers_site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# A flag set "label:flag,flag" (VARIANTS words) -> its flags, space-separated, for
# TURBOQUANT_CUDA_EXTRA_FLAGS.
variant_flags() { echo "${1#*:}" | tr , ' '; }
# The cuda backend's GPU tests that TESTS (a pytest -k expression; all when unset) selects, in
# this tree and build, within TEST_TIMEOUT (300 s): the whole log in $OUT/NAME_full.log, its
# tail printed and in $OUT/NAME.log.
gpu_tests() {  # NAME
  timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -rfs -n 8 tests/gpu/test_cuda_backend.py ${TESTS:+-k "$TESTS"} \
    > "$OUT/$1_full.log" 2>&1
  tail -30 "$OUT/$1_full.log" | tee "$OUT/$1.log"
}
