"""The prefill kernel's warpgroup MMAs (SM90a) on structured integer inputs, issued as the kernel
issues them (fp4_common.cuh's wrappers and descriptor, attention_prefill.cuh's decoded-tile
layout): S = Q K^T with K-major K (Q in registers as the kernel has it, and Q from shared
memory as the variants in benchmarks/variants), O = P V with N-major V at N 128 and 64, and the
FP8 S of the kernel's FP8 path (E4M3 Q in registers, E5M2 K decoded from FP4 codes, and E4M3
K8V4 key bytes), each checked
for equality with a host product (wgmma_layout_check.cu). A descriptor or fragment-map error shows
here as moved rows, columns or blocks, before it shows in attention as noise."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tools import find_nvcc, nvcc_link_flags  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NVCC = find_nvcc()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an SM90 GPU (H100 / H200)"),
    pytest.mark.skipif(NVCC is None, reason="needs nvcc"),
]


def test_wgmma_fragments_and_descriptors(tmp_path):
    exe = tmp_path / "wgmma_layout_check"
    build = subprocess.run([NVCC, "-std=c++17", "-O2", "-gencode=arch=compute_90a,code=sm_90a",
                            f"-I{ROOT / 'csrc_cuda'}", str(Path(__file__).with_name("wgmma_layout_check.cu")),
                            "-o", str(exe), *nvcc_link_flags(NVCC)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": 0 of") == 6, run.stdout
