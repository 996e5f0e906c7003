"""The SM120 kernels on a GPU: layout probes of each MMA instruction and attention against the
reference, in two builds of the same source:

- ``emulated`` (marker ``gpu``, needs an sm_90 GPU, e.g. H100): the MMA wrappers replaced by
  the software model of each instruction (csrc_cuda/sm120/mma_sm120.cuh);
- ``real`` (marker ``sm120``, needs an SM120-family GPU, e.g. RTX 50xx): the real
  ``mma.sync ... block_scale`` instructions. ``pytest -m sm120`` on such a GPU checks every
  layout assumption (fragments, scale lanes and bytes, encodings) in one command.

The probes' expected results come from an independent Python transcription of the PTX ISA's
fragment layouts (below), not from the C++ layout functions; the probes cover kind::mxf8f6f4
e4m3 x e2m1 and e4m3 x e4m3 (K8V4's QK^T: B holds E4M3 bytes as they are) and kind::mxf4.

Attention tolerance, per output element (derived, not tuned): the kernel rounds Q to E4M3
with one E8M0 scale per 32 elements and P*sV to E4M3 with one scale per (row, 32 keys);
everything else (FP4 K/V with power-of-two scales, fp32 MMA accumulation, softmax) is exact up
to fp32 rounding. So
    |out - ref| <= |ref_q8 - ref|                       Q's rounding, measured exactly: ref_q8
                                                          is the reference on the E4M3-rounded Q
                 + 2^-4 * sum_k w_k |v_k|                P's rounding: E4M3 round-to-nearest has
                                                          relative error <= 2^-4 per element; the
                                                          row sum uses unrounded P; w = softmax(q8)
                 + 1.5e-4 * max|v|                       E4M3 subnormals within a 32-key chunk:
                                                          absolute error < chunk max * 2^-10 / 224
                 + 2^-8 * (|ref| + the above)            the kernel's bf16/fp16 output rounding
                 + 1e-5 * sum_k w_k |v_k| + 1e-6         fp32 exp2 / accumulation order
``sum_k w_k |v_k|`` is the reference run on the same cache with V's sign bits cleared.
K8V4 caches (E4M3 keys, ``test_k8v4_*``) take the same bound: E4M3 key bytes times a power of
two decode exactly in fp32, as FP4 codes do.

With the transforms (rotation, key smoothing, sink: ``check_transformed``) the kernel rounds q'
= rotate(q * lam) to E4M3 and accumulates in the rotated space, so the same bound is taken
there, per rotated channel: the kernel's output is rotated back (an exact orthogonal map up to
fp32 rounding) and compared with a dense fp32 model of the kernel's arithmetic
(``transformed_terms``: exact q', E4M3 q', and |V'| weights; the sink logit from the fp32 q', as
the kernel does), which is itself checked against ``turboquant.reference``. The output's
bf16/fp16 rounding happens after the un-rotation, so in the rotated space it is bounded by
``2^-8 * D^-0.5 * sum_c |out_c|`` per row instead of ``2^-8 |out|`` per element.
"""
from __future__ import annotations

import math

import pytest
import torch

import dataclasses

from turboquant.api import prepare_attention
from turboquant.calls import attention_op_args, make_attention_call
from turboquant.shared_state import call_with_records
from turboquant.config import PER_SEQUENCE, PLAIN, QuantConfig
from turboquant._backends import sm120
from turboquant.reference import _gather_tokens, attention_reference
from turboquant.rotation import rotate, unrotate
from turboquant.smoothing import KEY_CENTER, KEY_SCALE, SINK_KEY, SINK_VALUE


def _capability():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


BUILDS = [
    pytest.param(True, id="emulated", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(_capability() != (9, 0), reason="the emulation build is sm_90a (H100/H200)")]),
    pytest.param(False, id="real", marks=[
        pytest.mark.sm120,
        pytest.mark.skipif(_capability()[0] != 12, reason="needs an SM120-family GPU (compute capability 12.x)")]),
]


@pytest.fixture(scope="module", params=BUILDS)
def ops(request):
    emulate = request.param
    reason = sm120.load_extension(emulate=emulate)
    assert reason is None, reason
    attention, probe = sm120.op_names(emulate)
    ns = torch.ops.turboquant
    return getattr(ns, attention.split("::")[1]), getattr(ns, probe.split("::")[1])


# ------------------------------------------------------------------------------------------
# Layout probes. PTX ISA 9.7.14.5.10 / .11 and 9.7.14.3, lane = 4 g + t.
# ------------------------------------------------------------------------------------------
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1(code):
    return -FP4[code & 7] if code & 8 else FP4[code & 7]


def e4m3(byte):
    e, m = (byte >> 3) & 15, byte & 7
    v = m * 2.0 ** -9 if e == 0 else (8 + m) * 2.0 ** (e - 10)
    return -v if byte & 0x80 else v


def e4m3_any(gen):
    """Any E4M3 byte but the two NaNs (0x7F, 0xFF): subnormals, both signs, +-448."""
    b = torch.randint(0, 256, (1,), generator=gen).item()
    return b ^ 1 if b & 0x7F == 0x7F else b


KINDS = {
    # kind id, K, B's element type, selector sets {0: (0,0,0,0), 1: ...} as built into the probe kernel
    "mxf8f6f4_e4m3_e2m1_k32": (0, 32, "e2m1", {0: (0, 0, 0, 0), 1: (3, 1, 2, 3)}),
    "mxf4_e2m1_e2m1_k64": (1, 64, "e2m1", {0: (0, 0, 0, 0), 1: (2, 1, 2, 3)}),
    "mxf8f6f4_e4m3_e4m3_k32": (2, 32, "e4m3", {0: (0, 0, 0, 0), 1: (3, 1, 2, 3)}),  # K8V4's QK^T
}


def a_slot(kind_k, lane, r, e):
    """(row, k) of element e of A register r (8-bit elements for k32, nibbles for k64)."""
    g, t = lane // 4, lane % 4
    per = 4 if kind_k == 32 else 8
    return g + 8 * (r % 2), per * t + e + (kind_k // 2) * (r // 2)


def b_slot(kind_k, lane, r, e):
    """(k, column) of element e of B register r."""
    g, t = lane // 4, lane % 4
    per = 4 if kind_k == 32 else 8
    return per * t + e + (kind_k // 2) * r, g


def pack(kind_k, b_type, A, B, sa, sb, sel):
    """Matrices (codes) and scale bytes [rows/cols][k/32] -> per-lane registers. k32
    (kind::mxf8f6f4): one 8-bit container per element, an e2m1 code in bits 5..2 or an e4m3
    byte as it is; k64 (kind::mxf4): packed nibbles, the lower k in the low nibble."""
    bid_a, tid_a, bid_b, tid_b = sel
    a = [[0] * 4 for _ in range(32)]
    b = [[0] * 2 for _ in range(32)]
    sfa = [0xFFFFFFFF] * 32  # unused bytes NaN: reading a wrong one shows
    sfb = [0xFFFFFFFF] * 32
    for lane in range(32):
        for r in range(4):
            for e in range(4 if kind_k == 32 else 8):
                row, k = a_slot(kind_k, lane, r, e)
                a[lane][r] |= A[row][k] << (8 * e) if kind_k == 32 else A[row][k] << (4 * e)
        for r in range(2):
            for e in range(4 if kind_k == 32 else 8):
                k, col = b_slot(kind_k, lane, r, e)
                if kind_k == 64:
                    b[lane][r] |= B[k][col] << (4 * e)
                elif b_type == "e4m3":
                    b[lane][r] |= B[k][col] << (8 * e)
                else:
                    b[lane][r] |= B[k][col] << (8 * e + 2)
    for row in range(16):
        lane = 4 * (row % 8) + 2 * tid_a + row // 8
        for ch in range(kind_k // 32):
            sh = 8 * (bid_a + ch)
            sfa[lane] = (sfa[lane] & ~(0xFF << sh)) | (sa[row][ch] << sh)
    for col in range(8):
        lane = 4 * col + tid_b
        for ch in range(kind_k // 32):
            sh = 8 * (bid_b + ch)
            sfb[lane] = (sfb[lane] & ~(0xFF << sh)) | (sb[col][ch] << sh)

    def i32(x):
        return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in x], dtype=torch.int32)

    return (i32(sum(a, [])).view(32, 4).cuda(), i32(sum(b, [])).view(32, 2).cuda(), i32(sfa).cuda(),
            i32(sfb).cuda())


def expected(kind_k, b_type, A, B, sa, sb):
    decode_a = e4m3 if kind_k == 32 else e2m1
    decode_b = e4m3 if b_type == "e4m3" else e2m1
    D = [[0.0] * 8 for _ in range(16)]
    for r in range(16):
        for n in range(8):
            D[r][n] = sum(decode_a(A[r][k]) * decode_b(B[k][n]) * 2.0 ** (sa[r][k // 32] - 127)
                          * 2.0 ** (sb[n][k // 32] - 127) for k in range(kind_k))
    return torch.tensor(D, dtype=torch.float64)


def run_probe(probe, kind, kind_k, b_type, sel_id, sel, A, B, sa, sb):
    a, b, sfa, sfb = pack(kind_k, b_type, A, B, sa, sb, sel)
    d = probe(a, b, sfa, sfb, torch.zeros(32, 4, device="cuda"), kind, sel_id).cpu().double()
    out = torch.empty(16, 8, dtype=torch.float64)
    for lane in range(32):
        for i in range(4):  # C/D: row g + 8 (i // 2), column 2 t + i % 2
            out[lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2] = d[lane, i]
    return out


def random_operands(kind_k, b_type, gen):
    def rnd(n):
        return torch.randint(0, n, (1,), generator=gen).item()

    def e4m3_in_range():  # exponent field 5..9: e4m3 x e4m3 products are multiples of 2^-10
        return (rnd(2) << 7) | ((5 + rnd(5)) << 3) | rnd(8)  # below 2^6, so sums stay exact in fp32
    if kind_k == 32:
        A = [[e4m3_in_range() for _ in range(32)] for _ in range(16)]
    else:
        A = [[rnd(16) for _ in range(64)] for _ in range(16)]
    if b_type == "e4m3":
        B = [[e4m3_in_range() for _ in range(8)] for _ in range(kind_k)]
    else:
        B = [[rnd(16) for _ in range(8)] for _ in range(kind_k)]
    return A, B


@pytest.mark.parametrize("sel_id", [0, 1])
@pytest.mark.parametrize("name", sorted(KINDS))
def test_probe_identity_and_exact_values(ops, name, sel_id):
    _, probe = ops
    kind, kind_k, b_type, sels = KINDS[name]
    gen = torch.Generator().manual_seed(17 + sel_id)
    chunks = kind_k // 32
    one_b = 0x38 if b_type == "e4m3" else 2  # 1.0
    # identity A: D = B's first 16 rows, each element where the layout says (e4m3 B: every
    # byte value but NaN, subnormals included)
    A = [[0] * kind_k for _ in range(16)]
    for r in range(16):
        A[r][r] = 0x38 if kind_k == 32 else 2  # 1.0
    if b_type == "e4m3":
        B = [[e4m3_any(gen) for _ in range(8)] for _ in range(kind_k)]
    else:
        _, B = random_operands(kind_k, b_type, gen)
    ones_a, ones_b = [[127] * chunks for _ in range(16)], [[127] * chunks for _ in range(8)]
    got = run_probe(probe, kind, kind_k, b_type, sel_id, sels[sel_id], A, B, ones_a, ones_b)
    assert torch.equal(got, expected(kind_k, b_type, A, B, ones_a, ones_b)), "identity A"
    # identity B: D = A's first 8 columns
    A, _ = random_operands(kind_k, b_type, gen)
    B = [[one_b if k == n else 0 for n in range(8)] for k in range(kind_k)]
    got = run_probe(probe, kind, kind_k, b_type, sel_id, sels[sel_id], A, B, ones_a, ones_b)
    assert torch.equal(got, expected(kind_k, b_type, A, B, ones_a, ones_b)), "identity B"
    # exactly representable random values and scales: exact results
    for _ in range(3):
        A, B = random_operands(kind_k, b_type, gen)
        lo, span = (125, 5) if kind_k == 64 else (120, 15)
        sa = [[lo + torch.randint(0, span, (1,), generator=gen).item() for _ in range(chunks)] for _ in range(16)]
        sb = [[lo + torch.randint(0, span, (1,), generator=gen).item() for _ in range(chunks)] for _ in range(8)]
        got = run_probe(probe, kind, kind_k, b_type, sel_id, sels[sel_id], A, B, sa, sb)
        assert torch.equal(got, expected(kind_k, b_type, A, B, sa, sb)), "random exact"


@pytest.mark.parametrize("sel_id", [0, 1])
@pytest.mark.parametrize("name", sorted(KINDS))
def test_probe_one_lanes_scale_byte(ops, name, sel_id):
    """Scale byte 128 (x2) for one row of A (one column of B) at a time: only that row (column)
    of D doubles, which pins which lane and byte carry each row's (column's) scale."""
    _, probe = ops
    kind, kind_k, b_type, sels = KINDS[name]
    gen = torch.Generator().manual_seed(5)
    A, B = random_operands(kind_k, b_type, gen)
    chunks = kind_k // 32
    base_a, base_b = [[127] * chunks for _ in range(16)], [[127] * chunks for _ in range(8)]
    for row in range(16):
        for ch in range(chunks):
            sa = [list(x) for x in base_a]
            sa[row][ch] = 128
            got = run_probe(probe, kind, kind_k, b_type, sel_id, sels[sel_id], A, B, sa, base_b)
            assert torch.equal(got, expected(kind_k, b_type, A, B, sa, base_b)), f"A row {row} chunk {ch}"
    for col in range(8):
        for ch in range(chunks):
            sb = [list(x) for x in base_b]
            sb[col][ch] = 128
            got = run_probe(probe, kind, kind_k, b_type, sel_id, sels[sel_id], A, B, base_a, sb)
            assert torch.equal(got, expected(kind_k, b_type, A, B, base_a, sb)), f"B column {col} chunk {ch}"


# ------------------------------------------------------------------------------------------
# Attention against the reference.
# ------------------------------------------------------------------------------------------
def make_problem(lens, hq, hkv, d, bs, *, qlens=None, per32=False, dtype=torch.bfloat16, seed=0,
                 k_scales=(123, 128), v_scales=(118, 133), k8v4=False):
    """Random codes and scale bytes straight into a paged cache; every slot no sequence owns
    (tails of last blocks, spare blocks) is poisoned with 0xFF (codes -6, scales NaN).
    ``k8v4``: a K8V4 cache, random E4M3 key bytes (every byte but the two NaNs, which the
    writer never stores; poisoned slots hold 0xFF, NaN) as float8_e4m3fn [.., D]."""
    gen = torch.Generator().manual_seed(seed)
    nblk = [math.ceil(n / bs) for n in lens]
    total = sum(nblk) + 2
    ids = torch.randperm(total, generator=gen)
    shape = (total, hkv, bs, d // 2)
    kc = torch.randint(0, 256, shape[:3] + ((d,) if k8v4 else (d // 2,)), generator=gen, dtype=torch.uint8)
    if k8v4:
        kc = torch.where(kc & 0x7F == 0x7F, kc ^ 1, kc)
    vc = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    sshape = (total, bs, hkv) + ((d // 32,) if per32 else ())
    ks = torch.randint(k_scales[0], k_scales[1] + 1, sshape, generator=gen, dtype=torch.uint8)
    vs = torch.randint(v_scales[0], v_scales[1] + 1, sshape, generator=gen, dtype=torch.uint8)
    width = max(max(nblk), 1) + 1
    tables = torch.full((len(lens), width), int(ids[-1]), dtype=torch.int32)
    owned = torch.zeros(total, bs, dtype=torch.bool)
    at = 0
    for s, n in enumerate(lens):
        for i in range(nblk[s]):
            blk = int(ids[at])
            tables[s, i] = blk
            owned[blk, : min(bs, n - i * bs)] = True
            at += 1
    for c in (kc, vc):
        c.permute(0, 2, 1, 3)[~owned] = 0xFF
    for sc in (ks, vs):
        sc[~owned] = 0xFF
    ntok = len(lens) if qlens is None else sum(qlens)
    q = torch.randn(ntok, hq, d, generator=gen).to(dtype)
    cu = None if qlens is None else torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if k8v4:
        kc = kc.view(torch.float8_e4m3fn)
    return dict(query=q.cuda(), key_cache=kc.cuda(), value_cache=vc.cuda(), key_scales=ks.cuda(),
                value_scales=vs.cuda(), block_tables=tables.cuda(), seq_lens=seq_lens.cuda(),
                cu_query_lens=None if cu is None else cu.cuda())


def _call(pr, query=None, value_cache=None, **kw):
    return make_attention_call(query if query is not None else pr["query"], pr["key_cache"],
                               value_cache if value_cache is not None else pr["value_cache"],
                               pr["key_scales"], pr["value_scales"], pr["block_tables"],
                               pr["seq_lens"], kw.get("scale", pr["query"].shape[-1] ** -0.5),
                               pr["cu_query_lens"], kw.get("sliding_window", 0),
                               kw.get("logits_soft_cap", 0.0), check_values=False)


def reference_f32(pr, **kw):
    call = _call(pr, **kw)
    out = torch.empty(call.query.shape, dtype=torch.float32, device="cuda")
    attention_reference(call, out)
    return out


def fp8_round_query(q):
    """The kernel's Q rounding: E4M3 (round to nearest even) with one E8M0 scale per 32
    elements, the smallest power of two 2^e with amax <= 448 * 2^e."""
    t, h, d = q.shape
    x = q.float().view(t, h, d // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    m, e = torch.frexp(amax)
    ex = torch.where(m <= 0.875, e - 9, e - 8).clamp(-127, 127)
    ex = torch.where(amax > 0, ex, torch.zeros_like(ex))
    s = torch.ldexp(torch.ones_like(amax), ex)
    return ((x / s).to(torch.float8_e4m3fn).float() * s).view(t, h, d)


def run_kernel(op, pr, **kw):
    call = _call(pr, **kw)
    out = torch.empty_like(pr["query"])
    op(*attention_op_args(call, out))
    torch.cuda.synchronize()
    return out


def check_against_reference(op, pr, label, **kw):
    out = run_kernel(op, pr, **kw).float()
    ref = reference_f32(pr, **kw)
    q8 = fp8_round_query(pr["query"]).to(torch.bfloat16)
    ref_q8 = reference_f32(pr, query=q8, **kw)
    abs_v = reference_f32(pr, query=q8, value_cache=pr["value_cache"] & 0x77, **kw)
    vmax = 6.0 * 2.0 ** (pr["value_scales"][pr["value_scales"] != 255].float().max().item() - 127)
    bound = (ref_q8 - ref).abs() + 2.0 ** -4 * abs_v + 1.5e-4 * vmax
    tol = bound * (1 + 2.0 ** -8) + 2.0 ** -8 * ref.abs() + 1e-5 * abs_v + 1e-6
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref)
    assert torch.equal(nan_out, nan_ref), f"{label}: NaN pattern differs"
    fin = ~nan_ref
    err = (out - ref).abs()[fin]
    ratio = (err / tol[fin]).max().item() if err.numel() else 0.0
    q_only = (ref_q8 - ref).abs()[fin]
    print(f"{label}: max|out-ref| {err.max().item() if err.numel() else 0:.3e}  "
          f"max|ref| {ref[fin].abs().max().item() if err.numel() else 0:.3e}  "
          f"max|ref_q8-ref| {q_only.max().item() if err.numel() else 0:.3e}  "
          f"max err/tol {ratio:.3f}")
    assert ratio <= 1.0, f"{label}: error exceeds the derived tolerance (max err/tol {ratio:.3f})"
    return out, ref


FOUNDATION_SHAPES = [
    # (label, lens, hq, hkv, d, bs)
    ("8B batch1 ctx1k", [1024], 32, 8, 128, 16),
    ("8B batch4 ctx<=4k", [4096, 1, 2500, 777], 32, 8, 128, 16),
    ("8B batch128 ctx<=1k", None, 32, 8, 128, 16),
    ("70B batch2 ctx32k", [32768, 9000], 64, 8, 128, 16),
]


@pytest.mark.parametrize("shape", FOUNDATION_SHAPES, ids=[s[0] for s in FOUNDATION_SHAPES])
def test_attention_foundation_shapes(ops, shape):
    label, lens, hq, hkv, d, bs = shape
    if lens is None:
        lens = torch.randint(1, 1025, (128,), generator=torch.Generator().manual_seed(3)).tolist()
    check_against_reference(ops[0], make_problem(lens, hq, hkv, d, bs, seed=len(lens)), label)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("per32", [False, True], ids=["scale-per-head", "scale-per-32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_attention_head_dims_scales_dtypes(ops, d, per32, dtype):
    pr = make_problem([1, 54, 97, 0, 300, 17], 8, 2, d, 32, per32=per32, dtype=dtype, seed=d)
    check_against_reference(ops[0], pr, f"d{d} per32={per32} {dtype}")


@pytest.mark.parametrize("per32", [False, True], ids=["scale-per-head", "scale-per-32"])
def test_attention_multi_token_window_softcap(ops, per32):
    lens, qlens = [40, 300, 5, 129, 1000], [3, 7, 5, 1, 0]
    pr = make_problem(lens, 16, 4, 128, 16, qlens=qlens, per32=per32, seed=11)
    check_against_reference(ops[0], pr, "multi-token")
    check_against_reference(ops[0], pr, "multi-token window 100", sliding_window=100)
    check_against_reference(ops[0], pr, "multi-token softcap 5", logits_soft_cap=5.0)
    # GQA group 16 with 7 query tokens: 112 rows, 7 tiles
    pr = make_problem([500, 77], 32, 2, 64, 64, qlens=[7, 2], per32=per32, seed=12)
    check_against_reference(ops[0], pr, "multi-token group 16")


@pytest.mark.parametrize("scale_group", [None, 32], ids=["scale-per-head", "scale-per-32"])
def test_attention_cache_written_from_gaussian_kv(ops, scale_group):
    """Realistic data: Gaussian K/V written by the reference cache writer (Llama-3-8B heads)."""
    from turboquant.cache import build_paged_problem

    gen = torch.Generator().manual_seed(41)
    lens = [2048, 1000, 17, 3000]
    prob = build_paged_problem(lens, 8, 128, 16, device="cuda", scale_group=scale_group, spare_blocks=2,
                               generator=gen, write_backend="reference", config=PLAIN)
    kc, vc, ks, vs = prob.cache
    pr = dict(query=torch.randn(len(lens), 32, 128, generator=gen).to(torch.bfloat16).cuda(), key_cache=kc,
              value_cache=vc, key_scales=ks, value_scales=vs, block_tables=prob.block_tables,
              seq_lens=prob.seq_lens, cu_query_lens=None)
    check_against_reference(ops[0], pr, f"gaussian kv, scale group {scale_group or 128}")

# ------------------------------------------------------------------------------------------
# The transforms (rotation, key smoothing, sink), fused into the kernel.
# ------------------------------------------------------------------------------------------
def transformed_terms(call):
    """A dense fp32 model of what the kernel computes for ``call``, in the rotated space (before
    the un-rotation): float32 [3, num_tokens, num_heads, D] = (exact: fp32 q'; q8: q' rounded
    to E4M3 as the kernel does, the sink logit from the fp32 q'; abs_v: the q8 weights on |V'|).
    Rows of a sequence whose slot lies outside seq_state are NaN, rows with seq_len 0 zero."""
    hkv, d, nh = call.num_kv_heads, call.head_dim, call.num_heads
    g = nh // hkv
    group = None if call.scale_group == d else call.scale_group
    lens = call.seq_lens.tolist()
    starts = list(range(call.num_seqs + 1)) if call.cu_query_lens is None else call.cu_query_lens.tolist()
    dev = call.query.device
    out = torch.zeros(3, call.query.shape[0], nh, d, device=dev)
    for s in range(call.num_seqs):
        q0, q1 = starts[s], starts[s + 1]
        nq, n = q1 - q0, lens[s]
        if nq == 0 or n == 0:
            continue
        q = call.query[q0:q1].float()  # [nq, H, D]
        rec = None
        if call.seq_state is not None:
            slot = int(call.state_ids[s])
            if not 0 <= slot < call.seq_state.shape[0]:
                out[:, q0:q1] = float("nan")
                continue
            rec = call.seq_state[slot].repeat_interleave(g, 0)  # [H, 5, D]
        qp = q * rec[:, KEY_SCALE] if rec is not None else q
        if call.rotation_signs is not None:
            qp = rotate(qp, call.rotation_signs)
        q8 = fp8_round_query(qp)
        blocks = call.block_tables[s]
        k = _gather_tokens(call.key_cache, call.key_scales, blocks, group, 0, n, call.block_size)
        v = _gather_tokens(call.value_cache, call.value_scales, blocks, group, 0, n, call.block_size)
        if call.sink:
            k[:, 0], v[:, 0] = call.seq_state[slot][:, SINK_KEY], call.seq_state[slot][:, SINK_VALUE]
        v = torch.where(torch.isfinite(v), v, 0.0)  # masked keys only (rows that see one are NaN in ref)
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)  # [H, n, D]
        logits = torch.einsum("qhd,hnd->qhn", qp, k)
        logits8 = torch.einsum("qhd,hnd->qhn", q8, k)
        if call.sink:
            logits8[..., 0] = logits[..., 0]
        if rec is not None and call.logits_soft_cap > 0:
            q_dot_m = (q * rec[:, KEY_CENTER]).sum(-1, keepdim=True)  # original q
            logits, logits8 = logits + q_dot_m, logits8 + q_dot_m
        pos = torch.arange(n - nq, n, device=dev)
        key_pos = torch.arange(n, device=dev)
        visible = key_pos[None, :] <= pos[:, None]
        if call.sliding_window > 0:
            visible &= key_pos[None, :] > pos[:, None] - call.sliding_window
        for i, (lg, vv) in enumerate(((logits, v), (logits8, v), (logits8, v.abs()))):
            lg = lg * call.scale
            if call.logits_soft_cap > 0:
                lg = call.logits_soft_cap * torch.tanh(lg / call.logits_soft_cap)
            lg = lg.masked_fill(~visible[:, None, :], float("-inf"))
            out[i, q0:q1] = torch.einsum("qhn,hnd->qhd", torch.softmax(lg, dim=-1), vv)
    return out


def run_call(op, call):
    out = torch.empty_like(call.query)
    op(*attention_op_args(call, out))
    torch.cuda.synchronize()
    return out


def check_transformed(op, call, label):
    """The kernel on ``call`` (transforms included) against the reference, with the derived
    tolerance taken in the rotated space (module docstring). Returns (out, reference fp32)."""
    out = run_call(op, call)
    ref = torch.empty(call.query.shape, dtype=torch.float32, device="cuda")
    attention_reference(call, ref)
    nan_ref = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan_ref), f"{label}: NaN pattern differs"
    fin = ~nan_ref
    exact, r8, abs_v = transformed_terms(call)
    signs = call.rotation_signs
    to_rotated = (lambda x: rotate(x, signs)) if signs is not None else (lambda x: x.float())
    # the dense model is the reference's arithmetic
    back = unrotate(exact, signs) if signs is not None else exact
    torch.testing.assert_close(back[fin], ref[fin], rtol=1e-4, atol=1e-4, msg=f"{label}: dense model")
    o = out.float()
    vs = call.value_scales
    vmax = 6.0 * 2.0 ** (vs[vs != 255].float().max().item() - 127) if bool((vs != 255).any()) else 0.0
    bound = (r8 - exact).abs() + 2.0 ** -4 * abs_v + 1.5e-4 * vmax
    if signs is not None:
        rounding = 2.0 ** -8 * call.head_dim ** -0.5 * o.abs().sum(-1, keepdim=True)
    else:
        rounding = 2.0 ** -8 * o.abs()
    tol = bound * (1 + 2.0 ** -8) + rounding + 1e-5 * abs_v + 1e-6
    err = (to_rotated(o) - exact).abs()[fin]
    ratio = (err / tol[fin]).max().item() if err.numel() else 0.0
    print(f"{label}: max|out'-ref'| {err.max().item() if err.numel() else 0:.3e}  "
          f"max|ref| {ref[fin].abs().max().item() if err.numel() else 0:.3e}  max err/tol {ratio:.3f}")
    assert ratio <= 1.0, f"{label}: error exceeds the derived tolerance (max err/tol {ratio:.3f})"
    return out, ref


def transformed_problem(lens, config, *, qlens=None, hq=8, hkv=2, d=128, bs=16, scale_group=None, seed=0,
                        key_offset=0.0, key_format="fp4", **kw):
    """A cache written by the reference writer with ``config`` (Gaussian K/V; keys shifted by
    ``key_offset`` times a fixed Gaussian vector, so the key center m is far from 0; ``key_format``
    as for ``allocate_cache``) and the validated call that reads it (transforms included:
    ``prepare_attention``; a shared state as the per-sequence records the sm120 backend builds
    from it)."""
    from turboquant.cache import build_paged_problem

    gen = torch.Generator().manual_seed(seed)
    center = key_offset * torch.randn(d, generator=torch.Generator().manual_seed(seed + 1))

    def kv_factory(s, shape):
        return torch.randn(shape, generator=gen) + center, torch.randn(shape, generator=gen)

    prob = build_paged_problem(lens, hkv, d, bs, device="cuda", scale_group=scale_group, spare_blocks=2,
                               generator=gen, write_backend="reference", config=config,
                               kv_factory=kv_factory if key_offset else None, key_format=key_format)
    ntok = len(lens) if qlens is None else sum(qlens)
    query = torch.randn(ntok, hq, d, generator=gen).to(torch.bfloat16).cuda()
    cu = None if qlens is None else torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(),
                                                 dtype=torch.int32, device="cuda")
    call = call_with_records(prepare_attention(query, *prob.cache, prob.block_tables,
                                               prob.seq_lens, d ** -0.5, cu_query_lens=cu, **kw,
                                               **prob.kwargs))
    return prob, call


TRANSFORM_CONFIGS = [
    pytest.param(QuantConfig(), None, id="default"),
    pytest.param(PER_SEQUENCE, None, id="per-sequence"),
    pytest.param(QuantConfig(), 32, id="default-per32"),
    pytest.param(QuantConfig.parse("rotation"), None, id="rotation"),
    pytest.param(QuantConfig.parse("plain"), None, id="plain"),
]


@pytest.mark.parametrize("multi_token", [False, True], ids=["decode", "multi-token"])
@pytest.mark.parametrize("config, scale_group", TRANSFORM_CONFIGS)
def test_attention_transforms(ops, config, scale_group, multi_token):
    lens = [1, 54, 97, 300]
    qlens = [1, 5, 7, 3] if multi_token else None  # 7 tokens x group 4: two row tiles
    _, call = transformed_problem(lens, config, qlens=qlens, scale_group=scale_group, seed=61)
    assert (call.rotation_signs is not None) == config.rotation and call.sink == config.sink
    assert sm120.BACKEND.check_attention(call) is None
    check_transformed(ops[0], call, f"{config.name} {'multi-token' if multi_token else 'decode'}")


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("scale_group", [None, 32], ids=["scale-per-head", "scale-per-32"])
def test_attention_transforms_head_dims(ops, d, scale_group):
    """The rotation's butterfly split between registers and lanes at D/8 = 8 and 32."""
    _, call = transformed_problem([1, 54, 97], QuantConfig(), d=d, scale_group=scale_group, seed=d)
    check_transformed(ops[0], call, f"default d{d} group {scale_group or d}")


def test_attention_transforms_window_softcap_splits(ops):
    """Sliding windows that hide the sink from some rows, q.m under a soft cap, several KV splits."""
    lens, qlens = [1, 54, 97, 1000], [1, 4, 6, 5]
    cfg = QuantConfig()
    _, call = transformed_problem(lens, cfg, qlens=qlens, seed=71, sliding_window=50)
    check_transformed(ops[0], call, "default window 50")
    _, call = transformed_problem(lens, cfg, qlens=qlens, seed=71, logits_soft_cap=5.0)
    assert call.seq_state is not None and call.logits_soft_cap > 0
    check_transformed(ops[0], call, "default softcap 5")
    # keys far from 0: q.m moves the capped logits a lot (leaving it out fails this case)
    _, call = transformed_problem(lens, cfg, qlens=qlens, seed=73, key_offset=2.0, logits_soft_cap=3.0)
    assert call.seq_state[:, :, KEY_CENTER].abs().mean() > 0.5
    check_transformed(ops[0], call, "default softcap 3, keys off-center")
    _, call = transformed_problem([3000, 77], cfg, hq=32, hkv=8, seed=72, sliding_window=700,
                                  logits_soft_cap=30.0)
    check_transformed(ops[0], call, "default 8B heads window 700 softcap 30")


def test_attention_sink_structured(ops):
    """Position 0 comes from the state record: a one-token sequence returns exactly the
    un-rotated sink value; position 0's FP4 bytes never count (poisoned here); a window that
    hides position 0 does not read the sink (NaN sink rows stay out); a slot outside seq_state
    gives NaN rows for its sequence only, without reading out of bounds."""
    op = ops[0]
    cfg = PER_SEQUENCE  # poisoned position 0 bytes: the shared state's table would miss
    lens = [1, 40, 1, 200]
    prob, call = transformed_problem(lens, cfg, seed=81)
    kc, vc, ks, vs = prob.cache
    for s in range(len(lens)):  # poison position 0's codes and scales: NaN if they were read
        blk = int(prob.block_tables[s, 0])
        kc[blk, :, 0], vc[blk, :, 0], ks[blk, 0], vs[blk, 0] = 0xFF, 0xFF, 0xFF, 0xFF
    out, ref = check_transformed(op, call, "sink, position 0 poisoned")
    assert torch.isfinite(out).all()
    g = call.num_heads // call.num_kv_heads
    for s in (0, 2):  # one-token sequences: exactly the sink value, un-rotated
        slot = int(call.state_ids[s])
        want = unrotate(call.seq_state[slot, :, SINK_VALUE], call.rotation_signs)  # [Hkv, D]
        want = want.repeat_interleave(g, 0).to(out.dtype)
        assert torch.equal(out[s], want), f"sequence {s}: not the sink value"
        assert torch.equal(out[s], ref[s].to(out.dtype))

    # A window of 8 hides position 0 from the 200-token sequence's query: its sink rows may be
    # anything, they are never read.
    _, call_w = transformed_problem(lens, cfg, seed=81, sliding_window=8)
    state = call_w.seq_state.clone()
    state[int(call_w.state_ids[3]), :, SINK_KEY:SINK_VALUE + 1] = float("nan")
    call_w = dataclasses.replace(call_w, seq_state=state)
    out_w, _ = check_transformed(op, call_w, "sink hidden by the window")
    assert torch.isfinite(out_w[3]).all()

    # A slot outside seq_state (value checks bypassed, as under CUDA graphs): NaN rows for that
    # sequence, every other sequence bit-identical.
    for bad_slot in (call.seq_state.shape[0] + 3, -1):
        ids = call.state_ids.clone()
        ids[1] = bad_slot
        out_bad = run_call(op, dataclasses.replace(call, state_ids=ids))
        assert torch.isnan(out_bad[1]).all(), f"slot {bad_slot}"
        keep = [0, 2, 3]
        assert torch.equal(out_bad[keep], out[keep]), f"slot {bad_slot}: other sequences changed"
    # an uninitialized record (NaN, as allocate_state leaves it) gives NaN too
    state = call.seq_state.clone()
    state[int(call.state_ids[3])] = float("nan")
    out_nan = run_call(op, dataclasses.replace(call, seq_state=state))
    assert torch.isnan(out_nan[3]).all() and torch.equal(out_nan[:3], out[:3])


def test_attention_nan_scale_and_out_of_range_block(ops):
    op = ops[0]
    pr = make_problem([200, 200, 0], 8, 2, 128, 16, seed=21)
    blk = int(pr["block_tables"][0, 3])
    pr["key_scales"][blk, 5, 1] = 255  # key 53 of sequence 0, kv head 1: visible, NaN scale
    out, ref = check_against_reference(op, pr, "NaN key scale")
    assert torch.isnan(out[0, 4:]).all() and not torch.isnan(out[0, :4]).any()
    assert (out[2] == 0).all()  # seq_len 0 gives zeros
    pr["key_scales"][blk, 5, 1] = 127
    pr["block_tables"][1, 2] = pr["key_cache"].shape[0] + 5  # a block id outside the cache
    out = run_kernel(op, pr)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()


def test_attention_op_in_cuda_graph_and_torch_compile(ops):
    """The op writes into `out` without host synchronization: it replays from a CUDA graph and
    traces under torch.compile(fullgraph=True) (schema + fake from turboquant/_backends/sm120.py)."""
    op = ops[0]
    pr = make_problem([700, 33, 0, 1500], 32, 8, 128, 16, seed=51)
    call = _call(pr)
    eager = run_kernel(op, pr)
    out = torch.zeros_like(eager)
    args = attention_op_args(call, out)
    op(*args)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(*args)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

    def fn(q):
        o = torch.empty_like(q)
        op(o, q, *attention_op_args(call, o)[2:])
        return o * 1.0

    compiled = torch.compile(fn, fullgraph=True)
    assert torch.equal(compiled(pr["query"]), eager)


# ------------------------------------------------------------------------------------------
# K8V4 (key_format "fp8_e4m3"): E4M3 keys through the e4m3 x e4m3 MMA, FP4 values. The key
# bytes decode exactly (E4M3 times a power of two), so the derived tolerance is the FP4 one.
# ------------------------------------------------------------------------------------------
K8V4_SCALES = (115, 121)  # key scale bytes for random E4M3 bytes (up to 448): logits of order 1


def batch17(pattern):
    return [pattern[i % len(pattern)] for i in range(17)]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_k8v4_batch17_head_dims(ops, d, dtype):
    """17 sequences of 1 / 54 / 97 keys, shuffled block tables, poisoned unused slots, GQA 4,
    random E4M3 key bytes (subnormals, negatives, +-448), one KV split and several."""
    pr = make_problem(batch17([1, 54, 97]), 8, 2, d, 16, dtype=dtype, seed=d + 1, k_scales=K8V4_SCALES, k8v4=True)
    assert pr["key_cache"].dtype == torch.float8_e4m3fn and pr["key_cache"].shape[-1] == d
    check_against_reference(ops[0], pr, f"k8v4 batch 17 d{d} {dtype}")
    pr = make_problem([1, 54, 97, 2000], 32, 8, d, 32, dtype=dtype, seed=d + 2, k_scales=K8V4_SCALES, k8v4=True)
    check_against_reference(ops[0], pr, f"k8v4 8B heads d{d} {dtype}, block 32")


def test_k8v4_multi_token_window_softcap(ops):
    lens, qlens = batch17([1, 54, 97]), batch17([1, 5, 7])
    pr = make_problem(lens, 16, 4, 128, 16, qlens=qlens, seed=91, k_scales=K8V4_SCALES, k8v4=True)
    check_against_reference(ops[0], pr, "k8v4 multi-token")
    check_against_reference(ops[0], pr, "k8v4 multi-token window 40", sliding_window=40)
    check_against_reference(ops[0], pr, "k8v4 multi-token softcap 5", logits_soft_cap=5.0)
    # GQA group 16 with 7 query tokens: 112 rows, 7 tiles; head dim 64, block 64
    pr = make_problem([500, 77], 32, 2, 64, 64, qlens=[7, 2], seed=92, k_scales=K8V4_SCALES, k8v4=True)
    check_against_reference(ops[0], pr, "k8v4 multi-token group 16")


def test_k8v4_cache_written_from_gaussian_kv(ops):
    """Realistic data: Gaussian K/V written by the reference cache writer (Llama-3-8B heads)."""
    from turboquant.cache import build_paged_problem

    gen = torch.Generator().manual_seed(93)
    lens = [2048, 1000, 17, 3000]
    prob = build_paged_problem(lens, 8, 128, 16, device="cuda", spare_blocks=2, generator=gen,
                               write_backend="reference", config=PLAIN, key_format="fp8_e4m3")
    kc, vc, ks, vs = prob.cache
    pr = dict(query=torch.randn(len(lens), 32, 128, generator=gen).to(torch.bfloat16).cuda(), key_cache=kc,
              value_cache=vc, key_scales=ks, value_scales=vs, block_tables=prob.block_tables,
              seq_lens=prob.seq_lens, cu_query_lens=None)
    check_against_reference(ops[0], pr, "k8v4 gaussian kv")


@pytest.mark.parametrize("multi_token", [False, True], ids=["decode", "multi-token"])
@pytest.mark.parametrize("config", [QuantConfig(), QuantConfig.parse("rotation"), QuantConfig.parse("plain")],
                         ids=["default", "rotation", "plain"])
def test_k8v4_transforms(ops, config, multi_token):
    """K8V4 caches written by the reference writer with the transforms: rotation, key smoothing
    and the sink act on Q and on the records exactly as with FP4 keys."""
    lens = batch17([1, 54, 97])
    qlens = batch17([1, 5, 7]) if multi_token else None
    _, call = transformed_problem(lens, config, qlens=qlens, seed=94, key_format="fp8_e4m3")
    assert call.key_format == "fp8_e4m3" and sm120.BACKEND.check_attention(call) is None
    check_transformed(ops[0], call, f"k8v4 {config.name} {'multi-token' if multi_token else 'decode'}")


@pytest.mark.parametrize("d", [64, 256])
def test_k8v4_transforms_head_dims_window_softcap(ops, d):
    """The default transforms at head dims 64 / 256 (the rotation's register / lane split), a
    window that hides the sink from some rows, and q.m under a soft cap with off-center keys."""
    lens, qlens = [1, 54, 97, 1000], [1, 4, 6, 5]
    cfg = QuantConfig()
    _, call = transformed_problem(lens, cfg, qlens=qlens, d=d, seed=95, key_format="fp8_e4m3")
    check_transformed(ops[0], call, f"k8v4 default d{d}")
    _, call = transformed_problem(lens, cfg, qlens=qlens, d=d, seed=95, sliding_window=50, key_format="fp8_e4m3")
    check_transformed(ops[0], call, f"k8v4 default d{d} window 50")
    _, call = transformed_problem(lens, cfg, qlens=qlens, d=d, seed=96, key_offset=2.0, logits_soft_cap=3.0,
                                  key_format="fp8_e4m3")
    assert call.seq_state[:, :, KEY_CENTER].abs().mean() > 0.5
    check_transformed(ops[0], call, f"k8v4 default d{d} softcap 3, keys off-center")


def test_k8v4_sink_and_nan(ops):
    """Position 0's E4M3 bytes are never read with the sink (poisoned here: NaN bytes and scale);
    a one-token sequence returns exactly the un-rotated sink value; a NaN key scale a row sees
    makes that row NaN, and only those rows."""
    op = ops[0]
    prob, call = transformed_problem([1, 40, 1, 200], PER_SEQUENCE, seed=97, key_format="fp8_e4m3")
    kc, vc, ks, vs = prob.cache
    for s in range(4):
        blk = int(prob.block_tables[s, 0])
        kc.view(torch.uint8)[blk, :, 0], vc[blk, :, 0], ks[blk, 0], vs[blk, 0] = 0xFF, 0xFF, 0xFF, 0xFF
    out, _ = check_transformed(op, call, "k8v4 sink, position 0 poisoned")
    assert torch.isfinite(out).all()
    g = call.num_heads // call.num_kv_heads
    for s in (0, 2):
        slot = int(call.state_ids[s])
        want = unrotate(call.seq_state[slot, :, SINK_VALUE], call.rotation_signs).repeat_interleave(g, 0)
        assert torch.equal(out[s], want.to(out.dtype)), f"sequence {s}: not the sink value"
    pr = make_problem([200, 200, 0], 8, 2, 128, 16, seed=98, k_scales=K8V4_SCALES, k8v4=True)
    blk = int(pr["block_tables"][0, 3])
    pr["key_scales"][blk, 5, 1] = 255  # key 53 of sequence 0, kv head 1: visible, NaN scale
    out, _ = check_against_reference(op, pr, "k8v4 NaN key scale")
    assert torch.isnan(out[0, 4:]).all() and not torch.isnan(out[0, :4]).any()
    assert (out[2] == 0).all()  # seq_len 0 gives zeros


def one_hot_k8v4_problem(d, *, hkv=2, group=8, bs=16, seed=0):
    """The structured K8V4 probe: key n of kv head h holds one nonzero E4M3 byte, 1.0 at channel
    perm[h][n] (a random permutation of the D channels), value n is one-hot at channel n (FP4
    1.0, scale 1). The D / group sequences share one shuffled block table (D + 5 keys; keys D..
    D + 4 are zero; the unused slots of the last block and a spare block are poisoned: NaN bytes
    and scales); query (sequence s, head h * group + i) is 30 at channel group * s + i, so every
    channel is asked once per kv head. With scale 1 the logit of the key whose byte sits at that
    channel is 30, every other is 0: the output is 1.0 at channel perm[h]^-1(c) and at most
    about e^-30 elsewhere. A key byte read from the wrong place, or B's e4m3 layout wrong, moves
    the peak. Returns (problem, expected one-hot outputs)."""
    gen = torch.Generator().manual_seed(seed)
    n_keys, n_seqs = d + 5, d // group
    nblk = math.ceil(n_keys / bs)
    ids = torch.randperm(nblk + 1, generator=gen)  # the last id: a spare block
    perm = torch.stack([torch.randperm(d, generator=gen) for _ in range(hkv)])  # [hkv, D]
    kc = torch.full((nblk + 1, hkv, bs, d), 0xFF, dtype=torch.uint8)
    vc = torch.full((nblk + 1, hkv, bs, d // 2), 0xFF, dtype=torch.uint8)
    ks = torch.full((nblk + 1, bs, hkv), 0xFF, dtype=torch.uint8)
    vs = torch.full((nblk + 1, bs, hkv), 0xFF, dtype=torch.uint8)
    for n in range(n_keys):
        blk, off = int(ids[n // bs]), n % bs
        kc[blk, :, off] = 0
        vc[blk, :, off] = 0
        ks[blk, off] = vs[blk, off] = 127
        if n < d:
            for h in range(hkv):
                kc[blk, h, off, perm[h, n]] = 0x38  # E4M3 1.0
            vc[blk, :, off, n // 2] = 2 << (4 * (n % 2))  # FP4 1.0 at channel n
    q = torch.zeros(n_seqs, hkv * group, d)
    want = torch.zeros(n_seqs, hkv * group, d)
    inverse = perm.argsort(dim=1)
    for s in range(n_seqs):
        for h in range(hkv):
            for i in range(group):
                c = group * s + i
                q[s, h * group + i, c] = 30.0
                want[s, h * group + i, inverse[h, c]] = 1.0
    table = ids[:nblk].to(torch.int32).repeat(n_seqs, 1)
    pr = dict(query=q.to(torch.bfloat16).cuda(), key_cache=kc.view(torch.float8_e4m3fn).cuda(), value_cache=vc.cuda(),
              key_scales=ks.cuda(), value_scales=vs.cuda(), block_tables=table.cuda(),
              seq_lens=torch.full((n_seqs,), n_keys, dtype=torch.int32).cuda(), cu_query_lens=None)
    return pr, want


@pytest.mark.parametrize("d", [64, 128, 256])
def test_k8v4_one_hot_keys_structured_probe(ops, d):
    pr, want = one_hot_k8v4_problem(d, seed=d)
    ref = reference_f32(pr, scale=1.0).cpu()
    torch.testing.assert_close(ref, want, rtol=0, atol=1e-6)  # the probe's premise, on the reference
    out = run_kernel(ops[0], pr, scale=1.0).float().cpu()
    wrong = (out.argmax(-1) != want.argmax(-1)).nonzero().tolist()
    assert not wrong, f"d{d}: (sequence, head) rows whose peak moved: {wrong[:8]}"
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


@pytest.mark.sm120
@pytest.mark.skipif(_capability()[0] != 12, reason="needs an SM120-family GPU (compute capability 12.x)")
def test_dispatcher_picks_sm120_on_compute_capability_12():
    import turboquant
    from turboquant import registry

    pr = make_problem([300, 5], 32, 8, 128, 16, seed=31)
    call = _call(pr)
    assert registry.select("auto", "attention", call).name == "sm120"
    _, call = transformed_problem([300, 5], QuantConfig(), hq=32, hkv=8, seed=31)
    assert registry.select("auto", "attention", call).name == "sm120"  # transforms fused
    _, call = transformed_problem([300, 5], QuantConfig(), hq=32, hkv=8, seed=31, key_format="fp8_e4m3")
    assert registry.select("auto", "attention", call).name == "sm120"  # K8V4
    out = turboquant.paged_attention_fp4(pr["query"], pr["key_cache"], pr["value_cache"], pr["key_scales"],
                                         pr["value_scales"], pr["block_tables"], pr["seq_lens"],
                                         128 ** -0.5, backend="sm120", config=PLAIN)
    ref = turboquant.paged_attention_fp4(pr["query"], pr["key_cache"], pr["value_cache"], pr["key_scales"],
                                         pr["value_scales"], pr["block_tables"], pr["seq_lens"],
                                         128 ** -0.5, backend="reference", config=PLAIN)
    assert out.shape == ref.shape and torch.isfinite(out).all()
