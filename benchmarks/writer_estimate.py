"""The HIP cache writer's speed on MI355X, estimated by the project's static ISA model (issue 38,
item 4): what `aiter.reshape_and_cache_fp4` would reach, since nothing AMD has run on hardware.

    python benchmarks/writer_estimate.py              # hipify, compile for gfx950, count, print
    python benchmarks/writer_estimate.py --json FILE  # also the numbers as JSON

The writer is compiled as turboquant/hip_writer.py builds it (hipify-torch over csrc_cuda's
writer, clang-22 for gfx950; the kernels the AITER op's libraries hold, tests/test_hip_writer.py),
and one kernel per config is counted: bf16 input, head dim 128, one scale per (token, head),
FP4 keys; `default` (key smoothing and rotation fused: the kSmooth, kRotate instantiation) and
`plain` (neither). The problem: 65536 tokens x 8 kv heads x D 128 (the bench's writer row,
`python -m turboquant bench`, whose H100 figures docs/performance.md gives).

Counting (benchmarks/isa_model.py's functions: parse_amd_body, amd_class through amd_counts,
amd_tile_cycles and predict_pct with its MI355X constants). The kernel has no loop: every
instruction of its body is counted once, both sides of each branch (the int32 and the int64
slot load, the encode a NaN/Inf group skips), an upper bound of one wave's path by a few
instructions. The compiler lays the int32 slot load out after s_endpgm and jumps back from it;
that backward branch is not a loop (nothing after it reaches it again), and is checked to be so.

Work. A work-item quantizes 16 elements of K and 16 of V of one (token, kv head) row
(WRITER_EPT), so a wave64 covers 64 / (D / 16) = 8 rows at D 128, and the problem is
65536 x 8 / 8 = 65536 waves: 256 per CU of MI355X's 256 (64 workgroups of 4 waves each).
Per wave and CU the model gives the clocks of each pipe (VALU 4 clocks per wave64 instruction
on a 16-lane SIMD, transcendentals x 4; SALU, LDS, VMEM and branch issue 4 clocks; the four
SIMDs of a CU sharing the waves), against the wave's share of the HBM bytes at 8 TB/s: the
bench's writer bytes (turboquant.bench.problems.writer_bytes: K and V read, codes and scales
written; 336.6 MB here; the slot ids and the state records, which the 8 heads of a token share
through L2, are not counted). The larger time is the call's; the % of 8 TB/s is the HBM time
over it (k = inf: memory and instructions overlap perfectly). The `x 1.5` column applies the
dependency factor the H100 measured for the cuda attention kernel bound by its instructions
(1.4-1.5x its throughput count, README "AMD performance estimate"): a sensitivity, not a fit.
The ds_bpermute of the group max and the rotation are counted at their issue (isa_model's
rule); the report also gives their bytes through the CU's LDS at 128 B per clock, which stay
below the VALU too. Left out: DRAM efficiency (8 TB/s is the 100 % line), write-combining of the 8- and 1-byte
stores, occupancy (the default kernel has 92 VGPRs, 5 waves per SIMD) and launch cost.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from isa_model import (  # noqa: E402
    MI355X, amd_class, amd_counts, amd_loops, amd_tile_cycles, parse_amd_body, predict_pct,
    real_loops)
from turboquant import hip_writer  # noqa: E402
from turboquant.bench.problems import writer_bytes  # noqa: E402

TOKENS, KV_HEADS, HEAD_DIM = 65536, 8, 128
ELEMENTS_PER_ITEM = 16  # csrc_cuda/tuning.cuh WRITER_EPT: elements of K and of V per work-item
WAVE = 64
DEPENDENCY_FACTOR = 1.5  # the H100's instruction-bound time over its throughput count (upper end)
CONFIGS = {"default": (True, True), "plain": (False, False)}  # (key smoothing, rotation)
# the hipified kernels' template arguments <T, D, GROUP, kSmooth, kRotate, kKeyE4m3>, mangled
DTYPES = {"bf16": "14__hip_bfloat16", "fp16": "6__half", "fp32": "f"}


def kernel_name(config: str, dtype: str = "bf16", head_dim: int = HEAD_DIM) -> str:
    smooth, rotate = CONFIGS[config]
    return (f"_ZN10turboquant8cuda_fp428{hip_writer.KERNEL}I{DTYPES[dtype]}Li{head_dim}ELi"
            f"{head_dim}ELb{int(smooth)}ELb{int(rotate)}ELb0EEEvNS0_16CacheWriteParamsE")


def writer_asm(clang: str | None = None, arch: str = "gfx950") -> str:
    """The hipified writer's assembly for `arch` (hip_writer's hipify + device build), cached in
    the temp dir by the writer sources' and the device shims' hash."""
    srcs = [hip_writer.CSRC_CUDA / n for n in hip_writer.WRITER_SOURCES]
    srcs += sorted(hip_writer.DEVICE_SHIMS.rglob("*.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in srcs)).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / "turboquant_writer_estimate" / digest
    out = cache / f"cache_writer_{arch}.s"
    if not out.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tu = hip_writer.hipify_writer(cache)
        hip_writer.compile_device(tu, [arch], cache, clang=clang)
    return out.read_text()


def kernel_body(asm: str, name: str) -> tuple[str, dict]:
    """The code of kernel `name` in `asm` and its '; Name: value' statistics."""
    m = re.search(rf"^{re.escape(name)}:[^\n]*\n(.*?)^\.Lfunc_end\d+:", asm, re.M | re.S)
    if m is None:
        raise ValueError(f"kernel {name} is not in the assembly")
    tail = asm[m.end():].split("\t.type\t", 1)[0]
    return m.group(1), {k: int(v) for k, v in re.findall(r"^; (\w+): (\d+)", tail, re.M)}


def wave_counts(body: str) -> tuple[Counter, Counter]:
    """One wave's instructions by isa_model's classes (amd_class), each once; and its vector
    ALU instructions by opcode."""
    ins, labels = parse_amd_body(body)
    if real_loops(ins, labels):
        raise ValueError(f"the writer kernel has loops {real_loops(ins, labels)}: trip counts "
                         "would be needed")
    counts, _ = amd_counts(ins, labels, [1] * len(amd_loops(ins, labels)))
    valu_ops = Counter(op for op, _ in ins if amd_class(op).startswith("valu"))
    return counts, valu_ops


def model(counts: Counter, waves: int, nbytes: float, hw: MI355X = MI355X()) -> dict:
    """The call's time from one wave's counts: per wave and CU the clocks of each pipe
    (isa_model.amd_tile_cycles with one 'tile' per wave), times the waves a CU runs; against the
    HBM time of the bytes; % of the bandwidth by isa_model.predict_pct."""
    cyc = amd_tile_cycles(counts, dataclasses.replace(hw, tiles_per_wave=1))
    per_cu = waves / hw.cus
    pred = predict_pct(cyc["cu_clk"], hw.clock_ghz, nbytes / waves, hw.bw_gbs, hw.cus)
    dep = predict_pct(cyc["cu_clk"] * DEPENDENCY_FACTOR, hw.clock_ghz, nbytes / waves, hw.bw_gbs,
                      hw.cus)
    # the ds_bpermute moves (isa_model counts their issue): 64 lanes x 4 bytes through the CU's
    # one LDS at hw.lds_bytes_per_clk, for comparison
    bpermute_clk = counts["lds"] * WAVE * 4 / hw.lds_bytes_per_clk
    hbm_us = nbytes / (hw.bw_gbs * 1e3)
    instr_us = cyc["cu_clk"] * per_cu / (hw.clock_ghz * 1e3)
    return {
        "limits_cu_clk_per_wave": cyc["limits_cu"],
        "instruction_bound": cyc["bound"],
        "bound": "memory" if pred["bound"] == "memory" else cyc["bound"],
        "bound_x_dependency": "memory" if dep["bound"] == "memory" else cyc["bound"],
        "hbm_us": hbm_us, "instruction_us": instr_us, "time_us": max(hbm_us, instr_us),
        "pct_of_hbm": pred["pct"], "pct_of_hbm_x_dependency": dep["pct"],
        "bytes": nbytes, "waves": waves, "waves_per_cu": per_cu,
        "bpermute_lds_clk_per_wave": bpermute_clk,
    }


def estimate(config: str, asm: str | None = None, clang: str | None = None,
             tokens: int = TOKENS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
             hw: MI355X = MI355X()) -> dict:
    """The writer of `config` ('default' or 'plain') on bf16 input, one scale per (token, head),
    FP4 keys: its counts and the model's prediction on MI355X."""
    asm = asm if asm is not None else writer_asm(clang)
    body, stats = kernel_body(asm, kernel_name(config, "bf16", head_dim))
    counts, valu_ops = wave_counts(body)
    threads = tokens * kv_heads * head_dim // ELEMENTS_PER_ITEM
    waves = -(-threads // WAVE)
    out = model(counts, waves, writer_bytes(tokens, kv_heads, head_dim, 0, 2), hw)
    out.update(config=config, counts=dict(counts), valu_ops=dict(valu_ops.most_common()),
               vgprs=stats.get("NumVgprs"),
               occupancy=stats.get("Occupancy"), kernel=kernel_name(config, "bf16", head_dim))
    return out


def report(results: dict) -> str:
    hw = MI355X()
    lines = [f"## HIP cache writer on MI355X ({hw.bw_gbs / 1000:g} TB/s, {hw.cus} CUs at "
             f"{hw.clock_ghz} GHz): {TOKENS} tokens x {KV_HEADS} kv heads x D {HEAD_DIM}, bf16, "
             "FP4 keys, one scale per (token, head); static estimate, nothing run", "",
             "one wave (8 rows of 128 elements of K and of V): instructions by class",  "",
             "| config | valu | valu_trans | valu_packed | salu | waitcnt | lds (ds_bpermute) | "
             "vmem | smem | branch | total | VGPRs | waves/SIMD |", "|---" * 13 + "|"]
    for name, r in results.items():
        c = Counter(r["counts"])
        lines.append(f"| {name} | {c['valu']} | {c['valu_trans']} | {c['valu_packed']} | "
                     f"{c['salu']} | {c['waitcnt']} | {c['lds']} | {c['vmem']} | {c['smem']} | "
                     f"{c['branch']} | {c['total']} | {r['vgprs']} | {r['occupancy']} |")
    lines += ["", "| config | VALU clk/wave/CU | SALU | LDS issue (ds_bpermute bytes at 128 B/clk) | "
              "VMEM issue | bound | instructions / HBM time | predicted % of 8 TB/s | GB/s | "
              "x 1.5 (dependency) |", "|---" * 10 + "|"]
    for name, r in results.items():
        L = r["limits_cu_clk_per_wave"]
        lines.append(f"| {name} | {L['valu']:.0f} | {L['salu']:.0f} | {L['lds_issue']:.0f} "
                     f"({r['bpermute_lds_clk_per_wave']:.0f}) | "
                     f"{L['vmem_issue']:.0f} | {r['bound']} | {r['instruction_us']:.1f} / "
                     f"{r['hbm_us']:.1f} us | {r['pct_of_hbm']:.1f} % | "
                     f"{r['bytes'] / r['time_us'] / 1e3:.0f} | "
                     f"{r['pct_of_hbm_x_dependency']:.1f} % ({r['bound_x_dependency']}) |")
    lines += ["", "the most frequent VALU opcodes per wave:", ""]
    for name, r in results.items():
        top = list(r["valu_ops"].items())[:8]
        lines.append(f"- {name}: " + ", ".join(f"{op} {n}" for op, n in top))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from _tools import CLANG_MISSING, find_clang

    clang = find_clang()
    if clang is None:
        print(f"skipped: {CLANG_MISSING}")
        return 1
    asm = writer_asm(clang)
    results = {name: estimate(name, asm) for name in CONFIGS}
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
