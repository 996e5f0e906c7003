"""benchmarks/ncu_source_summary.py on a small file in ncu's source-page CSV layout: the SASS
splits at the two USETMAXREG instructions into prologue, row warps and producers, and the
counts, stall reasons, opcodes and hottest rows of each region are those of its rows; the
listing of a region gives its executed instructions in order, within an address range."""
import csv
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ncu_source_summary", ROOT / "benchmarks" / "ncu_source_summary.py")
nss = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nss)

COLS = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
        "Instructions Executed", "stall_barrier", "stall_wait", "stall_short_sb", "stall_wait (Not Issued)"]
# address, source, samples, instructions, barrier / wait / short_sb samples
SASS = [
    ("0x100", "LDC R1, c[0x0][0x28]", 3, 10, 0, 3, 0),
    ("0x110", "USETMAXREG.TRY_ALLOC.CTAPOOL UP3, 0xd0", 0, 8, 0, 0, 0),
    ("0x120", "FFMA R164, R88, R16, -R163", 40, 1000, 0, 10, 30),
    ("0x130", "@!P2  BRA 0x7f0", 90, 500, 88, 2, 0),
    ("0x140", "MUFU.EX2 R3, R3", 5, 1000, 0, 5, 0),
    ("0x150", "USETMAXREG.DEALLOC.CTAPOOL 0x30", 0, 8, 0, 0, 0),
    ("0x160", "DEPBAR.LE SB0, 0x4", 70, 200, 70, 0, 0),
    ("0x170", "PRMT R14, R12, 0x7362, R15", 7, 3000, 0, 7, 0),
]


def write_csv(path, sass=SASS):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "void paged_attention_fp4_prefill_kernel<...>(...)"])
        w.writerow(COLS)
        for a, src, s, ins, bar, wait, ssb in sass:
            w.writerow([a, src, f"{s:,}", "0", f"{ins:,}", bar, wait, ssb, 99])


def test_regions_counts_and_hot_rows(tmp_path):
    p = tmp_path / "src.csv"
    write_csv(p)
    groups = {g["name"]: g for g in nss.summary(p, top=2)}
    assert list(groups) == ["prologue", "row warps", "producers"]
    rw, pr = groups["row warps"], groups["producers"]
    assert rw["instructions"] == 8 + 1000 + 500 + 1000 and rw["samples"] == 135
    assert pr["instructions"] == 8 + 200 + 3000 and pr["samples"] == 77
    assert rw["reasons"] == {"barrier": 88, "wait": 17, "short_sb": 30}  # the Not Issued column is not a reason
    assert rw["opcodes"]["FFMA"] == 1000 and rw["opcodes"]["BRA"] == 500 and rw["opcodes"]["USETMAXREG"] == 8
    assert [h[0] for h in rw["hot"]] == ["0x130", "0x120"]
    assert rw["hot"][0][3] == [("barrier", 88), ("wait", 2)]
    assert pr["hot"][0][:2] == ("0x160", 70)
    assert groups["prologue"]["instructions"] == 10


def test_without_the_split_one_region(tmp_path):
    sass = [r for r in SASS if "USETMAXREG" not in r[1]]
    p = tmp_path / "src.csv"
    write_csv(p, sass)
    groups = nss.summary(p)
    assert [g["name"] for g in groups] == ["whole kernel"]
    assert groups[0]["instructions"] == sum(r[3] for r in sass)


def test_listing_of_a_region_and_a_range(tmp_path):
    p = tmp_path / "src.csv"
    sass = SASS + [("0x145", "NOP", 0, 0, 0, 0, 0)]  # never executed: not listed
    write_csv(p, sorted(sass, key=lambda r: int(r[0], 16)))
    rows = nss.listing(p, "row warps")
    assert [(off, s, ins, src.split()[0]) for off, s, ins, src, _ in rows] == [
        (0, 0, 8, "USETMAXREG.TRY_ALLOC.CTAPOOL"), (0x10, 40, 1000, "FFMA"),
        (0x20, 90, 500, "@!P2"), (0x30, 5, 1000, "MUFU.EX2")]
    assert rows[1][4] == [("short_sb", 30), ("wait", 10)]
    part = nss.listing(p, "row warps", 0x120, 0x130)
    assert [off for off, *_ in part] == [0, 0x10]
    with pytest.raises(SystemExit, match="no region 'rows'"):
        nss.listing(p, "rows")
