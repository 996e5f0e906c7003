"""A static performance estimate of the decode kernels from their compiled instruction streams
(issue 20, part 2; every NVIDIA target: issue 43, item 2).

    python benchmarks/isa_model.py                       # compiles, counts, prints the tables
    python benchmarks/isa_model.py --no-hip              # the cuda part only (every NVIDIA target)
    python benchmarks/isa_model.py --no-hip --json nv.json
                                  # and the NVIDIA targets' figures under "nvidia"
    python benchmarks/isa_model.py --cuda-src DIR        # another copy of csrc_cuda (e.g. HEAD's)
    python benchmarks/isa_model.py --compute-bound cb_out/compute_bound.json
                                  # also the model with compute_bound_check.py's measured clocks
    python benchmarks/isa_model.py --no-cuda --json amd.json
                                  # the AMD part alone; its per-path figures as JSON too

Every constant is a field of `H100` / `NvidiaGpu` / `MI355X` / `MI300X` below, with its source;
one constant (the overlap exponent k) is fitted, on one named row (`OVERLAP_TRAIN_ROW`).

NVIDIA targets (`nvidia_report`, part 4 below): H100 and H200 (the sm_90a decode kernel's counts;
each its own bandwidth), B200 (csrc_cuda/compile_check.cu compiled for sm_100a, the same decode
kernel counted from its own SASS), RTX 5090 and RTX PRO 6000 (the sm120 kernel,
csrc_cuda/sm120/sass_check.cu for sm_120a); the RTX 5070 Ti runs the sm120 kernel too but no
sourced bandwidth or clock was found for it, so it is listed, not predicted.

1. Per 16-token tile (throughput limits). A decode kernel streams its KV cache in 16-token
  tiles. For one tile we count the instructions one warp (cuda) or one wave (AMD) issues for
  it, by class, and turn the counts into the time the SM (CU) needs per tile:

    cuda, per scheduler (4 per SM, each issuing 1 warp-instruction per clock):
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

    AMD, per SIMD (4 per CU). Each wave's instructions for some number of its tiles, divided by
    that number (`tiles_per_wave`): the gfx950 kernel's step loop (one wave, 128 tokens = 8
    tiles), gfx942's partition body (4 waves per workgroup, 256 tokens, 64 = 4 tiles per wave),
    AITER's kernels as benchmarks/aiter_anchor.py counts them. Every SIMD runs its own waves, so
    per CU = per SIMD / 4:
      valu   = VALU x 4 clk: a CDNA SIMD is 16 lanes wide, a wave64 instruction takes 4 clocks
               (MI355X's 157.3 TFLOP/s fp32 vector = 256 CU x 4 SIMD x 16 lanes x 2 (FMA) x
               2 (packed v_pk_*) x 2.4 GHz; MI300X: "Vector FP32 256 FLOPS/clock/CU", "Vector
               FP64 128" = 4 SIMD x 16 lanes x 2 (FMA) (x 2 packed for FP32), ROCm docs, AMD
               Instinct MI300 microarchitecture, table mi300x-perf-table); transcendentals
               (v_exp, v_rcp, v_log, ...) quarter rate, 16 clk.
      mfma   = gfx950 16x16x128 f8f6f4: 32 clk with an FP8 operand, 16 with both FP4 (MI355X
               dense MXFP8 5.0 PFLOP/s, MXFP4 10 PFLOP/s at 2.4 GHz over 1024 SIMDs: 2048 resp.
               4096 FLOP/clk/SIMD; one 16x16x128 is 65536 FLOP). The native path's QK has an
               FP4 A and an FP8 B operand: counted at the FP8 rate. gfx942 16x16x32 fp8_fp8:
               16 clk (MI300X "Matrix FP8 4096 FLOPS/clock/CU" (same table) = 1024 per SIMD;
               one 16x16x32 is 16384 FLOP).
      salu, lds issue, vmem issue, branch: 4 clk each (a SIMD gets one issue turn per 4 clocks,
               one instruction of each type per turn from different waves)
      tile time per SIMD = max of those; per CU = that / 4; also LDS bandwidth 128 B/clk/CU
      (ds_* bytes = 64 lanes x access width), HBM = tile bytes / (HBM bandwidth / CUs).

2. One call of the cuda decode kernel (`cuda_call`), for a batch x context on H100:
  - partitions from tuning.cuh's wave model (`choose_decode_partition_size`, a mirror of the C++
    read from the same constants), CTAs = batch x kv heads x partitions, in waves of
    132 SMs x 2 CTAs = 264 slots; in a wave of N CTAs every CTA streams its P/16 tiles, one per
      t_cta = smooth_max_k(t_hbm, t_issue, t_lat),   smooth_max_k(x) = (sum x_i^k)^(1/k)
      t_hbm   = tile bytes x N / bandwidth        (the CTA's share of HBM)
      t_issue = CTAs on its SM x SM clocks per tile / clock   (its share of the SM's issue)
      t_lat   = DRAM latency / (8 warps x (STAGES - 1) tiles in flight)   (Little's law)
    k -> inf is the throughput-only max() (perfect overlap of memory and instruction issue),
    k = 1 no overlap at all; k is fitted on ONE measured row (OVERLAP_TRAIN_ROW) and checked on
    every other row (other shapes and the other kernel);
  - per-call fixed costs from the measured timeline of one call (docs/cuda-kernels.md, "Known limits and open directions"): per
    wave a CTA's prologue (two dependent DRAM round trips: block ids, then the first KV tile)
    and its merge/output writes; the grid boundary to the next (programmatically dependent)
    grid; with a split KV range the reduce pass and the relaunch after it; the default
    config's Q/O transforms.
  predicted % of bandwidth = the bench's bytes / (predicted call time x measured bandwidth),
  the bench's own definition, so it compares with the measured rows one to one.

3. One call on AMD (`amd_call`), for the one table of issue 38 (`amd_table`): our gfx950 call
  (one launch: the partition kernel, Q's transform in its prologue, the reduce fused into the last partition of each
  row tile to finish; one wave per (sequence, partition, kv head),
  partitions from the launcher's plan, `partition_len`), gfx942's old kernel and AITER's pa_v1
  (partition kernel + reduce: 2 launches, 256-token partitions, 4 waves per workgroup) and
  AITER's asm kernel (1 launch, no split of the context: one workgroup of 4 waves per
  (sequence, kv head) streams the whole context; at batch B only 8 B workgroups work). Nothing
  AMD has been timed, so the fixed costs are ASSUMPTIONS taken from public sources (the fields
  of `MI355X`): a kernel launch inside a HIP graph, the DRAM round trip. Workgroups run in
  rounds of (CUs x SIMDs x waves per SIMD / waves per workgroup); in a round of n waves, w per
  SIMD, each wave's step of S tiles takes
      max(w x issue(step),  n x step bytes / HBM bandwidth,  latency term)
    latency term = latency + issue(step) when the step loop drains its loads (a vmcnt(0) wait in
    the loop: nothing of the next step is in flight), else Little's law, step bytes / (bytes the
    wave keeps in flight / latency) (AITER's asm loop waits vmcnt(15) at most: 15 16-byte loads
    per lane stay in flight). That last term is what holds the asm kernel at small batch: a
    workgroup's streaming rate, not the GPU's bandwidth. Per workgroup also: its dependent round
    trips before streaming (Q, the block table) and its instructions outside the loop; per call:
    launches, the reduce's round trips (ours: the waits from the ticket's atomic
    to its chunk loop, then one pass in chunks of partitions (8 at GQA 8), both counted from
    the compiled code; gfx942's: serial chunks of 8 partitions, 2 loops x
    ceil(partitions / 8) round trips; pa_v1's: all maxima and sums at once, then chunks of 64
    partitions) and the partials' bytes. The dependency factor (the
    H100's measured 1.4-1.5x of the instruction count) multiplies every kernel's issue time in
    the sensitivity rows, AITER's included. The per-tile rows (part 1) use the throughput max().

4. Every NVIDIA target (`nvidia_report`). The instruction time per tile is the throughput
  count of part 1 times the dependency factor, the H100's measured instruction-bound clocks over
  the count (1.48 for FP4: benchmarks/results/2026-11-24-h100-isa-model-dependency.json); k is
  refitted with it on the same H100 row. Why: with the bare count the H200 rows came out 9-12
  points high at batch >= 16 (15 of 30 within 10 points), because on the H200 the instruction
  term, not HBM, binds, and the bare count leaves out the register-dependency latency that
  compute_bound_check.py measured; on the H100, close to HBM, k had absorbed it. The gate: every
  H200 row of benchmarks/results/2026-11-27-h200-decode-peers.json within 10 points (each row at
  its run's measured bandwidth); `validated` is true only for a GPU whose rows met it (H100,
  H200), and no other target is marked validated. Targets without a measured bandwidth use the
  vendor peak times the mean measured / peak ratio of the H100 and H200. Per target:
  - B200: the sm_100a decode kernel's hot path (the vote's branch polarity differs from sm_90a:
    the walk follows the side where the vote is false), counts per tile as on sm_90a; new
    opcodes seen there (S2R, LDC in the loop) count as issue only.
  - sm120 (RTX 5090, RTX PRO 6000): one CTA per (sequence, kv head, split), 4 warps, each warp a
    32-key chunk per step. The chunk loop is the conditional back-edge around the QMMAs; its hot
    path (`sm120_hot_path`) takes no per-lane forward branch (valid keys, block ids in the
    cache, no soft cap, no NaN scale), sends each uniform branch where the benchmark's
    parameters send it (no sliding window: the parameter's offset from the AttentionParams
    struct), and repeats the V-to-shared loop D / 32 times. Per chunk: 16 QK MMAs (4 n8-tiles
    of keys x D / 32 k32 steps) and 16 PV MMAs (D / 8 n8-tiles of channels, k = the chunk's 32
    keys), all QMMA.SF.16832.F32.E4M3.E2M1.E8 (mma kind::mxf8f6f4, block scaled), each 8192
    FLOP at the vendor's dense FP8 rate (16 clk per scheduler; the half rate a microbenchmark
    saw with an FP4 operand is a sensitivity row). FP32, INT and IMAD share one 32-lane pipe per
    scheduler (Blackwell's unified cores). Counts per 16-token tile = per chunk / 2. CTAs per
    SM from ptxas's registers and shared memory; the call (`sm120_call`) mirrors
    plan_attention (splits of 128-key steps, ~2 x SMs CTAs), each chunk 3 dependent DRAM round
    trips (block id, K and scales, V after the softmax), the combine kernel always launched.
  The per-call fixed costs and the DRAM latency of the H100 are ASSUMED on every other target.

What the model leaves out: the DRAM's own efficiency (the measured read bandwidth is the
100 % line), L2/TLB effects (the over-fetch of the scale bytes' 32-byte sectors is shown as a
sensitivity column, not in the model), register-dependency latencies inside a warp (only as far
as the fitted k absorbs them; benchmarks/compute_bound_check.py measures the kernel bound by its
instructions: 1.4-1.5x the throughput count on H100), and the slowest CTA of a wave.

Which instructions belong to a tile:
  cuda: the key loop is the back-edge (a backward BRA) whose range holds HMMAs. Its hot path is
    walked from the loop head: BRA.DIV (warp-divergence fallback) is not taken; a forward
    conditional branch skips its region when the region's own instructions (nested regions
    excluded) include LDG (the block-id refill, once per 32 tiles) or MUFU.RCP (the soft-cap
    tanh, off in the benchmarks), and a branch right after VOTE.ANY (the lazy-rescale vote:
    some lane needs the slow path) is not taken, nor one on the predicate a B2R.RESULT wrote
    (the SM90a FP8 kernel's bar.red.or vote for the maxima exchange); any other region is
    executed. Every loop iteration is one 16-token tile of one warp (one 64-token step of a
    warpgroup in the FP8 kernel).
  gfx950 (tq_fp4_gfx950_attention.cuh): benchmarks/isa_hot_path.hip compiled with
    TQ_HOT_PATH_ASSUME(c) defined as __builtin_assume(c): the kernel assumes there that the step
    is full (every row sees its 128 tokens) and no soft cap is set, so the compiler drops the
    edge and soft-cap code and the one loop left is the hot path; every instruction of it is
    counted once per step (the exec-masked loads in it run on the hot path). The same file
    without the assumption gives "all paths" (the whole loop range, every branch side).
  gfx942 (the old kernel, tq_fp4_paged_attention.cuh, LUT path): the partition kernel has no
    tile loop (4 tiles per wave, unrolled); every instruction of the body is counted once, the
    bodies of its loops (Q staging, V decode, output rows) times their trip counts (from the
    source at HEAD 128, GQA 8), both sides of every forward branch included (an upper bound of
    a path; the branches are short).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CUDA_DECODE = "_ZN10turboquant8cuda_fp433paged_attention_fp4_decode_kernelILi128E13__nv_bfloat16Lb0ELb0ELi1ELb0EEEvNS0_10AttnParamsE"
CUDA_DECODE_K8V4 = CUDA_DECODE.replace("Lb0ELb0E", "Lb0ELb1E")
CUDA_SPEC = CUDA_DECODE.replace("ELi1ELb0EEEv", "ELi2ELb1EEEv")  # 16 (query token, head) columns
CUDA_SPEC8 = CUDA_DECODE.replace("ELi1ELb0EEEv", "ELi1ELb1EEEv")  # 8 (query token, head) columns
# the SM90a FP8 warpgroup decode kernel (attention_decode_wgmma.cuh): FP4 decode at D 128 on SM 9.x
CUDA_DECODE_WGMMA = ("_ZN10turboquant8cuda_fp439paged_attention_fp4_decode_wgmma_kernelI"
                     "13__nv_bfloat16Lb0EEEvNS0_10AttnParamsE")
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
CUDA_CLASSES = ["fp32", "imad", "alu", "mufu", "hmma", "gmma", "shared", "global", "shuffle",
                "control", "uniform", "other"]


def sass_class(op: str) -> str:
    base = op.split(".")[0]
    if base == "HMMA":
        return "hmma"
    if base in ("QGMMA", "HGMMA"):  # sm_90a warpgroup MMAs (FP8, fp16)
        return "gmma"
    if base in ("QMMA", "OMMA"):  # sm_120a block-scaled MMAs: FP8/FP6/FP4 (QMMA), FP4 (OMMA)
        return "qmma"
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


def find_key_loop(code: list[Sass], mma: str = "HMMA") -> tuple[int, int]:
    """(index of the loop head, index of the back-edge BRA) of the loop that holds the MMAs
    (opcode ``mma``: HMMA in the cuda kernels, QMMA in the sm120 one): of the conditional
    backward branches whose range contains them, the innermost (shortest) one (unconditional
    backward jumps are the returns of out-of-line BRA.DIV fallbacks)."""
    idx = {ins.addr: i for i, ins in enumerate(code)}
    best = None
    for i, ins in enumerate(code):
        t = _branch_target(ins)
        if t is None or t >= ins.addr or t not in idx or not ins.pred:
            continue
        j = idx[t]
        if any(c.base == mma for c in code[j:i]) and (best is None or i - j < best[1] - best[0]):
            best = (j, i)
    if best is None:
        raise ValueError(f"no loop with {mma} instructions")
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
    votes: set[str] = set()  # predicates holding a barrier vote's result (B2R.RESULT)
    while i <= back:
        steps += 1
        if steps > 100000:
            raise RuntimeError("hot path walk does not end")
        ins = code[i]
        path.append(ins)
        if ins.base == "B2R":
            votes.add(ins.args.split(",")[1].strip())
        elif ins.args.split(",")[0].strip() in votes:
            votes.discard(ins.args.split(",")[0].strip())  # the predicate written anew
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
        pred = ins.pred.lstrip("@!")
        if pred in votes:
            # the SM90a FP8 decode kernel's vote, a bar.red.or whose result (B2R.RESULT) says
            # whether any thread's P' outgrew the margin: the hot path is the one where it is
            # false (@!P BRA skips the exchange: taken)
            i = j if ins.pred.startswith("@!") else i + 1
            continue
        prev = code[i - 1] if i > 0 else None
        if prev is not None and prev.base == "VOTE":
            # the lazy-rescale vote (some lane needs the slow path): the hot path is the one
            # where the vote is false. sm_90a branches to the slow path on the vote (@P2 BRA:
            # not taken), sm_100a around it (@!P0 BRA: taken)
            vote = prev.args.split(",")[0].strip()
            i = j if ins.pred == f"@!{vote}" else i + 1
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
    # (the parser's opcode stops at the shape's lower-case x: "QGMMA.64", args "x16x32...")
    gmma = sum(gmma_clocks(ins.op + ins.args) for ins in instrs if sass_class(ins.op) == "gmma")
    if gmma:
        c["gmma_clk"] = gmma
    return c


def gmma_clocks(op: str) -> float:
    """Scheduler clocks of one warp's share of a QGMMA.64xNx32 (FP8) or HGMMA.64xNx16 (fp16)
    (`op`: the opcode with its shape):
    16 rows x N x K x 2 FLOP at 2048 FP8 / 1024 fp16 FLOP per clock and scheduler (1979 / 989
    dense TFLOP/s at 1.83 GHz over 132 SMs x 4 schedulers: NVIDIA H100 datasheet)."""
    m = re.match(r"([QH])GMMA\.64x(\d+)x(\d+)", op)
    if m is None:
        raise ValueError(f"not a warpgroup MMA shape: {op}")
    n, kk = int(m.group(2)), int(m.group(3))
    return 16 * n * kk * 2 / (2048 if m.group(1) == "Q" else 1024)


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
    # Per-call fixed costs (us), from the timeline of one call in docs/cuda-kernels.md (probe
    # build, 1 x 32k: 32 partitions x 8 kv heads; the 1 x 4k column in brackets):
    # one dependent DRAM round trip: the first KV tile lands (median) 3.07 us (2.05) after the
    # first CTA starts = two dependent round trips (block ids, then KV) + half of the first
    # burst of every CTA at the measured bandwidth (256 CTAs x 8 warps x 2 tiles x 2080 B =
    # 8.5 MB: 1.43 us; 4.3 MB: 0.72 us): (3.07 - 1.43) / 2 = 0.82, (2.05 - 0.72) / 2 = 0.67 ->
    # 0.75. Also the latency of Little's law (t_lat in `cuda_call`).
    dram_latency_us: float = 0.75
    merge_us: float = 1.6       # a CTA's warp merge and output / partial writes ("~1.6 us")
    boundary_us: float = 0.5    # grid end -> the dependent grid passes griddepcontrol.wait
    reduce_us: float = 2.0      # the split-KV reduce pass ("~2 us of reduce")
    relaunch_us: float = 2.0    # reduce end -> the next call's CTAs ("~2 us to the next call")
    # the default config's Q transform in the prologue and O un-rotation (NOTES session 4:
    # 1 x 4k default 9.6 vs plain 8.6 us; the timeline's probe build had no transforms)
    transforms_us: float = 1.0
    l2_bytes: int = 50 * 2**20  # H100 SXM L2 (bench.json meta "l2_bytes": 52428800)


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


def smooth_max(xs, k: float = math.inf) -> float:
    """(sum of x^k)^(1/k) over the positive xs: max(xs) as k -> inf, their sum at k = 1, and
    between the two (>= max) for every k >= 1. The overlap of resources that work at once:
    k = inf is perfect overlap (throughput-only), k = 1 none."""
    xs = [float(x) for x in xs if x > 0]
    if not xs:
        return 0.0
    m = max(xs)
    if math.isinf(k):
        return m
    return m * sum((x / m) ** k for x in xs) ** (1.0 / k)  # scaled by the max: no overflow


def predict_pct(sm_clk_per_tile: float, clock_ghz: float, tile_bytes: float, bw_gbs: float,
                units: int, k: float = math.inf) -> dict:
    """% of bandwidth = HBM time / smooth_max_k(HBM time, instruction time), per SM (CU) and
    tile; k = inf (the default) is the throughput-only max()."""
    t_issue_ns = sm_clk_per_tile / clock_ghz
    t_hbm_ns = tile_bytes / (bw_gbs / units)       # bytes / (GB/s) = ns
    return {"issue_ns": t_issue_ns, "hbm_ns": t_hbm_ns,
            "pct": 100.0 * t_hbm_ns / smooth_max([t_hbm_ns, t_issue_ns], k),
            "bound": "memory" if t_hbm_ns >= t_issue_ns else "instruction issue"}


# ----------------------------------------------------------------------------------------------
# cuda: one call of the decode kernel (partitions, waves, overlap, fixed costs)
# ----------------------------------------------------------------------------------------------
TUNING_CUH = ROOT / "csrc_cuda" / "tuning.cuh"


@functools.lru_cache(maxsize=None)
def tuning_constants(path: Path = TUNING_CUH) -> dict:
    """The decode kernel's launch constants as csrc_cuda/tuning.cuh sets them by default (its
    #define defaults and constexpr values), so the Python mirror follows the C++."""
    text = Path(path).read_text()

    def number(pattern: str) -> int:
        m = re.search(pattern, text)
        if m is None:
            raise ValueError(f"{path}: no match for {pattern!r}")
        return int(m.group(1))

    return {"DECODE_WARPS": number(r"#define\s+TQ_DECODE_WARPS\s+(\d+)"),
            "DECODE_STAGES": number(r"#define\s+TQ_DECODE_STAGES\s+(\d+)"),
            "DECODE_MIN_BLOCKS": number(r"#define\s+TQ_DECODE_MIN_BLOCKS\s+(\d+)"),
            "DECODE_WGMMA_STAGES": number(r"#define\s+TQ_DECODE_WGMMA_STAGES\s+(\d+)"),
            "DECODE_WGMMA_MIN_BLOCKS": number(r"#define\s+TQ_DECODE_WGMMA_MIN_BLOCKS\s+(\d+)"),
            "MIN_PARTITION": number(r"#define\s+TQ_MIN_PARTITION\s+(\d+)"),
            "DECODE_CTA_COST": number(r"\bDECODE_CTA_COST\s*=\s*(\d+)"),
            "DECODE_WGMMA_CTA_COST": number(r"\bDECODE_WGMMA_CTA_COST\s*=\s*(\d+)"),
            "DECODE_REDUCE_COST": number(r"\bDECODE_REDUCE_COST\s*=\s*(\d+)")}


def choose_decode_partition_size(max_seq_len: int, base_ctas: int, num_sms: int,
                                 t: dict | None = None, min_blocks: int | None = None,
                                 cta_cost: int | None = None) -> int:
    """tuning.cuh choose_decode_partition_size in Python (the same loop, the same integer
    arithmetic): the split-KV partition, in tokens, of the decode kernel (min_blocks: its
    resident CTAs per SM, DECODE_MIN_BLOCKS by default, and cta_cost, DECODE_CTA_COST; the
    SM90a kernel's are DECODE_WGMMA_MIN_BLOCKS and DECODE_WGMMA_CTA_COST)."""
    t = t or tuning_constants()
    blocks = t["DECODE_MIN_BLOCKS"] if min_blocks is None else min_blocks
    step, slots = t["DECODE_WARPS"] * TILE_TOKENS, num_sms * blocks
    length, base = max(max_seq_len, 1), max(base_ctas, 1)
    cta = t["DECODE_CTA_COST"] if cta_cost is None else cta_cost
    red, min_p = t["DECODE_REDUCE_COST"], t["MIN_PARTITION"]
    best_p = best_cost = 0
    n = 1
    while n <= -(-length // min_p) and n <= 4 * slots:
        p = -(-length // n)                          # ceil(L / n), rounded up to whole warps
        p = max(-(-p // step) * step, min_p)
        parts = -(-length // p)
        if best_p and base * length + base * parts * cta >= best_cost * slots:
            break
        cost = -(-(base * parts) // slots) * (p + cta) + (red if parts > 1 else 0)
        if not best_p or cost < best_cost:
            best_p, best_cost = p, cost
        n += 1
    return min(best_p, 1 << 30)


# CTA order of the decode grid: "kv" (HEAD since 06d9709: x = sequence x kv heads + kv head, the
# heads of a sequence are consecutive CTAs) or "seq" (before: x = sequence, y = kv head, the heads
# of a sequence num_seqs CTAs apart); it decides who shares the scale bytes' DRAM sectors.
CTA_ORDER = "kv"


def cta_index(s: int, kvh: int, part: int, batch: int, kv_heads: int, order: str) -> int:
    """Linear launch index of the CTA of (sequence s, kv head, partition) in the decode grid."""
    if order == "seq":
        return s + batch * (kvh + kv_heads * part)
    return s * kv_heads + kvh + batch * kv_heads * part


def scale_fetches(batch: int, nparts: int, kv_heads: int, slots: int, wave_us: float,
                  retention_us: float, order: str) -> float:
    """DRAM fetches of one tile's scale sectors per (sequence, partition), averaged: 1 when all
    kv heads of the sequence share one fetch, kv_heads when none do. The scale bytes are
    [block, token, kv head], so the heads of a sequence read the same sectors for a tile
    (`scale_sector_overfetch`); a head finds them in L2 when the previous head of its sequence
    to start began less than one L2 turnover (L2 bytes / bandwidth) before it. Start times:
    the first wave's CTAs start together, CTA i of a later wave at i / slots wave times."""
    total = 0
    for part in range(nparts):
        for s in range(batch):
            starts = sorted(0.0 if i < slots else wave_us * i / slots
                            for i in (cta_index(s, h, part, batch, kv_heads, order)
                                      for h in range(kv_heads)))
            total += 1 + sum(b - a > retention_us for a, b in zip(starts, starts[1:]))
    return total / (batch * nparts)


def cuda_call(batch: int, context: int, sm_clk_per_tile: float, tile_bytes: float,
              bw_gbs: float, k: float, hw: H100 = H100(), kv_heads: int = 8,
              transforms: bool = False, cta_order: str | None = None,
              wgmma: bool = False) -> dict:
    """Predicted time of one decode call (module docstring, part 2): partitions and waves,
    the streaming part per wave with the overlap term, and the per-call fixed costs (us).
    cta_order ("kv" / "seq"): add the scale sectors' over-fetch of that grid order
    (`scale_fetches`) to the tile's DRAM bytes; None: the tile's own bytes only. wgmma: the
    SM90a FP8 kernel's launch (DECODE_WGMMA_MIN_BLOCKS CTAs per SM, a ring of
    DECODE_WGMMA_STAGES 64-token steps, 4 tiles each, per CTA) instead of the decode kernel's."""
    t = tuning_constants()
    base = batch * kv_heads
    blocks = t["DECODE_WGMMA_MIN_BLOCKS"] if wgmma else t["DECODE_MIN_BLOCKS"]
    p = choose_decode_partition_size(context, base, hw.sms, t, blocks,
                                     t["DECODE_WGMMA_CTA_COST"] if wgmma else None)
    nparts = -(-context // p)
    ctas = base * nparts
    slots = hw.sms * blocks
    waves = -(-ctas // slots)
    in_flight = 4 * (t["DECODE_WGMMA_STAGES"] - 1) if wgmma else \
        t["DECODE_WARPS"] * (t["DECODE_STAGES"] - 1)  # tiles of a CTA in flight
    t_lat = hw.dram_latency_us * 1e3 / in_flight

    by_term: dict = {}  # us of the stream whose wave each term binds (the last stream's)

    def stream(nbytes: float) -> tuple[float, list]:
        total, left, per_wave = 0.0, ctas, []
        by_term.clear()
        while left > 0:
            n = min(slots, left)
            left -= n
            terms = {"HBM": nbytes * n / bw_gbs,                           # ns per CTA-tile
                     "issue": -(-n // hw.sms) * sm_clk_per_tile / hw.clock_ghz,
                     "latency": t_lat}
            per_wave.append(terms)
            dt = p / TILE_TOKENS * smooth_max(terms.values(), k) / 1e3
            top = max(terms, key=terms.get)
            by_term[top] = by_term.get(top, 0.0) + dt
            total += dt
        return total, per_wave

    stream_us, per_wave = stream(tile_bytes)
    fetches = 1.0
    if cta_order is not None:
        wave_us = p / TILE_TOKENS * smooth_max(per_wave[0].values(), k) / 1e3
        fetches = scale_fetches(batch, nparts, kv_heads, slots, wave_us,
                                hw.l2_bytes / (bw_gbs * 1e3), cta_order)
        extra = scale_sector_overfetch(kv_heads, fetches)
        stream_us, per_wave = stream(tile_bytes + extra)
    fixed = {"prologue + merge per wave": waves * (2 * hw.dram_latency_us + hw.merge_us),
             "grid boundary": hw.boundary_us}
    if nparts > 1:
        fixed["reduce + relaunch"] = hw.reduce_us + hw.relaunch_us
    if transforms:
        fixed["Q/O transforms"] = hw.transforms_us
    fixed_us = sum(fixed.values())
    first = per_wave[0]
    bound = max(first, key=first.get)
    return {"P": p, "nparts": nparts, "ctas": ctas, "waves": waves, "terms": first,
            "stream_by_term_us": dict(by_term),
            "stream_us": stream_us, "fixed": fixed, "fixed_us": fixed_us, "fetches": fetches,
            "total_us": stream_us + fixed_us,
            "bound": bound if stream_us >= fixed_us else f"fixed costs ({bound} in the stream)"}


def call_pct(nbytes: float, total_us: float, bw_gbs: float) -> float:
    """% of bandwidth as the bench defines it: bytes / time / measured read bandwidth."""
    return 100.0 * nbytes / (total_us * 1e-6) / (bw_gbs * 1e9)


def fit_overlap_k(row: dict, sm_clk_per_tile: float, tile_bytes: float, hw: H100 = H100(),
                  lo: float = 1.0, hi: float = 256.0, cta_order: str | None = None) -> float:
    """The k at which `cuda_call` reproduces the row's measured % of bandwidth (bisection: the
    prediction rises with k). inf where even k = inf predicts less, 1 where k = 1 predicts more."""
    def pct(k):
        c = cuda_call(row["batch"], row["context"], sm_clk_per_tile, tile_bytes, row["bw"], k,
                      hw, transforms=row["transforms"], cta_order=cta_order)
        return call_pct(row["bytes"], c["total_us"], row["bw"])
    if pct(math.inf) <= row["pct"]:
        return math.inf
    if pct(lo) >= row["pct"]:
        return lo
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if pct(mid) < row["pct"] else (lo, mid)
    return math.sqrt(lo * hi)


def scale_sector_bytes(kv_heads: int = 8, block_size: int = 16, sector: int = 32) -> int:
    """DRAM bytes one fetch of a tile's K and V scale sectors moves. The scales are
    [block, token, kv head] bytes, so the 16 scale bytes of one (tile, head) are strided over
    the block's block_size x kv_heads bytes and touch all of its sectors: 2 x 4 x 32 = 256 B
    at 8 kv heads, which all heads of the sequence need (32 B each)."""
    return 2 * -(-(block_size * kv_heads) // sector) * sector


def scale_sector_overfetch(kv_heads: int = 8, fetches: float | None = None) -> float:
    """Extra DRAM bytes per (tile, kv head) beyond its 2 x 16 scale bytes when the kv heads of
    a sequence make `fetches` fetches of the shared sectors between them (default: one each,
    no sharing: +224 B at 8 kv heads)."""
    f = kv_heads if fetches is None else fetches
    return max(0.0, scale_sector_bytes(kv_heads) * f / kv_heads - 2 * TILE_TOKENS)


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
    return outermost(edges)


def outermost(edges) -> list[tuple[int, int]]:
    """(head, back-edge) ranges with nested and overlapping ones merged."""
    edges = sorted(edges)
    outer: list[list[int]] = []
    for h, b in edges:
        if outer and h <= outer[-1][1]:
            outer[-1][1] = max(outer[-1][1], b)
            outer[-1][0] = min(outer[-1][0], h)
        else:
            outer.append([h, b])
    return [tuple(x) for x in outer]


def amd_branch_target(ins, labels, i) -> int | None:
    """The index a branch instruction of parse_amd_body's list jumps to (None: not a branch)."""
    op, rest = ins[i]
    if not op.startswith(("s_branch", "s_cbranch")) or not rest:
        return None
    return labels.get(rest.split()[0])


def _amd_successors(ins, labels, i) -> list[int]:
    op = ins[i][0]
    if op == "s_endpgm":
        return []
    t = amd_branch_target(ins, labels, i)
    if op.startswith("s_branch"):
        return [t] if t is not None else []
    nxt = [i + 1] if i + 1 < len(ins) else []
    return nxt + ([t] if t is not None else [])


def real_loops(ins, labels) -> list[tuple[int, int]]:
    """(head, back-edge index) of each loop: a backward branch whose target can reach the branch
    again. A backward jump that only leaves a region (to an s_endpgm block or an exit laid out
    earlier) is not a loop; amd_loops, which takes every backward branch, would merge it
    into one."""
    loops = []
    for i in range(len(ins)):
        t = amd_branch_target(ins, labels, i)
        if t is None or t > i:
            continue
        seen, todo = set(), [t]
        while todo:
            j = todo.pop()
            if j in seen:
                continue
            seen.add(j)
            todo.extend(_amd_successors(ins, labels, j))
        if i in seen:
            loops.append((t, i))
    return loops


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
    # Waves a SIMD holds at once, at most, and the VGPRs it shares among them (gfx90a and later:
    # 512 per lane, architectural and accumulation registers together; a wave of 256 VGPRs
    # leaves room for one more): the occupancy of a kernel known only by its register count.
    max_waves_per_simd: int = 8
    vgprs_per_simd: int = 512
    # Fixed costs of one call (`amd_call`). ASSUMPTIONS: nothing AMD has been timed here.
    # A dependent kernel launch inside a HIP graph, dispatch to dispatch: 3.9 us, the GPU time
    # per node of a replayed graph of serialized tiny kernels (ROCm/rocm-systems#10834, ROCm
    # 7.14: 3.865 us per node over 941 nodes; measured on gfx1100, no CDNA figure found: the
    # same AQL dispatch path assumed). For scale, facebookexperimental/triton#2040 timed a
    # two-launch split-KV decode on gfx950 (64/8/128, bf16 KV) at 13.9 us for 1 x 1k, whose KV
    # takes 0.5 us at 8 TB/s (AITER's there: 23.4 us).
    launch_us: float = 3.9
    # One dependent DRAM round trip: 0.36 us, gfx950's pointer-chase latency (idle) in
    # facebookexperimental/triton's AMDLatencyModel.h ("GLOBAL latency=790 is MEASURED ...
    # pointer-chase ~360 ns x 2.2 GHz"); under load it is longer, so the small shapes, where it
    # counts, are optimistic for every kernel alike.
    dram_latency_us: float = 0.36
    name: str = "MI355X"


@dataclasses.dataclass
class MI300X(MI355X):
    """gfx942. ROCm docs, "AMD Instinct MI300 series microarchitecture", table mi300x-perf-table
    (https://rocm.docs.amd.com/en/latest/conceptual/gpu-arch/mi300.html): 304 CUs, peak FP8
    2614.9 TFLOP/s at 4096 FLOPS/clock/CU (-> 2.1 GHz), Vector FP32 256 and Vector FP64 128
    FLOPS/clock/CU (4 SIMDs x 16 lanes x 2 (FMA), x 2 packed for FP32: a wave64 VALU op holds
    its SIMD 4 clocks), "theoretical aggregated peak memory bandwidth 5.3 TB per second"."""
    cus: int = 304
    clock_ghz: float = 2.1
    bw_gbs: float = 5300.0
    # v_mfma_f32_16x16x32_fp8_fp8 (the only MFMA of the gfx942 LUT path): 16384 FLOP at
    # 4096 / 4 SIMDs = 1024 FLOP/clk/SIMD
    mfma_fp8_clk: float = 16.0
    mfma_fp4_clk: float = float("nan")  # no FP4 MFMA on gfx942
    # launch_us and dram_latency_us: MI355X's (assumed the same; no MI300X figure either)
    name: str = "MI300X"


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


def cuda_sass(nvcc: str, cuobjdump: str, src_dir: Path | None = None,
              arch: str = "sm_90a") -> str:
    """cuobjdump -sass of csrc_cuda/compile_check.cu built with nvcc -cubin for arch (sm_90a, or
    sm_100a for B200), cached in the temp dir by the arch and the sources' hash. src_dir:
    another copy of csrc_cuda."""
    d = Path(src_dir or ROOT / "csrc_cuda")
    out = _cache_dir() / f"cuda_{arch}_{_digest(d.glob('*.cu*'))}.sass"
    if not out.exists():
        cubin = out.with_suffix(".cubin")
        subprocess.run([nvcc, "-std=c++17", f"-arch={arch}", "-O3", "-cubin", "-o", str(cubin),
                        str(d / "compile_check.cu")], check=True)
        text = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
        out.write_text(text)
    return out.read_text()


def _hip_flags(arch: str) -> list[str]:
    """clang-22's flags for device assembly (those of tests/test_aiter_isa.py)."""
    return ["-x", "hip", f"--offload-arch={arch}", "--offload-device-only", "-nogpulib",
            "-nogpuinc", "-O3", "-std=c++20", "-S"]


def hip_asm(clang: str, src_dir: Path | None = None) -> str:
    """gfx942 assembly of csrc_hip/tq_fp4_gfx942_isa_check.hip (the gfx942 kernel), cached by
    the sources' hash. src_dir: another copy of csrc_hip (e.g. from `git show`)."""
    d = Path(src_dir or ROOT / "csrc_hip")
    srcs = [p for p in d.glob("*") if p.is_file()]
    out = _cache_dir() / f"hip_gfx942_{_digest(srcs)}.s"
    if not out.exists():
        subprocess.run([clang, *_hip_flags("gfx942"), f"-I{d}", "-o", str(out),
                        str(d / "tq_fp4_gfx942_isa_check.hip")], check=True)
    return out.read_text()


GFX950_SOURCE = "tq_fp4_gfx950_attention.cuh"
HOT_PATH_TU = ROOT / "benchmarks" / "isa_hot_path.hip"
HOT_PATH_DEFINE = "-DTQ_HOT_PATH_ASSUME(c)=__builtin_assume(c)"
# A use of the hook in code (not its #define, not a comment)
_HOOK_USE = re.compile(r"^(?!\s*(#|//)).*\bTQ_HOT_PATH_ASSUME\(", re.M)


def hip_hot_path_asm(clang: str, src_dir: Path | None = None, hot: bool = True) -> str:
    """gfx950 assembly of benchmarks/isa_hot_path.hip (the gfx950 partition kernel, native, LUT
    and K8V4): hot=True with the hook TQ_HOT_PATH_ASSUME defined as __builtin_assume (the hot
    path), False without it (all paths). Cached by the sources' hash. src_dir: another copy of
    csrc_hip."""
    d = Path(src_dir or ROOT / "csrc_hip")
    if hot and not _HOOK_USE.search((d / GFX950_SOURCE).read_text()):
        raise ValueError(f"{d / GFX950_SOURCE} does not use TQ_HOT_PATH_ASSUME: its hot-path "
                         "build would count every path")
    srcs = [p for p in d.glob("*") if p.is_file()] + [HOT_PATH_TU]
    out = _cache_dir() / f"hip_hot_{'assume' if hot else 'all'}_{_digest(srcs)}.s"
    if not out.exists():
        subprocess.run([clang, *_hip_flags("gfx950"), *([HOT_PATH_DEFINE] if hot else []),
                        f"-I{d}", "-o", str(out), str(HOT_PATH_TU)], check=True)
    return out.read_text()


def source_constant(name: str, src_dir: Path | None = None) -> int:
    """The value of `constexpr int <name> = <n>;` in csrc_hip's headers (exactly one)."""
    d = Path(src_dir or ROOT / "csrc_hip")
    found = {int(m.group(1)) for p in sorted(d.glob("*.cuh"))
             for m in re.finditer(rf"constexpr int {name} = (\d+);", p.read_text())}
    if len(found) != 1:
        raise ValueError(f"constexpr int {name}: {sorted(found) or 'not found'} in {d}")
    return found.pop()


def decode_kernel(asm: str, kernel: str, native: bool, key_e4m3: bool = False) -> dict:
    """The decode instantiation <..., NATIVE = native, MULTI_TOKEN = false, KEY_E4M3 =
    key_e4m3> of the kernel whose mangled name contains `kernel`: tests/test_aiter_isa.py's
    {'body', 'stats', 'meta'} entry."""
    from test_aiter_isa import kernels
    tag = f"ELb{int(native)}ELb0ELb{int(key_e4m3)}EEEv"
    ks = kernels(asm)
    names = [n for n in ks if kernel in n and tag in n]
    if len(names) != 1:
        raise ValueError(f"{kernel} {tag}: {names}")
    return ks[names[0]]


def gfx942_decode_kernel(asm: str) -> dict:
    """The gfx942 kernel's (tq_fp4_paged_attention.cuh) decode partition kernel
    <..., MULTI_TOKEN = false>: tests/test_aiter_isa.py's {'body', 'stats', 'meta'} entry."""
    from test_aiter_isa import kernels
    ks = kernels(asm)
    names = [n for n in ks if "partition_kernel" in n and "ELb0EEEv" in n]
    if len(names) != 1:
        raise ValueError(f"gfx942 decode partition kernel: {names}")
    return ks[names[0]]


# Trip counts of the partition kernel's outermost loops at HEAD 128, GQA 8, decode, in order:
# Q staging (groups of 8 elements loaded as 16-byte vectors, one wait each: 2 trips at HEAD 128),
# a back-edge the compiler lays out in the rotation / q.m row sums that runs once, the two PV
# steps' V decode (kVUnits / kThreads = (128 tokens / 4 x 16 dwords) / 256 = 2 each), output
# rows h = wave, wave + 4 < GQA 8: 2.
HIP_DECODE_TRIPS = [2, 1, 2, 2, 2]


# ----------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------
# The measured H100 decode rows (cuda, 32/8/128): one evidence record. Runs 24d, 24e (bench), 24f
# (bench --peers, one row) timed the grid order before 06d9709 ("seq"); 24g's sections are
# tune_cuda.py builds of both orders (plain cache).
MEASURED_ROWS = ROOT / "benchmarks/results/2026-11-24-h100-isa-model-rows.json"
# the one row the overlap exponent k is fitted on: (run, config, batch, context)
OVERLAP_TRAIN_ROW = ("h100-2026-11-24d", "default", 64, 16384)
TRANSFORM_CONFIGS = {"default", "k8v4"}  # configs with the default transforms (Q/O in the kernel)


def all_measured_rows() -> list[dict]:
    """The record's rows as the model reads them (bytes and bandwidth of each row's own run)."""
    record = json.loads(MEASURED_ROWS.read_text())
    rows = []
    for cells in record["rows"]:
        r = dict(zip(record["columns"], cells))
        rows.append({"run": r["run"], "config": r["config"], "batch": r["batch"],
                     "context": r["context"], "pct": r["fp4_pct_bw"], "us": r["fp4_us"],
                     "bytes": r["fp4_bytes"], "bw": r["read_GBps"],
                     "k8v4": r["config"].startswith("k8v4"),
                     "transforms": r["config"] in TRANSFORM_CONFIGS, "order": r["cta_order"]})
    return rows


def predict_row(row: dict, kernel: dict, k: float, hw: H100 = H100(), overfetch: bool = False) -> dict:
    """`cuda_call` for a measured row with the counted kernel (`cuda_report`'s entry);
    overfetch: with the scale sectors' over-fetch of the row's grid order."""
    c = cuda_call(row["batch"], row["context"], kernel["cycles"]["sm_clk"], kernel["tile_bytes"],
                  row["bw"], k, hw, transforms=row["transforms"],
                  cta_order=row["order"] if overfetch else None)
    c["pct"] = call_pct(row["bytes"], c["total_us"], row["bw"])
    return c


def _within(d: list, pts: float) -> int:
    return sum(abs(x) <= pts for x in d)


# ----------------------------------------------------------------------------------------------
def cuda_report(sass: str, hw: H100 = H100(),
                measured_clk: dict | None = None) -> tuple[str, dict]:
    """The counts, the call model against every measured row, and (measured_clk: {"FP4": SM
    clocks per tile, "K8V4": ...} from compute_bound_check.py) the model with those clocks."""
    funcs = parse_sass(sass)
    res = {}
    lines = ["## cuda decode kernel (sm_90a SASS), per 16-token tile of one warp", ""]
    kernels = {}
    for label, name, tb in (("FP4 <128, bf16, false, false>", CUDA_DECODE, FP4_TILE_BYTES),
                            ("K8V4 <128, bf16, false, true>", CUDA_DECODE_K8V4, K8V4_TILE_BYTES)):
        code = funcs[name]
        h, b = find_key_loop(code)
        hot = hot_path(code, h, b)
        c = count_classes(hot)
        allc = count_classes(code[h:b + 1])
        cyc = cuda_tile_cycles(c, hw)
        res[label] = kernels["K8V4" if label.startswith("K8V4") else "FP4"] = {
            "counts": c, "all": allc, "cycles": cyc, "tile_bytes": tb,
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

    rows = all_measured_rows()
    key = lambda r: (r["run"], r["config"], r["batch"], r["context"])  # noqa: E731
    kern = lambda r: kernels["K8V4" if r["k8v4"] else "FP4"]  # noqa: E731
    train = next(r for r in rows if key(r) == OVERLAP_TRAIN_ROW)
    kt = kern(train)
    k = fit_overlap_k(train, kt["cycles"]["sm_clk"], kt["tile_bytes"], hw)
    k_of = fit_overlap_k(train, kt["cycles"]["sm_clk"], kt["tile_bytes"], hw, cta_order=train["order"])
    res.update(k=k, k_overfetch=k_of)
    t = tuning_constants()
    lines += [
        "## one call on H100 SXM: predicted vs measured (32/8/128, bf16, block 16; % of each run's "
        "measured read bandwidth)", "",
        f"Constants: SM clock {hw.clock_ghz} GHz, {hw.sms} SMs x {t['DECODE_MIN_BLOCKS']} CTAs of "
        f"{t['DECODE_WARPS']} warps, {t['DECODE_STAGES']} stages (tuning.cuh); per-call costs from "
        f"docs/cuda-kernels.md's one-call timeline: DRAM round trip {hw.dram_latency_us} us (x 2 per "
        f"CTA prologue, and Little's law), merge {hw.merge_us} us, grid boundary "
        f"{hw.boundary_us} us, reduce {hw.reduce_us} us + relaunch {hw.relaunch_us} us when "
        f"split, Q/O transforms {hw.transforms_us} us (default and k8v4 configs; session 4). "
        f"Fitted: overlap exponent k = {k:.2f} on the ONE row {train['run'][5:]} "
        f"{train['config']} {train['batch']} x {train['context'] // 1024}k (measured "
        f"{train['pct']:.1f} %); every other row is held back.",
        "",
        "Columns: P x n = partition x partitions (tuning.cuh's wave model), CTAs / waves of "
        f"{hw.sms * t['DECODE_MIN_BLOCKS']} slots; throughput-only = the first version "
        "(max(HBM, issue) per tile, no fixed costs); model = this version (stream + fixed us); "
        "bound = the largest term of the overlap in the first wave (or the fixed costs where they "
        "are the larger part). Sensitivity, not the model: grid order seq (before 06d9709) / kv "
        "(HEAD) with the scale-sector fetches per (sequence, tile) that order gives "
        f"(`scale_fetches`: 1 = shared by the 8 heads, 8 = none shared, +{scale_sector_overfetch():.0f} B "
        f"per tile), and the model with those bytes, k refit on the same row (k = {k_of:.2f}).",
        "",
        "| run | config | batch x context | P x n | CTAs / waves | measured % (us) | "
        "throughput-only % | model % (stream + fixed us) | model - measured | bound | "
        "order: fetches | with over-fetch % (- measured) |",
        "|---" * 12 + "|"]
    table = []
    for r in rows:
        kk = kern(r)
        old = predict_pct(kk["cycles"]["sm_clk"], hw.clock_ghz, kk["tile_bytes"], r["bw"], hw.sms)
        c = predict_row(r, kk, k, hw)
        alt = predict_row(r, kk, k_of, hw, overfetch=True)
        is_train = r is train
        table.append((r, c, alt, old, is_train))
        lines.append(
            f"| {r['run'][5:]} ({r['bw']:.0f} GB/s) | {r['config']} | {r['batch']} x "
            f"{r['context'] // 1024}k{' (fit)' if is_train else ''} | {c['P']} x {c['nparts']} | "
            f"{c['ctas']} / {c['waves']} | {r['pct']:.1f} ({r['us']:.1f}) | {old['pct']:.0f} | "
            f"{c['pct']:.1f} ({c['stream_us']:.1f} + {c['fixed_us']:.1f}) | "
            f"{c['pct'] - r['pct']:+.1f} | {c['bound']} | {r['order']}: {alt['fetches']:.1f} | "
            f"{alt['pct']:.1f} ({alt['pct'] - r['pct']:+.1f}) |")
    res["rows"] = table
    lines.append("")
    held = [(r, c, a, o) for r, c, a, o, tr in table if not tr]
    for title, idx in (("model", 1), ("with over-fetch (sensitivity)", 2)):
        d = [x[idx]["pct"] - x[0]["pct"] for x in held]
        shapes = {(x[0]["batch"], x[0]["context"]) for x in held}
        bad = {(x[0]["batch"], x[0]["context"]) for x in held if abs(x[idx]["pct"] - x[0]["pct"]) > 10}
        lines.append(f"{title}, held-back rows: {_within(d, 10)} of {len(d)} within 10 points "
                     f"({_within(d, 5)} within 5), {title.split(' (')[0]} - measured {min(d):+.1f} "
                     f".. {max(d):+.1f}, mean |diff| {sum(map(abs, d)) / len(d):.1f}; "
                     f"{len(shapes) - len(bad)} of {len(shapes)} batch x context shapes have every "
                     f"row within 10" + (f" (not: {', '.join(f'{b} x {c // 1024}k' for b, c in sorted(bad))})"
                                         if bad else ""))
        if idx == 1:
            res["held_diffs"] = d
        groups = [("bench runs d, e, f", lambda r: ":" not in r["run"]),
                  ("tune_cuda.py run g", lambda r: ":" in r["run"]),
                  ("FP4", lambda r: not r["k8v4"]), ("K8V4 (the other kernel)", lambda r: r["k8v4"]),
                  ("batch 1", lambda r: r["batch"] == 1), ("batch 16", lambda r: r["batch"] == 16),
                  ("batch >= 64", lambda r: r["batch"] >= 64)]
        for name, sel in groups:
            dd = [x[idx]["pct"] - x[0]["pct"] for x in held if sel(x[0])]
            od = [x[3]["pct"] - x[0]["pct"] for x in held if sel(x[0])]
            if dd:
                lines.append(f"  {name}: {len(dd)} rows, {_within(dd, 10)} within 10 points "
                             f"({_within(dd, 5)} within 5), {min(dd):+.1f} .. {max(dd):+.1f}"
                             + (f"; throughput-only: {_within(od, 10)} within 10, {min(od):+.1f} .. "
                                f"{max(od):+.1f}" if idx == 1 else ""))
    lines += ["", "How much the fit depends on its training row: k fitted on another single row, "
              "the rest held back:", "",
              "| training row | measured % | k | held-back rows within 10 / 5 points | range |",
              "|---|---|---|---|---|"]
    for tk in (OVERLAP_TRAIN_ROW, ("h100-2026-11-24d", "default", 64, 32768),
               ("h100-2026-11-24d", "k8v4", 64, 16384), ("h100-2026-11-24e", "default", 64, 16384),
               ("h100-2026-11-24d", "default", 16, 16384), ("h100-2026-11-24e", "default", 128, 32768),
               ("h100-2026-11-24g:kv", "plain", 64, 16384)):
        tr = next((r for r in rows if key(r) == tk), None)
        if tr is None:
            continue
        kf = fit_overlap_k(tr, kern(tr)["cycles"]["sm_clk"], kern(tr)["tile_bytes"], hw)
        dd = [predict_row(r, kern(r), kf, hw)["pct"] - r["pct"] for r in rows if r is not tr]
        lines.append(f"| {tk[0][5:]} {tk[1]} {tk[2]} x {tk[3] // 1024}k | {tr['pct']:.1f} | "
                     f"{kf:.2f} | {_within(dd, 10)} / {_within(dd, 5)} of {len(dd)} | "
                     f"{min(dd):+.1f} .. {max(dd):+.1f} |")
    # the grid-order A/B of the g run: measured change against the over-fetch term's
    ab = {}
    for r in rows:
        if ":" in r["run"]:
            ab.setdefault((r["batch"], r["context"]), {}).setdefault(r["order"], []).append(r)
    if ab:
        lines += ["", "Grid order A/B (run g, one call, two builds of each order): the measured "
                  "change of the call time from seq to kv order (mean of the two builds) against "
                  "the change the over-fetch term predicts (same bandwidth for both: the mean of "
                  "the four sections'; k as in the sensitivity column):", "",
                  "| batch x context | measured us seq -> kv | measured change | predicted us "
                  "seq -> kv | predicted change | fetches seq -> kv |", "|---|---|---|---|---|---|"]
        bw = sum(r["bw"] for d in ab.values() for rs in d.values() for r in rs) / sum(
            len(rs) for d in ab.values() for rs in d.values())
        for (b, ctx), d in sorted(ab.items()):
            if "seq" not in d or "kv" not in d:
                continue
            ms, mk = (sum(r["us"] for r in d[o]) / len(d[o]) for o in ("seq", "kv"))
            ps, pk = (predict_row(dict(d[o][0], bw=bw), kernels["FP4"], k_of, hw, overfetch=True)
                      for o in ("seq", "kv"))
            lines.append(f"| {b} x {ctx // 1024}k | {ms:.1f} -> {mk:.1f} | {100 * (mk / ms - 1):+.1f} % | "
                         f"{ps['total_us']:.1f} -> {pk['total_us']:.1f} | "
                         f"{100 * (pk['total_us'] / ps['total_us'] - 1):+.1f} % | "
                         f"{ps['fetches']:.1f} -> {pk['fetches']:.1f} |")
    if measured_clk:
        lines += ["", "### The model with the measured compute-bound clocks instead of the counts", "",
                  "SM clocks per tile (compute_bound_check.py, L2-resident slope): " + ", ".join(
                      f"{n} {measured_clk[n]:.1f} (counted {kernels[n]['cycles']['sm_clk']:.1f}, x "
                      f"{measured_clk[n] / kernels[n]['cycles']['sm_clk']:.2f})" for n in kernels
                      if n in measured_clk) + "; k refit on the same row:", ""]
        mk = {n: dict(kernels[n], cycles={"sm_clk": measured_clk.get(n, kernels[n]["cycles"]["sm_clk"])})
              for n in kernels}
        for overfetch in (False, True):
            kf = fit_overlap_k(train, mk["K8V4" if train["k8v4"] else "FP4"]["cycles"]["sm_clk"],
                               kt["tile_bytes"], hw, cta_order=train["order"] if overfetch else None)
            dd = [predict_row(r, mk["K8V4" if r["k8v4"] else "FP4"], kf, hw, overfetch)["pct"] - r["pct"]
                  for r in rows if r is not train]
            res[f"measured_k{'_overfetch' if overfetch else ''}"] = kf
            lines.append(f"- {'with' if overfetch else 'without'} the scale-sector over-fetch: k = "
                         f"{kf:.2f}, {_within(dd, 10)} of {len(dd)} held-back rows within 10 points "
                         f"({_within(dd, 5)} within 5), {min(dd):+.1f} .. {max(dd):+.1f}, mean |diff| "
                         f"{sum(map(abs, dd)) / len(dd):.1f}")
    res["kernels"] = kernels
    return "\n".join(lines), res


# ----------------------------------------------------------------------------------------------
# NVIDIA targets (issue 43, item 2): every NVIDIA GPU the package runs on, from its own SASS
# ----------------------------------------------------------------------------------------------
# The H200 decode rows the targets are validated on (bench, default config, 32/8/128): one
# evidence record, benchmarks/results/2026-11-27-h200-decode-peers.json (no FlashInfer columns:
# no H200 decode run with --peers is in the history; the record says which rows it holds).
H200_ROWS = ROOT / "benchmarks/results/2026-11-27-h200-decode-peers.json"
# the H200 rows of the SM90a FP8 decode kernel (default config), and that run's read bandwidth
H200_FP8_ROWS = ROOT / "benchmarks/results/2026-11-29-h200-decode-peers.json"
# The H100's measured instruction-bound clocks against the throughput count (L2-resident slope,
# benchmarks/compute_bound_check.py): benchmarks/results/2026-11-24-h100-isa-model-dependency.json
DEPENDENCY_RECORD = ROOT / "benchmarks/results/2026-11-24-h100-isa-model-dependency.json"
FP8_DEPENDENCY_RECORD = ROOT / "benchmarks/results/2026-11-29-h200-isa-model-dependency-fp8.json"
GATE_POINTS = 10.0     # the H200 rows must be met within this many points of % bandwidth
NVIDIA_SHAPES = {"64x32k": (64, 32768), "16x4k": (16, 4096)}
SM120_SOURCE = ROOT / "csrc_cuda" / "sm120" / "paged_attention_sm120.cuh"
SM120_DECODE = ("_ZN2tq5sm12028paged_attention_sm120_kernelI13__nv_bfloat16Li128ELb0ELb0EEEv"
                "NS0_15AttentionParamsE")  # <bf16, D 128, per-head scales, FP4 keys>
SM120_CHUNK = 32       # keys per warp step (kChunk), 4 warps per CTA (kWarps): the design note
SM120_WARPS = 4
# Dependent DRAM round trips per 32-key chunk of one sm120 warp, in source order: the block id
# (paged_kv::block_id), then the K codes and scales addressed by it, then the V codes, loaded
# after the softmax (the SASS has the V loads after the logits' FMNMX / MUFU.EX2).
SM120_ROUND_TRIPS = 3


@dataclasses.dataclass
class NvidiaGpu(H100):
    """One NVIDIA target: `H100`'s per-scheduler rates and per-call costs, and the figures that
    differ. bw_gbs: the measured read bandwidth where the record has one, else the vendor peak
    times the measured / peak ratio of the H100 and H200 (`nvidia_targets`)."""
    key: str = "h100"
    name: str = "H100 SXM5 80GB"
    kernel: str = "sm90"          # "sm90": csrc_cuda's decode kernel; "sm120": the sm120 kernel
    arch: str = "sm_90a"
    bw_peak_gbs: float = 3350.0
    bw_gbs: float = float("nan")  # filled in by nvidia_targets
    bw_from: str = ""
    qmma_clk: float = float("nan")  # QMMA.SF.16832 / OMMA.SF.16864 per scheduler (sm120)
    unified_int: bool = False     # INT32 on the same 32 lanes per scheduler as FP32
    sources: dict = dataclasses.field(default_factory=dict)


def nvidia_gpus() -> dict[str, NvidiaGpu]:
    """The NVIDIA targets with each figure's source ("assumption" where none was found)."""
    hopper = {
        "sms": "132 SMs (H100 SXM5): NVIDIA H100 Tensor Core GPU Architecture whitepaper; the "
               "bench's meta 'multiprocessors': 132 on both the H100 and the H200",
        "clock_ghz": "1.98 GHz: the SM clock of the measured compute-bound slope "
                     "(2026-11-24-h100-isa-model-dependency.json, 'at 1980 MHz')",
        "rates": "FP32 32 lanes, INT/IMAD 16 lanes, MUFU 4 per scheduler; HMMA.16816 4 clk "
                 "(989 dense fp16 TFLOP/s at 1.83 GHz over 132 SMs: NVIDIA H100 datasheet)",
    }
    out = {
        "h100": NvidiaGpu(sources=dict(hopper, bw_peak_gbs="3.35 TB/s: NVIDIA H100 datasheet "
                                       "(H100 SXM)", l2_bytes="50 MiB: bench meta l2_bytes")),
        "h200": NvidiaGpu(
            key="h200", name="H200 SXM 141GB", bw_peak_gbs=4800.0, l2_bytes=60 * 2**20,
            sources=dict(hopper, bw_peak_gbs="4.8 TB/s: NVIDIA H200 datasheet (H200 SXM)",
                         l2_bytes="60 MiB: bench meta l2_bytes 62914560 of the H200 runs",
                         clock_ghz="1.98 GHz: ASSUMPTION, the H100's (the same GH100 die and "
                                   "700 W; the H200 datasheet gives the same Tensor Core "
                                   "TFLOP/s as the H100's, no clock)")),
        "b200": NvidiaGpu(
            key="b200", name="B200 (HGX, 1000 W)", arch="sm_100a", sms=148,
            bw_peak_gbs=8000.0, l2_bytes=0,
            sources={"sms": "148 SMs: ASSUMPTION from a third-party database (TechPowerUp via "
                            "hmc-tech.com, 'SMs 148'); NVIDIA's datasheet lists no SM count",
                     "clock_ghz": "1.98 GHz: ASSUMPTION, third-party 'boost clock 1.98GHz' "
                                  "(hmc-tech.com); no NVIDIA figure",
                     "bw_peak_gbs": "8 TB/s per GPU: NVIDIA HGX B200 specifications",
                     "rates": "FP32 32 lanes per scheduler: 80 TFLOP/s FP32 (NVIDIA, HGX B200 "
                              "at 1000 W) / (148 SMs x 2 x 1.98 GHz) = 136 per SM ~ 128; INT, "
                              "MUFU and mma.sync HMMA.16816: ASSUMPTION, Hopper's per-SM "
                              "rates (NVIDIA gives tcgen05 rates only: 2.25 PFLOP/s dense "
                              "FP16)",
                     "l2_bytes": "not used (third-party figures disagree)"}),
        "rtx5090": NvidiaGpu(
            key="rtx5090", name="GeForce RTX 5090", kernel="sm120", arch="sm_120a", sms=170,
            clock_ghz=2.407, bw_peak_gbs=1792.0, l2_bytes=96 * 2**20, qmma_clk=16.0,
            alu_clk=1.0, imad_clk=1.0, unified_int=True,
            sources={"sms": "170 SMs, 21760 CUDA cores: NVIDIA GeForce RTX 5090 specifications "
                            "(as listed by Tom's Hardware / Linux Format, May 2025)",
                     "clock_ghz": "2.407 GHz boost: same listing",
                     "bw_peak_gbs": "1792 GB/s (512-bit GDDR7, 28 Gbps): same listing",
                     "l2_bytes": "96 MB: same listing",
                     "rates": "FP32 32 lanes per scheduler: 104.8 TFLOP/s = 170 x 128 x 2 x "
                              "2.407 GHz; INT32 on the same unified cores (NVIDIA RTX "
                              "Blackwell: 'twice the integer math throughput per clock' of "
                              "Ada), so FP32 + INT + IMAD share 32 lanes (ASSUMPTION: IMAD at "
                              "full rate); MUFU 4 per scheduler (ASSUMPTION, Hopper's)",
                     "qmma_clk": "16 clk per m16n8k32 (8192 FLOP): 838 dense FP8 TFLOP/s "
                                 "(1676 sparse, NVIDIA's RTX 5090 figures) / (170 SMs x 4 x "
                                 "2.407 GHz) = 512 FLOP/clk/scheduler; OMMA.SF.16864 (FP4, "
                                 "16384 FLOP) at 1676 dense FP4 TFLOP/s: also 16 clk. Not "
                                 "vendor: a microbenchmark (main-horse.github.io, '5090 mm "
                                 "perf') timed kind::mxf8f6f4 with an FP4/FP6 operand at half "
                                 "the e4m3 x e4m3 rate: 32 clk is the sensitivity row"}),
        "rtxpro6000": NvidiaGpu(
            key="rtxpro6000", name="RTX PRO 6000 Blackwell", kernel="sm120", arch="sm_120a",
            sms=188, clock_ghz=2.6, bw_peak_gbs=1792.0, l2_bytes=128 * 2**20, qmma_clk=16.0,
            alu_clk=1.0, imad_clk=1.0, unified_int=True,
            sources={"sms": "188 SMs, 24064 CUDA cores: NVIDIA RTX PRO 6000 Blackwell (GTC "
                            "2025 announcement, as reported by purepc.pl / Tom's Hardware)",
                     "clock_ghz": "2.6 GHz: derived, 125 TFLOP/s FP32 (NVIDIA) / (24064 x 2)",
                     "bw_peak_gbs": "1792 GB/s (512-bit GDDR7 ECC): same reports",
                     "l2_bytes": "128 MB: same reports",
                     "rates": "as the RTX 5090 (same GB202 SM)",
                     "qmma_clk": "16 clk: 4000 AI TOPS (FP4 sparse, NVIDIA) = 1000 dense FP8 "
                                 "TFLOP/s / (188 x 4 x 2.6 GHz) = 512 FLOP/clk/scheduler"}),
    }
    return out


# The RTX 5070 Ti runs the sm120 kernel too; the sources searched for this model gave no
# vendor figure for its bandwidth or clock (only a 70-SM leak), so it is listed, not predicted.
NOT_PREDICTED = {"rtx5070ti": "GeForce RTX 5070 Ti: no sourced bandwidth or clock found"}


def dependency_factor(path: Path = DEPENDENCY_RECORD, fmt: str = "FP4") -> float:
    """Measured / counted SM clocks per tile of the decode kernel bound by its instructions (the
    record's mean over its runs): what register dependencies inside a warp add to the
    throughput count."""
    rec = json.loads(Path(path).read_text())
    xs = [dict(zip(rec["columns"], r)) for r in rec["rows"]]
    xs = [x["measured_over_predicted"] for x in xs if x["format"] == fmt]
    return sum(xs) / len(xs)


def h200_rows(path: Path = H200_ROWS) -> list[dict]:
    """The H200 record's rows as `all_measured_rows` gives the H100's (default config)."""
    rec = json.loads(Path(path).read_text())
    out = []
    for cells in rec["rows"]:
        r = dict(zip(rec["columns"], cells))
        out.append({"run": r["run"], "config": "default", "batch": r["batch"],
                    "context": r["context"], "pct": r["fp4_pct_bw"], "us": r["fp4_us"],
                    "bytes": r["fp4_bytes"], "bw": r["read_GBps"], "k8v4": False,
                    "transforms": True, "order": CTA_ORDER})
    return out


def h200_fp8_rows(path: Path = H200_FP8_ROWS) -> tuple[list[dict], float]:
    """(rows, read GB/s) of the SM90a FP8 decode kernel's H200 record: batch, context, measured
    % of the read bandwidth (the bench's bytes; the model's are the KV tiles'), us."""
    rec = json.loads(Path(path).read_text())
    bw = float(re.search(r"\((\d+) GB/s", rec["notes"]).group(1))
    out = []
    for cells in rec["rows"]:
        r = dict(zip(rec["columns"], cells))
        b, ctx = (x.strip() for x in r["batch x context"].split("x"))
        out.append({"batch": int(b), "context": int(ctx.rstrip("k")) * 1024,
                    "pct": r["turboquant_pct_bw"], "us": r["turboquant_us"]})
    return out, bw


def fp8_decode_model(sass90: str, gpus: dict, k: float) -> dict:
    """The SM90a FP8 decode kernel in the call model: its 64-token step's hot path (one warp's
    step is one 16-token tile: its own K rows and a quarter of V's), the instruction time = the
    count x this kernel's own dependency factor (its instruction-bound clocks measured on an
    H200 over the count: FP8_DEPENDENCY_RECORD), k the decode kernel's
    (ASSUMPTION: carried over from the warp-MMA kernel), its launch (`cuda_call(wgmma=True)`);
    the H200 rows of its record predicted at that run's bandwidth."""
    dep = dependency_factor(FP8_DEPENDENCY_RECORD)
    code = parse_sass(sass90)[CUDA_DECODE_WGMMA]
    h, b = find_key_loop(code, mma="QGMMA")
    counts = count_classes(hot_path(code, h, b))
    rows, bw = h200_fp8_rows()
    out = {"loop": (code[h].addr, code[b].addr), "counts_per_tile": dict(counts), "k": k,
           "dependency_factor": dep, "targets": {}}
    for key in ("h100", "h200"):
        g = gpus[key]
        cyc = nvidia_tile_cycles(counts, g)
        clk = cyc["sm_clk"] * dep
        pred = {}
        for label, (bb, ctx) in NVIDIA_SHAPES.items():
            c = cuda_call(bb, ctx, clk, FP4_TILE_BYTES, g.bw_gbs, k, g, transforms=True, wgmma=True)
            pred[label] = round(call_pct(bb * 8 * ctx * FP4_TILE_BYTES / TILE_TOKENS,
                                         c["total_us"], g.bw_gbs), 1)
        out["targets"][key] = {"sched_clocks_per_tile": cyc["limits"], "bound": cyc["bound"],
                               "sm_clocks_per_tile": clk, "predicted_pct_bw": pred}
    h200 = gpus["h200"]
    clk = nvidia_tile_cycles(counts, h200)["sm_clk"] * dep
    errs = []
    for r in rows:
        c = cuda_call(r["batch"], r["context"], clk, FP4_TILE_BYTES, bw, k, h200, transforms=True,
                      wgmma=True)
        p = call_pct(r["batch"] * 8 * r["context"] * FP4_TILE_BYTES / TILE_TOKENS, c["total_us"], bw)
        errs.append({"batch x context": f"{r['batch']}x{r['context'] // 1024}k",
                     "measured_pct": r["pct"], "predicted_pct": round(p, 1),
                     "error_pts": round(p - r["pct"], 1)})
    out["h200_rows"], out["h200_bw_gbs"] = errs, bw
    out["h200_within_gate"] = sum(abs(e["error_pts"]) <= GATE_POINTS for e in errs)
    return out


def nvidia_tile_cycles(counts: Counter, hw: NvidiaGpu, tiles: float = 1.0) -> dict:
    """Scheduler clocks per 16-token tile by limit (`cuda_tile_cycles` with the tensor-core
    ops of every target, and FP32 + INT on one pipe where the SM has unified cores); counts
    are for `tiles` tiles (an sm120 chunk is 2)."""
    alu = counts["alu"] * hw.alu_clk
    fma = counts["fp32"] * hw.fp32_clk + counts["imad"] * hw.imad_clk
    if hw.unified_int:
        fma += alu
    mma = counts["hmma"] * hw.hmma_clk + (counts["qmma"] * hw.qmma_clk if counts["qmma"] else 0) \
        + counts["gmma_clk"]
    lim = {"issue": counts["total"] * 1.0, "fma": fma, "alu": alu,
           "mufu": counts["mufu"] * hw.mufu_clk, "mma": mma}
    lim = {k: v / tiles for k, v in lim.items()}
    bound = max(lim, key=lim.get)
    return {"limits": lim, "bound": bound, "sched_clk": lim[bound],
            "sm_clk": lim[bound] / hw.schedulers}


# --- sm120: the kernel's key loop -------------------------------------------------------------
def attention_params_offsets(path: Path = SM120_SOURCE, base: int = 0x380) -> dict[str, int]:
    """Byte offsets of the sm120 AttentionParams fields in the kernel's constant bank (c[0x0]
    from 0x380 on sm_90+), from the struct in the source: pointers 8 bytes, int / float 4, bool
    1, each aligned to its size."""
    body = re.search(r"struct AttentionParams \{(.*?)\n\};", Path(path).read_text(), re.S)
    off, out = base, {}
    for line in body.group(1).splitlines():
        decl = line.split("//")[0].strip().rstrip(";")
        if not decl:
            continue
        m = re.match(r"(const\s+)?(\w+)\s*(\*?)\s*(.*)", decl)
        size = 8 if m.group(3) else {"bool": 1}.get(m.group(2), 4)
        for name in (n.strip() for n in m.group(4).split(",")):
            off = -(-off // size) * size
            out[name] = off
            off += size
    return out


# The benchmark's values of the parameters the loop branches on uniformly (decode, default
# config): no sliding window, no soft cap, no sink
SM120_BENCH_PARAMS = {"sliding_window": 0, "logits_soft_cap": 0, "sink": 0}


def _track_uniform(ins: Sass, ur: dict, up: dict, params: dict[int, float]) -> None:
    """Follow, along the walked path, the uniform registers loaded from parameters of known
    value (LDCU URn, c[0x0][off]) and the uniform predicates set by comparing one with zero
    (UISETP.<cmp>.AND UPn, UPT, URn, URZ or an immediate, UPT); anything else written to them
    is unknown."""
    dst = ins.args.split(",")[0].strip()
    if ins.base.startswith("LDCU"):
        m = re.search(r"c\[0x0\]\[(0x[0-9a-f]+)\]", ins.args)
        ur[dst] = params.get(int(m.group(1), 16)) if m else None
    elif ins.base == "UISETP":
        a = [x.strip() for x in ins.args.split(",")]
        v = ur.get(a[2])
        c = 0 if a[3] == "URZ" else (int(a[3], 0) if re.fullmatch(r"-?(0x)?[0-9a-f]+", a[3])
                                     else None)
        cmp = ins.op.split(".")[1]
        up[dst] = None if v is None or c is None else {
            "GT": v > c, "GE": v >= c, "LT": v < c, "LE": v <= c, "EQ": v == c, "NE": v != c}[cmp]
    elif dst.startswith("UR"):
        ur[dst] = None


def sm120_hot_path(code: list[Sass], head: int, back: int, trips: int,
                   params: dict[int, float]) -> list[Sass]:
    """One steady-state iteration (one 32-key chunk of one warp) of the sm120 chunk loop:
    a forward branch on a per-lane predicate (@P / @!P: key past the end, block id outside the
    cache, soft cap set, a V scale of 255) is not taken, its fall-through is the path of valid
    keys without a soft cap; a uniform branch (BRA.U UPn / !UPn) goes where the benchmark's
    parameter values send it (`_track_uniform`: the sliding-window tests); unconditional
    jumps are followed; an inner backward branch (the V-to-shared-memory loop, not unrolled)
    repeats its body `trips` times."""
    idx = {ins.addr: i for i, ins in enumerate(code)}
    path, i, steps, ur, up = [], head, 0, {}, {}
    while i <= back:
        steps += 1
        if steps > 100000:
            raise RuntimeError("hot path walk does not end")
        ins = code[i]
        path.append(ins)
        _track_uniform(ins, ur, up, params)
        if i == back:
            break
        t = _branch_target(ins)
        if t is None or t not in idx:
            i += 1
            continue
        j = idx[t]
        m = re.match(r"(!?)(UP\d)\s*,", ins.args)
        if j <= i:                                   # inner loop back-edge
            if not (head < j < i):
                raise ValueError(f"backward branch at {ins.addr:#x} leaves the chunk loop")
            path.extend(code[j:i + 1] * (trips - 1))
            i += 1
        elif m:                                      # uniform: the benchmark's parameters
            if up.get(m.group(2)) is None:
                raise ValueError(f"{ins.op} {ins.args} at {ins.addr:#x}: its predicate is not a "
                                 "test of a parameter of known value on this path")
            taken = up[m.group(2)] != bool(m.group(1))
            i = j if taken else i + 1
        elif ins.pred:                               # per-lane: valid keys, no soft cap
            i += 1
        else:
            i = j
    return path


def sm120_counts(sass: str, source: Path = SM120_SOURCE) -> dict:
    """The sm120 kernel <bf16, D 128, per-head scales, FP4 keys>: its chunk loop, the hot path of
    one 32-key chunk of one warp, its class counts and the MMA ops in it."""
    code = parse_sass(sass)[SM120_DECODE]
    h, b = find_key_loop(code, "QMMA")
    at = {x.addr: n for n, x in enumerate(code)}
    inner = [(at[t], i) for i, ins in enumerate(code[h:b], h)
             if (t := _branch_target(ins)) is not None and t in at and h < at[t] < i]
    # the V loop (`for piece < D / 32`): one 16-byte load per piece, so its trip count is
    # D / 32 / (the 16-byte loads in its body)
    trips = 1
    if inner:
        (j, i), = inner
        loads = sum(x.op.startswith("LDG.E.128") for x in code[j:i + 1])
        trips = 128 // 32 // max(loads, 1)
    offs = attention_params_offsets(source)
    params = {offs[k]: v for k, v in SM120_BENCH_PARAMS.items()}
    hot = sm120_hot_path(code, h, b, trips, params)
    return {"code": code, "loop": (h, b), "hot": hot, "counts": count_classes(hot),
            "all": count_classes(code[h:b + 1]), "v_loop_trips": trips,
            "mma_ops": Counter(x.op for x in hot if sass_class(x.op) in ("qmma", "hmma"))}


def sm120_resources(ptxas_log: str, kernel: str = SM120_DECODE) -> dict:
    """Registers and shared memory of one kernel from `ptxas -v`."""
    m = re.search(re.escape(kernel) + r".*?Used (\d+) registers.*?(\d+) bytes smem", ptxas_log,
                  re.S)
    return {"registers": int(m.group(1)), "smem": int(m.group(2))}


def ctas_per_sm(registers: int, threads: int, smem: int, regs_per_sm: int = 65536,
                reg_unit: int = 8, max_threads: int = 1536, smem_per_sm: int = 100 * 1024) -> int:
    """Resident CTAs per SM: registers (allocated in units of 8 per thread: 65536 per SM),
    threads (1536 per SM on sm_120: CUDA C Programming Guide, compute capability 12.x) and
    shared memory (100 KB per SM on 12.x, same table)."""
    regs = -(-registers // reg_unit) * reg_unit * threads
    return max(1, min(regs_per_sm // regs, max_threads // threads,
                      smem_per_sm // max(smem, 1)))


def sm120_sass(nvcc: str, cuobjdump: str) -> tuple[str, str]:
    """(cuobjdump -sass, ptxas -v log) of csrc_cuda/sm120/sass_check.cu for sm_120a, cached in
    the temp dir by the sources' hash (the sm120 folder and the two shared headers it includes)."""
    d = ROOT / "csrc_cuda"
    srcs = list((d / "sm120").glob("*.cu*")) + [d / "limits.cuh", d / "paged_kv.cuh"]
    out = _cache_dir() / f"sm120_{_digest(srcs)}.sass"
    log = out.with_suffix(".ptxas")
    if not out.exists() or not log.exists():
        cubin = out.with_suffix(".cubin")
        r = subprocess.run([nvcc, "-std=c++17", "-O3", "-arch=sm_120a", "-cubin", "-Xptxas", "-v",
                            f"-I{d / 'sm120'}", str(d / "sm120" / "sass_check.cu"), "-o",
                            str(cubin)], check=True, capture_output=True, text=True)
        log.write_text(r.stderr)
        out.write_text(subprocess.run([cuobjdump, "-sass", str(cubin)], check=True,
                                      capture_output=True, text=True).stdout)
    return out.read_text(), log.read_text()


def sm120_plan(batch: int, context: int, sms: int, kv_heads: int = 8) -> tuple[int, int]:
    """plan_attention of paged_attention_sm120.cuh for decode (one tile of rows per (sequence,
    kv head)): (splits, partition) with splits of whole 128-key steps and ~2 x SMs CTAs."""
    step = SM120_CHUNK * SM120_WARPS
    ctas = batch * kv_heads
    max_parts = -(-context // step)
    want = max(1, -(-(2 * sms) // ctas))
    splits = min(want, max_parts)
    partition = -(-(-(-context // splits)) // step) * step
    return -(-context // partition), partition


def sm120_call(batch: int, context: int, sm_clk_per_tile: float, tile_bytes: float,
               bw_gbs: float, k: float, hw: NvidiaGpu, cta_slots: int, kv_heads: int = 8,
               transforms: bool = True) -> dict:
    """`cuda_call` for the sm120 kernel: CTAs = batch x kv heads x splits (`sm120_plan`), in
    waves of SMs x `cta_slots`; each CTA's 4 warps stream their own 32-key chunks, each chunk
    SM120_ROUND_TRIPS dependent DRAM round trips (t_lat = round trips x latency / (4 warps x
    2 tiles)); fixed costs as `cuda_call`'s, the combine kernel always (its reduce + relaunch):
    H100 figures, ASSUMPTIONS here."""
    nparts, p = sm120_plan(batch, context, hw.sms, kv_heads)
    ctas = batch * kv_heads * nparts
    slots = hw.sms * cta_slots
    waves = -(-ctas // slots)
    t_lat = SM120_ROUND_TRIPS * hw.dram_latency_us * 1e3 / (SM120_WARPS * SM120_CHUNK / TILE_TOKENS)
    total, left, first, by_term = 0.0, ctas, None, {}
    while left > 0:
        n = min(slots, left)
        left -= n
        terms = {"HBM": tile_bytes * n / bw_gbs,
                 "issue": -(-n // hw.sms) * sm_clk_per_tile / hw.clock_ghz, "latency": t_lat}
        first = first or terms
        dt = p / TILE_TOKENS * smooth_max(terms.values(), k) / 1e3
        top = max(terms, key=terms.get)
        by_term[top] = by_term.get(top, 0.0) + dt
        total += dt
    fixed = {"prologue + merge per wave": waves * (2 * hw.dram_latency_us + hw.merge_us),
             "grid boundary": hw.boundary_us, "combine + relaunch": hw.reduce_us + hw.relaunch_us}
    if transforms:
        fixed["Q/O transforms"] = hw.transforms_us
    fixed_us = sum(fixed.values())
    bound = max(first, key=first.get)
    return {"P": p, "nparts": nparts, "ctas": ctas, "waves": waves, "terms": first,
            "stream_by_term_us": by_term, "stream_us": total, "fixed": fixed, "fixed_us": fixed_us,
            "total_us": total + fixed_us,
            "bound": bound if total >= fixed_us else f"fixed costs ({bound} in the stream)"}


def _bound_name(call: dict, cyc: dict) -> str:
    """The JSON's `bound` at a shape: of the call's time, the largest share: the stream time
    of the waves each term binds ("hbm", "latency", or the binding instruction limit of
    "issue": "issue" / "alu" / "fma" / "mufu" / "mma") or the fixed costs ("latency": DRAM round
    trips and launches)."""
    shares = dict(call["stream_by_term_us"], fixed=call["fixed_us"])
    top = max(shares, key=shares.get)
    return {"HBM": "hbm", "latency": "latency", "fixed": "latency"}.get(top, cyc["bound"])


def nvidia_report(sass90: str, sass100: str | None = None, sm120: tuple[str, str] | None = None,
                  dep: float | None = None) -> tuple[str, dict]:
    """Issue 43, item 2: the model on every NVIDIA target. k is fitted on the H100 training row
    (OVERLAP_TRAIN_ROW) with the instruction time = throughput count x the measured dependency
    factor; the H100 and H200 rows are predicted with their runs' own bandwidths; the gate is
    every H200 row within GATE_POINTS. Returns (text, {"nvidia": {target: ...}, ...})."""
    dep = dependency_factor() if dep is None else dep
    gpus = nvidia_gpus()
    h100_rows = [r for r in all_measured_rows() if not r["k8v4"]]
    h2_rows = h200_rows()
    key = lambda r: (r["run"], r["config"], r["batch"], r["context"])  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    gpus["h100"].bw_gbs = mean([r["bw"] for r in h100_rows])
    gpus["h200"].bw_gbs = mean([r["bw"] for r in h2_rows])
    ratio = mean([gpus[g].bw_gbs / gpus[g].bw_peak_gbs for g in ("h100", "h200")])
    for g in gpus.values():
        if g.key in ("h100", "h200"):
            g.bw_from = "measured (mean read bandwidth of the record's runs)"
        else:
            g.bw_gbs = g.bw_peak_gbs * ratio
            g.bw_from = (f"vendor peak x {ratio:.3f} (the mean measured / peak of the H100 and "
                         "H200: ASSUMPTION that the ratio carries over)")

    def sm90_kernel(sass: str) -> dict:
        code = parse_sass(sass)[CUDA_DECODE]
        h, b = find_key_loop(code)
        c = count_classes(hot_path(code, h, b))
        return {"counts": c, "loop": (code[h].addr, code[b].addr), "tiles": 1.0}

    kern = {"sm_90a": sm90_kernel(sass90)}
    if sass100 is not None:
        kern["sm_100a"] = sm90_kernel(sass100)
    slots120 = None
    if sm120 is not None:
        r = sm120_counts(sm120[0])
        res120 = sm120_resources(sm120[1])
        slots120 = ctas_per_sm(res120["registers"], 32 * SM120_WARPS, res120["smem"])
        code = r["code"]
        kern["sm_120a"] = {"counts": r["counts"], "tiles": SM120_CHUNK / TILE_TOKENS,
                           "loop": (code[r["loop"][0]].addr, code[r["loop"][1]].addr),
                           "mma_ops": dict(r["mma_ops"]), "v_loop_trips": r["v_loop_trips"],
                           "resources": res120, "ctas_per_sm": slots120}

    h100 = gpus["h100"]
    c90 = nvidia_tile_cycles(kern["sm_90a"]["counts"], h100)
    train = next(r for r in h100_rows if key(r) == OVERLAP_TRAIN_ROW)
    fits = {}
    for name, d in (("count", 1.0), ("count x dependency", dep)):
        kk = fit_overlap_k(train, c90["sm_clk"] * d, FP4_TILE_BYTES, h100)
        errs = {}
        for gk, rows in (("h100", h100_rows), ("h200", h2_rows)):
            errs[gk] = []
            for r in rows:
                c = cuda_call(r["batch"], r["context"], c90["sm_clk"] * d, FP4_TILE_BYTES, r["bw"],
                              kk, gpus[gk], transforms=r["transforms"])
                pct = call_pct(r["bytes"], c["total_us"], r["bw"])
                errs[gk].append((r, pct, pct - r["pct"], r is train))
        fits[name] = {"k": kk, "dep": d, "errs": errs}
    model = fits["count x dependency"]
    k = model["k"]
    h200_ok = all(abs(e) <= GATE_POINTS for _, _, e, _ in model["errs"]["h200"])
    h100_ok = all(abs(e) <= GATE_POINTS for _, _, e, tr in model["errs"]["h100"] if not tr)

    def predict(g: NvidiaGpu) -> dict | None:
        arch = g.arch if g.kernel == "sm90" else "sm_120a"
        if arch not in kern:
            return None
        kk = kern[arch]
        cyc = nvidia_tile_cycles(kk["counts"], g, kk["tiles"])
        clk = cyc["sm_clk"] * dep
        out = {}
        for label, (b, ctx) in NVIDIA_SHAPES.items():
            if g.kernel == "sm90":
                c = cuda_call(b, ctx, clk, FP4_TILE_BYTES, g.bw_gbs, k, g, transforms=True)
            else:
                c = sm120_call(b, ctx, clk, FP4_TILE_BYTES, g.bw_gbs, k, g, slots120)
            nbytes = b * 8 * ctx * FP4_TILE_BYTES / TILE_TOKENS
            out[label] = (call_pct(nbytes, c["total_us"], g.bw_gbs), c)
        validated = {"h100": h100_ok, "h200": h200_ok}.get(g.key, False)
        big = out["64x32k"][1]
        return {"name": g.name, "arch": arch,
                "kernel": "csrc_cuda decode kernel" if g.kernel == "sm90" else "sm120 kernel",
                "predicted_pct_bw": {s: round(v[0], 1) for s, v in out.items()},
                "bound": _bound_name(big, cyc),
                "validated": validated,
                "uses_validated_model": h200_ok,
                "counts_per_tile": {c: kk["counts"][c] / kk["tiles"] for c in
                                    CUDA_CLASSES + ["qmma", "total"] if kk["counts"][c]},
                "sched_clocks_per_tile": cyc["limits"], "instruction_bound": cyc["bound"],
                "sm_clocks_per_tile": clk, "dependency_factor": dep,
                "terms_ns_64x32k": big["terms"],
                "stream_by_term_us_64x32k": big["stream_by_term_us"],
                "call_64x32k": {x: big[x] for x in ("P", "nparts", "ctas", "waves",
                                                    "stream_us", "fixed_us", "total_us")},
                "hardware": {"sms": g.sms, "schedulers": g.schedulers, "clock_ghz": g.clock_ghz,
                             "bw_peak_gbs": g.bw_peak_gbs, "bw_gbs": round(g.bw_gbs, 1),
                             "bw_from": g.bw_from, "fp32_clk": g.fp32_clk,
                             "imad_clk": g.imad_clk, "alu_clk": g.alu_clk,
                             "mufu_clk": g.mufu_clk, "hmma_clk": g.hmma_clk,
                             "qmma_clk": None if math.isnan(g.qmma_clk) else g.qmma_clk,
                             "unified_int": g.unified_int, "l2_bytes": g.l2_bytes or None,
                             "dram_latency_us": g.dram_latency_us,
                             "ctas_per_sm": slots120 if g.kernel == "sm120" else
                             tuning_constants()["DECODE_MIN_BLOCKS"],
                             "sources": g.sources}}

    targets = {g: p for g, p in ((g, predict(gpus[g])) for g in gpus) if p is not None}
    if "rtx5090" in targets:  # the QMMA sensitivity: half the vendor rate
        g2 = dataclasses.replace(gpus["rtx5090"], qmma_clk=2 * gpus["rtx5090"].qmma_clk)
        targets["rtx5090"]["predicted_pct_bw_qmma_half_rate"] = predict(g2)["predicted_pct_bw"]
    per_row = {gk: [{"run": r["run"], "batch x context": f"{r['batch']}x{r['context'] // 1024}k",
                     "measured_pct": r["pct"], "predicted_pct": round(p, 1),
                     "error_pts": round(e, 1), "fit": tr} for r, p, e, tr in errs]
               for gk, errs in model["errs"].items()}
    for gk in ("h100", "h200"):
        if gk in targets:
            targets[gk]["rows"] = per_row[gk]
    res = {"nvidia": targets, "k": k, "dependency_factor": dep, "gate_points": GATE_POINTS,
           "h200_validated": h200_ok, "h100_validated": h100_ok,
           "not_predicted": NOT_PREDICTED, "kernels": kern, "fits": fits}
    fp8 = None
    if CUDA_DECODE_WGMMA in parse_sass(sass90):
        fp8 = res["fp8_decode"] = fp8_decode_model(sass90, gpus, k)

    lines = ["## NVIDIA targets (issue 43, item 2): the call model on each GPU's own SASS", "",
             f"Instruction time per tile = the throughput count x {dep:.2f}, the H100's measured "
             "instruction-bound clocks over the count (2026-11-24-h100-isa-model-dependency."
             f"json); k = {k:.2f} fitted on the ONE H100 row {OVERLAP_TRAIN_ROW[0][5:]} "
             f"{OVERLAP_TRAIN_ROW[2]} x {OVERLAP_TRAIN_ROW[3] // 1024}k. Gate: every H200 row of "
             f"2026-11-27-h200-decode-peers.json within {GATE_POINTS:g} points.", "",
             "| model | k | H100 rows within 10 (range) | H200 rows within 10 (range) |",
             "|---|---|---|---|"]
    for name, f in fits.items():
        cells = []
        for gk in ("h100", "h200"):
            d = [e for _, _, e, tr in f["errs"][gk] if not tr]
            cells.append(f"{_within(d, 10)} of {len(d)} ({min(d):+.1f} .. {max(d):+.1f})")
        lines.append(f"| {name} | {f['k']:.2f} | {cells[0]} | {cells[1]} |")
    lines += ["", "H200 rows, the model (count x dependency) against the record:", "",
              "| run | batch x context | measured % | predicted % | error |",
              "|---|---|---|---|---|"]
    for r, p, e, _ in model["errs"]["h200"]:
        lines.append(f"| {r['run']} | {r['batch']} x {r['context'] // 1024}k | {r['pct']:.1f} | "
                     f"{p:.1f} | {e:+.1f} |")
    lines += ["", f"Gate: H200 {'MET' if h200_ok else 'NOT MET'} (every row within "
              f"{GATE_POINTS:g} points); H100 held-back rows {'all' if h100_ok else 'NOT all'} "
              "within it." + ("" if h200_ok else " The other targets' figures are NOT "
                              "validated (validated: false, uses_validated_model: false)."),
              "", "| target | kernel (arch) | SMs | clock GHz | bandwidth GB/s (from) | "
              "instructions per tile | bound per tile | % at 64 x 32k | % at 16 x 4k | bound at "
              "64 x 32k | validated |", "|---" * 11 + "|"]
    for t in targets.values():
        hw = t["hardware"]
        lines.append(
            f"| {t['name']} | {t['kernel']} ({t['arch']}) | {hw['sms']} | {hw['clock_ghz']} | "
            f"{hw['bw_gbs']:.0f} ("
            f"{'measured' if hw['bw_from'].startswith('measured') else 'peak x ratio'}) | "
            f"{t['counts_per_tile']['total']:.0f} | {t['instruction_bound']} | "
            f"{t['predicted_pct_bw']['64x32k']:.1f} | {t['predicted_pct_bw']['16x4k']:.1f} | "
            f"{t['bound']} | {t['validated']} |")
    for g, why in NOT_PREDICTED.items():
        lines.append(f"| {why} | sm120 kernel (sm_120a) | - | - | - | - | - | - | - | - | - |")
    if "sm_120a" in kern:
        s = kern["sm_120a"]
        lines += ["", f"sm120 kernel: chunk loop {s['loop'][0]:#x}..{s['loop'][1]:#x}, hot path "
                  f"{s['counts']['total']} instructions per 32-key chunk of one warp (the V loop "
                  f"x {s['v_loop_trips']}), MMAs {s['mma_ops']}; {s['resources']['registers']} "
                  f"registers, {s['resources']['smem']} B shared memory: {s['ctas_per_sm']} CTAs "
                  f"of {SM120_WARPS} warps per SM. RTX 5090 with QMMA at half the vendor rate "
                  f"(the microbenchmark's FP4-operand rate): "
                  f"{targets['rtx5090']['predicted_pct_bw_qmma_half_rate']}."]
    if fp8 is not None:
        lim = fp8["targets"]["h200"]["sched_clocks_per_tile"]
        cnt = fp8["counts_per_tile"]
        lines += ["", "## The SM90a FP8 decode kernel (what FP4 decode at D 128 runs on SM 9.x)", "",
                  f"Step loop {fp8['loop'][0]:#x}..{fp8['loop'][1]:#x}: {cnt['total']} instructions "
                  f"per warp and 64-token step (one 16-token tile): ALU {cnt.get('alu', 0)}, IMAD "
                  f"{cnt.get('imad', 0)}, FP32 {cnt.get('fp32', 0)}, MUFU {cnt.get('mufu', 0)}, "
                  f"QGMMA {cnt.get('gmma', 0)} ({cnt.get('gmma_clk', 0):g} scheduler clocks). "
                  "Scheduler clocks per tile: " + ", ".join(f"{x} {v:g}" for x, v in lim.items())
                  + f"; bound: {fp8['targets']['h200']['bound']}. The call model with this "
                  f"kernel's own dependency factor {fp8['dependency_factor']:.2f} (its "
                  f"instruction-bound clocks on an H200 over the count: {FP8_DEPENDENCY_RECORD.name}), "
                  f"k {k:.2f} (ASSUMPTION: fitted on the warp-MMA kernel) and this kernel's launch:", "",
                  "| target | % at 64 x 32k | % at 16 x 4k |", "|---|---|---|"]
        for key, t in fp8["targets"].items():
            lines.append(f"| {key} | {t['predicted_pct_bw']['64x32k']:.1f} | "
                         f"{t['predicted_pct_bw']['16x4k']:.1f} |")
        lines += ["", f"Against its H200 record ({H200_FP8_ROWS.name}, {fp8['h200_bw_gbs']:g} GB/s): "
                  f"{fp8['h200_within_gate']} of {len(fp8['h200_rows'])} rows within "
                  f"{GATE_POINTS:g} points.", "", "| batch x context | measured % | predicted % | "
                  "error |", "|---|---|---|---|"]
        for e in fp8["h200_rows"]:
            lines.append(f"| {e['batch x context']} | {e['measured_pct']:.1f} | "
                         f"{e['predicted_pct']:.1f} | {e['error_pts']:+.1f} |")
    lines += ["", "Vendor figures and sources:", ""]
    for t in targets.values():
        lines.append(f"- {t['name']}: " + "; ".join(f"{k}: {v}" for k, v in
                                                    t["hardware"]["sources"].items()))
    return "\n".join(lines), res


# The gfx942 kernel (tq_fp4_paged_attention.cuh, the LUT path): (label, arch, GPU constants).
# gfx950 runs tq_fp4_gfx950_attention.cuh (`gfx950_paths`).
HIP_PATHS = [
    ("gfx942 LUT", "gfx942", MI300X()),
]


def hip_report(asms, hw: MI355X | None = None, k: float = math.inf) -> tuple[str, dict]:
    """The AMD partition kernels: counts, where they are, the per-tile limits and the predicted
    % of HBM bandwidth. asms: {arch: assembly} (a str is gfx950's alone); k: the overlap
    exponent fitted on the cuda side (inf: the throughput-only max)."""
    if isinstance(asms, str):
        asms = {"gfx950": asms}
    lines = ["## The old partition kernel (tq_fp4_paged_attention.cuh; decode, bf16, HEAD 128, "
             "block 16, GQA 8): gfx942 on MI300X", "",
             "per wave and 256-token partition (= 4 tiles per wave); per-tile = / 4", ""]
    res = {}
    cols = AMD_CLASSES + ["valu_packed", "vmcnt0", "total", "lds_bytes"]
    lines.append("| path | " + " | ".join(cols) + " |")
    lines.append("|---" * (len(cols) + 1) + "|")
    for label, arch, gpu in HIP_PATHS:
        if arch not in asms:
            continue
        ins, labels = parse_amd_body(gfx942_decode_kernel(asms[arch])["body"])
        loops = amd_loops(ins, labels)
        if len(loops) != len(HIP_DECODE_TRIPS):
            lines.append(f"{label}: {len(loops)} loops, expected {len(HIP_DECODE_TRIPS)}; skipped")
            continue
        c, lp = amd_counts(ins, labels, HIP_DECODE_TRIPS)
        tb = FP4_TILE_BYTES
        res[label] = {"counts": c, "loops": lp, "tile_bytes": tb, "hw": hw or gpu, "arch": arch,
                      "regions": amd_regions(ins, labels, HIP_DECODE_TRIPS)}
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
    kk = "inf" if math.isinf(k) else f"{k:.2f}"
    lines.append("| path | GPU | valu clk/tile/CU | mfma | salu | lds issue | lds bw | vmem issue | "
                 "bound | instr ns/tile/CU | HBM ns/tile/CU | predicted % of HBM, max() | "
                 f"predicted %, overlap k = {kk} | with VALU 1 clk | VALU of the tile work only "
                 "(no prologue/epilogue) |")
    lines.append("|---" * 15 + "|")
    for label, r in res.items():
        g = r["hw"]
        cyc = amd_tile_cycles(r["counts"], g)
        p = predict_pct(cyc["cu_clk"], g.clock_ghz, r["tile_bytes"], g.bw_gbs, g.cus)
        pk = predict_pct(cyc["cu_clk"], g.clock_ghz, r["tile_bytes"], g.bw_gbs, g.cus, k)
        cyc1 = amd_tile_cycles(r["counts"], dataclasses.replace(g, valu_clk=1.0))
        p1 = predict_pct(cyc1["cu_clk"], g.clock_ghz, r["tile_bytes"], g.bw_gbs, g.cus, k)
        bound = "memory" if p["bound"] == "memory" else cyc["bound"]
        bound1 = "memory" if p1["bound"] == "memory" else cyc1["bound"]
        r.update(cycles=cyc, pred=p, pred_k=pk, pred_valu1=p1, bound=bound, bound1=bound1)
        L = cyc["limits_cu"]
        lines.append(f"| {label} | {g.name} ({g.bw_gbs / 1000:g} TB/s) | {L['valu']:.0f} | "
                     f"{L['mfma']:.0f} | {L['salu']:.0f} | {L['lds_issue']:.0f} | "
                     f"{L['lds_bw']:.0f} | {L['vmem_issue']:.0f} | {bound} | {p['issue_ns']:.0f} | "
                     f"{p['hbm_ns']:.0f} | {p['pct']:.1f} % | {pk['pct']:.1f} % | "
                     f"{p1['pct']:.0f} % ({bound1}) | {steady_valu_pct(r, g, k):.0f} % |")
    if res:
        lines += ["", "### Estimate (steady-state 16-token tile; the cuda validation's overlap "
                  f"term, k = {kk})", "", "| path | GPU | predicted % of HBM bandwidth | "
                  "limiting bound | instruction / HBM time per tile per CU |", "|---|---|---|---|---|"]
        for label, r in res.items():
            lines.append(f"| {label} | {r['hw'].name} | {r['pred_k']['pct']:.1f} % | {r['bound']} | "
                         f"{r['pred']['issue_ns']:.0f} / {r['pred']['hbm_ns']:.0f} ns |")
    return "\n".join(lines), res


def steady_valu_pct(r: dict, hw: MI355X = MI355X(), k: float = math.inf) -> float:
    """% of bandwidth if only the VALU work between the first and the last MFMA and the V decode
    loops counted (what a longer partition would approach), with the VALU at hw.valu_clk."""
    valu = sum(v for k, (n, v) in r["regions"].items()
               if k.startswith(("V decode", "rest from the first")))
    cu_clk = valu * hw.valu_clk / hw.tiles_per_wave / hw.simds
    return predict_pct(cu_clk, hw.clock_ghz, r["tile_bytes"], hw.bw_gbs, hw.cus, k)["pct"]


# ----------------------------------------------------------------------------------------------
# AMD: the gfx950 kernel, AITER's kernels and one call of each (issue 38's one table)
# ----------------------------------------------------------------------------------------------
# (JSON name, label, NATIVE, KEY_E4M3) of the gfx950 partition kernel's decode specializations
GFX950_PATHS = [("gfx950_fp4_native", "gfx950 native FP4", True, False),
                ("gfx950_fp4_lut", "gfx950 LUT", False, False),
                ("gfx950_k8v4", "gfx950 K8V4", True, True)]
KV_HEADS, Q_HEADS, HEAD = 8, 64, 128   # the table's shape: 64 query heads, 8 kv heads, head 128
TABLE_SHAPES = [(b, ctx) for ctx in (4096, 32768) for b in (1, 16, 64, 128)]
# The H100's measured instruction-bound time over its throughput count (compute_bound_check.py;
# benchmarks/results/2026-11-24-h100-isa-model-dependency.json: K8V4 1.40x, FP4 1.49x): the low end here, the
# high end is aiter_anchor.DEPENDENCY_FACTOR (1.5).
DEPENDENCY_FACTOR_LOW = 1.4
PLAN_FILE = ROOT / "turboquant" / "integration" / "aiter" / "files" / "pa_fp4_plan.py"


def plan_module():
    """The launcher's plan, pa_fp4_plan.py, imported by path (a dependency-free module: the AITER
    patch ships it beside the launcher, so the model, the launcher and the tests split a call
    the same way)."""
    import importlib.util
    mod = sys.modules.get("pa_fp4_plan")
    if mod is None or getattr(mod, "__file__", None) != str(PLAN_FILE):
        spec = importlib.util.spec_from_file_location("pa_fp4_plan", PLAN_FILE)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["pa_fp4_plan"] = mod
    return mod


def partition_len() -> Callable[[int, int, int, int], int]:
    """The launcher's partition_len(row_tiles, num_kv_heads, max_seq_len, num_cus): the largest
    128 x 2^k <= 2048 tokens that still gives row_tiles x num_kv_heads x ceil(max_seq_len / P)
    >= 1 wave x 4 SIMDs x num_cus waves, else 256."""
    return plan_module().partition_len


@dataclasses.dataclass
class AmdPath:
    """One row of the AMD table: a kernel's counts and what one call of it does (`amd_call`)."""
    label: str
    hw: MI355X
    tile_bytes: int
    step: Counter              # one wave's instructions for one step of `tiles_per_step` tiles
    tiles_per_step: int
    once: Counter              # one wave's instructions outside the step, once per workgroup
    mfma_clk: float            # SIMD clocks of one of its MFMA instructions
    waves_per_wg: int
    occupancy: int             # waves per SIMD at once
    launches: int              # kernel launches per call
    wg_step_tokens: int        # tokens a workgroup advances per step
    partition: Callable[[int, int, int, int], int] | None  # partition_len's signature; None: no split
    prologue_trips: int        # dependent DRAM round trips before a workgroup's first step
    in_flight_bytes: int       # a wave's bytes in flight across steps; 0: each step drains its loads
    # a fused reduce's instructions (one wave per row tile): straight line, chunk loop body
    reduce_code: tuple[Counter, Counter] | None = None
    reduce: tuple[int, int, int] = (0, 0, 0)  # round trips: base + per_chunk x ceil(partitions / chunk)
    all_paths: Counter | None = None  # gfx950: the step loop without the hot-path assumption
    stats: dict = dataclasses.field(default_factory=dict)

    def cycles(self, counts: Counter | None = None) -> dict:
        """amd_tile_cycles of one step's counts (or `counts` for the same tiles), per tile."""
        hw = dataclasses.replace(self.hw, tiles_per_wave=self.tiles_per_step)
        return amd_tile_cycles(self.step if counts is None else counts, hw, self.mfma_clk)

    def hbm_clk(self) -> float:
        """CU clocks of one tile's bytes at the CU's share of HBM bandwidth."""
        return self.tile_bytes / (self.hw.bw_gbs / self.hw.cus) * self.hw.clock_ghz


def simd_issue_clocks(c: Counter, hw: MI355X, mfma_clk: float) -> float:
    """Clocks one wave's instructions `c` hold its SIMD: the largest per-SIMD limit of
    amd_tile_cycles (the CU-wide LDS bandwidth left out)."""
    lim = amd_tile_cycles(c, dataclasses.replace(hw, tiles_per_wave=1), mfma_clk)["limits_cu"]
    return max(v for k, v in lim.items() if k != "lds_bw") * hw.simds


def loads_in_flight_bytes(loop) -> int:
    """Bytes a wave keeps in flight across the iterations of a loop ([(op, operands)]): 0 if
    the loop waits for all its loads (vmcnt(0)), else its deepest s_waitcnt vmcnt(N) x one
    16-byte load per lane."""
    waits = [int(m.group(1)) for op, rest in loop if op == "s_waitcnt"
             for m in [re.search(r"vmcnt\((\d+)\)", rest)] if m]
    return 0 if not waits or min(waits) == 0 else max(waits) * 64 * 16


def amd_call(p: AmdPath, batch: int, context: int, dep: float = 1.0) -> dict:
    """Predicted time of one decode call (module docstring, part 3), us, at `batch` sequences of
    `context` tokens, 64/8/128; dep multiplies every instruction time (the dependency factor)."""
    hw = p.hw
    lat = hw.dram_latency_us * 1e3                                   # ns
    part = p.partition(batch, KV_HEADS, context, hw.cus) if p.partition else context
    nparts = -(-context // part)
    wgs = batch * KV_HEADS * nparts
    steps = -(-min(part, context) // p.wg_step_tokens)
    issue = simd_issue_clocks(p.step, hw, p.mfma_clk) * dep / hw.clock_ghz   # ns per step
    once = simd_issue_clocks(p.once, hw, p.mfma_clk) * dep / hw.clock_ghz if p.once else 0.0
    step_bytes = p.tiles_per_step * p.tile_bytes                     # one wave's
    slots = hw.cus * hw.simds * p.occupancy // p.waves_per_wg
    full, rest = divmod(wgs, slots)
    stream, first = 0.0, None
    for n, times in ((slots, full), (rest, 1 if rest else 0)):
        if not times:
            continue
        waves = n * p.waves_per_wg
        w = -(-waves // (hw.cus * hw.simds))                         # waves per busy SIMD
        terms = {"issue": w * issue, "HBM": waves * step_bytes / hw.bw_gbs,
                 "latency": step_bytes * lat / p.in_flight_bytes if p.in_flight_bytes
                 else lat + issue}
        first = first or terms
        stream += times * (p.prologue_trips * lat + w * once + steps * max(terms.values()))
    base, chunk, per_chunk = p.reduce
    partials = batch * Q_HEADS * nparts * (HEAD * 2 + 8)             # bf16 O, fp32 m and l
    fixed = {"launches": p.launches * hw.launch_us * 1e3,
             "reduce": (base + per_chunk * -(-nparts // chunk)) * lat + 2 * partials / hw.bw_gbs
             + ((simd_issue_clocks(p.reduce_code[0], hw, p.mfma_clk)
                 + -(-nparts // chunk) * simd_issue_clocks(p.reduce_code[1], hw, p.mfma_clk))
                * dep / hw.clock_ghz if p.reduce_code else 0.0)
             if chunk else 0.0}
    total = stream + sum(fixed.values())
    kv = batch * context * KV_HEADS * p.tile_bytes / TILE_TOKENS
    return {"partition": part, "nparts": nparts, "workgroups": wgs, "rounds": full + (rest > 0),
            "terms": first, "bound": max(first, key=first.get), "stream_us": stream / 1e3,
            "fixed_us": {k: v / 1e3 for k, v in fixed.items()}, "total_us": total / 1e3,
            "pct": 100.0 * kv / total / hw.bw_gbs}


def reduce_counts(ins, labels, ticket: int) -> tuple[Counter, Counter, int, int]:
    """The fused reduce from the ticket's atomic (instruction `ticket`) on: (its straight-line
    instructions after the atomic and its chunk loop's body, every branch side; partitions per
    chunk; dependent round trips before the loop): the loop runs once per chunk, a chunk loads
    each partition's maximum and sum as two global_load_dword, and every s_waitcnt vmcnt(0)
    from the atomic to the loop is a round trip of its own (the atomic's return, then the
    sink's state record)."""
    loops = [(h, b) for h, b in outermost(real_loops(ins, labels)) if h > ticket]
    if len(loops) != 1:
        raise ValueError(f"{len(loops)} loops in the fused reduce, expected its chunk loop")
    (h, b), = loops
    scalar_loads = sum(op == "global_load_dword" for op, _ in ins[h:b + 1])
    if scalar_loads < 2 or scalar_loads % 2:
        raise ValueError(f"{scalar_loads} global_load_dword in the reduce's chunk loop, expected "
                         "two per partition")
    trips = sum(op == "s_waitcnt" and "vmcnt(0)" in rest for op, rest in ins[ticket:h])
    return (amd_counts(ins[ticket + 1:h] + ins[b + 1:], {}, [])[0],
            amd_counts(ins[h:b + 1], {}, [])[0], scalar_loads // 2, trips)


def step_loop(ins, labels, label: str) -> tuple[int, int]:
    """The partition kernel's step loop: the one outermost loop that holds the MFMAs (the others
    are the prologue's row passes and the fused reduce's pass over the partials); loops found by
    reachability (real_loops: the compiler may lay a block out after the reduce and jump back)."""
    loops = [(h, b) for h, b in outermost(real_loops(ins, labels))
             if any(op.startswith("v_mfma") for op, _ in ins[h:b + 1])]
    if len(loops) != 1:
        raise ValueError(f"{label}: {len(loops)} outermost loops with MFMAs, expected the one "
                         "step loop")
    return loops[0]


def gfx950_paths(clang: str, src_dir: Path | None = None) -> dict[str, AmdPath]:
    """The gfx950 partition kernel's three decode paths: one step of the hot-path build, the rest
    of the kernel once per partition, the step of the all-paths build beside it."""
    hot, every = hip_hot_path_asm(clang, src_dir), hip_hot_path_asm(clang, src_dir, hot=False)
    tiles = source_constant("kStep", src_dir) // TILE_TOKENS
    hw = MI355X()
    out = {}
    for name, label, native, e4 in GFX950_PATHS:
        k = decode_kernel(hot, "tq_fp4_pa_gfx950_kernel", native, e4)
        ins, labels = parse_amd_body(k["body"])
        ins_all, labels_all = parse_amd_body(
            decode_kernel(every, "tq_fp4_pa_gfx950_kernel", native, e4)["body"])
        (h, b), (h2, b2) = step_loop(ins, labels, label), step_loop(ins_all, labels_all, label)
        # after the step loop: the partial's stores up to the ticket's atomic (every wave),
        # then the fused reduce (the row tile's last wave only)
        ticket = next(i for i in range(b + 1, len(ins)) if "atomic" in ins[i][0])
        red = reduce_counts(ins, labels, ticket)
        out[name] = AmdPath(
            label, hw, K8V4_TILE_BYTES if e4 else FP4_TILE_BYTES,
            step=amd_counts(ins[h:b + 1], {}, [])[0], tiles_per_step=tiles,
            # the rest, every branch side (an upper bound); QK and PV at the FP8 rate (an FP8
            # operand in each, module docstring)
            once=amd_counts(ins[:h] + ins[b + 1:ticket + 1], {}, [])[0], mfma_clk=hw.mfma_fp8_clk,
            reduce_code=red[:2],
            waves_per_wg=k["meta"]["max_flat_workgroup_size"] // k["meta"]["wavefront_size"],
            occupancy=k["stats"]["Occupancy"], launches=1, wg_step_tokens=tiles * TILE_TOKENS,
            partition=partition_len(),
            # Q and the state record (transformed in the prologue: its instructions are in
            # `once`), then the block table before the first KV load
            prologue_trips=2, in_flight_bytes=loads_in_flight_bytes(ins[h:b + 1]),
            # the reduce, fused into the last partition of each row tile: the round trips
            # counted from the atomic to the chunk loop, then one pass over the partials in
            # chunks (each chunk's loads before its first use)
            reduce=(red[3], red[2], 1),
            all_paths=amd_counts(ins_all[h2:b2 + 1], {}, [])[0],
            stats={"VGPRs": k["stats"]["NumVgprs"], "AGPRs": k["stats"]["NumAgprs"],
                   "occupancy": k["stats"]["Occupancy"], "LDS": k["stats"]["LDSByteSize"],
                   "scratch": k["stats"]["ScratchSize"]})
    return out


def gfx942_path(clang: str, src_dir: Path | None = None) -> AmdPath:
    """The old kernel's LUT path on gfx942 (HIP_PATHS' row): its whole partition body per wave
    (4 tiles, HIP_DECODE_TRIPS), 4 waves per workgroup, 256-token partitions, reduce."""
    (label, arch, hw), = HIP_PATHS
    k = gfx942_decode_kernel(hip_asm(clang, src_dir))
    ins, labels = parse_amd_body(k["body"])
    counts, _ = amd_counts(ins, labels, HIP_DECODE_TRIPS)
    waves = k["meta"]["max_flat_workgroup_size"] // k["meta"]["wavefront_size"]
    tokens = waves * hw.tiles_per_wave * TILE_TOKENS
    return AmdPath(label, hw, FP4_TILE_BYTES, step=counts, tiles_per_step=hw.tiles_per_wave,
                   once=Counter(), mfma_clk=hw.mfma_fp8_clk, waves_per_wg=waves,
                   occupancy=k["stats"]["Occupancy"], launches=2, wg_step_tokens=tokens,
                   partition=lambda *_: tokens, prologue_trips=2,
                   in_flight_bytes=loads_in_flight_bytes(ins),
                   reduce=(2, source_constant("kReduceChunk", src_dir), 2),
                   stats={"VGPRs": k["stats"]["NumVgprs"], "occupancy": k["stats"]["Occupancy"],
                          "LDS": k["stats"]["LDSByteSize"]})


def aiter_paths(clang: str | None, objdump: str | None) -> dict[str, AmdPath]:
    """AITER's FP8 kernels as benchmarks/aiter_anchor.py counts them (pa_v1 with clang, the asm
    kernel with llvm-objdump; each needs the pinned wheel)."""
    import aiter_anchor as aa
    out = {}
    if aa.find_wheel() is None:
        return out
    hw = MI355X()
    if clang:
        r = aa.pa_v1_fp8_counts(clang)
        src = aa._wheel_member(aa.ATTENTION_COMMON, None).decode()
        # its reduce (_paged_attention_ll4mi_reduce_kernel): the maxima and sums of all
        # partitions, then the values in chunks of MAX_NPAR partitions, then the output
        max_npar = int(re.search(r"constexpr int MAX_NPAR = (\d+);", src).group(1))
        tokens = r["tokens_per_step"]["workgroup"]
        out["aiter_pa_v1_fp8"] = AmdPath(
            "AITER pa_v1 FP8", hw, r["tile_bytes"], step=r["counts"],
            tiles_per_step=r["tiles_per_wave"], once=Counter(), mfma_clk=r["mfma_clk"],
            waves_per_wg=r["waves"], occupancy=r["kernel"]["stats"]["Occupancy"], launches=2,
            wg_step_tokens=tokens, partition=lambda *_: tokens, prologue_trips=2,
            in_flight_bytes=loads_in_flight_bytes(r["ins"]), reduce=(3, max_npar, 1),
            stats={"VGPRs": r["kernel"]["stats"]["NumVgprs"],
                   "occupancy": r["kernel"]["stats"]["Occupancy"]})
    if objdump:
        r = aa.asm_fp8_counts(objdump)
        (h, b) = r["loops"][0]
        kd = r["descriptor"]
        occupancy = min(hw.max_waves_per_simd, hw.vgprs_per_simd // kd["next_free_vgpr"])
        out["aiter_asm_fp8"] = AmdPath(
            "AITER asm FP8", hw, r["tile_bytes"], step=r["counts"],
            # prologue, tail step and epilogue: both copies of the tail (one runs): an upper bound
            tiles_per_step=r["tiles_per_wave"], once=sum(r["fixed"].values(), Counter()),
            mfma_clk=r["mfma_clk"], waves_per_wg=r["waves"], occupancy=occupancy, launches=1,
            wg_step_tokens=r["tokens_per_step"]["workgroup"], partition=None,
            prologue_trips=2, in_flight_bytes=loads_in_flight_bytes(r["ins"][h:b + 1]),
            stats={"VGPRs": kd["next_free_vgpr"], "occupancy": occupancy})
    return out


JSON_FIELDS = ["valu_clocks_per_tile", "hbm_clocks_per_tile", "predicted_pct_bw",
               "time_per_token_vs_aiter_asm_fp8_64x32k", "time_per_token_vs_aiter_asm_fp8_1x4k",
               "bound"]


def amd_table(paths: dict[str, AmdPath], dep_high: float) -> tuple[str, dict]:
    """Issue 38's one table: per path the CU clocks per tile by limit, the bound, the predicted %
    of HBM bandwidth and the predicted time per token relative to AITER's asm FP8 kernel at
    64/8/128 x TABLE_SHAPES; the sensitivity rows with the dependency factors; the call
    structure. Returns (markdown, {JSON name: the JSON_FIELDS and more}); dep_high is the
    dependency factor of the JSON's predicted_pct_bw and time ratios."""
    ref = paths.get("aiter_asm_fp8")
    shapes = " | ".join(f"{b} x {c // 1024}k" for b, c in TABLE_SHAPES)

    def ratios(p: AmdPath, dep: float) -> list[float | None]:
        return [amd_call(p, b, c, dep)["total_us"] / amd_call(ref, b, c, dep)["total_us"]
                if ref else None for b, c in TABLE_SHAPES]

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    lines = ["## AMD performance estimate (static, from the compiled ISA; nothing has run on AMD "
             "hardware)", "",
             "bf16 Q, head 128, block 16, GQA 8, decode. CU clocks per 16-token tile of one kv "
             "head (per-SIMD clocks / 4 SIMDs; VALU: transcendentals x 4; LDS: issue / bytes); "
             "HBM = the tile's bytes at the CU's share of the bandwidth; % of HBM = per tile, "
             "throughput max(). Time per token relative to AITER's asm FP8 kernel on MI355X, "
             "64 query heads / 8 kv heads / head 128, batch x context, by `amd_call` (fixed "
             "costs: assumptions, below); < 1 is faster. The gfx942 row is MI300X against MI355X.",
             "", "| path | GPU | VALU | MFMA | LDS | VMEM | HBM | bound | % of HBM (x "
             f"{dep_high:g}) | {shapes} |", "|---" * (9 + len(TABLE_SHAPES)) + "|"]
    res = {}
    for name, p in paths.items():
        cyc = p.cycles()
        lim = cyc["limits_cu"]
        hbm = p.hbm_clk()
        pct = predict_pct(cyc["cu_clk"], p.hw.clock_ghz, p.tile_bytes, p.hw.bw_gbs, p.hw.cus)
        pct_dep = predict_pct(cyc["cu_clk"] * dep_high, p.hw.clock_ghz, p.tile_bytes,
                              p.hw.bw_gbs, p.hw.cus)
        bound = "HBM" if pct["bound"] == "memory" else cyc["bound"]
        r = ratios(p, 1.0)
        lines.append(f"| {p.label} | {p.hw.name} | {lim['valu']:.0f} | {lim['mfma']:.0f} | "
                     f"{lim['lds_issue']:.0f} / {lim['lds_bw']:.0f} | {lim['vmem_issue']:.0f} | "
                     f"{hbm:.0f} | {bound} | {pct['pct']:.1f} ({pct_dep['pct']:.1f}) | "
                     + " | ".join(fmt(x) for x in r) + " |")
        big = amd_call(p, 64, 32768, dep_high)
        r_dep = dict(zip(TABLE_SHAPES, ratios(p, dep_high)))
        res[name] = {"label": p.label, "gpu": p.hw.name,
                     "valu_clocks_per_tile": lim["valu"], "hbm_clocks_per_tile": hbm,
                     "predicted_pct_bw": big["pct"],
                     "time_per_token_vs_aiter_asm_fp8_64x32k": r_dep[(64, 32768)],
                     "time_per_token_vs_aiter_asm_fp8_1x4k": r_dep[(1, 4096)],
                     "bound": bound, "dependency_factor": dep_high,
                     "limits_cu": lim, "predicted_pct_bw_per_tile": pct["pct"],
                     "ratios": {f"{b}x{c // 1024}k": x for (b, c), x in zip(TABLE_SHAPES, r)}}
        if p.all_paths is not None:
            res[name]["valu_clocks_per_tile_all_paths"] = p.cycles(p.all_paths)["limits_cu"]["valu"]
    lines += ["", f"Sensitivity: every kernel's instruction time x {DEPENDENCY_FACTOR_LOW:g} and "
              f"x {dep_high:g} (the H100's measured range, AITER's kernels included): % of HBM "
              "bandwidth of one call at 64 x 32k, and the time per token relative to AITER's asm "
              "FP8 kernel (same factor):", "",
              f"| path | factor | % of HBM at 64 x 32k | {shapes} |",
              "|---" * (3 + len(TABLE_SHAPES)) + "|"]
    for name, p in paths.items():
        for dep in (DEPENDENCY_FACTOR_LOW, dep_high):
            lines.append(f"| {p.label} | x {dep:g} | {amd_call(p, 64, 32768, dep)['pct']:.1f} | "
                         + " | ".join(fmt(x) for x in ratios(p, dep)) + " |")
    hw = MI355X()
    lines += ["", "Call structure and fixed costs. ASSUMPTIONS, nothing AMD has been timed: a "
              f"dependent launch inside a HIP graph {hw.launch_us} us (ROCm/rocm-systems#10834: "
              "3.865 us per node of a replayed graph of serialized tiny kernels, measured on "
              "gfx1100; no CDNA figure found), a dependent DRAM round trip "
              f"{hw.dram_latency_us} us (gfx950 pointer chase, facebookexperimental/triton "
              "AMDLatencyModel.h: ~360 ns, idle). Ours: the partition kernel (Q transformed in "
              "each wave's prologue, the reduce fused into each row tile's last partition) = 1 "
              "launch, one wave per (sequence, partition, kv head), partitions from the "
              "launcher's plan (`partition_len` of pa_fp4_plan.py); "
              "pa_v1 and gfx942: partition kernel + reduce = 2 launches, 256-token partitions of "
              "4 waves; AITER asm: 1 launch, one workgroup of 4 waves per (sequence, kv head) over "
              "the whole context, no split. Per call at 1 x 4k and 64 x 32k (factor 1): "
              "partition x partitions, workgroups / rounds, the first round's per-step terms' "
              "bound, streaming + fixed us (launches, reduce), total us, % of HBM:", "",
              "| path | waves per workgroup / per SIMD | bytes in flight per wave | 1 x 4k | "
              "64 x 32k |", "|---|---|---|---|---|"]

    def call_cell(c: dict) -> str:
        f = c["fixed_us"]
        return (f"{c['partition']} x {c['nparts']}, {c['workgroups']} / {c['rounds']}, "
                f"{c['bound']}: {c['stream_us']:.1f} + {f['launches']:.1f} + "
                f"{f['reduce']:.1f} = {c['total_us']:.1f} us, "
                f"{c['pct']:.1f} %")

    for name, p in paths.items():
        lines.append(f"| {p.label} | {p.waves_per_wg} / {p.occupancy} | "
                     f"{p.in_flight_bytes or '0: a step drains its loads'} | "
                     f"{call_cell(amd_call(p, 1, 4096))} | {call_cell(amd_call(p, 64, 32768))} |")
    gfx = {n: p for n, p in paths.items() if p.all_paths is not None}
    if gfx:
        lines += ["", "gfx950 partition kernel, one wave's 128-token step (8 tiles): the hot path "
                  "(TQ_HOT_PATH_ASSUME: full step, no soft cap) against all paths of the loop; "
                  "the rest of the kernel runs once per partition:", "",
                  "| path | VGPRs / AGPRs | occupancy (waves per SIMD) | LDS B | hot path: "
                  "instructions / VALU / transcendental / MFMA per step | VALU clk per tile | all "
                  "paths: instructions / VALU / transcendental | VALU clk per tile | once per "
                  "partition: instructions / VALU |", "|---" * 9 + "|"]
        for name, p in gfx.items():
            s, a = p.step, p.all_paths
            lines.append(
                f"| {p.label} | {p.stats['VGPRs']} / {p.stats['AGPRs']} | {p.stats['occupancy']} "
                f"| {p.stats['LDS']} | {s['total']} / {s['valu']} / {s['valu_trans']} / "
                f"{s['mfma']} | {p.cycles()['limits_cu']['valu']:.1f} | {a['total']} / "
                f"{a['valu']} / {a['valu_trans']} | {p.cycles(a)['limits_cu']['valu']:.1f} | "
                f"{p.once['total']} / {p.once['valu'] + p.once['valu_trans']} |")
    return "\n".join(lines), res


NVIDIA_JSON_FIELDS = ["predicted_pct_bw", "bound", "validated", "uses_validated_model",
                      "counts_per_tile", "sched_clocks_per_tile", "sm_clocks_per_tile",
                      "dependency_factor", "hardware", "name", "arch", "kernel"]


def nvidia_json(res: dict) -> dict:
    """The `--json` file's "nvidia" part: {target: the NVIDIA_JSON_FIELDS (the H100 / H200 also
    their rows with the errors, and "fp8_decode": the SM90a FP8 decode kernel's prediction, the
    H200 with its record's rows), and "model": k, the dependency factor, the gate}}."""
    model = {"k": res["k"], "dependency_factor": res["dependency_factor"],
             "gate_points": res["gate_points"], "h200_validated": res["h200_validated"],
             "not_predicted": res["not_predicted"]}
    out = {g: {**{f: t[f] for f in NVIDIA_JSON_FIELDS + ["rows", "predicted_pct_bw_qmma_half_rate"]
                  if f in t}, "model": model} for g, t in res["nvidia"].items()}
    fp8 = res.get("fp8_decode")
    if fp8 is not None:
        for g, t in fp8["targets"].items():
            out[g]["fp8_decode"] = dict(t, counts_per_tile=fp8["counts_per_tile"])
        out["h200"]["fp8_decode"].update(rows=fp8["h200_rows"], bw_gbs=fp8["h200_bw_gbs"],
                                         rows_within_gate=fp8["h200_within_gate"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-hip", action="store_true")
    ap.add_argument("--no-cuda", action="store_true", help="the AMD part only")
    ap.add_argument("--no-nvidia-targets", action="store_true",
                    help="skip the other NVIDIA targets (the sm_100a and sm_120a compiles)")
    ap.add_argument("--hip-src", type=Path, help="a copy of csrc_hip to compile instead")
    ap.add_argument("--cuda-src", type=Path, help="a copy of csrc_cuda to compile instead")
    ap.add_argument("--compute-bound", type=Path, metavar="JSON",
                    help="compute_bound.json of benchmarks/compute_bound_check.py: also the model "
                         "with its measured SM clocks per tile")
    ap.add_argument("--json", type=Path, metavar="FILE",
                    help="write the AMD table's figures per path (gfx950_fp4_native, ..., "
                         "aiter_asm_fp8) and, under \"nvidia\", the NVIDIA targets' (h100, h200, "
                         "b200, rtx5090, ...) to FILE")
    args = ap.parse_args(argv)
    measured = None
    if args.compute_bound:
        cb = json.loads(args.compute_bound.read_text())
        measured = {n: cb[f"slope_{n}"] for n in ("FP4", "K8V4") if f"slope_{n}" in cb}
    from _tools import find_clang, find_nvcc, find_tool
    k = math.inf
    out: dict = {}

    def write_json(note: str) -> None:
        if args.json:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
            print(f"\n{args.json}: {note}")

    nv_note = ("under \"nvidia\": per target predicted_pct_bw at 64x32k and 16x4k, bound, "
               "validated, counts per tile, hardware figures")
    if not args.no_cuda:
        nvcc, cuobj = find_nvcc(), find_tool("cuobjdump")
        if nvcc and cuobj:
            sass90 = cuda_sass(nvcc, cuobj, args.cuda_src)
            text, res = cuda_report(sass90, measured_clk=measured)
            k = res["k"]
            print(text)
            if not args.no_nvidia_targets:
                text, nres = nvidia_report(sass90, cuda_sass(nvcc, cuobj, args.cuda_src, "sm_100a"),
                                           sm120_sass(nvcc, cuobj))
                print()
                print(text)
                out["nvidia"] = nvidia_json(nres)
        else:
            print("cuda part skipped: nvcc/cuobjdump not found (the AMD rows use k = inf)")
    if args.no_hip:
        write_json(nv_note)
        return 0
    clang = find_clang()
    if not clang:
        print("AMD part skipped: clang-22 not found")
        write_json(nv_note)
        return 0
    import aiter_anchor as aa
    print()
    text, _ = hip_report({"gfx942": hip_asm(clang, args.hip_src)}, k=k)
    print(text)
    paths = {**gfx950_paths(clang, args.hip_src), "gfx942_fp4_lut": gfx942_path(clang, args.hip_src),
             **aiter_paths(clang, aa.find_objdump())}
    missing = [why for ok, why in ((aa.find_wheel(), aa.WHEEL_MISSING),
                                   (aa.find_objdump(), aa.OBJDUMP_MISSING)) if not ok]
    text, res = amd_table(paths, aa.DEPENDENCY_FACTOR)
    print()
    print(text)
    if missing:
        print("\nAITER's rows incomplete (no time ratios without the asm kernel): "
              + "; ".join(missing))
    out.update({n: {f: r[f] for f in JSON_FIELDS + ["dependency_factor"]} for n, r in res.items()})
    write_json(f"per path {', '.join(JSON_FIELDS)}; predicted_pct_bw of one call at 64 x 32k and "
               f"the time ratios with every kernel's instruction time x "
               f"{aa.DEPENDENCY_FACTOR:g} (dependency_factor)"
               + (f"; {nv_note}" if "nvidia" in out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
