"""The SM120 kernels compile for sm_120a and sm_121a to the block-scaled tensor-core
instructions, with no spills and no local memory (no SM120 GPU needed).

Compiles csrc_cuda/sm120/sass_check.cu (the attention kernel for head dims 64/128/256, the
per-32-scale variant, the K8V4 variants (E4M3 keys) at each head dim, the split combiner and the
three layout-probe kernels) with ``nvcc -cubin -Xptxas -v``, reads ptxas's resource lines and
the SASS from cuobjdump, and asserts: inside a loop (a backward branch spans it) in every
attention kernel, QMMA.SF.16832.F32.E4M3.E2M1.E8 (QK^T with FP4 keys, and PV) and, in the K8V4
kernels only, QMMA.SF.16832.F32.E4M3.E4M3.E8 (QK^T with E4M3 keys: D/32 per n-tile, 4 n-tiles,
as many as PV's); OMMA.SF.16864.F32.E2M1.E2M1.E8 in the mxf4 probe and each k32 form in its
probe; 0 bytes of stack frame, spill stores / loads, and no LDL/STL in the attention kernels
(nor stack or spills in the split combiner, which un-rotates), and at most 168 registers at
head dims <= 128 (three CTAs per SM). Prints the register counts.

Needs nvcc (CUDA 12.9+/13) and cuobjdump + nvdisasm; where no CUDA toolkit has them,
bash .ci/install gets them from PyPI (the nvidia-* wheels put them in
site-packages/nvidia/cu13/bin, where tests/_tools.py finds them).
"""
from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _tools import find_nvcc, find_tool

ROOT = Path(__file__).resolve().parents[1]
SM120 = ROOT / "csrc_cuda" / "sm120"
ARCHS = ("sm_120a", "sm_121a")
QMMA = "QMMA.SF.16832.F32.E4M3.E2M1.E8"
QMMA_E4M3 = "QMMA.SF.16832.F32.E4M3.E4M3.E8"  # K8V4's QK^T: E4M3 B
OMMA = "OMMA.SF.16864.F32.E2M1.E2M1.E8"


NVCC, CUOBJDUMP, NVDISASM = find_nvcc(), find_tool("cuobjdump"), find_tool("nvdisasm")
pytestmark = [
    pytest.mark.slow,  # two nvcc compiles: about 40 s on 2 cores
    pytest.mark.skipif(not (NVCC and CUOBJDUMP and NVDISASM),
                       reason=f"needs nvcc (and g++), cuobjdump and nvdisasm (found {NVCC}, "
                              f"{CUOBJDUMP}, {NVDISASM}): bash .ci/install gets them from PyPI"),
]


def _compile(arch, out_dir):
    cubin = out_dir / f"sass_check_{arch}.cubin"
    res = subprocess.run([NVCC, "-std=c++17", "-O3", f"-arch={arch}", "-cubin", "-Xptxas", "-v",
                          f"-I{SM120}", str(SM120 / "sass_check.cu"), "-o", str(cubin)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return cubin, res.stderr


def _ptxas_resources(log):
    """{mangled kernel: (registers, stack bytes, spill store bytes, spill load bytes)}"""
    out, current, props = {}, None, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            props = tuple(int(x) for x in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            out[current] = (int(m.group(1)),) + props
            current = None
    return out


def _sass_by_function(cubin):
    env = dict(os.environ, PATH=f"{Path(NVDISASM).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    res = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    funcs, name = {}, None
    for line in res.stdout.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
        elif name:
            m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
            if m:
                funcs[name].append((int(m.group(1), 16), m.group(2)))
    return funcs


def _in_loop(addr, instrs):
    for at, text in instrs:
        m = re.search(r"\bBRA(?:\.\S+)?\s+(?:!?U?P\d+,\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= addr < at:
            return True
    return False


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sm120_sass")
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        results = list(pool.map(lambda a: _compile(a, out_dir), ARCHS))
    return {arch: (_ptxas_resources(log), _sass_by_function(cubin)) for arch, (cubin, log) in zip(ARCHS, results)}


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_kernels_use_block_scaled_mma_without_spills(builds, arch):
    resources, sass = builds[arch]
    attention = sorted(k for k in sass if "paged_attention_sm120_kernel" in k)
    assert len(attention) == 7, sorted(sass)
    assert sum(1 for k in attention if k.endswith("ELb1EEEvNS0_15AttentionParamsE")) == 3, attention  # K8V4
    for name in attention:
        regs, stack, spill_st, spill_ld = resources[name]
        instrs = sass[name]
        head_dim = int(re.search(r"Li(\d+)ELb", name).group(1))
        k8v4 = name.endswith("ELb1EEEvNS0_15AttentionParamsE")  # <T, D, kPer32, kKeyE4m3>
        mma = [(a, t) for a, t in instrs if QMMA in t]
        mma8 = [(a, t) for a, t in instrs if QMMA_E4M3 in t]
        local = [t for _, t in instrs if re.search(r"\b(LDL|STL)\b", t)]
        print(f"{arch} {name}: {regs} registers, {stack} B stack, {spill_st}/{spill_ld} B spill "
              f"stores/loads, {len(local)} local-memory instructions, {len(mma)} x {QMMA}, "
              f"{len(mma8)} x {QMMA_E4M3}")
        assert mma, f"{name}: no {QMMA}"
        assert all(_in_loop(a, instrs) for a, _ in mma + mma8), f"{name}: an MMA outside the key loop"
        if k8v4:  # QK^T on E4M3 keys (4 n-tiles x D/32 steps), PV on FP4 values (D/8 n-tiles)
            assert len(mma8) == 4 * (head_dim // 32) and len(mma) == head_dim // 8, (len(mma8), len(mma))
        else:
            assert not mma8, f"{name}: {QMMA_E4M3} in an FP4-key kernel"
        assert (stack, spill_st, spill_ld) == (0, 0, 0), f"{name}: stack/spills {stack}/{spill_st}/{spill_ld}"
        assert not local, f"{name}: local memory {local[:3]}"
        assert not any(t.startswith("HMMA") or " HMMA" in t for _, t in instrs), "unscaled fp16 MMA in kernel"
        if head_dim <= 128:  # __launch_bounds__(128, 3): three CTAs per SM fit the register file
            assert regs <= 168, f"{name}: {regs} registers leave room for fewer than 3 CTAs per SM"
    combine = [k for k in sass if "combine_splits_sm120_kernel" in k]
    assert combine, sorted(sass)
    for name in combine:
        regs, stack, spill_st, spill_ld = resources[name]
        print(f"{arch} {name}: {regs} registers, {stack} B stack, {spill_st}/{spill_ld} B spill stores/loads")
        assert (stack, spill_st, spill_ld) == (0, 0, 0), f"{name}: stack/spills {stack}/{spill_st}/{spill_ld}"


@pytest.mark.parametrize("arch", ARCHS)
def test_probe_kernels_hold_each_instruction(builds, arch):
    resources, sass = builds[arch]
    probes = {k: v for k, v in sass.items() if "mma_probe_sm120_kernel" in k}
    k32 = [k for k in probes if "kernelILi0E" in k]
    k64 = [k for k in probes if "kernelILi1E" in k]
    k32_e4m3 = [k for k in probes if "kernelILi2E" in k]
    assert k32 and k64 and k32_e4m3, sorted(probes)
    for name in k32:
        lines = [t for _, t in probes[name] if "MMA" in t]
        print(f"{arch} {name}: {lines}")
        assert len(lines) == 1 and QMMA in lines[0]
    for name in k32_e4m3:
        lines = [t for _, t in probes[name] if "MMA" in t]
        print(f"{arch} {name}: {lines}")
        assert len(lines) == 1 and QMMA_E4M3 in lines[0]
    for name in k64:
        lines = [t for _, t in probes[name] if "MMA" in t]
        print(f"{arch} {name}: {lines}")
        assert len(lines) == 1 and OMMA in lines[0]
