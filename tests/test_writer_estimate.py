"""benchmarks/writer_estimate.py: the HIP cache writer's predicted % of MI355X's 8 TB/s, by the
ISA model's AMD counting. The arithmetic and the loop test run on hand-made input (always); the
estimate itself compiles the hipified writer for gfx950 and skips without clang-22."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from _tools import CLANG_MISSING, find_clang

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import writer_estimate as we  # noqa: E402

TOY = """\
kernel:
\ts_load_dwordx2 s[0:1], s[4:5], 0x0
\ts_cbranch_scc1 .LBB0_4
.LBB0_1:
\tv_add_f32_e32 v1, v1, v2
\tglobal_store_dword v[2:3], v1, off
.LBB0_3:
\ts_endpgm
.LBB0_4:
\tv_mov_b32_e32 v1, 0
\ts_branch .LBB0_1
"""


def test_a_jump_back_from_an_out_of_line_block_is_not_a_loop():
    """The layout the writer's int32 slot load has (a block after s_endpgm jumping back) is no
    loop; a branch back to a block that reaches it again is one."""
    ins, labels = we.parse_amd_body(TOY)
    assert we.real_loops(ins, labels) == []
    assert len(we.amd_loops(ins, labels)) == 1  # isa_model takes every backward branch
    counts, valu = we.wave_counts(TOY)
    assert counts["valu"] == 2 and counts["vmem"] == 1 and counts["total"] == 7
    assert valu == Counter({"v_add_f32_e32": 1, "v_mov_b32_e32": 1})
    looping = TOY.replace("\ts_endpgm\n", "\ts_cbranch_vccnz .LBB0_1\n\ts_endpgm\n")
    ins, labels = we.parse_amd_body(looping)
    assert we.real_loops(ins, labels) == [(2, 4)]
    with pytest.raises(ValueError, match="loops"):
        we.wave_counts(looping)


def test_model_arithmetic():
    """100 VALU instructions a wave = 100 CU clocks per wave (4 clocks on one of 4 SIMDs);
    65536 waves on 256 CUs at 2.4 GHz: 10.67 us, against 64 MB at 8 TB/s = 8 us: VALU-bound at
    75 %; with 50 the HBM time holds (100 %)."""
    r = we.model(Counter(valu=100, vmem=2), waves=65536, nbytes=64e6)
    assert r["limits_cu_clk_per_wave"]["valu"] == pytest.approx(100)
    assert r["instruction_us"] == pytest.approx(100 * 256 / 2400)
    assert r["hbm_us"] == pytest.approx(8.0)
    assert r["bound"] == "valu" and r["pct_of_hbm"] == pytest.approx(75.0)
    assert r["pct_of_hbm_x_dependency"] == pytest.approx(50.0)
    r = we.model(Counter(valu=50), waves=65536, nbytes=64e6)
    assert r["bound"] == "memory" and r["pct_of_hbm"] == pytest.approx(100.0)
    assert r["time_us"] == pytest.approx(8.0)


@pytest.fixture(scope="module")
def asm():
    clang = find_clang()
    if clang is None:
        pytest.skip(CLANG_MISSING)
    return we.writer_asm(clang)


def test_estimate_default_and_plain(asm):
    """Both configs give a % of 8 TB/s in (0, 100] with a named bound; the default config (key
    smoothing and rotation fused) does more VALU work than plain and cannot be faster; the
    kernel counted is the one asked for (the rotation's ds_bpermute only in the default's)."""
    res = {name: we.estimate(name, asm) for name in we.CONFIGS}
    for name, r in res.items():
        assert 0 < r["pct_of_hbm"] <= 100, (name, r["pct_of_hbm"])
        assert 0 < r["pct_of_hbm_x_dependency"] <= r["pct_of_hbm"]
        assert r["bound"] in ("memory", "valu", "salu", "lds_issue", "lds_bw", "vmem_issue",
                              "branch", "mfma")
        assert r["waves"] == 65536 and r["waves_per_cu"] == 256
        assert r["bytes"] == 65536 * 8 * (2 * 128 * 2 + 128 + 2)
        assert r["counts"].get("mfma", 0) == 0 and r["counts"]["vmem"] > 0
        print(f"{name}: {r['pct_of_hbm']:.1f} % of 8 TB/s ({r['bound']}), "
              f"{r['instruction_us']:.1f} / {r['hbm_us']:.1f} us")
    d, p = res["default"], res["plain"]
    assert d["counts"]["valu"] > p["counts"]["valu"]
    assert d["counts"]["lds"] > 16 * p["counts"]["lds"]  # the FWHT's shuffles
    assert d["pct_of_hbm"] <= p["pct_of_hbm"]
    assert "ELb1ELb1ELb0E" in d["kernel"] and "ELb0ELb0ELb0E" in p["kernel"]


def test_main_prints_and_writes_json(asm, tmp_path, capsys):
    out = tmp_path / "writer.json"
    assert we.main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| default |" in text and "| plain |" in text and "predicted % of 8 TB/s" in text
    data = json.loads(out.read_text())
    assert set(data) == {"default", "plain"}
    assert all(0 < r["pct_of_hbm"] <= 100 for r in data.values())
