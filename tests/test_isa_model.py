"""benchmarks/isa_model.py: the static performance estimate from the compiled instruction stream.

The model's arithmetic and its parsers run on hand-made instruction lists (always); the real
kernels' counts need nvcc + cuobjdump (cuda decode kernel, sm_90a SASS) or clang-22 (gfx950
partition kernels) and skip without them. The compiled outputs are cached in the temp dir by
the sources' hash, so a second run is fast.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from _tools import CLANG_MISSING, find_clang, find_nvcc, find_tool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import isa_model as im  # noqa: E402

# ---------------------------------------------------------------------------------------------
# hand-made instruction streams
# ---------------------------------------------------------------------------------------------
TOY_SASS = """
\t\tFunction : toy
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/               @P0 BRA 0x60 ;
        /*0030*/                   LDG.E.CONSTANT R3, desc[UR4][R4.64] ;
        /*0040*/                   IMAD R3, R3, 0x2, RZ ;
        /*0050*/                   SHF.R.S32.HI R3, RZ, 0x1, R3 ;
        /*0060*/                   BRA.DIV UR5, 0x200 ;
        /*0070*/                   SHFL.IDX PT, R5, R2, R3, 0x1f ;
        /*0080*/                   LDS.128 R8, [R6] ;
        /*0090*/                   HMMA.16816.F32 R12, R8, R10, RZ ;
        /*00a0*/                   FFMA R13, R12, R13, R14 ;
        /*00b0*/                   MUFU.EX2 R14, R13 ;
        /*00c0*/                   VOTE.ANY P1, P1 ;
        /*00d0*/               @P1 BRA 0x100 ;
        /*00e0*/                   LOP3.LUT R15, R15, 0xff, RZ, 0xc0, !PT ;
        /*00f0*/                   BRA 0x120 ;
        /*0100*/                   SHFL.BFLY PT, R16, R14, 0x1, 0x1f ;
        /*0110*/                   FMNMX R16, R16, R14, !PT ;
        /*0120*/                   LDGSTS.E.BYPASS.LTC128B.128 [R17], desc[UR4][R18.64] ;
        /*0130*/                   HMMA.16816.F32 R20, R8, R10, R20 ;
        /*0140*/              @!P2 BRA 0x10 ;
        /*0150*/                   EXIT ;
        /*0200*/                   BRA 0x70 ;
"""


def test_sass_parser_and_hot_path_on_a_toy_loop():
    code = im.parse_sass(TOY_SASS)["toy"]
    assert [i.op for i in code[:3]] == ["MOV", "IADD3", "BRA"]
    assert code[2].pred == "@P0"
    head, back = im.find_key_loop(code)
    assert (code[head].addr, code[back].addr) == (0x10, 0x140)
    hot = [i.addr for i in im.hot_path(code, head, back)]
    # the LDG region (block-id refill) is skipped, BRA.DIV falls through, the branch after
    # the vote is not taken (slow path 0x100-0x110 left out), the unconditional BRA is followed
    assert hot == [0x10, 0x20, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
                   0x120, 0x130, 0x140]
    c = im.count_classes(im.hot_path(code, head, back))
    assert (c["hmma"], c["fp32"], c["mufu"], c["shared"], c["global"], c["shuffle"], c["alu"],
            c["control"], c["total"]) == (2, 1, 1, 1, 1, 2, 2, 5, 15)


def test_cuda_model_arithmetic():
    c = Counter({"fp32": 100, "imad": 60, "alu": 520, "mufu": 4, "hmma": 16, "total": 750})
    cyc = im.cuda_tile_cycles(c, im.H100())
    # issue 750, fma 100 x 1 + 60 x 2 = 220, alu 520 x 2 = 1040, mufu 32, hmma 64
    assert cyc["limits"] == {"issue": 750, "fma": 220, "alu": 1040, "mufu": 32, "hmma": 64}
    assert cyc["bound"] == "alu" and cyc["sm_clk"] == 260
    # 260 SM clocks at 2 GHz = 130 ns; HBM: 2080 B / (2640 GB/s / 132) = 104 ns -> 80 %
    p = im.predict_pct(cyc["sm_clk"], 2.0, 2080, 2640.0, 132)
    assert p["issue_ns"] == pytest.approx(130.0) and p["hbm_ns"] == pytest.approx(104.0)
    assert p["pct"] == pytest.approx(80.0) and p["bound"] == "instruction issue"
    # under the HBM time the prediction is 100 %
    assert im.predict_pct(100, 2.0, 2080, 2640.0, 132)["pct"] == 100.0


TOY_AMD = """\
\ts_mov_b32 s0, 0
.LBB0_1:
\tv_add_u32_e32 v1, v1, v2
\ts_add_i32 s0, s0, 1
\ts_cmp_eq_u32 s0, 4
\ts_cbranch_scc0 .LBB0_1
; %bb.2:
\tv_exp_f32_e32 v3, v3
\tv_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], 0, v20, v21 op_sel_hi:[0,0,0]
\tds_read_b128 v[0:3], v4
\tglobal_load_dword v5, v[6:7], off
\ts_waitcnt vmcnt(0)
\ts_endpgm
"""


def test_amd_counts_and_model_arithmetic():
    ins, labels = im.parse_amd_body(TOY_AMD)
    assert im.amd_loops(ins, labels) == [(1, 4)]
    c, loops = im.amd_counts(ins, labels, [4])
    assert (c["valu"], c["valu_trans"], c["salu"], c["branch"], c["mfma"], c["lds"], c["vmem"],
            c["waitcnt"], c["total"], c["lds_bytes"]) == (4, 1, 9, 5, 1, 1, 1, 1, 23, 1024)
    cyc = im.amd_tile_cycles(c, im.MI355X())
    L = cyc["limits_cu"]
    # per tile = / 4 tiles per wave, per CU = / 4 SIMDs: valu (4 + 1 x 4) x 4 clk / 16 = 2;
    # mfma 32 / 16 = 2; salu (9 + 1 waitcnt) x 4 / 16 = 2.5; branch 5 x 4 / 16 = 1.25;
    # LDS 1024 B / 4 tiles / 128 B per clk = 2
    assert (L["valu"], L["mfma"], L["salu"], L["branch"], L["lds_bw"]) == (2, 2, 2.5, 1.25, 2)
    assert cyc["bound"] == "salu" and cyc["cu_clk"] == 2.5
    # 2.5 clk at 2.4 GHz against 2080 B at 8000 GB/s / 256 CUs (66.6 ns): memory-bound
    p = im.predict_pct(cyc["cu_clk"], 2.4, 2080, 8000.0, 256)
    assert p["hbm_ns"] == pytest.approx(66.56) and p["pct"] == 100.0


# ---------------------------------------------------------------------------------------------
# the real kernels
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sass():
    nvcc, cuobj = find_nvcc(), find_tool("cuobjdump")
    if nvcc is None or cuobj is None:
        pytest.skip("needs nvcc and cuobjdump (tests/_tools.py; bash .ci/install gets them)")
    return im.parse_sass(im.cuda_sass(nvcc, cuobj))


@pytest.mark.parametrize("name", [im.CUDA_DECODE, im.CUDA_DECODE_K8V4], ids=["fp4", "k8v4"])
def test_cuda_decode_loop_counts(sass, name):
    code = sass[name]
    head, back = im.find_key_loop(code)
    assert code[back].op == "BRA" and code[back].pred  # the conditional back-edge
    hot = im.hot_path(code, head, back)
    c = im.count_classes(hot)
    print(name, dict(c))
    # design note of csrc_cuda/paged_attention_decode.cuh: per 16-token tile a warp runs D/16
    # MMAs for S^T = K Q^T and D/16 for O^T = V^T P^T: 16 at D 128
    assert c["hmma"] == 2 * 128 // 16
    assert all(i.op == "HMMA.16816.F32" for i in hot if i.base == "HMMA")
    assert im.count_classes(code[head:back + 1])["hmma"] == 16  # none off the hot path
    for cls in ("fp32", "imad", "alu", "mufu", "shared", "global", "shuffle", "control"):
        assert c[cls] > 0, cls
    assert c["mufu"] == 4  # exp2 of the thread's 4 logits
    assert sum(i.base == "LDGSTS" for i in hot) >= 4  # the tile's K and V copies
    assert not [i for i in hot if i.base == "LDG"]    # the block-id refill is off the hot path
    cyc = im.cuda_tile_cycles(c)
    p = im.predict_pct(cyc["sm_clk"], 1.98, im.FP4_TILE_BYTES, 3050.0, 132)
    assert 0 < p["pct"] <= 100


@pytest.fixture(scope="module")
def hip_asm():
    clang = find_clang()
    if clang is None:
        pytest.skip(CLANG_MISSING)
    return im.hip_asm(clang)


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_gfx950_partition_counts(hip_asm, native):
    ins, labels = im.parse_amd_body(im.hip_partition_body(hip_asm, native))
    loops = im.amd_loops(ins, labels)
    # counted with every loop once: structure-independent checks
    c1, _ = im.amd_counts(ins, labels, [1] * len(loops))
    assert c1["mfma"] == 16  # 4 tiles x (Q hi, Q lo) for QK + 2 K-steps x 2 n-tiles x 2 for PV
    for cls in ("valu", "lds", "vmem", "waitcnt", "salu", "branch"):
        assert c1[cls] > 0, cls
    if len(loops) != len(im.HIP_DECODE_TRIPS):
        pytest.skip(f"the kernel now has {len(loops)} outermost loops, not "
                    f"{len(im.HIP_DECODE_TRIPS)}: update isa_model.HIP_DECODE_TRIPS")
    c, _ = im.amd_counts(ins, labels, im.HIP_DECODE_TRIPS)
    cyc = im.amd_tile_cycles(c)
    p = im.predict_pct(cyc["cu_clk"], 2.4, im.FP4_TILE_BYTES, 8000.0, 256)
    print("native" if native else "lut", dict(c), cyc, p)
    assert 0 < p["pct"] <= 100
