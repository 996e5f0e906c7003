"""gfx950 machine code of the FP4 paged-attention kernel, compiled here with clang-22 alone.

clang-22 comes from Debian's packages (``apt-get install clang-22``); no ROCm, no HIP
headers: ``-nogpulib -nogpuinc`` and the kernel uses clang builtins only. The tests read the
assembly and check the instruction forms, spills, registers and occupancy of each kernel.

gfx942 (MI300X): the same translation unit compiled with ``--offload-arch=gfx942`` gives the
LUT path on ``v_mfma_f32_16x16x32_fp8_fp8`` (FP8 = E4M3FNUZ, no scale operand: four
instructions per 128-element K step, the E8M0 scales applied in fp32); the native FP4 and the
K8V4 instantiations are trap stubs there (the launcher never picks them on gfx942).
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
ISA_TU = CSRC / "tq_fp4_gfx950_isa_check.hip"
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
def isa(tmp_path_factory):
    return kernels(compile_to_asm(ISA_TU, tmp_path_factory.mktemp("isa") / "isa.s"))


def _one(isa, native: bool, multi: bool = False, key_e4m3: bool = False):
    """The partition kernel <..., USE_NATIVE_FP4_MFMA = native, MULTI_TOKEN = multi,
    KEY_E4M3 = key_e4m3>."""
    tag = f"ELb{int(native)}ELb{int(multi)}ELb{int(key_e4m3)}EEEv"
    names = [n for n in isa if "partition_kernel" in n and tag in n]
    assert len(names) == 1, names
    return isa[names[0]]


# Today's decode figures (Bf16, head 128, block 16, GQA 8) before multi-token and window
# support: native 82 VGPRs, 5 waves/SIMD; LUT 105 VGPRs, 4 waves/SIMD. Neither may get worse.
DECODE_OCCUPANCY = {True: 5, False: 4}


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


def test_native_path_uses_fp4_operand(isa):
    k = _one(isa, native=True)
    lines = [ln.strip() for ln in k["body"].splitlines() if MFMA in ln]
    for ln in lines:
        print(ln)
    fp4 = [ln for ln in lines if "cbsz:4" in ln]
    fp8 = [ln for ln in lines if "cbsz" not in ln and "blgp" not in ln]
    # QK: 4 tiles of 16 tokens per wave x (Q hi, Q lo); A = 4 VGPRs of FP4 (cbsz:4), B = 8
    # VGPRs of FP8.
    assert len(fp4) == 8
    assert all(re.search(r"v\[\d+:\d+\], v\[(\d+):(\d+)\], v\[(\d+):(\d+)\]", ln) for ln in fp4)
    for ln in fp4:
        a0, a1, b0, b1 = map(int, re.search(r"v\[\d+:\d+\], v\[(\d+):(\d+)\], v\[(\d+):(\d+)\]", ln).groups())
        assert (a1 - a0, b1 - b0) == (3, 7), ln
    # PV: FP8 x FP8, 2 K-steps x 2 output tiles per wave x (P hi, P lo).
    assert len(fp8) == 8
    assert len(lines) == 16
    _no_spills(k)
    _report("native", k)
    assert k["stats"]["Occupancy"] >= DECODE_OCCUPANCY[True]


def test_lut_path_is_fp8_only(isa):
    k = _one(isa, native=False)
    lines = [ln.strip() for ln in k["body"].splitlines() if MFMA in ln]
    for ln in lines:
        print(ln)
    assert len(lines) == 16
    assert not [ln for ln in lines if "cbsz" in ln or "blgp" in ln]  # format 0 (E4M3) on both sides
    assert "v_perm_b32" in k["body"]  # the FP4 -> E4M3 table
    _no_spills(k)
    _report("lut", k)
    assert k["stats"]["Occupancy"] >= DECODE_OCCUPANCY[False]


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_multi_token_kernel_same_forms_and_occupancy(isa, native):
    """The multi-token instantiation (cu_query_lens; window and soft cap are runtime
    arguments of both): the same MFMA instructions as decode, in the same number, no spills,
    and an occupancy no lower than decode's."""
    decode, multi = _one(isa, native), _one(isa, native, multi=True)
    forms = lambda k: sorted(re.sub(r"v\[?\d+(:\d+)?\]?", "v", ln.strip())  # noqa: E731
                             for ln in k["body"].splitlines() if MFMA in ln)
    assert forms(multi) == forms(decode)
    _no_spills(multi)
    _report(f"{'native' if native else 'lut'} multi-token", multi)
    assert multi["stats"]["Occupancy"] >= decode["stats"]["Occupancy"]


@pytest.mark.parametrize("multi", [False, True], ids=["decode", "multi-token"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_k8v4_keys_use_the_fp8_operand(isa, native, multi):
    """K8V4 (KEY_E4M3): the key operand of QK is the E4M3 bytes as they are, i.e. format 0
    (no cbsz:4, no table) in both specializations; the same 16 MFMAs per wave and partition as
    the FP4 kernels, no spills, and the native FP4 decode kernel's occupancy."""
    k = _one(isa, native, multi, key_e4m3=True)
    lines = [ln.strip() for ln in k["body"].splitlines() if MFMA in ln]
    for ln in lines:
        print(ln)
    assert len(lines) == 16
    assert not [ln for ln in lines if "cbsz" in ln or "blgp" in ln]
    # every operand pair is 8 + 8 VGPRs (FP8 x FP8): QK's A is 32 key bytes per lane
    for ln in lines:
        a0, a1, b0, b1 = map(int, re.search(r"v\[\d+:\d+\], v\[(\d+):(\d+)\], v\[(\d+):(\d+)\]",
                                            ln).groups())
        assert (a1 - a0, b1 - b0) == (7, 7), ln
    _no_spills(k)
    _report(f"k8v4 {'native' if native else 'lut'} {'multi-token' if multi else 'decode'}", k)
    assert k["stats"]["Occupancy"] >= DECODE_OCCUPANCY[True]


def test_reduce_kernels(isa):
    names = [n for n in isa if "reduce_kernel" in n]
    assert len(names) == 2  # decode, multi-token
    for name in names:
        _no_spills(isa[name])
        _report(name, isa[name])


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


# Issue 20: the per-partition prologue (Q, the state record's lam and m rows, the rotation
# signs, the sink key) loads 16-byte vectors, all of a group before the group's one wait,
# instead of one 16-bit / 32-bit load and one s_waitcnt vmcnt(0) per element (141 waits per
# wave and partition at head 128, benchmarks/isa_model.py). Today, before the first MFMA:
# 6 (native) / 7 (LUT) vmcnt(0) waits in straight-line code, among them the block table ->
# scale bytes chain and the sink key, and one loop (the 8-element groups, 2 trips at head
# 128, unrolled twice) with 14 vector loads and 2 such waits. The bounds leave a little room
# for the scheduler; a return to element-at-a-time loads breaks both.
PROLOGUE_VMCNT0_MAX = 8
PROLOGUE_LOADS_PER_VMCNT0_MIN = 4


@pytest.mark.parametrize("key_e4m3", [False, True], ids=["fp4", "k8v4"])
@pytest.mark.parametrize("multi", [False, True], ids=["decode", "multi-token"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_prologue_loads_are_batched(isa, native, multi, key_e4m3):
    ins, loops = _instructions(_one(isa, native, multi, key_e4m3)["body"])
    first = next(i for i, (op, _) in enumerate(ins) if op.startswith("v_mfma"))
    prologue = ins[:first]
    narrow = sorted({op for op, _ in prologue if op.startswith("global_load")
                     and ("short" in op or "d16" in op)})
    assert not narrow, f"16-bit loads before the first MFMA (Q comes in 16-byte vectors): {narrow}"
    waits = _waits(prologue, "vmcnt")
    print(f"vmcnt(0) before the first MFMA: {waits}")
    assert waits <= PROLOGUE_VMCNT0_MAX
    for h, b in loops:
        if h >= first:
            continue
        body = ins[h:b + 1]
        loads = sum(op.startswith("global_load") for op, _ in body)
        w = _waits(body, "vmcnt")
        print(f"prologue loop {h}..{b}: {loads} global loads, {w} vmcnt(0)")
        assert loads == 0 or w == 0 or loads >= PROLOGUE_LOADS_PER_VMCNT0_MIN * w


# The reduce combines up to max_num_partitions partials per row: it loads a chunk of 8
# partitions' max logits (scalar loads), then their sums, maxima and 16-bit values, each
# chunk's loads before the chunk's one wait per counter, instead of a serial chain of one
# load and one wait per partition. A loop of the reduce that loads partials holds >= 8 loads
# per full wait (vmcnt(0) or lgkmcnt(0)); today 8 per 1 (maxima) and 24 per 2 (the rest).
# Loops with a single scalar load (the multi-token binary search over cu_query_lens: each
# step needs the last) are not partial loads.
REDUCE_LOADS_PER_WAIT_MIN = 8


@pytest.mark.parametrize("arch_isa", ["isa", "isa942"])
def test_reduce_loads_are_batched(request, arch_isa):
    isa_ = request.getfixturevalue(arch_isa)
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


def _matrix_source(natives, key8s) -> str:
    """A translation unit instantiating the partition kernel for every SHAPES class, decode and
    multi-token (multi-token only above GQA 16), each native-path and key-format flag given."""
    args = ("const uint16_t*, const uint8_t*, const uint8_t*, const uint8_t*, const uint8_t*, "
            "const int*, const int*, const int*, float*, float*, uint16_t*, float, float, int, "
            "int, int, int, int, int, int, int64_t, int, int, const float*, const float*, "
            "const int*, int, int, int")
    lines = ['#include "tq_fp4_paged_attention.cuh"']
    for scalar, head, block, gqa in SHAPES:
        for native in natives:
            for multi in ("false", "true") if gqa <= 16 else ("true",):
                for key8 in key8s:
                    lines.append(f"template __attribute__((global)) void "
                                 f"tq::tq_fp4_pa_partition_kernel<tq::{scalar}, {head}, {block}, "
                                 f"{gqa}, {native}, {multi}, {key8}>({args});")
    return "\n".join(lines) + "\n"


def test_shape_matrix_compiles_without_spills(tmp_path):
    """Every (head, block, GQA, dtype) class the backend can launch, both paths, decode and
    multi-token, FP4 and E4M3 (K8V4) keys: no spills."""
    src = tmp_path / "matrix.hip"
    src.write_text(_matrix_source(natives=("true", "false"), key8s=("false", "true")))
    ks = kernels(compile_to_asm(src, tmp_path / "matrix.s"))
    assert len(ks) == sum(8 if gqa <= 16 else 4 for _, _, _, gqa in SHAPES)
    for name, k in sorted(ks.items()):
        _no_spills(k)
        assert MFMA in k["body"]
        _report(name, k)


# --------------------------------------------------------------------------- gfx942 (MI300X)

MFMA_942 = "v_mfma_f32_16x16x32_fp8_fp8"
FNUZ_TABLE_WORDS = ("0x44403800", "0x54504c48")  # v_perm_b32 sources: FNUZ of codes 0..3, 4..7
OCP_TABLE_WORDS = ("0x3c383000", "0x4c484440")
# LDS per workgroup (28288 B at head 128) against gfx942's 64 KiB per CU: 2 workgroups of 4
# waves per CU, i.e. 2 waves per SIMD; the VGPRs (83) would allow 5.
GFX942_OCCUPANCY = 2


@pytest.fixture(scope="module")
def isa942(tmp_path_factory):
    return kernels(compile_to_asm(ISA_TU, tmp_path_factory.mktemp("isa942") / "isa.s", "gfx942"))


@pytest.mark.parametrize("multi", [False, True], ids=["decode", "multi-token"])
def test_gfx942_lut_path_on_fp8_fp8_mfma(isa942, multi):
    """The LUT kernels for gfx942: no trap, no scaled MFMA; QK 4 tiles x (Q hi, Q lo) and PV
    2 K-steps x 2 output tiles x (P hi, P lo) per wave, each 128-element K step as four
    16x16x32 instructions on 2 + 2 VGPRs (8 FP8 bytes per lane): 64 in all; the FP4 -> FP8
    table is the FNUZ one; no spills."""
    k = _one(isa942, native=False, multi=multi)
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


@pytest.mark.parametrize("key_e4m3", [False, True], ids=["fp4", "k8v4"])
def test_gfx942_native_and_k8v4_are_stubs(isa942, key_e4m3):
    """No scaled MFMA on gfx942: the native FP4 kernels and the K8V4 kernels (whose OCP E4M3
    key bytes the FNUZ MFMA would misread) trap; the launcher declines them on gfx942."""
    for native, multi in ((True, False), (True, True)) + (((False, False), (False, True)) if key_e4m3 else ()):
        k = _one(isa942, native, multi, key_e4m3)
        assert "s_trap" in k["body"] and MFMA_942 not in k["body"]


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
    src.write_text(_matrix_source(natives=("false",), key8s=("false",)))
    ks = kernels(compile_to_asm(src, tmp_path / "matrix942.s", "gfx942"))
    assert len(ks) == sum(2 if gqa <= 16 else 1 for _, _, _, gqa in SHAPES)
    for name, k in sorted(ks.items()):
        _no_spills(k)
        assert MFMA_942 in k["body"] and "s_trap" not in k["body"]
        _report(f"gfx942 {name}", k)
