# Sourced by benchmarks/device.sh (and by a device command line that runs Python itself):
# $OUT (./out when unset, made absolute) with a bench/ folder, unbuffered Python, the
# extension's build folder, FlashInfer's JIT folder and build jobs, NVLink multicast off for
# NCCL (the device machines ask for it), FlashInfer itself where .peers/ was carried
# (benchmarks/make_peers_site.sh builds it), and the libraries built before the call where
# .prebuilt/ was carried (benchmarks/prebuild_cuda.py: no nvcc time on the device for the trees
# and flag variants built there; any other build still compiles).
OUT=${OUT:-out}
mkdir -p "$OUT/bench"
OUT=$(cd "$OUT" && pwd)  # absolute: logs are written from inside other trees too
export OUT PYTHONUNBUFFERED=1 TURBOQUANT_BUILD_DIR=${TURBOQUANT_BUILD_DIR:-$PWD/.tqbuild}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .prebuilt ]; then export TURBOQUANT_PREBUILT_DIR=$PWD/.prebuilt; fi
# a build's lock left by a command killed while loading (timeout) makes every later load wait
# forever (torch's FileBaton): none can be in use when a call starts
find "$TURBOQUANT_BUILD_DIR" -name lock -delete 2>/dev/null || true
export FLASHINFER_WORKSPACE_BASE=$PWD/.fiws MAX_JOBS=${MAX_JOBS:-16}
if [ -f .peers/peers_site.tar.xz ] && [ -z "${DEVICE_DRY_RUN:-}" ]; then
  # unpacked once per machine (a call may run device.sh several times)
  [ -d /tmp/site/flashinfer ] || tar -xJf .peers/peers_site.tar.xz -C /tmp
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# A flag set "NAME=FLAGS" or "NAME:FLAGS" (FLAGS separated by commas or spaces) -> its name, and
# its flags space-separated for TURBOQUANT_CUDA_EXTRA_FLAGS. The name ends at the first = or :.
variant_name() { echo "${1%%[=:]*}"; }
variant_flags() { case $1 in *[=:]*) echo "${1#*[=:]}" | tr , ' ' ;; esac; }
