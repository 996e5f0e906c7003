# turboquant-fp4: the launch plan of the FP4 paged attention (pa_fp4.py): how long a partition
# is, how many there are, and where each region of the workspace lies, for both architectures.
# Injected into csrc/cpp_itfs/pa/ by `python -m turboquant.integration.aiter.patch` (imported as
# csrc.cpp_itfs.pa.pa_fp4_plan); removed by its --revert. Dependency-free (no torch, no AITER):
# benchmarks/isa_model.py imports this file by path for its call model.
#
# gfx950 (tq_fp4_gfx950_attention.cuh): one kernel, one wave per (row tile, partition, kv
# head) over partitions of `partition_len` tokens (a multiple of the kernel's 128-token step,
# chosen per call by `partition_len` below); the last partition of a row tile to finish
# (counted by the tile's ticket) reduces the tile's rows. Workspace, every region 16-byte
# aligned, in this order:
#   exp_sums, max_logits  float32  [num_tokens, num_heads, max_parts]
#   tmp_out               float32  [num_tokens, num_heads, max_parts, head_size] (O / l)
# Nothing in it outlives the call: any buffer of at least the call's size serves, reused or
# not. The tickets are not in the workspace: uint32 [row_tiles, num_kv_heads]
# (`num_tickets`), an array the launcher keeps per device and stream, zero when allocated and
# left zero by every call.
# gfx942 (tq_fp4_paged_attention.cuh, the LUT kernel): 256-token partitions of 4 waves, and the
# workspace pa_v1 lays out, packed: exp_sums, max_logits (float32), tmp_out (query dtype), each
# [num_tokens, num_heads, max_parts(, head_size)].

from dataclasses import dataclass
from typing import Optional

STEP = 128                  # gfx950: tokens per online-softmax step; partitions are multiples
MAX_PARTITION_LEN = 2048    # gfx950: the longest partition the plan picks ...
MIN_PARTITION_LEN = 256     # ... and the shortest (see partition_len)
GFX942_PARTITION_LEN = 256  # gfx942: tq::kPartition of the old kernel (pa_v1's partition size)
WAVES_PER_SIMD = 1          # gfx950: the partition waves wanted per SIMD ...
SIMDS_PER_CU = 4            # ... of every CU: 1 x 4 x num_cus waves at least, if the call has them
TILE_ROWS = 16              # (query token, head) rows per row tile (the MFMA's 16 columns)
MAX_DECODE_GQA = 16         # a decode tile holds the whole GQA group; larger groups run multi-token
ALIGN = 16                  # every workspace region starts at a multiple of this many bytes
PARTIAL_BYTES = 4           # gfx950: tmp_out's element, fp32 (gfx942: the query dtype's)
ARCHS = ("gfx950", "gfx942")
REGIONS = ("exp_sums", "max_logits", "tmp_out")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _align(n: int) -> int:
    return _ceil_div(n, ALIGN) * ALIGN


def partition_len(row_tiles: int, num_kv_heads: int, max_seq_len: int, num_cus: int) -> int:
    """gfx950: tokens per partition. The largest 128 x 2^k <= 2048 that still gives
    row_tiles x num_kv_heads x ceil(max_seq_len / P) >= 1 wave x 4 SIMDs x num_cus partition
    waves (longer partitions: fewer partials to write and reduce, Q transformed fewer times),
    else 256 (the call cannot fill the GPU: split finely, but not below the length whose
    partials the fused reduce combines faster than it streams them). Both constants are the ISA
    model's choice over its table (benchmarks/isa_model.py, 1-128 sequences x 4k-32k: one wave
    per SIMD and 256 tokens at least are as fast or faster at every shape); an estimate, not a
    measurement."""
    want = WAVES_PER_SIMD * SIMDS_PER_CU * num_cus
    p = MAX_PARTITION_LEN
    while p > MIN_PARTITION_LEN:
        if row_tiles * num_kv_heads * _ceil_div(max_seq_len, p) >= want:
            return p
        p //= 2
    return MIN_PARTITION_LEN


def runs_multi_token(multi_token: bool, gqa_ratio: int) -> bool:
    """Whether the call runs the multi-token instantiation: cu_query_lens given, or a decode whose
    GQA group is larger than a decode tile holds (then one query token per sequence)."""
    return bool(multi_token) or gqa_ratio > MAX_DECODE_GQA


def row_tiles(num_seqs: int, num_tokens: int, gqa_ratio: int, multi_token: bool) -> int:
    """Row tiles of the partition kernel's grid: one per sequence in decode; multi-token, enough for
    every sequence's ceil(q x gqa / 16) tiles (num_seqs + ceil(num_tokens x gqa / 16); spare
    ones exit). multi_token: the instantiation that runs (runs_multi_token)."""
    if not multi_token:
        return num_seqs
    return num_seqs + _ceil_div(num_tokens * gqa_ratio, TILE_ROWS)


def num_partitions(max_seq_len: int, partition_len: int) -> int:
    """Partitions of the grid (at least 1)."""
    return max(1, _ceil_div(max_seq_len, partition_len))


@dataclass(frozen=True)
class Region:
    offset: int  # bytes from the workspace's start
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Plan:
    """One call's launch plan: its partitions and its workspace layout."""

    arch: str
    partition_len: int
    max_parts: int
    row_tiles: int
    multi_token: bool  # the instantiation that runs (runs_multi_token)
    regions: dict  # name -> Region, in REGIONS order
    size: int  # bytes of workspace the call needs

    def offset(self, name: str) -> int:
        """Byte offset of a region (what the launcher passes)."""
        return self.regions[name].offset


def num_tickets(p: Plan, num_kv_heads: int) -> int:
    """gfx950: the reduce's tickets of a call, one per (row tile, kv head)."""
    return p.row_tiles * num_kv_heads


def plan(arch: str, *, num_seqs: int, num_tokens: int, num_heads: int, num_kv_heads: int,
         head_size: int, max_seq_len: int, multi_token: bool, num_cus: Optional[int] = None,
         partition: Optional[int] = None, qo_bytes: int = 2) -> Plan:
    """The plan of one call. multi_token: cu_query_lens given (the GQA > 16 rule is applied here).
    gfx950: partition (tokens per partition) None picks it from num_cus (`partition_len`); a
    given one (a multiple of STEP) is taken as it is, e.g. STEP for the largest workspace any
    plan of the call's shape needs. gfx942: 256-token partitions, pa_v1's packed layout
    (num_cus and partition unused), tmp_out in the query dtype (qo_bytes; gfx950's is fp32)."""
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, "
                         f"got {num_heads}")
    gqa = num_heads // num_kv_heads
    multi = runs_multi_token(multi_token, gqa)
    tiles = row_tiles(num_seqs, num_tokens, gqa, multi)
    rows = num_tokens * num_heads
    if arch == "gfx942":
        parts = num_partitions(max_seq_len, GFX942_PARTITION_LEN)
        partials = rows * parts
        regions = {"exp_sums": Region(0, 4 * partials),
                   "max_logits": Region(4 * partials, 4 * partials),
                   "tmp_out": Region(8 * partials, qo_bytes * partials * head_size)}
        return Plan(arch, GFX942_PARTITION_LEN, parts, tiles, multi, regions,
                    regions["tmp_out"].end)
    if partition is None:
        if num_cus is None:
            raise ValueError("num_cus: expected the GPU's compute units (or a partition)")
        partition = partition_len(tiles, num_kv_heads, max_seq_len, num_cus)
    if partition < STEP or partition % STEP:
        raise ValueError(f"partition: expected a multiple of {STEP} tokens, got {partition}")
    parts = num_partitions(max_seq_len, partition)
    partials = rows * parts
    sizes = {"exp_sums": 4 * partials, "max_logits": 4 * partials,
             "tmp_out": PARTIAL_BYTES * partials * head_size}
    regions, off = {}, 0
    for name, n in sizes.items():
        regions[name] = Region(off, n)
        off = _align(off + n)
    return Plan(arch, partition, parts, tiles, multi, regions, off)


def workspace_size(arch: str, **kwargs) -> int:
    """Bytes of workspace one call needs (plan(arch, **kwargs).size)."""
    return plan(arch, **kwargs).size
