# Sourced by the device scripts: $OUT (./out when unset) with a bench/ folder, unbuffered Python,
# the extension's build folder, FlashInfer's JIT folder and build jobs, and FlashInfer itself
# where .peers/ was carried (benchmarks/make_peers_site.sh builds it).
OUT=${OUT:-out}
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1 TURBOQUANT_BUILD_DIR=${TURBOQUANT_BUILD_DIR:-$PWD/.tqbuild}
export FLASHINFER_WORKSPACE_BASE=$PWD/.fiws MAX_JOBS=${MAX_JOBS:-16}
if [ -f .peers/peers_site.tar.xz ]; then
  tar -xJf .peers/peers_site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
