"""AMD machine code of the FP4 paged-attention kernels, compiled here with clang-22 alone.

clang-22 comes from Debian's packages (``apt-get install clang-22``); no ROCm, no HIP
headers: ``-nogpulib -nogpuinc`` and the kernels use clang builtins only. The tests read the
assembly and check the instruction forms, spills, registers and occupancy of each kernel.

gfx950 (MI350X/MI355X): tq_fp4_gfx950_attention.cuh's partition kernel (native FP4 and LUT,
FP4 and E4M3 keys, decode and multi-token) for every shape class.
gfx942 (MI300X): tq_fp4_paged_attention.cuh, the LUT path on ``v_mfma_f32_16x16x32_fp8_fp8``
(FP8 = E4M3FNUZ, no scale operand: four instructions per 128-element K step, the E8M0 scales
applied in fp32), and its reduce.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from _tools import CLANG_MISSING, find_clang

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from isa_model import parse_amd_body  # noqa: E402 - one AMDGCN asm parser for the ISA checks and the estimate
CSRC = ROOT / "csrc_hip"
ISA_TU_942 = CSRC / "tq_fp4_gfx942_isa_check.hip"  # the gfx942 kernel's instantiations
MFMA = "v_mfma_scale_f32_16x16x128_f8f6f4"
FLAGS = ["-x", "hip", "--offload-arch=gfx950", "--offload-device-only", "-nogpulib", "-nogpuinc",
         "-O3", "-std=c++20", "-S"]


def _clang():
    clang = find_clang()
    if clang is None:
        pytest.skip(CLANG_MISSING)
    return clang


def compile_to_asm(src: Path, out: Path, arch: str = "gfx950") -> str:
    flags = [f if f != "--offload-arch=gfx950" else f"--offload-arch={arch}" for f in FLAGS]
    subprocess.run([_clang(), *flags, f"-I{CSRC}", "-o", str(out), str(src)], check=True)
    return out.read_text()


def kernels(asm: str) -> dict:
    """Mangled name -> {'body': code, 'stats': {NumVgprs, NumAgprs, ScratchSize, Occupancy, ...},
    'meta': {vgpr_spill_count, sgpr_spill_count, private_segment_fixed_size, ...}}."""
    result = {}
    for m in re.finditer(r"\t\.type\t(\S+),@function\n(.*?)\t\.size\t\1, (.*?)(?=\t\.type\t|\Z)", asm,
                         re.S):
        name, body, trailer = m.group(1), m.group(2), m.group(3)
        stats = {k: int(v) for k, v in re.findall(r"^; (\w+): (\d+)", trailer, re.M)}
        result[name] = {"body": body, "stats": stats, "meta": {}}
    for block in re.split(r"\n  - ", asm.split("amdhsa.kernels:", 1)[1]):
        name = re.search(r"\.name:\s+(\S+)", block)
        if name and name.group(1) in result:
            result[name.group(1)]["meta"] = {k: int(v) for k, v in
                                             re.findall(r"\.(\w+):\s+(\d+)\s*$", block, re.M)}
    return result


@pytest.fixture(scope="module")
def isa942(tmp_path_factory):
    return kernels(compile_to_asm(ISA_TU_942, tmp_path_factory.mktemp("isa942") / "isa.s", "gfx942"))


def _one(isa, multi: bool = False):
    """The gfx942 partition kernel <..., MULTI_TOKEN = multi> (tq_fp4_paged_attention.cuh)."""
    tag = f"ELb{int(multi)}EEEv"
    names = [n for n in isa if "partition_kernel" in n and tag in n]
    assert len(names) == 1, names
    return isa[names[0]]


def _report(name, k):
    s, m = k["stats"], k["meta"]
    print(f"{name}: VGPR {s['NumVgprs']} AGPR {s['NumAgprs']} total {s['TotalNumVgprs']} "
          f"SGPR {s.get('TotalNumSgprs')} scratch {s['ScratchSize']} B, spills vgpr "
          f"{m.get('vgpr_spill_count')} sgpr {m.get('sgpr_spill_count')}, LDS "
          f"{m.get('group_segment_fixed_size')} B, occupancy {s['Occupancy']} waves/SIMD")


def _no_spills(k):
    assert k["stats"]["ScratchSize"] == 0
    assert k["meta"]["vgpr_spill_count"] == 0
    assert k["meta"]["sgpr_spill_count"] == 0
    assert k["meta"]["private_segment_fixed_size"] == 0
    assert "scratch_" not in k["body"] and "buffer_store_dword" not in k["body"]


def _no_scratch_or_vgpr_spills(k):
    assert k["stats"]["ScratchSize"] == 0
    assert k["meta"]["vgpr_spill_count"] == 0
    assert k["meta"]["private_segment_fixed_size"] == 0
    assert "scratch_" not in k["body"] and "buffer_store_dword" not in k["body"]


def _instructions(body: str) -> tuple[list[tuple[str, str]], list[tuple[int, int]]]:
    """(opcode, operands) of a kernel body, and its loops as (head, back-edge) index ranges
    (a branch to a label at or before it)."""
    ins, labels = parse_amd_body(body)
    loops = [(labels[rest.split()[0]], i) for i, (op, rest) in enumerate(ins)
             if op.startswith(("s_branch", "s_cbranch")) and rest and rest.split()[0] in labels
             and labels[rest.split()[0]] <= i]
    return ins, loops


def _waits(ins, counter: str) -> int:
    return sum(1 for op, rest in ins if op == "s_waitcnt" and f"{counter}(0)" in rest)


# --------------------------------------------------------------------------- gfx950 (MI355X)
# tq_fp4_gfx950_attention.cuh: the partition kernel (one wave per workgroup, Q's transform in its
# prologue, 128-token steps, the reduce fused into the last partition of each row tile).

PARTITION_950 = "tq::gfx950::tq_fp4_pa_gfx950_kernel"
SPILL_LANE_OPS = ("v_writelane_b32", "v_readlane_b32")
MAX_SGPR_SPILLS = 32  # outside the step loop; head 256 multi-token LUT: 27 (Q's transform in the prologue)


def _gfx950_source(shapes, natives=("true", "false"), key8s=("false", "true")) -> str:
    """The gfx950 kernels of each (scalar, head, block, gqa) class: the partition kernel for both
    specializations, decode and multi-token (multi-token only above GQA 16), both key formats;
    named by their template arguments alone."""
    lines = ['#include "tq_fp4_gfx950_attention.cuh"']
    for scalar, head, block, gqa in shapes:
        for native in natives:
            for multi in ("false", "true") if gqa <= 16 else ("true",):
                for key8 in key8s:
                    k = f"{PARTITION_950}<tq::{scalar}, {head}, {block}, {gqa}, {native}, {multi}, {key8}>"
                    lines.append(f"template __attribute__((global)) decltype({k}) {k};")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def isa950(tmp_path_factory):
    d = tmp_path_factory.mktemp("isa950")
    src = d / "gfx950.hip"
    src.write_text(_gfx950_source([("Bf16", 128, 16, 8)]))
    return kernels(compile_to_asm(src, d / "gfx950.s"))


def _partition950(isa, native: bool, multi: bool, key_e4m3: bool):
    tag = f"ELb{int(native)}ELb{int(multi)}ELb{int(key_e4m3)}EEEv"
    names = [n for n in isa if "tq_fp4_pa_gfx950_kernel" in n and tag in n]
    assert len(names) == 1, names
    return isa[names[0]]


def _step_and_whole(k):
    """(the step loop's instructions, the kernel's) of a gfx950 partition kernel."""
    from isa_model import step_loop
    ins, labels = parse_amd_body(k["body"])
    h, b = step_loop(ins, labels, "gfx950")
    return ins[h:b + 1], ins


def _mfmas_per_step(head: int) -> int:
    """QK: 8 tiles x ceil(head / 128) K-steps x (Q hi, Q lo); PV: head / 16 output tiles x
    (P hi, P lo)."""
    return 8 * -(-head // 128) * 2 + head // 16 * 2


def _check_gfx950_partition(name, k, head, native, multi, key8):
    loop, whole = _step_and_whole(k)
    mf = [rest for op, rest in loop if op == MFMA]
    assert len(mf) == _mfmas_per_step(head) == sum(op == MFMA for op, _ in whole), name
    fp4 = [r for r in mf if "cbsz:4" in r]
    ops = {op for op, _ in loop}
    assert not [r for r in mf if "blgp" in r or ("cbsz" in r and "cbsz:4" not in r)]
    if native:  # V always FP4 (PV), K FP4 unless E4M3 keys
        assert len(fp4) == head // 16 * 2 + (0 if key8 else 8 * -(-head // 128) * 2), name
        assert "ds_read_b64_tr_b4" in ops and "ds_read_b64_tr_b8" not in ops
    else:
        assert not fp4
        assert "ds_read_b64_tr_b8" in ops and "ds_read_b64_tr_b4" not in ops
    # the fused reduce's ticket: one device-scope atomic add, after the step loop
    atomics = [op for op, _ in whole if "atomic" in op]
    assert len(atomics) == 1 and "add" in atomics[0] and not [op for op, _ in loop if "atomic" in op]
    _no_scratch_or_vgpr_spills(k)
    # SGPR spills go to VGPR lanes (v_writelane / v_readlane), a few, never inside the step loop
    # (Q's transform, the multi-token kernels' row ranges and head 256's bases: 2 to 27, in the
    # prologue and the fused reduce)
    # (head 256 multi-token K8V4 kernels: one v_readlane per 128-token step, of thousands)
    assert sum(op in SPILL_LANE_OPS for op, _ in loop) <= (1 if head == 256 and multi and key8 else 0), name
    assert k["meta"]["sgpr_spill_count"] <= MAX_SGPR_SPILLS, name


@pytest.mark.parametrize("key8", [False, True], ids=["fp4", "k8v4"])
@pytest.mark.parametrize("multi", [False, True], ids=["decode", "multi-token"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_gfx950_partition_kernel_forms(isa950, native, multi, key8):
    """The step loop holds every MFMA of the kernel: 32 per 128-token step at head 128; the
    native path feeds K (FP4 keys) and V as FP4 operands (cbsz:4) with V through
    ds_read_b64_tr_b4, the LUT path FP8 only with V through ds_read_b64_tr_b8; the fused
    reduce's ticket is the kernel's one atomic; no scratch, no spills in the loop (outside it
    the native FP4 decode kernel, the default, keeps one 64-bit pointer across the loop in a
    VGPR lane: 2 SGPRs; the others hold Q's transform's scalars in their prologue beside the
    reduce's pointers and spill 4 to 9; the estimate counts these instructions); two waves per
    SIMD at least (the one-wave workgroups' latency hiding)."""
    k = _partition950(isa950, native, multi, key8)
    _check_gfx950_partition("gfx950", k, 128, native, multi, key8)
    if native and not multi and not key8:
        assert k["meta"]["sgpr_spill_count"] <= 2
    _report(f"gfx950 {'native' if native else 'lut'} {'multi' if multi else 'decode'} "
            f"{'k8v4' if key8 else 'fp4'}", k)
    assert k["stats"]["Occupancy"] >= 2


def test_gfx950_shape_matrix_compiles_without_spills(tmp_path):
    """Every (head, block, GQA, dtype) class the backend can launch, both paths, decode and
    multi-token, FP4 and E4M3 (K8V4) keys: the same forms, no scratch or VGPR spills, a few
    SGPR spills at most and none in the step loop."""
    src = tmp_path / "matrix950.hip"
    src.write_text(_gfx950_source(SHAPES))
    ks = kernels(compile_to_asm(src, tmp_path / "matrix950.s"))
    parts = {n: k for n, k in ks.items() if "tq_fp4_pa_gfx950_kernel" in n}
    assert len(parts) == sum(8 if gqa <= 16 else 4 for _, _, _, gqa in SHAPES)
    for name, k in sorted(parts.items()):
        head = int(re.search(r"ELi(\d+)ELi\d+ELi\d+ELb", name).group(1))
        native, multi, key8 = (bool(int(x)) for x in re.search(r"ELb(\d)ELb(\d)ELb(\d)EEEv", name).groups())
        _check_gfx950_partition(name, k, head, native, multi, key8)
        _report(name, k)


# The reduce combines up to max_num_partitions partials per row: it loads a chunk of 8
# partitions' max logits (scalar loads), then their sums, maxima and 16-bit values, each
# chunk's loads before the chunk's one wait per counter, instead of a serial chain of one
# load and one wait per partition. A loop of the reduce that loads partials holds >= 8 loads
# per full wait (vmcnt(0) or lgkmcnt(0)); today 8 per 1 (maxima) and 24 per 2 (the rest).
# Loops with a single scalar load (the multi-token binary search over cu_query_lens: each
# step needs the last) are not partial loads.
REDUCE_LOADS_PER_WAIT_MIN = 8


def test_gfx942_reduce_loads_are_batched(isa942):
    isa_ = isa942
    names = [n for n in isa_ if "reduce_kernel" in n]
    assert len(names) == 2
    for name in names:
        ins, loops = _instructions(isa_[name]["body"])
        partial_loops = 0
        for h, b in loops:
            body = ins[h:b + 1]
            vec = sum(op.startswith("global_load") for op, _ in body)
            scal = sum(op.startswith("s_load") for op, _ in body)
            if vec == 0 and scal <= 1:
                continue
            partial_loops += 1
            w = _waits(body, "vmcnt") + _waits(body, "lgkmcnt")
            print(f"{name} loop {h}..{b}: {vec} global + {scal} scalar loads, {w} full waits")
            assert vec + scal >= REDUCE_LOADS_PER_WAIT_MIN * max(w, 1)
        assert partial_loops >= 2  # the maxima, then sums / maxima / values


SHAPES = [  # (scalar, head, block, gqa)
    ("Bf16", 64, 16, 8), ("Bf16", 128, 16, 4), ("Bf16", 128, 16, 16), ("Bf16", 128, 256, 1),
    ("Bf16", 256, 16, 8), ("Fp16", 128, 32, 8), ("Fp16", 256, 64, 16), ("Bf16", 128, 16, 3),
    ("Bf16", 128, 16, 32),  # above 16: multi-token only (decode calls run it too)
]


def _matrix_source() -> str:
    """A translation unit instantiating the gfx942 partition kernel for every SHAPES class,
    decode and multi-token (multi-token only above GQA 16)."""
    lines = ['#include "tq_fp4_paged_attention.cuh"']
    for scalar, head, block, gqa in SHAPES:
        for multi in ("false", "true") if gqa <= 16 else ("true",):
            k = f"tq::tq_fp4_pa_partition_kernel<tq::{scalar}, {head}, {block}, {gqa}, {multi}>"
            lines.append(f"template __attribute__((global)) decltype({k}) {k};")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- gfx942 (MI300X)

MFMA_942 = "v_mfma_f32_16x16x32_fp8_fp8"
FNUZ_TABLE_WORDS = ("0x44403800", "0x54504c48")  # v_perm_b32 sources: FNUZ of codes 0..3, 4..7
OCP_TABLE_WORDS = ("0x3c383000", "0x4c484440")
# LDS per workgroup (28288 B at head 128) against gfx942's 64 KiB per CU: 2 workgroups of 4
# waves per CU, i.e. 2 waves per SIMD; the VGPRs (83) would allow 5.
GFX942_OCCUPANCY = 2


@pytest.mark.parametrize("multi", [False, True], ids=["decode", "multi-token"])
def test_gfx942_lut_path_on_fp8_fp8_mfma(isa942, multi):
    """The LUT kernels for gfx942: no trap, no scaled MFMA; QK 4 tiles x (Q hi, Q lo) and PV
    2 K-steps x 2 output tiles x (P hi, P lo) per wave, each 128-element K step as four
    16x16x32 instructions on 2 + 2 VGPRs (8 FP8 bytes per lane): 64 in all; the FP4 -> FP8
    table is the FNUZ one; no spills."""
    k = _one(isa942, multi=multi)
    body = k["body"]
    assert "s_trap" not in body
    assert "v_mfma_scale" not in body
    lines = [ln.strip() for ln in body.splitlines() if MFMA_942 in ln]
    assert len(lines) == 64
    for ln in lines:
        a0, a1, b0, b1 = map(int, re.search(r"v\[\d+:\d+\], v\[(\d+):(\d+)\], v\[(\d+):(\d+)\]",
                                            ln).groups())
        assert (a1 - a0, b1 - b0) == (1, 1), ln
    assert "v_perm_b32" in body and "v_cvt_pk_fp8_f32" in body
    assert all(w in body for w in FNUZ_TABLE_WORDS)
    assert not any(w in body for w in OCP_TABLE_WORDS)
    assert "v_ldexp_f32" in body  # the E8M0 scales, in fp32
    _no_spills(k)
    _report(f"gfx942 lut {'multi-token' if multi else 'decode'}", k)
    assert k["stats"]["Occupancy"] >= GFX942_OCCUPANCY


def test_gfx942_reduce_kernels(isa942):
    names = [n for n in isa942 if "reduce_kernel" in n]
    assert len(names) == 2
    for name in names:
        assert "s_trap" not in isa942[name]["body"]
        _no_spills(isa942[name])
        _report(f"gfx942 {name}", isa942[name])


def test_gfx942_shape_matrix_compiles_without_spills(tmp_path):
    """Every (head, block, GQA, dtype) class, LUT path with FP4 keys, decode and multi-token,
    for gfx942: the 16x16x32 FP8 MFMA, no trap, no spills."""
    src = tmp_path / "matrix942.hip"
    src.write_text(_matrix_source())
    ks = kernels(compile_to_asm(src, tmp_path / "matrix942.s", "gfx942"))
    assert len(ks) == sum(2 if gqa <= 16 else 1 for _, _, _, gqa in SHAPES)
    for name, k in sorted(ks.items()):
        _no_spills(k)
        assert MFMA_942 in k["body"] and "s_trap" not in k["body"]
        _report(f"gfx942 {name}", k)
