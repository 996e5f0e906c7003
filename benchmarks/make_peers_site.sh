#!/usr/bin/env bash
# Builds .peers/peers_site.tar.xz, what benchmarks/device_env.sh unpacks on the device machine
# (which has no package index): flashinfer-python 0.7.2.post1 (pure Python, 62 MB as a wheel,
# over the 64 MiB a device call may carry) and apache-tvm-ffi 0.1.12 for CPython 3.12, unpacked,
# minus the kernel sources paged decode and prefill never compile (sampling, MoE, MLA, ...),
# xz-compressed (about 16 MB). Everything else FlashInfer imports is in the device image.
#   run once, here: bash benchmarks/make_peers_site.sh ; echo /.peers/ >> .git/info/exclude
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$work/whl" flashinfer-python==0.7.2.post1 \
    apache-tvm-ffi==0.1.12
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do (cd "$work/site" && unzip -q -o "$w"); done
csrc="$work/site/flashinfer/data/csrc"
rm -rf "$csrc"/cake_sampling "$csrc"/cake_dsv4 "$csrc"/kda "$csrc"/fused_moe "$csrc"/gdn \
    "$csrc"/cake_fmha "$csrc"/blackwell_bf16_fp4 "$csrc"/experimental "$csrc"/alphamoe* \
    "$work"/site/*.dist-info/RECORD
mkdir -p .peers
tar -cJf .peers/peers_site.tar.xz -C "$work" site
ls -l .peers/peers_site.tar.xz
