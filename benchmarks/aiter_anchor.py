"""AITER's own FP8 paged-attention kernels counted by the static ISA model, as the anchor the FP4
kernel is judged against (issue 38, item 2).

    python benchmarks/aiter_anchor.py            # compiles, disassembles, counts, prints the table
    python benchmarks/aiter_anchor.py --k 3.38   # the % with the cuda side's overlap exponent

Two kernels of the pinned amd-aiter 0.1.7.post2.dev18 wheel (.whl/, read at run time, never
installed and never copied into this repository), both for an FP8 E4M3 KV cache, a bf16 query,
head size 128, block size 16, GQA 8, decode:

(a) pa_v1's partition body, `_paged_attention_kernel` of aiter_meta/csrc/include/
  attention_common.cuh. attention_v1.cu defines its kernel entry only for gfx90a/gfx94x, so
  benchmarks/aiter_anchor/pa_v1_fp8.hip restates the entry and benchmarks/aiter_anchor/include
  stands in for the HIP and ck_tile headers (no ROCm here); clang-22 compiles it for gfx950 with
  the flags of isa_model.hip_asm. AITER's JIT adds -fgpu-flush-denormals-to-zero and scheduler
  options; with them the same number of VALU instructions comes out.
(b) the shipped gfx950 assembly kernel hsa/gfx950/pa/pa_bf16_pertokenFp8_gqa8_2tg_4w.co, the
  hp = 0 row of pa_asm.csv for bf16 Q, FP8 KV, GQA 8, decode (pa_fwd's default high_precision = 1
  accepts that row, _hp and _uhp alike, whichever its configuration map yields first),
  disassembled with llvm-objdump-22.

Work per tile. Both kernels run 4 waves (256 threads) per workgroup on one kv head, and a
workgroup advances through the context 256 tokens at a time: each wave computes QK for its own
64 tokens and PV for all 256 tokens over its quarter of the head (32 of 128 elements), so one
256-token step is 4 tiles of 16 tokens per wave, as in isa_model's AMD rows.
  pa_v1: one step is the whole kernel (a 256-token partition: T_PAR_SIZE = 256, read from
    attention_common.cuh, over NUM_THREADS / WARP_SIZE = 4 waves, the latter from the kernel
    metadata); it has no loop, so each instruction of the body counts once (both sides of every
    branch, as isa_model counts its own partition kernel) and the body is 4 tiles.
  asm: one workgroup per (kv head, sequence) streams the whole context in a loop; an iteration
    holds two 256-token steps (the workgroup's token counter, the register compared before the
    loop's exits, goes up by 0x100 twice) over 4 waves (asm_pa.cu launches 256 threads; CDNA
    runs wave64): 128 tokens, 8 tiles per wave. The loads agree: 32 16-byte loads per wave and
    iteration, 32 KB, 128 tokens of K and V. Waves 0-1 and 2-3 run two copies of the loop with the
    same counts. The prologue (Q quantized to FP8) and the tail step run once per (kv head,
    sequence).
Counts per tile per CU then follow isa_model.amd_tile_cycles (MI355X) with tiles_per_wave set to
the kernel's own value, and predict_pct gives the % of 8 TB/s against the tile's HBM bytes:
pa_v1 16 x (128 K + 128 V) = 4096 (per-tensor scales); asm 16 x (128 + 128 + 4 + 4) = 4224 (a
fp32 scale per token for K and for V, [kv heads, tokens], aiter cache.h).

MFMA clocks. pa_v1 on gfx950 converts the FP8 bytes to bf16 in VALU (v_cvt_pk_f32_fp8, then a
truncation) and runs v_mfma_f32_16x16x32_bf16; the asm kernel runs v_mfma_f32_16x16x32_fp8_fp8.
Both are counted at 16 clocks (4 passes): 16 x 16 x 32 x 2 = 16384 FLOP at 1024 FLOP/clk/SIMD,
MI355X's dense BF16/FP16 rate (2.5 PFLOP/s = 1024 SIMDs x 1024 x 2.4 GHz; iree-org/iree#22457:
16x16x32 f16 "double the throughput with same latency (16 clocks)"). The non-scaled FP8 16x16x32
keeps gfx942's 16 clocks (ROCm/amd_matrix_instruction_calculator, CDNA3 table; LLVM 22's
gfx950 scheduling model, llvm-mca-22 -mcpu=gfx950: the same 4 passes as on gfx942 and as the bf16
16x16x32). So it reaches 2.5 PFLOP/s, not the 5.0 of MI355X's "FP8" figure, which only
v_mfma_*_f8f6f4 (16x16x128 FP8: 32 clocks, isa_model's mfma_fp8_clk) delivers (ROCm/rocm-systems
#3506: gfx950's MXFP8 has "much higher throughput than FP8"; ROCm/composable_kernel#2202 moved FP8
GEMMs to the new instructions). Neither kernel is near its MFMA limit either way.

Fixed costs (structure only; nothing here has run on AMD hardware, nothing is timed):
  pa_v1: grid (sequences, ceil(max context / 256) partitions, kv heads); every partition reloads
    and restages Q and its block-table entries (inside the per-tile count above) and writes a bf16
    partial output (8 heads x 128 x 2 B = 2 KB per kv head) plus fp32 max and sum per head, which
    paged_attention_ll4mi_reduce_kernel (grid (heads, sequences), 128 threads; always launched,
    up to 8 x 64 partitions = 128k tokens) reads back: 4 KB of partials per 64 KB of KV, +6 % HBM
    bytes when they leave L2 (attention_v1.cu paged_attention_custom_launcher).
  asm: grid (kv heads, sequences), no split of the context and no reduce kernel (asm_pa.cu
    pa_fwd launches kv_heads x batch workgroups of 256 threads); one prologue and one tail step
    per (kv head, sequence). With 8 kv heads only batch x 8 CUs of 256 work (batch 1: 8 CUs), so
    below batch 32 the per-CU tile rate above is not the GPU's.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from isa_model import (  # noqa: E402
    MI355X, TILE_TOKENS, _cache_dir, _digest, amd_class, amd_counts, amd_loops, amd_tile_cycles,
    amd_branch_target, parse_amd_body, predict_pct, real_loops)

WHEEL = "amd_aiter-0.1.7.post2.dev18-py3-none-any.whl"
ATTENTION_COMMON = "aiter_meta/csrc/include/attention_common.cuh"
ASM_KERNEL = "aiter_meta/hsa/gfx950/pa/pa_bf16_pertokenFp8_gqa8_2tg_4w.co"
ANCHOR = ROOT / "benchmarks" / "aiter_anchor"
WRAPPER = ANCHOR / "pa_v1_fp8.hip"
HEAD = 128                              # head size of the instantiation counted
KV_BYTES_PER_TOKEN = 2 * HEAD           # FP8 K and V codes
PA_V1_TILE_BYTES = TILE_TOKENS * KV_BYTES_PER_TOKEN
ASM_TILE_BYTES = TILE_TOKENS * (KV_BYTES_PER_TOKEN + 2 * 4)  # + fp32 K and V scale per token
# v_mfma_f32_16x16x32_{bf16,fp8_fp8} on gfx950: 16 clocks (module docstring)
MFMA_16X16X32_CLK = 16.0
# The sensitivity the H100 measured: the cuda kernel bound by its instructions took 1.4-1.5x its
# throughput count (README, AMD performance estimate); its upper end.
DEPENDENCY_FACTOR = 1.5
FLAGS = ["-x", "hip", "--offload-arch=gfx950", "--offload-device-only", "-nogpulib", "-nogpuinc",
         "-O3", "-std=c++20", "-S"]
OBJDUMP_MISSING = ("llvm-objdump-22 not found: apt-get install -y --no-install-recommends llvm-22 "
                   "(Debian bookworm-security; bash .ci/install does it as root), or set "
                   "TURBOQUANT_OBJDUMP")
WHEEL_MISSING = (f"{WHEEL} not found in $TURBOQUANT_AITER_WHEEL_DIR or {ROOT / '.whl'}: "
                 "pip download --no-deps amd-aiter==0.1.7.post2.dev18 -d .whl")


def find_wheel() -> Path | None:
    """The pinned AITER wheel: in $TURBOQUANT_AITER_WHEEL_DIR or <repo>/.whl, else None."""
    for d in (os.environ.get("TURBOQUANT_AITER_WHEEL_DIR"), ROOT / ".whl"):
        if d and (Path(d) / WHEEL).is_file():
            return Path(d) / WHEEL
    return None


def find_objdump() -> str | None:
    """llvm-objdump for the gfx950 code object: $TURBOQUANT_OBJDUMP, else llvm-objdump-22 (Debian's
    llvm-22, the LLVM of clang-22) on PATH, else None."""
    return os.environ.get("TURBOQUANT_OBJDUMP") or shutil.which("llvm-objdump-22")


def _wheel_member(name: str, wheel: Path | None) -> bytes:
    wheel = wheel or find_wheel()
    if wheel is None:
        raise FileNotFoundError(WHEEL_MISSING)
    with zipfile.ZipFile(wheel) as z:
        return z.read(name)


def loop_token_step(ins, labels, head: int, back: int) -> int:
    """Tokens one workgroup advances per iteration of the loop [head, back]: the sum of the
    s_addk_i32 increments of the counter that the s_cmp before each exit branch tests."""
    counters = set()
    for i in range(head + 1, back + 1):
        t = amd_branch_target(ins, labels, i)
        if t is not None and not head <= t <= back and ins[i - 1][0].startswith("s_cmp"):
            counters.add(ins[i - 1][1].split(",")[0].strip())
    step = 0
    for op, rest in ins[head:back + 1]:
        if op == "s_addk_i32" and rest.split(",")[0].strip() in counters:
            step += int(rest.split(",")[1], 0)
    return step


def _mfma_ops(ins) -> Counter:
    return Counter(op for op, _ in ins if op.startswith("v_mfma"))


def _kv_load_bytes(ins) -> int:
    """Bytes one wave's 16-byte vector memory loads bring in (64 lanes x 16 B each)."""
    return sum(64 * 16 for op, _ in ins if op in ("global_load_dwordx4", "buffer_load_dwordx4"))


# ----------------------------------------------------------------------------------------------
# (a) pa_v1, compiled
# ----------------------------------------------------------------------------------------------
def pa_v1_asm(clang: str, wheel: Path | None = None) -> str:
    """gfx950 assembly of the wrapper around attention_common.cuh, which is taken from the wheel
    into a cache directory alone (so that its own includes find the stand-ins), cached by the
    hash of the sources."""
    src = _wheel_member(ATTENTION_COMMON, wheel)
    stand_ins = [WRAPPER, *(p for p in (ANCHOR / "include").rglob("*") if p.is_file())]
    key = hashlib.sha256(src + _digest(stand_ins).encode()).hexdigest()[:16]
    d = _cache_dir() / f"aiter_pa_v1_{key}"
    out = d / "pa_v1_fp8.s"
    if not out.exists():
        d.mkdir(exist_ok=True)
        (d / "attention_common.cuh").write_bytes(src)
        subprocess.run([clang, *FLAGS, f"-I{d}", f"-I{ANCHOR / 'include'}", "-o", str(out),
                        str(WRAPPER)], check=True)
    return out.read_text()


def _estimate(counts: Counter, tiles_per_wave: int, tile_bytes: int, k: float) -> dict:
    """isa_model's per-tile limits (amd_tile_cycles) and % of HBM (predict_pct) on MI355X for a
    wave's counts over `tiles_per_wave` tiles; also the % with the dependency factor applied."""
    hw = dataclasses.replace(MI355X(), tiles_per_wave=tiles_per_wave)
    cyc = amd_tile_cycles(counts, hw, MFMA_16X16X32_CLK)
    pred = predict_pct(cyc["cu_clk"], hw.clock_ghz, tile_bytes, hw.bw_gbs, hw.cus, k)
    dep = predict_pct(cyc["cu_clk"] * DEPENDENCY_FACTOR, hw.clock_ghz, tile_bytes, hw.bw_gbs,
                      hw.cus, k)
    return {"counts": counts, "hw": hw, "arch": "gfx950", "tile_bytes": tile_bytes,
            "tiles_per_wave": tiles_per_wave, "cycles": cyc, "pred": pred, "pred_dep": dep,
            "hbm_clk": pred["hbm_ns"] * hw.clock_ghz, "mfma_clk": MFMA_16X16X32_CLK,
            "mfma_per_tile": counts["mfma"] / tiles_per_wave,
            "bound": "memory" if pred["bound"] == "memory" else cyc["bound"]}


def _valu_ops(ins) -> Counter:
    return Counter(op for op, _ in ins if amd_class(op).startswith("valu"))


def pa_v1_fp8_counts(clang: str, wheel: Path | None = None, k: float = math.inf) -> dict:
    """pa_v1's FP8 partition body on gfx950: one wave's counts for its 256-token partition (4
    tiles; module docstring), the limits per tile per CU and the predicted % of 8 TB/s."""
    from test_aiter_isa import kernels
    (name, kern), = kernels(pa_v1_asm(clang, wheel)).items()
    ins, labels = parse_amd_body(kern["body"])
    if real_loops(ins, labels):
        raise ValueError(f"{name}: a loop in pa_v1's partition body; the count assumes none")
    counts, _ = amd_counts(ins, labels, [1] * len(amd_loops(ins, labels)))
    src = _wheel_member(ATTENTION_COMMON, wheel).decode()
    partition = int(re.search(r"constexpr int T_PAR_SIZE\s*=\s*(\d+);", src).group(1))
    waves = kern["meta"]["max_flat_workgroup_size"] // kern["meta"]["wavefront_size"]
    res = _estimate(counts, partition // waves // TILE_TOKENS, PA_V1_TILE_BYTES, k)
    res.update(name=name, kernel=kern, ins=ins, labels=labels, waves=waves,
               tokens_per_step={"workgroup": partition, "wave": partition // waves},
               mfma_ops=_mfma_ops(ins), valu_ops=_valu_ops(ins),
               kv_load_bytes=_kv_load_bytes(ins))
    return res


# ----------------------------------------------------------------------------------------------
# (b) the shipped gfx950 assembly kernel, disassembled
# ----------------------------------------------------------------------------------------------
def asm_disassembly(objdump: str, wheel: Path | None = None) -> tuple[str, str]:
    """(llvm-objdump -d of the kernel's code, its kernel descriptor as .amdhsa directives),
    cached by the code object's hash."""
    co = _wheel_member(ASM_KERNEL, wheel)
    d = _cache_dir() / f"aiter_asm_{hashlib.sha256(co).hexdigest()[:16]}"
    text, kd = d / "text.s", d / "descriptor.s"
    if not kd.exists():
        d.mkdir(exist_ok=True)
        path = d / Path(ASM_KERNEL).name
        path.write_bytes(co)
        for out, args in ((text, ["-d"]), (kd, ["-D", "-j", ".rodata"])):
            out.write_text(subprocess.run([objdump, *args, "--mcpu=gfx950", str(path)], check=True,
                                          capture_output=True, text=True).stdout)
    return text.read_text(), kd.read_text()


def objdump_body(text: str) -> str:
    """llvm-objdump -d output -> the code as isa_model.parse_amd_body reads it: each symbol (the
    kernel's, then its branch labels) as a `name:` line, instructions without their address and
    encoding comments."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if m:
            out.append(f"{m.group(1)}:")
        elif line.startswith("\t") and out:
            out.append(line.split("//")[0].rstrip())
    return "\n".join(out)


def kernel_descriptor(kd: str) -> dict[str, int]:
    """`.amdhsa_<field> <value>` lines of the disassembled kernel descriptor."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"\.amdhsa_(\w+) (\d+)$", kd, re.M)}


def asm_fp8_counts(objdump: str, wheel: Path | None = None, k: float = math.inf) -> dict:
    """The asm FP8 kernel's steady-state loop on gfx950: one wave's counts for one iteration
    (8 tiles; module docstring), the limits per tile per CU and the predicted % of 8 TB/s."""
    text, kd = asm_disassembly(objdump, wheel)
    ins, labels = parse_amd_body(objdump_body(text))
    loops = real_loops(ins, labels)
    if len(loops) != 2:
        raise ValueError(f"{len(loops)} loops, expected 2 (waves 0-1 and waves 2-3)")
    per_loop = [amd_counts(ins[h:b + 1], {}, [])[0] for h, b in loops]
    steps = {loop_token_step(ins, labels, h, b) for h, b in loops}
    if per_loop[0] != per_loop[1] or len(steps) != 1:
        raise ValueError(f"the two copies of the loop differ: {per_loop}, token steps {steps}")
    launcher = _wheel_member("aiter_meta/csrc/py_itfs_cu/asm_pa.cu", wheel).decode()
    threads = int(re.search(r"(\d+),\s*// bdx", launcher).group(1))
    waves = threads // 64                                   # CDNA runs wave64 only
    (step,) = steps
    head, back = loops[0]
    kv = _kv_load_bytes(ins[head:back + 1])
    if kv != step // waves * KV_BYTES_PER_TOKEN:
        raise ValueError(f"{kv} bytes of 16-byte loads per wave and iteration, but "
                         f"{step // waves} tokens per wave")
    res = _estimate(per_loop[0], step // waves // TILE_TOKENS, ASM_TILE_BYTES, k)
    in_loops = {i for h, b in loops for i in range(h, b + 1)}
    rest = [x for i, x in enumerate(ins) if i not in in_loops]
    res.update(name=next(iter(labels)), ins=ins, labels=labels, loops=loops, waves=waves,
               tokens_per_step={"workgroup": step, "wave": step // waves},
               mfma_ops=_mfma_ops(ins[head:back + 1]), valu_ops=_valu_ops(ins[head:back + 1]),
               kv_load_bytes=kv, descriptor=kernel_descriptor(kd),
               fixed={"prologue": amd_counts(ins[:loops[0][0]], {}, [])[0],
                      "tail step (two copies, one runs) and epilogue":
                          amd_counts(rest[loops[0][0]:], {}, [])[0]})
    return res


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def report(rows: dict[str, dict], k: float = math.inf) -> str:
    """The table: per kernel, clocks per 16-token tile per CU by limit, the bound, HBM clocks
    per tile and the predicted % of 8 TB/s."""
    kk = "inf" if math.isinf(k) else f"{k:.2f}"
    lines = ["## AITER's FP8 paged attention on gfx950 (MI355X, 8 TB/s), by isa_model's AMD "
             "counts", "",
             "bf16 Q, FP8 E4M3 KV, head 128, block 16, GQA 8, decode; CU clocks per 16-token "
             "tile of one kv head (VALU with transcendentals x4; MFMA 16x16x32 at 16 clk); "
             f"overlap exponent k = {kk}", "",
             "| kernel | tokens per iteration: workgroup / wave | tiles per wave | VALU (trans) "
             "per wave and iteration | MFMA per tile | valu | mfma | lds issue | lds bw | "
             "vmem issue | salu | bound | HBM clk | predicted % of 8 TB/s | with the x1.5 "
             "dependency factor |",
             "|---" * 15 + "|"]
    for label, r in rows.items():
        c, lim, t = r["counts"], r["cycles"]["limits_cu"], r["tokens_per_step"]
        lines.append(
            f"| {label} | {t['workgroup']} / {t['wave']} | {r['tiles_per_wave']} | "
            f"{c['valu']} ({c['valu_trans']}) | {r['mfma_per_tile']:g} "
            f"{'/'.join(op[7:] for op in r['mfma_ops'])} | {lim['valu']:.0f} | "
            f"{lim['mfma']:.0f} | "
            f"{lim['lds_issue']:.0f} | {lim['lds_bw']:.0f} | {lim['vmem_issue']:.0f} | "
            f"{lim['salu']:.0f} | {r['bound']} | {r['hbm_clk']:.0f} | {r['pred']['pct']:.1f} % | "
            f"{r['pred_dep']['pct']:.1f} % |")
    lines.append("")
    if "pa_v1 FP8" in rows:
        r = rows["pa_v1 FP8"]
        conv = sum(n for op, n in r["valu_ops"].items() if op.startswith(("v_cvt_pk_f32_fp8",
                                                                            "v_perm_b32")))
        lines.append(f"pa_v1: {r['kernel']['stats'].get('NumVgprs')} VGPRs, occupancy "
                     f"{r['kernel']['stats'].get('Occupancy')} waves/SIMD, LDS "
                     f"{r['kernel']['meta'].get('group_segment_fixed_size')} B, scratch "
                     f"{r['kernel']['stats'].get('ScratchSize')}; FP8 -> bf16 conversion "
                     f"(v_cvt_pk_f32_fp8, v_perm_b32) {conv} of {sum(r['valu_ops'].values())} "
                     "VALU; plus the reduce kernel per call (not counted).")
    if "asm FP8" in rows:
        r = rows["asm FP8"]
        kd = r["descriptor"]
        fixed = "; ".join(f"{n}: {c['total']} instructions ({c['valu'] + c['valu_trans']} VALU)"
                          for n, c in r["fixed"].items())
        lines.append(f"asm: {kd['next_free_vgpr']} VGPRs ({kd['accum_offset']} + AGPRs), LDS "
                     f"{kd['group_segment_fixed_size']} B, scratch "
                     f"{kd['private_segment_fixed_size']}; once per (kv head, sequence): {fixed}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=float, default=math.inf,
                    help="overlap exponent of predict_pct (default inf: the throughput max())")
    args = ap.parse_args(argv)
    from _tools import CLANG_MISSING, find_clang
    if find_wheel() is None:
        print(f"skipped: {WHEEL_MISSING}")
        return 0
    rows = {}
    clang, objdump = find_clang(), find_objdump()
    if clang:
        rows["pa_v1 FP8"] = pa_v1_fp8_counts(clang, k=args.k)
    else:
        print(f"pa_v1 skipped: {CLANG_MISSING}")
    if objdump:
        rows["asm FP8"] = asm_fp8_counts(objdump, k=args.k)
    else:
        print(f"asm kernel skipped: {OBJDUMP_MISSING}")
    if rows:
        print(report(rows, args.k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
