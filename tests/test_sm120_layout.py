"""Layout probes of the SM120 MMA software model on the CPU: a host program runs 32 simulated
lanes through the very model the emulation build runs on the GPU (csrc_cuda/sm120/mma_sm120.cuh),
with registers filled from the documented fragment / scale layouts, and compares with a plain
matrix product (identity A and B, one lane's scale byte changed, exact random values, for
kind::mxf8f6f4 k32 e4m3 x e2m1 and e4m3 x e4m3 (K8V4 keys), and kind::mxf4 k64, with several
selector values)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SM120 = ROOT / "csrc_cuda" / "sm120"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_mma_model_layout_probes_on_host(tmp_path):
    exe = tmp_path / "layout_host_test"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{SM120}",
                    str(SM120 / "tests" / "layout_host_test.cpp"), "-o", str(exe)], check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    print(res.stdout)
    assert res.returncode == 0 and res.stdout.strip().endswith("ALL OK"), res.stdout + res.stderr
    assert res.stdout.count(" ok\n") == 57  # 8 (kind, selector set) pairs x 7 probes + decoders
