"""A static performance estimate of the decode kernels from their compiled instruction streams
(issue 20, part 2, first version).

    python benchmarks/isa_model.py            # compiles, counts, prints the tables
    python benchmarks/isa_model.py --no-hip   # the cuda part only

The model (deliberately simple; every constant is a parameter of `H100` / `MI355X` below):

  A decode kernel streams its KV cache in 16-token tiles. For one tile we count the
  instructions one warp (cuda) or one wave (gfx950) issues for it, by class, and turn the
  counts into the time the SM (CU) needs per tile from *throughput limits only*:

    cuda, per scheduler (4 per SM, each issuing 1 warp-instruction per clock; 2 CTAs x 8 warps
    per SM resident = 4 warps per scheduler, assumed enough to hide every latency):
      issue  = all instructions x 1 clk
      fma    = FP32 (FFMA/FADD/FMUL/HFMA2..) x 1 clk (H100: 32 FP32 lanes per scheduler)
               + IMAD* x 2 clk (IMAD runs on the FMA pipe at half rate, 16 lanes)
      alu    = integer/logic/compare/select (IADD3, LOP3, SHF, PRMT, LEA, ISETP, SEL, FSETP,
               FMNMX, ...) x 2 clk (16 lanes per clock)
      mufu   = MUFU x 8 clk (4 lanes per clock)
      hmma   = HMMA.16816 x 4 clk: 989 dense fp16 TFLOP/s at 1.83 GHz over 132 SMs is
               4096 FLOP/clk/SM = 1024 per scheduler; one m16n8k16 is 4096 FLOP
      tile time per scheduler = max(issue, fma, alu, mufu, hmma); per SM = that / 4.
    HBM time per tile per SM = tile bytes / (measured read bandwidth / 132), tile bytes =
      16 tokens x (64 K + 64 V code bytes + 2 scale bytes) = 2080 (FP4, D 128, one kv head);
      K8V4: 16 x (128 + 64 + 2) = 3104.
    predicted % of bandwidth = HBM time / max(HBM time, issue-limited time).

  gfx950 (MI355X), per SIMD (4 per CU; one workgroup = 4 waves, one per SIMD; a partition is
  256 tokens, 64 per wave, so a wave's whole partition body is 4 tiles and is divided by 4):
      valu   = VALU x 4 clk: a CDNA SIMD is 16 lanes wide, a wave64 instruction takes 4 clocks
               (MI355X's 157.3 TFLOP/s fp32 vector = 256 CU x 4 SIMD x 16 lanes x 2 (FMA) x
               2 (packed v_pk_*) x 2.4 GHz); transcendentals (v_exp, v_rcp, v_log, ...) quarter
               rate, 16 clk. (`--valu-clk 1` shows the brief's "1 per clock" variant.)
      mfma   = 16x16x128 f8f6f4: 32 clk with an FP8 operand, 16 with both FP4 (MI355X dense
               MXFP8 5.0 PFLOP/s, MXFP4 10 PFLOP/s at 2.4 GHz over 1024 SIMDs: 2048 resp.
               4096 FLOP/clk/SIMD; one 16x16x128 is 65536 FLOP). The native path's QK has an
               FP4 A and an FP8 B operand: counted at the FP8 rate.
      salu, lds issue, vmem issue, branch: 4 clk each (a SIMD gets one issue turn per 4 clocks,
               one instruction of each type per turn from different waves)
      tile time per SIMD = max of those; per CU = that / 4; also LDS bandwidth 128 B/clk/CU
      (ds_* bytes = 64 lanes x access width), HBM = tile bytes / (8 TB/s / 256 CUs).

  What the model leaves out, on purpose: latencies and dependent chains (it assumes enough
  resident warps/waves to hide them), the DRAM's own efficiency (the measured read bandwidth is
  the 100 % line), per-CTA fixed costs (prologue, merge, split-KV reduce: the cuda figure is the
  steady-state loop; short sequences are latency-bound and outside the model), L2/TLB effects
  and tail effects. It answers one question: is the instruction stream of a tile cheaper than
  its bytes, and by how much.

Which instructions belong to a tile:
  cuda: the key loop is the back-edge (a backward BRA) whose range holds HMMAs. Its hot path is
    walked from the loop head: BRA.DIV (warp-divergence fallback) is not taken; a forward
    conditional branch skips its region when the region's own instructions (nested regions
    excluded) include LDG (the block-id refill, once per 32 tiles) or MUFU.RCP (the soft-cap
    tanh, off in the benchmarks), and a branch right after VOTE.ANY (the lazy-rescale vote:
    some lane needs the slow path) is not taken; any other region is executed. Every loop
    iteration is one 16-token tile of one warp.
  gfx950: the partition kernel has no tile loop (4 tiles per wave, unrolled); every
    instruction of the body is counted once, the bodies of its loops (Q staging, V decode,
    output rows) times their trip counts (from the source at HEAD 128, GQA 8), both sides of
    every forward branch included (an upper bound of a path; the branches are short).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CUDA_DECODE = "_ZN10turboquant8cuda_fp433paged_attention_fp4_decode_kernelILi128E13__nv_bfloat16Lb0ELb0EEEvNS0_10AttnParamsE"
CUDA_DECODE_K8V4 = CUDA_DECODE.replace("Lb0ELb0E", "Lb0ELb1E")
TILE_TOKENS = 16
FP4_TILE_BYTES = TILE_TOKENS * (64 + 64 + 2)     # D 128: K codes + V codes + 2 scale bytes
K8V4_TILE_BYTES = TILE_TOKENS * (128 + 64 + 2)   # E4M3 keys


# ----------------------------------------------------------------------------------------------
# cuda: SASS
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Sass:
    addr: int
    pred: str      # "" or "@P0", "@!P1", ...
    op: str        # full opcode with modifiers, e.g. "HMMA.16816.F32"
    args: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def parse_sass(text: str) -> dict[str, list[Sass]]:
    """cuobjdump -sass output -> {mangled function name: instructions in address order}."""
    out: dict[str, list[Sass]] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = _SASS_LINE.match(line)
        if m and cur is not None:
            cur.append(Sass(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return out


FP32_OPS = {"FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2", "FFMA2", "FADD2", "FMUL2"}
ALU_OPS = {"IADD3", "LOP3", "SHF", "PRMT", "LEA", "ISETP", "SEL", "FSETP", "FSEL", "FMNMX",
           "VIMNMX", "VIMNMX3", "VIADD", "VIADDMNMX", "MOV", "PLOP3", "P2R", "R2P", "IABS",
           "F2FP", "IMNMX", "BMSK", "FLO", "POPC", "BREV", "I2F", "F2I", "F2F", "I2I", "FRND",
           "HSETP2", "HMNMX2", "FCHK", "SGXT", "LOP", "IADD", "ISCADD", "CSET", "CSETP"}
SHARED_OPS = {"LDS", "STS", "LDSM", "ATOMS", "STSM"}
GLOBAL_OPS = {"LDG", "STG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "RED", "ATOMG", "LD", "ST", "LDL",
              "STL", "ATOM", "UBLKCP", "UTMALDG"}
SHUFFLE_OPS = {"SHFL", "VOTE", "VOTEU", "MOVM", "REDUX", "MATCH"}
CONTROL_OPS = {"BRA", "BAR", "BSSY", "BSYNC", "WARPSYNC", "NOP", "EXIT", "CALL", "RET", "BREAK",
               "YIELD", "PREEXIT", "ACQBULK", "ENDCOLLECTIVE", "JMP", "BRX", "SYNCS"}
CUDA_CLASSES = ["fp32", "imad", "alu", "mufu", "hmma", "shared", "global", "shuffle", "control",
                "uniform", "other"]


def sass_class(op: str) -> str:
    base = op.split(".")[0]
    if base == "HMMA":
        return "hmma"
    if base == "MUFU":
        return "mufu"
    if base == "IMAD":
        return "imad"
    if base in FP32_OPS:
        return "fp32"
    if base in ALU_OPS:
        return "alu"
    if base in SHARED_OPS:
        return "shared"
    if base in GLOBAL_OPS:
        return "global"
    if base in SHUFFLE_OPS:
        return "shuffle"
    if base in CONTROL_OPS:
        return "control"
    if base.startswith("U") or base in {"S2UR", "R2UR"}:
        return "uniform"
    return "other"  # S2R, CS2R, LDC, ...


def _branch_target(ins: Sass) -> int | None:
    if ins.base != "BRA":
        return None
    m = re.search(r"0x([0-9a-f]+)\s*$", ins.args)
    return int(m.group(1), 16) if m else None


def find_key_loop(code: list[Sass]) -> tuple[int, int]:
    """(index of the loop head, index of the back-edge BRA) of the loop that holds the HMMAs:
    of the conditional backward branches whose range contains HMMAs, the innermost (shortest)
    one (unconditional backward jumps are the returns of out-of-line BRA.DIV fallbacks)."""
    idx = {ins.addr: i for i, ins in enumerate(code)}
    best = None
    for i, ins in enumerate(code):
        t = _branch_target(ins)
        if t is None or t >= ins.addr or t not in idx or not ins.pred:
            continue
        j = idx[t]
        if any(c.base == "HMMA" for c in code[j:i]) and (best is None or i - j < best[1] - best[0]):
            best = (j, i)
    if best is None:
        raise ValueError("no loop with HMMA instructions")
    return best


def _region_is_cold(code: list[Sass], lo: int, hi: int, idx: dict[int, int]) -> bool:
    """The own instructions of [lo, hi) (forward-branch regions nested in it left out) include
    a marker of a cold path: LDG (block-id refill) or MUFU.RCP (soft cap)."""
    i = lo
    while i < hi:
        ins = code[i]
        t = _branch_target(ins)
        if ins.pred and t is not None and t > ins.addr and t in idx and idx[t] <= hi and ins.op != "BRA.DIV":
            i = idx[t]
            continue
        if ins.base == "LDG" or ins.op.startswith("MUFU.RCP"):
            return True
        i += 1
    return False


def hot_path(code: list[Sass], head: int, back: int) -> list[Sass]:
    """The instructions one steady-state iteration of the loop [head, back] executes (rules in
    the module docstring)."""
    idx = {ins.addr: i for i, ins in enumerate(code)}
    path, i, steps = [], head, 0
    while i <= back:
        steps += 1
        if steps > 100000:
            raise RuntimeError("hot path walk does not end")
        ins = code[i]
        path.append(ins)
        if i == back:
            break
        t = _branch_target(ins)
        if t is None or ins.op == "BRA.DIV" or t not in idx:
            i += 1
            continue
        j = idx[t]
        if not ins.pred:                      # unconditional jump
            i = j
            continue
        if j <= i or j > back:                # leaves the loop / backward: not taken
            i += 1
            continue
        prev = code[i - 1] if i > 0 else None
        if prev is not None and prev.base == "VOTE":  # the slow-path vote: not taken
            i += 1
            continue
        i = j if _region_is_cold(code, i + 1, j, idx) else i + 1
    return path


def hot_path_parts(hot: list[Sass]) -> list[tuple[str, int, Counter]]:
    """The hot path cut at its first LDGDEPBAR (end of the cp.async issue for a later tile) and
    its first HMMA: (name, instructions, class counts) of each part."""
    cut1 = next((i + 1 for i, x in enumerate(hot) if x.base == "LDGDEPBAR"), 0)
    cut2 = next((i for i, x in enumerate(hot) if x.base == "HMMA"), cut1)
    parts = [("block-id shuffle, cache addresses, cp.async issue", hot[:cut1]),
             ("wait, K loads from shared memory, K decode up to the first HMMA", hot[cut1:cut2]),
             ("from the first HMMA: the rest of the K decode between the S^T MMAs, softmax, P, "
              "V decode, O^T MMAs", hot[cut2:])]
    return [(name, len(part), count_classes(part)) for name, part in parts]


def count_classes(instrs) -> Counter:
    c = Counter(sass_class(ins.op) for ins in instrs)
    c["total"] = len(instrs)
    return c


@dataclasses.dataclass
class H100:
    sms: int = 132
    schedulers: int = 4
    clock_ghz: float = 1.98
    fp32_clk: float = 1.0   # FFMA/FADD/FMUL: 32 lanes per scheduler
    imad_clk: float = 2.0   # IMAD: FMA pipe at 16 lanes
    alu_clk: float = 2.0    # 16 lanes
    mufu_clk: float = 8.0   # 4 lanes
    hmma_clk: float = 4.0   # 1024 FLOP/clk/scheduler (989 TFLOP/s dense at 1.83 GHz)
    warps_per_sm: int = 16  # 2 CTAs x 8 warps (README's tuning); assumed to hide latency


def cuda_tile_cycles(counts: Counter, hw: H100 = H100()) -> dict:
    """Scheduler clocks one warp's tile occupies each limit, and the binding one."""
    lim = {
        "issue": counts["total"] * 1.0,
        "fma": counts["fp32"] * hw.fp32_clk + counts["imad"] * hw.imad_clk,
        "alu": counts["alu"] * hw.alu_clk,
        "mufu": counts["mufu"] * hw.mufu_clk,
        "hmma": counts["hmma"] * hw.hmma_clk,
    }
    bound = max(lim, key=lim.get)
    return {"limits": lim, "bound": bound, "sched_clk": lim[bound], "sm_clk": lim[bound] / hw.schedulers}


def predict_pct(sm_clk_per_tile: float, clock_ghz: float, tile_bytes: float, bw_gbs: float,
                units: int) -> dict:
    """% of bandwidth = HBM time / max(HBM time, instruction time), per SM (CU) and tile."""
    t_issue_ns = sm_clk_per_tile / clock_ghz
    t_hbm_ns = tile_bytes / (bw_gbs / units)       # bytes / (GB/s) = ns
    return {"issue_ns": t_issue_ns, "hbm_ns": t_hbm_ns,
            "pct": 100.0 * t_hbm_ns / max(t_hbm_ns, t_issue_ns),
            "bound": "memory" if t_hbm_ns >= t_issue_ns else "instruction issue"}


# ----------------------------------------------------------------------------------------------
# gfx950: AMDGPU assembly
# ----------------------------------------------------------------------------------------------
AMD_CLASSES = ["valu", "valu_trans", "mfma", "lds", "vmem", "smem", "waitcnt", "salu", "branch"]
_TRANS = re.compile(r"^v_(exp|log|rcp|rsq|sqrt|sin|cos)_")


def amd_class(op: str) -> str:
    if op.startswith("v_mfma"):
        return "mfma"
    if _TRANS.match(op):
        return "valu_trans"
    if op.startswith("v_"):
        return "valu"
    if op.startswith("ds_"):
        return "lds"
    if op.startswith(("global_", "buffer_", "flat_", "scratch_")):
        return "vmem"
    if op.startswith(("s_load", "s_buffer_load", "s_store")):
        return "smem"
    if op.startswith("s_waitcnt"):
        return "waitcnt"
    if op.startswith(("s_branch", "s_cbranch", "s_barrier", "s_endpgm", "s_nop", "s_setprio",
                      "s_sleep", "s_trap")):
        return "branch"
    return "salu"


def parse_amd_body(body: str) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Kernel body text -> ([(opcode, operands)], {label: index of the next instruction})."""
    ins, labels = [], {}
    for line in body.splitlines():
        s = line.split(";")[0].rstrip()
        m = re.match(r"^(\.?[\w.$]+):", s)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        s = s.strip()
        if not s or s.startswith("."):
            continue
        op, _, rest = s.partition(" ")
        ins.append((op, rest.strip()))
    return ins, labels


def amd_loops(ins, labels) -> list[tuple[int, int]]:
    """Outermost loops: (head index, back-edge index) of backward branches, nested ones merged."""
    edges = []
    for i, (op, rest) in enumerate(ins):
        if op.startswith(("s_branch", "s_cbranch")):
            t = labels.get(rest.split()[0]) if rest else None
            if t is not None and t <= i:
                edges.append((t, i))
    edges.sort()
    outer: list[list[int]] = []
    for h, b in edges:
        if outer and h <= outer[-1][1]:
            outer[-1][1] = max(outer[-1][1], b)
            outer[-1][0] = min(outer[-1][0], h)
        else:
            outer.append([h, b])
    return [tuple(x) for x in outer]


def amd_counts(ins, labels, trips: list[int]) -> tuple[Counter, list[tuple[int, int, int]]]:
    """Class counts of one wave's run of the body: each instruction once, loop bodies times
    their trip counts (one per outermost loop, in order)."""
    loops = amd_loops(ins, labels)
    if len(trips) != len(loops):
        raise ValueError(f"{len(loops)} loops found, {len(trips)} trip counts given")
    weight = [1] * len(ins)
    for (h, b), n in zip(loops, trips):
        for k in range(h, b + 1):
            weight[k] = n
    c: Counter = Counter()
    ds_bytes = 0
    for (op, rest), w in zip(ins, weight):
        cls = amd_class(op)
        c[cls] += w
        if op == "s_waitcnt" and "vmcnt(0)" in rest:
            c["vmcnt0"] += w  # a wait for every outstanding global load: a memory round trip
        if op.startswith("v_pk_"):
            c["valu_packed"] += w
        if cls == "lds" and not op.startswith(("ds_swizzle", "ds_bpermute", "ds_permute")):
            ds_bytes += w * 64 * _ds_width(op)
    c["total"] = sum(weight)
    c["lds_bytes"] = ds_bytes
    return c, [(h, b, n) for (h, b), n in zip(loops, trips)]


HIP_LOOP_NAMES = ["Q staging loop (q, lam, m loads)", "row-sum back-edge (rotation / q.m)",
                  "V decode loop (PV step 0)", "V decode loop (PV step 1)", "output rows loop"]


def amd_regions(ins, labels, trips) -> dict[str, tuple[int, int]]:
    """(instructions, VALU instructions) of one wave per region: each outermost loop (times its
    trip count) and the straight-line rest (QK, softmax, P, the MFMAs, barriers, stores)."""
    loops = amd_loops(ins, labels)
    out, inside = {}, set()
    for k, ((h, b), n) in enumerate(zip(loops, trips)):
        name = HIP_LOOP_NAMES[k] if k < len(HIP_LOOP_NAMES) else f"loop {k}"
        ops = [op for op, _ in ins[h:b + 1]]
        out[f"{name} x{n}"] = (n * len(ops), n * sum(amd_class(o).startswith("valu") for o in ops))
        inside.update(range(h, b + 1))
    mf = [i for i, (op, _) in enumerate(ins) if op.startswith("v_mfma")]
    first, last = (mf[0], mf[-1]) if mf else (len(ins), len(ins))
    for name, lo, hi in (("rest before the first MFMA (prologue)", 0, first),
                         ("rest from the first to the last MFMA", first, last + 1),
                         ("rest after the last MFMA", last + 1, len(ins))):
        ops = [ins[i][0] for i in range(lo, hi) if i not in inside]
        out[name] = (len(ops), sum(amd_class(o).startswith("valu") for o in ops))
    return out


def _ds_width(op: str) -> int:
    m = re.search(r"_b(\d+)$", op) or re.search(r"_[ui](\d+)$", op)
    bits = int(m.group(1)) if m else 32
    return (2 if re.match(r"ds_(read|write)2", op) else 1) * bits // 8


@dataclasses.dataclass
class MI355X:
    cus: int = 256
    simds: int = 4
    clock_ghz: float = 2.4
    bw_gbs: float = 8000.0
    valu_clk: float = 4.0      # wave64 over a 16-lane SIMD
    trans_factor: float = 4.0  # transcendental: quarter rate
    mfma_fp8_clk: float = 32.0
    mfma_fp4_clk: float = 16.0
    issue_clk: float = 4.0     # SALU / LDS / VMEM / branch issue per instruction per SIMD
    lds_bytes_per_clk: float = 128.0
    waves_per_partition: int = 4
    tiles_per_wave: int = 4    # 64 tokens per wave per 256-token partition


def amd_tile_cycles(c: Counter, hw: MI355X = MI355X(), mfma_clk: float | None = None) -> dict:
    per = 1.0 / hw.tiles_per_wave
    mclk = hw.mfma_fp8_clk if mfma_clk is None else mfma_clk
    lim_simd = {
        "valu": (c["valu"] + c["valu_trans"] * hw.trans_factor) * hw.valu_clk * per,
        "mfma": c["mfma"] * mclk * per,
        "salu": (c["salu"] + c["waitcnt"]) * hw.issue_clk * per,
        "lds_issue": c["lds"] * hw.issue_clk * per,
        "vmem_issue": (c["vmem"] + c["smem"]) * hw.issue_clk * per,
        "branch": c["branch"] * hw.issue_clk * per,
    }
    lim_cu = {k: v / hw.simds for k, v in lim_simd.items()}
    # the CU's one LDS serves every SIMD: a tile's ds_* bytes / 128 B per clock
    lim_cu["lds_bw"] = c["lds_bytes"] * per / hw.lds_bytes_per_clk
    bound = max(lim_cu, key=lim_cu.get)
    return {"limits_cu": lim_cu, "bound": bound, "cu_clk": lim_cu[bound]}


# ----------------------------------------------------------------------------------------------
# compiling
# ----------------------------------------------------------------------------------------------
def _cache_dir() -> Path:
    d = Path(tempfile.gettempdir()) / "turboquant_isa_model"
    d.mkdir(exist_ok=True)
    return d


def _digest(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


def cuda_sass(nvcc: str, cuobjdump: str) -> str:
    """cuobjdump -sass of csrc_cuda/compile_check.cu built with nvcc -cubin for sm_90a (cached
    in the temp dir by the sources' hash)."""
    srcs = list((ROOT / "csrc_cuda").glob("*.cu*"))
    out = _cache_dir() / f"cuda_{_digest(srcs)}.sass"
    if not out.exists():
        cubin = out.with_suffix(".cubin")
        subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", "-O3", "-cubin", "-o", str(cubin),
                        str(ROOT / "csrc_cuda" / "compile_check.cu")], check=True)
        text = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
        out.write_text(text)
    return out.read_text()


def hip_asm(clang: str, src_dir: Path | None = None) -> str:
    """gfx950 assembly of csrc_hip/tq_fp4_gfx950_isa_check.hip (flags of tests/test_aiter_isa.py).
    src_dir: another copy of csrc_hip (e.g. from `git show HEAD:...`)."""
    d = src_dir or ROOT / "csrc_hip"
    srcs = [p for p in d.glob("*") if p.is_file()]
    out = _cache_dir() / f"hip_{_digest(srcs)}.s"
    if not out.exists():
        subprocess.run([clang, "-x", "hip", "--offload-arch=gfx950", "--offload-device-only",
                        "-nogpulib", "-nogpuinc", "-O3", "-std=c++20", "-S", f"-I{d}", "-o",
                        str(out), str(d / "tq_fp4_gfx950_isa_check.hip")], check=True)
    return out.read_text()


def hip_partition_body(asm: str, native: bool, key_e4m3: bool = False) -> str:
    from test_aiter_isa import kernels
    tag = f"ELb{int(native)}ELb0ELb{int(key_e4m3)}EEEv"
    ks = kernels(asm)
    names = [n for n in ks if "partition_kernel" in n and tag in n]
    if len(names) != 1:
        raise ValueError(f"partition kernel {tag}: {names}")
    return ks[names[0]]["body"]


# Trip counts of the partition kernel's outermost loops at HEAD 128, GQA 8, decode, in order:
# Q staging (groups of 8 elements loaded as 16-byte vectors, one wait each: 2 trips at HEAD 128),
# a back-edge the compiler lays out in the rotation / q.m row sums that runs once, the two PV
# steps' V decode (kVUnits / kThreads = (128 tokens / 4 x 16 dwords) / 256 = 2 each), output
# rows h = wave, wave + 4 < GQA 8: 2.
HIP_DECODE_TRIPS = [2, 1, 2, 2, 2]


# ----------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------
RESULTS = ROOT / "benchmarks" / "results"
RUNS = ["h100-2026-11-24d", "h100-2026-11-24e"]


def run_bandwidth(run: str) -> float:
    log = (RESULTS / run / "bench.log").read_text()
    return float(re.search(r"bandwidth: read (\d+(?:\.\d+)?) GB/s", log).group(1))


def measured_rows(run: str) -> list[dict]:
    rows = []
    for r in csv.DictReader(open(RESULTS / run / "bench.csv")):
        if r["shape"] != "32/8/128" or r["status"] != "ok" or r["backend"] != "cuda":
            continue
        rows.append({"run": run, "config": r["config"], "batch": int(r["batch"]),
                     "context": int(r["context"]), "pct": float(r["fp4_pct_bw"]),
                     "bw": run_bandwidth(run)})
    return rows


STREAMING_MIN_TILES = 32


def tiles_per_warp(batch: int, context: int, kv_heads: int = 8, hw: H100 = H100()) -> float:
    return batch * kv_heads * context / TILE_TOKENS / (hw.sms * hw.warps_per_sm)


# ----------------------------------------------------------------------------------------------
def cuda_report(sass: str, clocks=(1.98, 1.755)) -> tuple[str, dict]:
    funcs = parse_sass(sass)
    res = {}
    lines = ["## cuda decode kernel (sm_90a SASS), per 16-token tile of one warp", ""]
    for label, name, tb in (("FP4 <128, bf16, false, false>", CUDA_DECODE, FP4_TILE_BYTES),
                            ("K8V4 <128, bf16, false, true>", CUDA_DECODE_K8V4, K8V4_TILE_BYTES)):
        code = funcs[name]
        h, b = find_key_loop(code)
        hot = hot_path(code, h, b)
        c = count_classes(hot)
        allc = count_classes(code[h:b + 1])
        cyc = cuda_tile_cycles(c)
        res[label] = {"counts": c, "all": allc, "cycles": cyc, "tile_bytes": tb,
                      "loop": (code[h].addr, code[b].addr)}
        lines.append(f"{label}: loop 0x{code[h].addr:x}..0x{code[b].addr:x}, hot path "
                     f"{c['total']} instructions ({allc['total']} in the whole loop range)")
        lines.append("| class | " + " | ".join(CUDA_CLASSES) + " | total |")
        lines.append("|---" * (len(CUDA_CLASSES) + 2) + "|")
        lines.append("| hot path | " + " | ".join(str(c[k]) for k in CUDA_CLASSES) + f" | {c['total']} |")
        lines.append("| loop range | " + " | ".join(str(allc[k]) for k in CUDA_CLASSES) + f" | {allc['total']} |")
        for part, n, cc in hot_path_parts(hot):
            lines.append(f"  hot path part: {part}: {n} instructions ("
                         + ", ".join(f"{k} {v}" for k, v in cc.most_common() if k != "total") + ")")
        lim = cyc["limits"]
        lines.append("scheduler clocks per warp-tile: " + ", ".join(f"{k} {v:.0f}" for k, v in lim.items())
                     + f" -> {cyc['bound']}-bound, {cyc['sm_clk']:.1f} SM clocks per tile; tile bytes {tb}")
        lines.append("")
    lines.append("## predicted vs measured, H100 SXM (32/8/128; % of the run's measured read bandwidth)")
    lines.append("")
    lines.append("tiles/warp = batch x 8 kv heads x context / 16 / (132 SMs x 16 warps); below "
                 f"{STREAMING_MIN_TILES} the per-CTA fixed costs (first-tile latency, merge, split-KV "
                 "reduce) dominate: outside the model (marked *). busy = instruction time / HBM time.")
    lines.append("")
    hdr = "| run | config | batch x context | tiles/warp | measured % | " + " | ".join(
        f"predicted % @ {c} GHz (issue/HBM ns)" for c in clocks) + " | diff (pts, first clock) |"
    lines.append(hdr)
    lines.append("|---" * (6 + len(clocks)) + "|")
    rows = []
    for run in RUNS:
        for m in measured_rows(run):
            if m["batch"] < 16:
                continue
            label = "K8V4 <128, bf16, false, true>" if m["config"].startswith("k8v4") else "FP4 <128, bf16, false, false>"
            r = res[label]
            preds = [predict_pct(r["cycles"]["sm_clk"], ck, r["tile_bytes"], m["bw"], H100().sms) for ck in clocks]
            tpw = tiles_per_warp(m["batch"], m["context"])
            rows.append((m, preds, tpw))
            star = "*" if tpw < STREAMING_MIN_TILES else ""
            lines.append(f"| {m['run'][5:]} ({m['bw']:.0f} GB/s) | {m['config']} | {m['batch']} x {m['context'] // 1024}k{star} | "
                         f"{tpw:.0f} | {m['pct']:.1f} | " + " | ".join(
                             f"{p['pct']:.0f} ({p['issue_ns']:.0f}/{p['hbm_ns']:.0f} ns, busy "
                             f"{100 * p['issue_ns'] / p['hbm_ns']:.0f} %)" for p in preds)
                         + f" | {preds[0]['pct'] - m['pct']:+.1f} |")
    res["rows"] = rows
    lines.append("")
    for kind in ("FP4", "K8V4"):
        d = [p[0]["pct"] - m["pct"] for m, p, t in rows
             if t >= STREAMING_MIN_TILES and m["config"].startswith("k8v4") == (kind == "K8V4")]
        if d:
            lines.append(f"{kind}, streaming shapes (>= {STREAMING_MIN_TILES} tiles/warp): predicted - measured "
                         f"{min(d):+.1f} .. {max(d):+.1f} points over {len(d)} rows, "
                         f"{sum(abs(x) <= 10 for x in d)} within 10 points")
    return "\n".join(lines), res


def hip_report(asm: str, hw: MI355X = MI355X()) -> tuple[str, dict]:
    lines = ["## gfx950 partition kernels (decode, bf16, HEAD 128, block 16, GQA 8), MI355X",
             "", "per wave and 256-token partition (= 4 tiles per wave); per-tile = / 4", ""]
    res = {}
    cols = AMD_CLASSES + ["valu_packed", "vmcnt0", "total", "lds_bytes"]
    lines.append("| path | " + " | ".join(cols) + " |")
    lines.append("|---" * (len(cols) + 1) + "|")
    for label, native, e4 in (("native FP4", True, False), ("LUT", False, False),
                              ("K8V4 native", True, True)):
        ins, labels = parse_amd_body(hip_partition_body(asm, native, e4))
        loops = amd_loops(ins, labels)
        trips = HIP_DECODE_TRIPS if len(loops) == len(HIP_DECODE_TRIPS) else None
        if trips is None:
            lines.append(f"{label}: {len(loops)} loops, expected {len(HIP_DECODE_TRIPS)}; skipped")
            continue
        c, lp = amd_counts(ins, labels, trips)
        tb = K8V4_TILE_BYTES if e4 else FP4_TILE_BYTES
        res[label] = {"counts": c, "loops": lp, "tile_bytes": tb, "regions": amd_regions(ins, labels, trips)}
        lines.append(f"| {label} | " + " | ".join(str(c[k]) for k in cols) + " |")
    lines.append("")
    lines.append("where a wave's instructions are (count incl. trip counts / of them VALU), per partition:")
    lines.append("")
    names = list(next(iter(res.values()))["regions"]) if res else []
    lines.append("| path | " + " | ".join(names) + " |")
    lines.append("|---" * (len(names) + 1) + "|")
    for label, r in res.items():
        lines.append(f"| {label} | " + " | ".join(f"{r['regions'][n][0]} / {r['regions'][n][1]}"
                                                 for n in names) + " |")
    lines.append("")
    lines.append("| path | valu clk/tile/CU | mfma | salu | lds issue | lds bw | vmem issue | bound | "
                 "instr ns/tile/CU | HBM ns/tile/CU | predicted % of 8 TB/s | with VALU 1 clk | "
                 "VALU of the tile work only (no prologue/epilogue) |")
    lines.append("|---" * 14 + "|")
    for label, r in res.items():
        cyc = amd_tile_cycles(r["counts"], hw)
        p = predict_pct(cyc["cu_clk"], hw.clock_ghz, r["tile_bytes"], hw.bw_gbs, hw.cus)
        cyc1 = amd_tile_cycles(r["counts"], dataclasses.replace(hw, valu_clk=1.0))
        p1 = predict_pct(cyc1["cu_clk"], hw.clock_ghz, r["tile_bytes"], hw.bw_gbs, hw.cus)
        r.update(cycles=cyc, pred=p, pred_valu1=p1, bound1=cyc1["bound"])
        L = cyc["limits_cu"]
        bound = "memory" if p["bound"] == "memory" else cyc["bound"]
        bound1 = "memory" if p1["bound"] == "memory" else cyc1["bound"]
        lines.append(f"| {label} | {L['valu']:.0f} | {L['mfma']:.0f} | {L['salu']:.0f} | {L['lds_issue']:.0f} | "
                     f"{L['lds_bw']:.0f} | {L['vmem_issue']:.0f} | {bound} | {p['issue_ns']:.0f} | "
                     f"{p['hbm_ns']:.0f} | {p['pct']:.0f} % | {p1['pct']:.0f} % ({bound1}) | "
                     f"{steady_valu_pct(r, hw):.0f} % |")
    return "\n".join(lines), res


def steady_valu_pct(r: dict, hw: MI355X = MI355X()) -> float:
    """% of bandwidth if only the VALU work between the first and the last MFMA and the V decode
    loops counted (what a longer partition would approach), with the VALU at hw.valu_clk."""
    valu = sum(v for k, (n, v) in r["regions"].items()
               if k.startswith(("V decode", "rest from the first")))
    cu_clk = valu * hw.valu_clk / hw.tiles_per_wave / hw.simds
    return predict_pct(cu_clk, hw.clock_ghz, r["tile_bytes"], hw.bw_gbs, hw.cus)["pct"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-hip", action="store_true")
    ap.add_argument("--hip-src", type=Path, help="a copy of csrc_hip to compile instead")
    args = ap.parse_args(argv)
    from _tools import find_clang, find_nvcc, find_tool
    nvcc, cuobj = find_nvcc(), find_tool("cuobjdump")
    if nvcc and cuobj:
        text, _ = cuda_report(cuda_sass(nvcc, cuobj))
        print(text)
    else:
        print("cuda part skipped: nvcc/cuobjdump not found")
    if not args.no_hip:
        clang = find_clang()
        if clang:
            print()
            text, _ = hip_report(hip_asm(clang, args.hip_src))
            print(text)
        else:
            print("gfx950 part skipped: clang-22 not found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
