"""The AITER launcher's plan (turboquant/integration/aiter/files/pa_fp4_plan.py, shipped into
AITER as csrc.cpp_itfs.pa.pa_fp4_plan): the partition length per call, the grid's row tiles and
partitions, and the workspace layout of both architectures. Dependency-free, so it is loaded here
by path, by benchmarks/isa_model.py's loader."""
from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from isa_model import PLAN_FILE, plan_module  # noqa: E402 - the one loader of the plan

P = plan_module()
LENGTHS = (128, 256, 512, 1024, 2048)
BATCHES = (1, 17, 128)
CONTEXTS = (1, 97, 4096, 32768)
CUS = (80, 256, 304)  # MI308X-like, MI355X, MI300X


def test_dependency_free():
    """Only the standard library: isa_model imports it by path, AITER beside pa_fp4.py."""
    text = PLAN_FILE.read_text()
    imports = {line.split()[1].split(".")[0] for line in text.splitlines()
               if line.startswith(("import ", "from "))}
    assert imports <= {"dataclasses", "typing"}, imports
    assert "turboquant" in text[:400]  # the patch's test of its own files (patch._is_ours)


def _spec_partition_len(tiles, kvh, ctx, cus):
    """The rule as the brief states it, by brute force over every candidate."""
    fits = [p for p in LENGTHS if p >= 256 and tiles * kvh * math.ceil(ctx / p) >= 4 * cus]
    return max(fits) if fits else 256


@pytest.mark.parametrize("cus", CUS)
def test_partition_len_rule(cus):
    """Batch 1, 17, 128 x contexts 1, 97, 4k, 32k x kv heads 1, 8 x decode and multi-token row
    tiles (4 query tokens per sequence at GQA 8): the largest 128 x 2^k <= 2048 whose grid still
    has a wave per SIMD of every CU, else 256 (never 128); the next longer one would not have
    them."""
    for b, ctx, kvh, q in itertools.product(BATCHES, CONTEXTS, (1, 8), (None, 4)):
        tiles = P.row_tiles(b, b if q is None else b * q, 8, q is not None)
        p = P.partition_len(tiles, kvh, ctx, cus)
        assert p == _spec_partition_len(tiles, kvh, ctx, cus), (b, ctx, kvh, q, cus)
        waves = tiles * kvh * math.ceil(ctx / p)
        assert p in LENGTHS and p >= 256
        assert p == 256 or waves >= 4 * cus
        if p < 2048:
            assert tiles * kvh * math.ceil(ctx / (2 * p)) < 4 * cus


@pytest.mark.parametrize("tiles, kvh, ctx, cus, want", [
    (1, 8, 65536, 256, 512),      # 8 x 128 partitions of 512 = 1024 waves = 1 x 4 x 256
    (1, 8, 32768, 256, 256),      # 8 x 128 of 256: just enough at 256
    (1, 8, 65537, 256, 512),      # 8 x 129 of 512 >= 1024; at 1024: 8 x 65 < 1024
    (1, 8, 4096, 256, 256),       # never enough: the shortest (256, not 128)
    (1, 1, 1, 304, 256),          # one token
    (17, 8, 4096, 80, 1024),      # 17 x 8 x 4 = 544 >= 320; at 2048: 272 < 320
    (17, 8, 97, 80, 256),         # 136 waves whatever P: the shortest
    (128, 8, 97, 80, 2048),       # 1024 waves >= 320 with one partition
    (128, 8, 32768, 304, 2048),   # 16384 >= 1216
    (16, 8, 4096, 256, 512),      # 128 x 8 = 1024
    (16, 8, 32768, 256, 2048),
    (128, 1, 4096, 256, 512),     # 128 x 8 = 1024
    (128, 1, 0, 256, 256),        # no keys at all
])
def test_partition_len_values(tiles, kvh, ctx, cus, want):
    assert P.partition_len(tiles, kvh, ctx, cus) == want


def test_row_tiles():
    assert P.row_tiles(5, 5, 8, False) == 5
    assert P.row_tiles(2, 5, 4, True) == 2 + 2          # ceil(5 x 4 / 16)
    assert P.row_tiles(3, 17, 1, True) == 3 + 2         # ceil(17 / 16)
    # a decode whose GQA group exceeds a tile's 16 columns runs the multi-token kernel
    assert not P.runs_multi_token(False, 16) and P.runs_multi_token(False, 17)
    assert P.runs_multi_token(True, 1)
    plan = P.plan("gfx950", num_seqs=3, num_tokens=3, num_heads=32, num_kv_heads=1,
                  head_size=64, max_seq_len=100, multi_token=False, num_cus=256)
    assert plan.multi_token and plan.row_tiles == 3 + 6


SHAPES = [  # num_seqs, num_tokens (None: decode), num_heads, num_kv_heads, head_size, max_seq_len
    (1, None, 64, 8, 128, 4096), (17, None, 64, 8, 128, 97), (128, None, 64, 8, 128, 32768),
    (3, None, 8, 2, 64, 1), (2, 5, 8, 2, 256, 33), (17, 40, 32, 8, 128, 4097),
    (1, None, 32, 1, 64, 300), (5, 7, 3, 1, 128, 129), (1, None, 1, 1, 64, 0),
]


def _plans(shape, arch, **kw):
    seqs, tokens, heads, kvh, d, ctx = shape
    args = dict(num_seqs=seqs, num_tokens=seqs if tokens is None else tokens, num_heads=heads,
                num_kv_heads=kvh, head_size=d, max_seq_len=ctx, multi_token=tokens is not None)
    for cus in CUS:
        yield P.plan(arch, num_cus=cus, **args, **kw), args


def _check_disjoint(plan, aligned):
    spans = sorted((r.offset, r.end, name) for name, r in plan.regions.items())
    for (a0, a1, na), (b0, b1, nb) in zip(spans, spans[1:]):
        assert a1 <= b0, f"{na} [{a0}, {a1}) overlaps {nb} [{b0}, {b1})"
    assert spans[0][0] >= 0 and spans[-1][1] <= plan.size
    if aligned:
        assert all(r.offset % 16 == 0 for r in plan.regions.values()), plan.regions


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gfx950_workspace_layout(shape):
    """Regions in order, disjoint, 16-byte aligned, each as large as its tensor, the partitions
    covering max_seq_len; the size the sum; one ticket per (row tile, kv head), kept apart."""
    for plan, a in _plans(shape, "gfx950"):
        assert list(plan.regions) == list(P.REGIONS)
        _check_disjoint(plan, aligned=True)
        rows = a["num_tokens"] * a["num_heads"]
        assert plan.max_parts * plan.partition_len >= a["max_seq_len"]
        assert plan.max_parts == max(1, math.ceil(a["max_seq_len"] / plan.partition_len))
        partials = rows * plan.max_parts
        want = {"exp_sums": 4 * partials, "max_logits": 4 * partials,
                "tmp_out": 4 * partials * a["head_size"]}
        assert {n: r.nbytes for n, r in plan.regions.items()} == want
        assert plan.regions["tmp_out"].end <= plan.size < plan.regions["tmp_out"].end + 16
        assert plan.offset("tmp_out") == plan.regions["tmp_out"].offset
        assert P.num_tickets(plan, a["num_kv_heads"]) == plan.row_tiles * a["num_kv_heads"]
        assert P.workspace_size("gfx950", num_cus=256, **a) == P.plan(
            "gfx950", num_cus=256, **a).size


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gfx942_workspace_is_pa_v1s(shape):
    """gfx942 keeps the old kernel's workspace: 256-token partitions, exp_sums, max_logits,
    tmp_out packed as pa_v1 lays them out (the size pa_v1's callers allocate), nothing else."""
    for plan, a in _plans(shape, "gfx942"):
        parts = max(1, math.ceil(a["max_seq_len"] / 256))
        partials = a["num_tokens"] * a["num_heads"] * parts
        assert (plan.partition_len, plan.max_parts) == (256, parts)
        assert {n: (r.offset, r.nbytes) for n, r in plan.regions.items()} == {
            "exp_sums": (0, 4 * partials), "max_logits": (4 * partials, 4 * partials),
            "tmp_out": (8 * partials, 2 * partials * a["head_size"])}
        assert plan.size == partials * (2 * 4 + 2 * a["head_size"])
        _check_disjoint(plan, aligned=False)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shortest_partition_bounds_every_plan(shape):
    """workspace_size(..., partition=128) is at least what any num_cus's plan needs: a buffer of
    that size serves them all."""
    seqs, tokens, heads, kvh, d, ctx = shape
    args = dict(num_seqs=seqs, num_tokens=seqs if tokens is None else tokens, num_heads=heads,
                num_kv_heads=kvh, head_size=d, max_seq_len=ctx, multi_token=tokens is not None)
    bound = P.workspace_size("gfx950", partition=128, **args)
    plans = [P.plan("gfx950", partition=p, **args) for p in LENGTHS]
    plans += [P.plan("gfx950", num_cus=c, **args) for c in CUS]
    assert max(plan.size for plan in plans) == bound


def test_smaller_calls_fit_a_buffer_sized_for_more():
    """A buffer sized for 64 sequences at the shortest partition holds the plan of any smaller
    decode batch."""
    big = dict(num_heads=64, num_kv_heads=8, head_size=128, max_seq_len=32768, multi_token=False)
    bound = P.workspace_size("gfx950", num_seqs=64, num_tokens=64, partition=128, **big)
    for b in (1, 2, 17, 63, 64):
        plan = P.plan("gfx950", num_seqs=b, num_tokens=b, num_cus=256, **big)
        assert plan.size <= bound


def test_plan_refusals():
    a = dict(num_seqs=1, num_tokens=1, num_heads=8, num_kv_heads=2, head_size=128,
             max_seq_len=100, multi_token=False)
    with pytest.raises(ValueError, match="arch: expected one of"):
        P.plan("gfx90a", num_cus=256, **a)
    with pytest.raises(ValueError, match="partition: expected a multiple of 128"):
        P.plan("gfx950", partition=192, **a)
    with pytest.raises(ValueError, match="num_cus"):
        P.plan("gfx950", **a)
    with pytest.raises(ValueError, match="num_heads: expected a multiple of num_kv_heads=3"):
        P.plan("gfx950", num_cus=256, **{**a, "num_kv_heads": 3})
