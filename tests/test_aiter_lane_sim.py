"""Host lane simulation of the gfx950 FP4 paged-attention kernels (csrc_hip/).

The kernel sources are compiled for the host (``-DTQ_HOST_SIM``) with every thread of a
workgroup as a fiber; the MFMA is replaced by a software model of
``v_mfma_scale_f32_16x16x128_f8f6f4`` written from its documented lane layouts, and the
transposing LDS reads (``ds_read_b64_tr_b4`` / ``_b8``) by a model of the CDNA4 ISA's
description (csrc_hip/sim/tq_fp4_lane_sim.cpp). The gfx950 build runs the kernel of
tq_fp4_gfx950_attention.cuh (Q's transform in each wave's prologue, one-wave partitions of
128-token steps, fused reduce); each
case runs both specializations (native FP4 operands for K and V, and LUT: both decoded to
E4M3) and is compared with

- an emulation (float64, no lane layout at all) of the kernels' arithmetic (``emulate``): Q
  as two E4M3 terms (hi + lo / 16) with one E8M0 scale per row, an online softmax per
  128-token step with P as two E4M3 terms after folding the V scale in, each partition's
  output rounded to the query dtype. Wrong bytes, scales or orientation in any lane give
  errors of order one; the simulation matches it bit for bit on most cases.
- ``turboquant.reference`` (the contract), within the accuracy FP8 Q and P allow.

The accuracy transforms (rotation, key smoothing, sink; CONTRACT.md section 2) run in the same
kernel sources: the emulation applies them in fp32 with turboquant's own functions, the
reference through ``paged_attention_fp4(backend="reference", **problem.kwargs)``.

Multi-token queries (cu_query_lens: the kernel's multi-token instantiation, rows of (query
token, head) in row tiles), sliding windows and soft cap run through the same comparison, with
structured probes: rows that see exactly one key, a NaN scale that must reach exactly the rows
whose range holds it, window edges, a saturating cap.

K8V4 caches (E4M3 keys, ``key_format="fp8_e4m3"``) run the KEY_E4M3 instantiations through the
same comparisons, plus a one-hot key probe whose output peak moves under any byte-order or
lane error in the FP8 key operand.

gfx942 (MI300X): built with ``-DTQ_SIM_GFX942`` the simulation runs tq_fp4_paged_attention.cuh's
LUT path, FP8 = E4M3FNUZ (bias 8, 0x80 NaN) on ``v_mfma_f32_16x16x32_fp8_fp8`` (no scale
operand: the kernel applies the E8M0 scales in fp32), modelled from that instruction's
documented layout, with 256-token partitions. Its cases (the ``gfx942`` section at the end)
compare with that kernel's emulation in FNUZ terms (``emulate(..., fnuz=True)``: Q's scale for
240 instead of 448, FNUZ rounding) and the reference.
"""
from __future__ import annotations

import ctypes
import itertools
import dataclasses
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import turboquant
from turboquant.api import prepare_attention
from turboquant.shared_state import call_with_records
from turboquant.calls import make_attention_call
from turboquant.cache import build_paged_problem
from turboquant.config import PER_SEQUENCE, PLAIN, QuantConfig
from turboquant.format import decode_e2m1, decode_e8m0, unpack_fp4
from turboquant.reference import attention_reference
from turboquant.rotation import rotate, rotation_norm, unrotate
from turboquant.smoothing import KEY_CENTER, KEY_SCALE, SINK_KEY, SINK_VALUE

ROOT = Path(__file__).resolve().parents[1]
SIM_SRC = ROOT / "csrc_hip" / "sim" / "tq_fp4_lane_sim.cpp"
PARTITION = 256  # the gfx950 tests' default partition length (any multiple of 128)
PARTITION_942 = 256  # the gfx942 kernel's partition (tq::kPartition)
LOG2E = 1.4426950408889634


def _build_sim(tmp_path_factory, *defines):
    cxx = shutil.which("g++") or shutil.which("clang++") or shutil.which("clang++-22")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++ or clang++) to build the lane simulation")
    lib = tmp_path_factory.mktemp("lane_sim") / "libtq_fp4_lane_sim.so"
    subprocess.run([cxx, "-std=c++20", "-O2", "-shared", "-fPIC", "-Wno-psabi", "-DTQ_HOST_SIM",
                    *defines, "-o", str(lib), str(SIM_SRC)], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.tq_sim_paged_attention.restype = ctypes.c_int
    dll.tq_sim_paged_attention_gfx950.restype = ctypes.c_int
    dll.tq_sim_is_gfx942.restype = ctypes.c_int
    dll.tq_sim_f32_to_e4m3.restype = ctypes.c_uint32
    dll.tq_sim_f32_to_e4m3.argtypes = [ctypes.c_float]
    dll.tq_sim_rotation_norm.restype = ctypes.c_float
    for name in ("tq_sim_f32_to_e4m3fnuz", "tq_sim_f32_to_fp8"):
        getattr(dll, name).restype = ctypes.c_uint32
        getattr(dll, name).argtypes = [ctypes.c_float]
    return dll


@pytest.fixture(scope="session")
def sim_lib(tmp_path_factory):
    """The gfx950 build of the kernel (native FP4 and LUT paths)."""
    return _build_sim(tmp_path_factory)


@pytest.fixture(scope="session")
def sim_lib_942(tmp_path_factory):
    """The gfx942 build (-DTQ_SIM_GFX942): the LUT path in FNUZ on v_mfma_f32_16x16x32_fp8_fp8."""
    return _build_sim(tmp_path_factory, "-DTQ_SIM_GFX942")


def _ptr(t):
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def run_sim(lib, query, cache, block_tables, seq_lens, scale, *, native, soft_cap=0.0,
            rotation_signs=None, seq_state=None, state_ids=None, sink=False, cu_query_lens=None,
            sliding_window=0, sinks=None, return_lse=False, partition_len=PARTITION):
    """The simulated kernels: the gfx950 build runs the partition kernel (and its fused reduce)
    of tq_fp4_gfx950_attention.cuh with partitions of partition_len tokens (a multiple of 128);
    the gfx942 build the partition + reduce pair of tq_fp4_paged_attention.cuh (256-token
    partitions). -> out like query. The transforms' tensors as in an AttentionCall (None: off);
    cu_query_lens None: decode (the decode instantiation), else the multi-token one; a
    float8_e4m3fn key cache runs the K8V4 instantiation (E4M3 keys), which takes the value
    cache's strides. sinks: learned sink logits float32 [num_heads]; return_lse: -> (out, lse
    float32 [num_tokens, num_heads])."""
    key_cache, value_cache, key_scales, value_scales = cache
    num_tokens, num_heads, head = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    gfx942 = bool(lib.tq_sim_is_gfx942())
    plen = PARTITION_942 if gfx942 else partition_len
    max_parts = max(1, math.ceil(int(seq_lens.max()) / plen)) if num_seqs else 1
    exp_sums = torch.full((num_tokens, num_heads, max_parts), float("nan"))
    max_logits = torch.full_like(exp_sums, float("nan"))
    # partials: the query dtype on gfx942, fp32 on gfx950
    tmp_out = torch.zeros((num_tokens, num_heads, max_parts, head),
                          dtype=query.dtype if gfx942 else torch.float32)
    out = torch.full_like(query, float("nan"))
    lse = torch.full((num_tokens, num_heads), 12345.0) if return_lse else None  # must be written
    query = query.contiguous()
    head_args = (int(query.dtype == torch.bfloat16), head, block_size, num_heads // num_kv_heads,
                 int(native), int(key_cache.dtype == torch.float8_e4m3fn),
                 _ptr(query), _ptr(key_cache), _ptr(value_cache), _ptr(key_scales),
                 _ptr(value_scales), _ptr(block_tables), _ptr(seq_lens), _ptr(cu_query_lens),
                 _ptr(exp_sums), _ptr(max_logits), _ptr(tmp_out), _ptr(out), ctypes.c_float(scale),
                 ctypes.c_float(soft_cap), int(sliding_window), num_seqs, num_tokens, num_kv_heads,
                 block_tables.shape[1], max_parts)
    tail_args = (query.stride(0), ctypes.c_long(value_cache.stride(0)), value_cache.stride(1),
                 value_cache.stride(2), _ptr(rotation_signs), _ptr(seq_state), _ptr(state_ids),
                 0 if seq_state is None else seq_state.shape[0], int(sink), _ptr(sinks), _ptr(lse))
    if gfx942:
        rc = lib.tq_sim_paged_attention(*head_args, key_cache.shape[0], *tail_args)
    else:
        rc = lib.tq_sim_paged_attention_gfx950(*head_args, plen, key_cache.shape[0], *tail_args)
    assert rc == 0, (f"lane simulation failed (rc={rc}: -1 barrier deadlock, -2 no instantiation, "
                     "-4 a reduce ticket left set)")
    return (out, lse) if return_lse else out


def reference(query, cache, block_tables, seq_lens, scale, soft_cap=0.0, cu_query_lens=None,
              sliding_window=0):
    call = make_attention_call(query, *cache, block_tables, seq_lens, scale, cu_query_lens,
                               sliding_window, soft_cap, None)
    out = torch.empty_like(query)
    attention_reference(call, out)
    return out


def _e4m3(x, fnuz=False):
    return x.float().to(torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn).to(torch.float64)


def _e4m3_pair(x, fnuz=False):
    """x as the kernel's two E4M3 (fnuz: E4M3FNUZ, gfx942) terms: hi + lo / 16."""
    hi = _e4m3(x, fnuz)
    return hi + _e4m3((x.float().double() - hi) * 16, fnuz) / 16


def _q_scale_byte(amax, fp8_max=448.0):
    if amax == 0:
        return 127
    if not math.isfinite(amax):
        return 255
    e = math.ceil(math.log2(amax / fp8_max))
    while 2.0 ** (e - 1) * fp8_max >= amax:
        e -= 1
    while 2.0 ** e * fp8_max < amax:
        e += 1
    return min(254, max(1, e + 127))


def emulate(query, cache, block_tables, seq_lens, scale, soft_cap=0.0, rotation_signs=None,
            seq_state=None, state_ids=None, sink=False, cu_query_lens=None, sliding_window=0,
            sinks=None, return_lse=False, fnuz=False, partition_len=PARTITION):
    """The kernels' arithmetic in float64 without any lane layout: fnuz=True the gfx942 kernel
    (_emulate_gfx942), else the gfx950 kernels (tq_fp4_gfx950_attention.cuh):

    - prologue: q' = rotate(q * lam) in fp32, times f = scale * log2(e) (scale alone under a
      soft cap), as two E4M3 terms with the row's E8M0 scale; q.m and the sink's logit x0
      (log2 units) from the fp32 q';
    - partitions of partition_len tokens in steps of 128, per row an online softmax in log2
      units: x = q8 . k (capped: cap(x + f q.m) * log2(e)), invisible tokens -inf, per step
      m' = max(m, max x), e = 2^(x - m'), l = l 2^(m - m') + sum e, O = O 2^(m - m') +
      (P' as two E4M3 terms) V 2^(E + vs_ref - 127), P' = e 2^(vs - vs_ref - E) with E the
      exponent of the step's largest e 2^(vs - vs_ref) (so P' < 1 whatever vs_ref), the
      partial O / l in fp32;
    - reduce: the partials' maxima plus f q.m (unless the cap already added it), the sink
      (x0, v0) for the rows that see position 0, learned sinks as one more logit, then the
      un-rotation in fp32.
    Rows are (query token, head); a row at position p sees keys max(0, p - W + 1) .. p."""
    if fnuz:
        return _emulate_gfx942(query, cache, block_tables, seq_lens, scale, soft_cap,
                               rotation_signs, seq_state, state_ids, sink, cu_query_lens,
                               sliding_window, sinks, return_lse, fnuz=True)
    key_cache, value_cache, key_scales, value_scales = cache
    num_tokens, num_heads, head = query.shape
    num_seqs = seq_lens.shape[0]
    hkv, bs = key_cache.shape[1], key_cache.shape[2]
    gqa = num_heads // hkv
    starts = list(range(num_seqs + 1)) if cu_query_lens is None else cu_query_lens.tolist()
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse_out = torch.full(query.shape[:2], float("-inf"), dtype=torch.float64)
    first = 1 if sink else 0
    f = scale if soft_cap > 0 else scale * LOG2E
    step = 128
    for s in range(num_seqs):
        n, q0, q1 = int(seq_lens[s]), starts[s], starts[s + 1]
        nq = q1 - q0
        if nq == 0:
            continue
        record = None
        if seq_state is not None:
            r = int(state_ids[s])
            record = seq_state[r] if 0 <= r < seq_state.shape[0] else None
        pos = torch.arange(n)
        qpos = torch.arange(n - nq, n).repeat_interleave(gqa)
        lo = (qpos - sliding_window + 1).clamp_min(0) if sliding_window > 0 else torch.zeros_like(qpos)
        visible = (pos[None] <= qpos[:, None]) & (pos[None] >= lo[:, None]) & (pos[None] >= first)
        blk = block_tables[s, pos // bs].long()
        slot = pos % bs
        for h in range(hkv):
            if key_cache.dtype == torch.float8_e4m3fn:
                k4 = key_cache[blk, h, slot].double()
            else:
                k4 = decode_e2m1(unpack_fp4(key_cache[blk, h, slot])).double()
            v4 = decode_e2m1(unpack_fp4(value_cache[blk, h, slot])).double()
            ks = key_scales[blk, slot, h].long()
            vs = value_scales[blk, slot, h].long()
            kdeq = k4 * decode_e8m0(ks.to(torch.uint8)).double()[:, None]
            q = query[q0:q1, h * gqa:(h + 1) * gqa].float().reshape(nq * gqa, head)
            qdm = torch.zeros(nq * gqa)
            if seq_state is not None:
                if record is None:  # a bad slot: NaN rows
                    q = torch.full_like(q, float("nan"))
                    qdm = torch.full_like(qdm, float("nan"))
                else:
                    qdm = (q.double() * record[h, KEY_CENTER].double()).sum(-1).float()
                    q = q * record[h, KEY_SCALE]
            if rotation_signs is not None:
                q = rotate(q, rotation_signs)
            x0 = torch.full((nq * gqa,), float("-inf"), dtype=torch.float64)
            if sink:
                k0 = record[h, SINK_KEY] if record is not None else torch.full((head,), float("nan"))
                x0 = scale * ((q.double() @ k0.double()) + qdm.double())
                if soft_cap > 0:
                    x0 = soft_cap * torch.tanh(x0 / soft_cap)
                x0 = x0 * LOG2E
            qf = (q * f).double()
            qs = torch.tensor([255 if torch.isnan(r).any() else _q_scale_byte(float(r.abs().max()))
                               for r in qf])
            hi = _e4m3(qf * torch.exp2(127.0 - qs.double())[:, None])
            lo8 = _e4m3((qf * torch.exp2(127.0 - qs.double())[:, None] - hi) * 16) / 16
            lo8 = torch.where((qs >= 4)[:, None], lo8, 0.0)
            q8 = (hi + lo8) * torch.exp2(qs.double() - 127)[:, None]
            q8[qs == 255] = float("nan")
            x = q8 @ kdeq.T
            qadd = (qdm.double() * f)
            add_in_parts = soft_cap > 0 and seq_state is not None
            if soft_cap > 0:
                x = soft_cap * torch.tanh((x + (qadd[:, None] if add_in_parts else 0.0)) / soft_cap) * LOG2E
            x = torch.where(visible, x, float("-inf"))
            parts = []
            for p0 in range(0, max(n, 1), partition_len):
                m = torch.full((nq * gqa,), float("-inf"), dtype=torch.float64)
                l = torch.zeros(nq * gqa, dtype=torch.float64)
                o = torch.zeros(nq * gqa, head, dtype=torch.float64)
                for t0 in range(p0, min(p0 + partition_len, n), step):
                    sl = slice(t0, min(t0 + step, n))
                    xs, vis = x[:, sl], visible[:, sl]
                    mx = torch.where(vis, xs, float("-inf")).max(dim=1).values
                    mx = torch.where(torch.isnan(mx), float("-inf"), mx)
                    m_new = torch.maximum(m, mx)
                    m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = torch.where(m == m_new, 1.0, torch.exp2(m - m_use))
                    m = m_new
                    e = torch.where(vis, torch.exp2(xs - m_use[:, None]), 0.0)
                    l = l * alpha + e.sum(1)
                    vsf = vs[sl].double()
                    pw = torch.where(vis, e * torch.where(vsf == 255, float("nan"),
                                                          torch.exp2(vsf - 127)), 0.0)
                    pmax = pw.max(dim=1).values
                    pexp = torch.where(pmax > 0, torch.floor(torch.log2(pmax)) + 1, 0.0)
                    pexp = torch.where(torch.isnan(pmax), 0.0, pexp).clamp_min(-127)
                    pn = pw * torch.exp2(-pexp)[:, None]
                    hi = _e4m3(pn)
                    p8 = hi + torch.where((pexp >= -123)[:, None], _e4m3((pn - hi) * 16) / 16, 0.0)
                    o = o * alpha[:, None] + (p8 @ v4[sl]) * torch.exp2(pexp)[:, None]
                    nanrow = torch.isnan(pw).any(1)
                    o[nanrow] = float("nan")
                o = torch.where((l == 0)[:, None], 0.0, o / l[:, None])
                # the partition holds some of the row's keys (the sink counts as position 0)
                has = (visible[:, p0:p0 + partition_len].any(1) |
                       ((lo == 0) & torch.tensor(bool(sink) and p0 == 0) & (qpos >= 0)))
                parts.append((has, m, l, o.float().double()))  # fp32 partials
            inc = torch.stack([hs for hs, _, _, _ in parts])
            sees0 = (lo == 0) & torch.tensor(bool(sink)) & (qpos >= 0)
            qadd_r = 0.0 if add_in_parts else qadd
            mg = torch.stack([torch.where(hs, mm + qadd_r, float("-inf")) for hs, mm, _, _ in parts]).max(0).values
            mg = torch.where(sees0, torch.maximum(mg, x0), mg)
            if sinks is not None:
                mg = torch.maximum(mg, sinks[h * gqa:(h + 1) * gqa].double().repeat(nq) * LOG2E)
            mg_safe = torch.where(mg == float("-inf"), 0.0, mg)
            num = torch.zeros(nq * gqa, head, dtype=torch.float64)
            den = torch.zeros(nq * gqa, dtype=torch.float64)
            for hs, mm, ll, t in parts:
                w = torch.where(ll == 0, 0.0, ll * torch.exp2(mm + qadd_r - mg_safe))
                num = num + torch.where(hs[:, None], w[:, None] * t, 0.0)
                den = den + torch.where(hs, w, 0.0)
            if sink:
                v0 = record[h, SINK_VALUE].double() if record is not None else torch.full((head,), float("nan"))
                w0 = torch.where(sees0, torch.exp2(x0 - mg_safe), 0.0)
                num = num + w0[:, None] * v0[None]
                den = den + w0
            if sinks is not None:
                den = den + torch.exp2(sinks[h * gqa:(h + 1) * gqa].double().repeat(nq) * LOG2E - mg_safe)
            anyp = inc.any(0) | sees0
            rows = torch.where(anyp[:, None], num / torch.where(anyp, den, 1.0)[:, None], 0.0)
            row_lse = torch.where(anyp | torch.tensor(sinks is not None), (mg + torch.log2(den)) / LOG2E,
                                  float("-inf"))
            row_lse = torch.where(torch.isnan(rows[:, 0]), float("nan"), row_lse)
            if rotation_signs is not None:
                rows = unrotate(rows.float(), rotation_signs).double()
            out[q0:q1, h * gqa:(h + 1) * gqa] = rows.view(nq, gqa, head)
            lse_out[q0:q1, h * gqa:(h + 1) * gqa] = row_lse.view(nq, gqa)
    if sinks is not None:
        empty = torch.isneginf(lse_out)
        lse_out = torch.where(empty, sinks.double()[None].expand_as(lse_out), lse_out)
    out = out.to(query.dtype)
    return (out, lse_out.float()) if return_lse else out


def _emulate_gfx942(query, cache, block_tables, seq_lens, scale, soft_cap=0.0, rotation_signs=None,
            seq_state=None, state_ids=None, sink=False, cu_query_lens=None, sliding_window=0,
            sinks=None, return_lse=False, fnuz=False):
    """The gfx942 kernel's arithmetic (fnuz: its FP8, E4M3FNUZ, Q scaled to 240) in float64 without any lane layout (FP4 or E4M3 keys times
    their scale); the transforms in fp32 as
    the kernel does them (q' = rotate(q * lam); the sink as one more fp32 key of partition 0,
    merged by log-sum-exp for the rows that see position 0; each partition's output un-rotated
    before its rounding). Rows are (query token, head); a row at position p sees keys
    max(0, p - W + 1) .. p (W = sliding_window, 0: from 0), each partition that holds some of
    them gives a partial, the others none. Learned sinks (sinks [num_heads]) join the combine as
    one more logit without a value; with sinks or return_lse the logits carry q.m (a record)
    without a soft cap too; return_lse: -> (out, lse)."""
    key_cache, value_cache, key_scales, value_scales = cache
    num_tokens, num_heads, head = query.shape
    num_seqs = seq_lens.shape[0]
    hkv, bs = key_cache.shape[1], key_cache.shape[2]
    gqa = num_heads // hkv
    starts = list(range(num_seqs + 1)) if cu_query_lens is None else cu_query_lens.tolist()
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse_out = torch.full(query.shape[:2], float("-inf"), dtype=torch.float64)
    if sinks is not None:
        lse_out[:] = sinks.double()[None]  # a row that sees nothing: the sink's logit
    true_logits = sinks is not None or return_lse
    first = 1 if sink else 0  # the FP4 stream serves positions first .. n-1
    for s in range(num_seqs):
        n, q0, q1 = int(seq_lens[s]), starts[s], starts[s + 1]
        nq = q1 - q0
        if n == 0 or nq == 0:
            continue
        record = None
        if seq_state is not None:
            r = int(state_ids[s])
            if not 0 <= r < seq_state.shape[0]:
                out[q0:q1] = float("nan")
                lse_out[q0:q1] = float("nan")
                continue
            record = seq_state[r]  # [Hkv, 5, D]
        pos = torch.arange(n)
        qpos = torch.arange(n - nq, n).repeat_interleave(gqa)  # row (token j, head i) -> position
        lo = (qpos - sliding_window + 1).clamp_min(0) if sliding_window > 0 else torch.zeros_like(qpos)
        visible = (pos[None] <= qpos[:, None]) & (pos[None] >= lo[:, None])  # [rows, n]
        blk = block_tables[s, pos // bs].long()
        slot = pos % bs
        for h in range(hkv):
            if key_cache.dtype == torch.float8_e4m3fn:  # K8V4: the E4M3 bytes' values
                k4 = key_cache[blk, h, slot].double()  # [n, D]
            else:
                k4 = decode_e2m1(unpack_fp4(key_cache[blk, h, slot])).double()
            v4 = decode_e2m1(unpack_fp4(value_cache[blk, h, slot])).double()
            ks = key_scales[blk, slot, h].long()
            vs = value_scales[blk, slot, h].long()
            ks[:first], vs[:first] = 127, 127  # removed by selection
            k4[:first], v4[:first] = 0, 0
            kdeq = k4 * decode_e8m0(ks.to(torch.uint8)).double()[:, None]
            q = query[q0:q1, h * gqa:(h + 1) * gqa].float().reshape(nq * gqa, head)  # token-major rows
            qdm = torch.zeros(nq * gqa, dtype=torch.float64)
            if record is not None:
                if soft_cap > 0 or true_logits:
                    qdm = (q.double() * record[h, KEY_CENTER].double()).sum(-1)
                q = q * record[h, KEY_SCALE]
            if rotation_signs is not None:
                q = rotate(q, rotation_signs)
            q = q.double()
            qs = torch.tensor([_q_scale_byte(float(r.abs().max()), 240.0 if fnuz else 448.0) for r in q])
            q8 = _e4m3_pair(q * torch.exp2(127.0 - qs.double())[:, None], fnuz) * torch.exp2(qs.double() - 127)[:, None]
            x = scale * (q8 @ kdeq.T + qdm[:, None])  # [rows, n]
            if soft_cap > 0:
                x = soft_cap * torch.tanh(x / soft_cap)
            x[:, :first] = float("-inf")
            x = torch.where(visible, x, float("-inf"))
            parts = []
            for p0 in range(0, n, PARTITION_942):
                xs = x[:, p0:p0 + PARTITION_942]
                m = xs.max(dim=1).values
                m_safe = torch.where(m == float("-inf"), 0.0, m)  # no FP4 token: l = 0
                l = torch.exp(xs - m_safe[:, None]).sum(dim=1)
                y = xs * LOG2E + (vs[p0:p0 + PARTITION_942].double() - 127)[None]
                ytop = torch.ceil(y.max(dim=1).values)
                p8 = _e4m3_pair(torch.exp2(y - torch.where(ytop == float("-inf"), 0.0, ytop)[:, None]), fnuz)
                tpow = ytop - m * LOG2E
                ip = torch.floor(tpow).nan_to_num(0.0).clamp(-127, 127)
                acc = (p8 @ v4[p0:p0 + PARTITION_942]) * torch.exp2(ip)[:, None]
                live = ~(l == 0)  # a NaN l stays NaN, as in the kernel
                o = torch.where(live[:, None], acc * (torch.exp2(tpow - ip) / l)[:, None], 0.0)
                if sink and p0 == 0:
                    x0 = scale * (q @ record[h, SINK_KEY].double() + qdm)
                    if soft_cap > 0:
                        x0 = soft_cap * torch.tanh(x0 / soft_cap)
                    m2 = torch.maximum(m, x0)
                    alpha = torch.where(live, torch.exp(m - m2), 0.0)
                    beta = torch.exp(x0 - m2)
                    l2 = l * alpha + beta
                    o2 = (o * (l * alpha)[:, None] + beta[:, None] * record[h, SINK_VALUE].double()) / l2[:, None]
                    sees0 = lo == 0  # the rows whose window holds position 0
                    o = torch.where(sees0[:, None], o2, o)
                    m, l = torch.where(sees0, m2, m), torch.where(sees0, l2, l)
                if rotation_signs is not None:
                    o = unrotate(o.float(), rotation_signs).double()
                tmp = o.to(query.dtype).double()
                vnan = (visible[:, p0:p0 + PARTITION_942] & (vs[p0:p0 + PARTITION_942] == 255)[None]).any(1)
                tmp[vnan] = float("nan")
                # the partition holds some of the row's keys (the sink counts as position 0)
                has = (visible[:, p0:p0 + PARTITION_942].any(1) |
                       ((lo == 0) & torch.tensor(p0 == 0)))
                parts.append((has, m, l, tmp))
            rows = torch.zeros(nq * gqa, head, dtype=torch.float64)
            inc = torch.stack([hs for hs, _, _, _ in parts])  # [P, rows]
            ms = torch.stack([m for _, m, _, _ in parts])
            mg = torch.where(inc, ms, float("-inf")).max(dim=0).values
            num = torch.zeros_like(rows)
            den = torch.zeros(nq * gqa, dtype=torch.float64)
            if sinks is not None:  # one more logit per head, no value
                sk = sinks[h * gqa:(h + 1) * gqa].double().repeat(nq)  # token-major rows
                mg = torch.maximum(mg, sk)
                den = torch.exp(sk - mg)
            for hs, m, l, t in parts:
                w = l * torch.exp(m - mg)
                num = num + torch.where(hs[:, None], w[:, None] * t, 0.0)
                den = den + torch.where(hs, w, 0.0)
            anyp = inc.any(0)
            rows = torch.where(anyp[:, None], num / torch.where(anyp, den, 1.0)[:, None], 0.0)
            out[q0:q1, h * gqa:(h + 1) * gqa] = rows.view(nq, gqa, head)
            row_lse = torch.where(torch.isnan(rows[:, 0]), float("nan"), mg + torch.log(den))
            lse_out[q0:q1, h * gqa:(h + 1) * gqa] = row_lse.view(nq, gqa)
    out = out.to(query.dtype)
    return (out, lse_out.float()) if return_lse else out


def _rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _problem(seq_lens, hkv, head, bs, dtype=torch.bfloat16, seed=0, kv_factory=None,
             config=PLAIN, key_format="fp4"):
    gen = torch.Generator().manual_seed(seed)
    return build_paged_problem(seq_lens, hkv, head, bs, dtype=dtype, generator=gen,
                               spare_blocks=2, poison=True, write_backend="reference",
                               kv_factory=kv_factory, config=config, key_format=key_format), gen


CONFIGS = [  # (dtype, head, block_size, gqa, num_kv_heads, seq_lens)
    (torch.bfloat16, 128, 16, 4, 2, [1, 300, 517]),
    (torch.bfloat16, 128, 16, 8, 1, [255, 256, 257]),
    (torch.bfloat16, 64, 16, 4, 2, [40, 700]),
    (torch.bfloat16, 256, 32, 2, 2, [129, 380]),
    (torch.float16, 128, 16, 4, 1, [70, 513]),
    (torch.bfloat16, 128, 256, 1, 3, [0, 600, 1]),
    (torch.bfloat16, 128, 16, 16, 1, [513]),
]


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-bs{c[2]}-g{c[3]}")
def test_lane_sim_matches_emulation_and_reference(sim_lib, cfg, native):
    dtype, head, bs, gqa, hkv, seq_lens = cfg
    prob, gen = _problem(seq_lens, hkv, head, bs, dtype)
    query = torch.randn((len(seq_lens), hkv * gqa, head), generator=gen).to(dtype)
    scale = head ** -0.5
    args = (query, prob.cache, prob.block_tables, prob.seq_lens, scale)
    out = run_sim(sim_lib, *args, native=native)
    assert torch.isfinite(out).all(), "poisoned (0xFF) slots past seq_len reached the output"
    assert (out[torch.tensor(seq_lens) == 0] == 0).all(), "seq_len 0 must give zeros"
    emu = emulate(*args)
    ref = reference(*args)
    e_emu, e_ref = _rel_err(out, emu), _rel_err(out, ref)
    print(f"{'native' if native else 'lut'} {cfg[:4]}: rel err vs emulation {e_emu:.2e}, "
          f"vs reference {e_ref:.2e}")
    assert e_emu < 1e-3
    assert e_ref < 1e-2


def test_lane_sim_soft_cap(sim_lib):
    prob, gen = _problem([300], 2, 128, 16)
    query = 8 * torch.randn((1, 8, 128), generator=gen).to(torch.bfloat16)
    args = (query, prob.cache, prob.block_tables, prob.seq_lens, 128 ** -0.5)
    for native in (True, False):
        out = run_sim(sim_lib, *args, native=native, soft_cap=5.0)
        assert _rel_err(out, emulate(*args, soft_cap=5.0)) < 1e-3
        assert _rel_err(out, reference(*args, soft_cap=5.0)) < 1e-2


def _identity_kv(seq, shape, key=2.0):
    """K row t = ``key`` at element t % D (else 0); V row t = 1.0 at element (3 t + 1) % D."""
    n, hkv, d = shape
    k = torch.zeros(shape)
    v = torch.zeros(shape)
    t = torch.arange(n)
    k[t, :, t % d] = key
    v[t, :, (3 * t + 1) % d] = 1.0
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_identity_probe(sim_lib, native):
    """One-hot K rows pick single Q elements, one-hot V rows put each token's probability in
    one output element: any permutation of Q, K or V bytes across lanes, or a transposed
    output, moves mass to the wrong element."""
    prob, gen = _problem([300, 140], 2, 128, 16, kv_factory=_identity_kv)
    query = torch.randn((2, 8, 128), generator=gen).to(torch.bfloat16)
    args = (query, prob.cache, prob.block_tables, prob.seq_lens, 0.5)
    emu = emulate(*args)
    out = run_sim(sim_lib, *args, native=native)
    assert _rel_err(out, emu) < 1e-3
    assert _rel_err(out, reference(*args)) < 1e-2
    # The probe is sharp: the same data with K's element order reversed is far away.
    flipped = query.flip(-1)
    assert _rel_err(emulate(flipped, *args[1:]), emu) > 0.3


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_single_scale_probes(sim_lib, native):
    """Change one token's K scale, one token's V scale, one query head's magnitude: the
    simulated kernel follows the emulation each time (each lane applies its own row's scale)."""
    prob, gen = _problem([300], 2, 128, 16)
    query = torch.randn((1, 8, 128), generator=gen).to(torch.bfloat16)
    args = [query, prob.cache, prob.block_tables, prob.seq_lens, 128 ** -0.5]
    base = run_sim(sim_lib, *args, native=native)
    kc, vc, ks, vs = prob.cache
    tok = 37
    blk, slot = int(prob.block_tables[0, tok // 16]), tok % 16
    for name, tensor, delta in (("key", ks, 3), ("value", vs, 4)):
        changed = [t.clone() for t in prob.cache]
        idx = 2 if name == "key" else 3
        changed[idx][blk, slot, 1] = tensor[blk, slot, 1] + delta
        out = run_sim(sim_lib, query, changed, *args[2:], native=native)
        assert _rel_err(out, emulate(query, changed, *args[2:])) < 1e-3, name
        assert torch.equal(out[:, :4], base[:, :4]), f"{name} scale of kv head 1 moved kv head 0"
        assert not torch.equal(out[:, 4:], base[:, 4:]), f"{name} scale change had no effect"
    loud = query.clone()
    loud[0, 5] *= 1000.0
    out = run_sim(sim_lib, loud, *args[1:], native=native)
    assert _rel_err(out, emulate(loud, *args[1:])) < 1e-3


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_nan_and_masking(sim_lib, native):
    """A visible NaN scale (255) makes its kv head's output NaN; 0xFF bytes past seq_len (the
    poisoned tail of the last block) never do."""
    prob, gen = _problem([300], 2, 128, 16)
    query = torch.randn((1, 8, 128), generator=gen).to(torch.bfloat16)
    rest = (prob.block_tables, prob.seq_lens, 128 ** -0.5)
    tok = 290
    blk, slot = int(prob.block_tables[0, tok // 16]), tok % 16
    assert int(prob.cache.key_scales[blk, 15, 0]) == 255  # slot 303 is past seq_len: poisoned
    for idx in (2, 3):  # key scale, value scale
        bad = [t.clone() for t in prob.cache]
        bad[idx][blk, slot, 0] = 255
        out = run_sim(sim_lib, query, bad, *rest, native=native)
        assert torch.isnan(out[0, :4]).all()
        assert torch.isfinite(out[0, 4:]).all()
        assert torch.isnan(reference(query, bad, *rest)[0, :4]).all()


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_result_does_not_depend_on_thread_order(sim_lib, native):
    """The fibers run in ascending, descending and random orders between barriers: the same
    bits each time, so no thread reads LDS that another writes without a barrier between."""
    prob, gen = _problem([300, 40], 2, 64, 16)
    query = torch.randn((2, 8, 64), generator=gen).to(torch.bfloat16)
    args = (query, prob.cache, prob.block_tables, prob.seq_lens, 0.125)
    outs = []
    for mode, seed in ((0, 1), (1, 1), (2, 7), (2, 99)):
        sim_lib.tq_sim_set_schedule(mode, seed)
        outs.append(run_sim(sim_lib, *args, native=native))
    sim_lib.tq_sim_set_schedule(0, 1)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_fp4_to_e4m3_table(sim_lib):
    """The kernel's decode (v_perm on the magnitudes + sign) equals the 16-entry table."""
    table = torch.tensor([0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C,
                          0x80, 0xB0, 0xB8, 0xBC, 0xC0, 0xC4, 0xC8, 0xCC])
    fp8 = table.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(fp8, decode_e2m1(torch.arange(16, dtype=torch.uint8)))
    lo, hi = ctypes.c_uint32(), ctypes.c_uint32()
    for word in (0x76543210, 0xFEDCBA98, 0x0F1E2D3C, 0x89ABCDEF):
        sim_lib.tq_sim_decode_fp4x8(ctypes.c_uint32(word), ctypes.byref(lo), ctypes.byref(hi))
        got = [(lo.value >> (8 * i)) & 0xFF for i in range(4)] + [(hi.value >> (8 * i)) & 0xFF for i in range(4)]
        assert got == [int(table[(word >> (4 * i)) & 0xF]) for i in range(8)]


def test_e4m3_conversion_model(sim_lib):
    """The host model of v_cvt_pk_fp8_f32 rounds like torch's float8_e4m3fn."""
    xs = torch.cat([torch.randn(2000) * 50, torch.randn(500) * 1e-2, torch.tensor([0.0, 448.0, -448.0])])
    got = torch.tensor([sim_lib.tq_sim_f32_to_e4m3(float(x)) for x in xs], dtype=torch.uint8)
    assert torch.equal(got, xs.to(torch.float8_e4m3fn).view(torch.uint8))


# --------------------------------------------------------------------------- accuracy transforms

def _transform_call(prob, query, scale, soft_cap=0.0, cu_query_lens=None, sliding_window=0):
    """The AttentionCall the aiter backend runs for ``prob`` (its config, state and slots; a
    shared state as the per-sequence records it builds)."""
    return call_with_records(prepare_attention(query, *prob.cache, prob.block_tables,
                                               prob.seq_lens, scale, logits_soft_cap=soft_cap,
                                               cu_query_lens=cu_query_lens,
                                               sliding_window=sliding_window, **prob.kwargs))


def _sim_call(lib, call, native, partition_len=PARTITION):
    return run_sim(lib, call.query, (call.key_cache, call.value_cache, call.key_scales,
                                     call.value_scales), call.block_tables, call.seq_lens,
                   call.scale, native=native, soft_cap=call.logits_soft_cap,
                   rotation_signs=call.rotation_signs, seq_state=call.seq_state,
                   state_ids=call.state_ids, sink=call.sink, cu_query_lens=call.cu_query_lens,
                   sliding_window=call.sliding_window, partition_len=partition_len)


def _emulate_call(call, fnuz=False, partition_len=PARTITION):
    return emulate(call.query, (call.key_cache, call.value_cache, call.key_scales,
                                call.value_scales), call.block_tables, call.seq_lens, call.scale,
                   call.logits_soft_cap, call.rotation_signs, call.seq_state, call.state_ids,
                   call.sink, call.cu_query_lens, call.sliding_window, fnuz=fnuz,
                   partition_len=partition_len)


def _reference_call(call):
    out = torch.empty_like(call.query)
    attention_reference(call, out)
    return out


TRANSFORM_CONFIGS = {"default": QuantConfig(), "per-sequence": PER_SEQUENCE,
                     "rotation": QuantConfig.parse("rotation"),
                     "plain": PLAIN, "smooth": QuantConfig.parse("smooth"),
                     "sink": QuantConfig.parse("sink")}
TRANSFORM_SHAPES = [  # (dtype, head, block_size, gqa, num_kv_heads, seq_lens)
    (torch.bfloat16, 128, 16, 4, 2, [1, 54, 97, 300]),
    (torch.bfloat16, 64, 16, 8, 1, [97, 1, 54]),
    (torch.bfloat16, 256, 32, 2, 1, [54, 1, 257]),
    (torch.float16, 128, 16, 16, 1, [97, 1]),
    (torch.bfloat16, 128, 256, 1, 3, [0, 300, 1]),
]


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
@pytest.mark.parametrize("shape", TRANSFORM_SHAPES,
                         ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-bs{c[2]}-g{c[3]}")
@pytest.mark.parametrize("name", ["default", "per-sequence", "rotation", "plain"])
def test_lane_sim_transforms_match_emulation_and_reference(sim_lib, name, shape, native):
    """The default config (rotation + the layer's key smoothing + sink, through the shared
    state), the same with per-sequence records, rotation alone and no transform, on lengths 1 / 54 / 97 / 257 / 300 (a sequence of one token is the sink alone),
    shuffled block tables and 0xFF-poisoned unused slots, against the emulation and
    paged_attention_fp4(backend="reference")."""
    dtype, head, bs, gqa, hkv, seq_lens = shape
    prob, gen = _problem(seq_lens, hkv, head, bs, dtype, seed=3, config=TRANSFORM_CONFIGS[name])
    query = torch.randn((len(seq_lens), hkv * gqa, head), generator=gen).to(dtype)
    call = _transform_call(prob, query, head ** -0.5)
    out = _sim_call(sim_lib, call, native)
    assert torch.isfinite(out).all()
    assert (out[torch.tensor(seq_lens) == 0] == 0).all(), "seq_len 0 must give zeros"
    ref = turboquant.paged_attention_fp4(query, *prob.cache, prob.block_tables, prob.seq_lens,
                                         head ** -0.5, backend="reference", **prob.kwargs)
    e_emu, e_ref = _rel_err(out, _emulate_call(call)), _rel_err(out, ref)
    worst = float((out.double() - ref.double()).abs().max())
    print(f"{name} {'native' if native else 'lut'} {shape[:4]} lens {seq_lens}: rel err vs "
          f"emulation {e_emu:.2e}, vs reference {e_ref:.2e} (max abs {worst:.2e})")
    assert e_emu < 1e-3
    assert e_ref < 1e-2
    if TRANSFORM_CONFIGS[name].sink:
        one = seq_lens.index(1)
        assert torch.equal(out[one], ref[one]), "one token: exactly the un-rotated sink value"


@pytest.mark.parametrize("name", ["default", "smooth", "sink"])
def test_lane_sim_transforms_with_soft_cap(sim_lib, name):
    """With a soft cap and a state record the logit gets q.m back before the cap (keys with a
    per-channel offset, so that m is far from 0)."""
    g = torch.Generator().manual_seed(6)
    center = 2.0 * torch.randn(128, generator=g)
    prob, gen = _problem([1, 97, 300], 2, 128, 16, seed=5, config=TRANSFORM_CONFIGS[name],
                         kv_factory=lambda s, shape: (torch.randn(shape, generator=g) + center,
                                                      torch.randn(shape, generator=g)))
    query = 8 * torch.randn((3, 8, 128), generator=gen).to(torch.bfloat16)
    call = _transform_call(prob, query, 128 ** -0.5, soft_cap=5.0)
    for native in (True, False):
        out = _sim_call(sim_lib, call, native)
        e_emu, e_ref = _rel_err(out, _emulate_call(call)), _rel_err(out, _reference_call(call))
        print(f"soft cap {name} {'native' if native else 'lut'}: rel err vs emulation "
              f"{e_emu:.2e}, vs reference {e_ref:.2e}")
        assert e_emu < 1e-3
        assert e_ref < 1e-2
    # q.m matters under the cap: the same call without it is measurably different.
    if prob.kwargs["config"].key_smoothing is not None:
        centered = call.seq_state.clone()
        centered[:, :, KEY_CENTER] = 0
        other = _reference_call(dataclasses.replace(call, seq_state=centered))
        assert _rel_err(other, _reference_call(call)) > 1e-2


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_sink_structured(sim_lib, native):
    """A sink record whose value row is a unit vector (after rotation) and whose key is aligned
    with the query: the sink dominates, so each output row is about the un-rotated unit
    vector, i.e. a row of the rotation matrix; a single-token sequence gives it exactly."""
    config = PER_SEQUENCE
    prob, gen = _problem([1, 54, 300], 2, 128, 16, seed=7, config=config)
    query = torch.randn((3, 8, 128), generator=gen).to(torch.bfloat16)
    state = prob.kwargs["seq_state"]
    signs = turboquant.rotation.rotation_signs(128, config.rotation_seed)
    for r in range(state.shape[0]):
        for h in range(2):
            state[r, h, SINK_VALUE] = 0.0
            state[r, h, SINK_VALUE, (5 * r + 3 * h + 1) % 128] = 1.0
    call = _transform_call(prob, query, 128 ** -0.5)
    # the sink key: along the mean direction of the kv head's 4 transformed queries, long
    # enough that every one of them gives it a logit >= 40 (FP4 keys: a few units)
    for s in range(3):
        r = int(call.state_ids[s])
        for h in range(2):
            q = rotate(call.query[s, 4 * h:4 * h + 4].float() * state[r, h, KEY_SCALE], signs)
            direction = (q / q.norm(dim=-1, keepdim=True)).mean(0)
            state[r, h, SINK_KEY] = direction * (40 / (call.scale * (q @ direction).min()))
    out = _sim_call(sim_lib, call, native)
    ref = _reference_call(call)
    assert _rel_err(out, _emulate_call(call)) < 1e-3
    assert _rel_err(out, ref) < 1e-2
    for s in range(3):
        r = int(call.state_ids[s])
        for h in range(2):
            unit = unrotate(state[r, h, SINK_VALUE], signs)  # a row of R^T: +-1/sqrt(128)
            rows = out[s, 4 * h:4 * h + 4].float()
            assert (rows - unit).abs().max() < 0.02, (s, h)
            if int(call.seq_lens[s]) == 1:
                assert torch.equal(out[s, 4 * h:4 * h + 4],
                                   unit.to(torch.bfloat16).expand(4, -1)), "exactly v0 R^T"


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_bad_slot_gives_nan(sim_lib, native):
    """A state slot outside [0, num_slots) gives NaN rows for its sequence only (nothing is
    read from it); the other sequences are unchanged."""
    prob, gen = _problem([54, 1, 300], 2, 64, 16, seed=9, config=PER_SEQUENCE)
    query = torch.randn((3, 8, 64), generator=gen).to(torch.bfloat16)
    call = _transform_call(prob, query, 0.125)
    good = _sim_call(sim_lib, call, native)
    for bad_slot in (-1, prob.kwargs["seq_state"].shape[0], 1 << 30):
        ids = call.state_ids.clone()
        ids[0] = bad_slot
        ids[1] = -7
        bad = dataclasses.replace(call, state_ids=ids)
        out = _sim_call(sim_lib, bad, native)
        assert torch.isnan(out[:2]).all()
        assert torch.equal(out[2], good[2])
        assert torch.isnan(_reference_call(bad)[:2]).all()


def test_lane_sim_transforms_do_not_depend_on_thread_order(sim_lib):
    prob, gen = _problem([300, 1], 2, 64, 16, seed=11, config=PER_SEQUENCE)
    query = torch.randn((2, 8, 64), generator=gen).to(torch.bfloat16)
    call = _transform_call(prob, query, 0.125, soft_cap=4.0)
    outs = []
    for mode, seed in ((0, 1), (1, 1), (2, 7)):
        sim_lib.tq_sim_set_schedule(mode, seed)
        outs.append(_sim_call(sim_lib, call, True))
    sim_lib.tq_sim_set_schedule(0, 1)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_rotation_norm_constant(sim_lib):
    """The kernel's HEAD^-0.5 is turboquant.rotation.rotation_norm's fp32 constant."""
    for head in (64, 128, 256):
        assert sim_lib.tq_sim_rotation_norm(head) == rotation_norm(head)


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_sink_ignores_position_zero_bytes(sim_lib, native):
    """With the sink on, position 0's FP4 codes and scales never reach the output: poisoned
    to 0xFF (NaN scales) they give the same bits."""
    prob, gen = _problem([1, 54, 300], 2, 128, 16, seed=13, config=PER_SEQUENCE)
    query = torch.randn((3, 8, 128), generator=gen).to(torch.bfloat16)
    call = _transform_call(prob, query, 128 ** -0.5, soft_cap=6.0)
    base = _sim_call(sim_lib, call, native)
    poisoned = [t.clone() for t in prob.cache]
    for s in range(3):
        blk = int(prob.block_tables[s, 0])
        poisoned[0][blk, :, 0] = 0xFF
        poisoned[1][blk, :, 0] = 0xFF
        poisoned[2][blk, 0] = 0xFF
        poisoned[3][blk, 0] = 0xFF
    bad = dataclasses.replace(call, key_cache=poisoned[0], value_cache=poisoned[1],
                              key_scales=poisoned[2], value_scales=poisoned[3])
    assert torch.equal(_sim_call(sim_lib, bad, native), base)
    assert torch.equal(_reference_call(bad), _reference_call(call))


# --------------------------------------------------------------------------- multi-token, window

def _cu(q_lens):
    return torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)


def _multi_problem(seq_lens, q_lens, hkv, head, bs, gqa, dtype=torch.bfloat16, seed=0,
                   config=PLAIN, kv_factory=None, key_format="fp4"):
    """A paged problem (shuffled blocks, 0xFF-poisoned unused slots) with q_lens[s] query tokens
    for sequence s: -> (problem, query [sum(q_lens), hkv * gqa, head], cu_query_lens)."""
    prob, gen = _problem(seq_lens, hkv, head, bs, dtype, seed=seed, config=config,
                         kv_factory=kv_factory, key_format=key_format)
    query = torch.randn((sum(q_lens), hkv * gqa, head), generator=gen).to(dtype)
    return prob, query, _cu(q_lens)


def _check(lib, call, native, *, emu_tol=1e-3, ref_tol=1e-2, label="", fnuz=False):
    """The simulated kernel against the emulation and the reference: -> (out, ref)."""
    out = _sim_call(lib, call, native)
    ref = _reference_call(call)
    e_emu, e_ref = _rel_err(out, _emulate_call(call, fnuz)), _rel_err(out, ref)
    print(f"{label} {'native' if native else 'lut'}: rel err vs emulation {e_emu:.2e}, vs "
          f"reference {e_ref:.2e}")
    assert e_emu < emu_tol
    assert e_ref < ref_tol
    return out, ref


MULTI_SHAPES = [  # (dtype, head, block, gqa, num_kv_heads, seq_lens, q_lens, windows)
    # rows 4 .. 80 per sequence (q = 20: 5 tiles), chunks crossing block boundaries (77 .. 96),
    # two partitions (300); windows 1, the block size, across the partition boundary, > seq_len
    pytest.param((torch.bfloat16, 128, 16, 4, 2, [1, 54, 97, 300], [1, 5, 20, 7],
                  [0, 1, 16, 60, 1000]), marks=pytest.mark.slow),
    # one query token per tile (GQA 16); a sequence that is all query tokens (prefill from 0)
    (torch.float16, 128, 16, 16, 1, [54, 17], [3, 17], [0, 13]),
    # GQA 3 does not divide 16: a token's heads straddle tiles
    (torch.bfloat16, 64, 16, 3, 2, [97, 40, 1], [9, 1, 1], [0, 33]),
    # GQA 1, 256-token blocks: 18 rows (2 tiles) of one sequence, an empty sequence
    (torch.bfloat16, 128, 256, 1, 3, [300, 1, 0], [18, 1, 0], [0, 257]),
]


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
@pytest.mark.parametrize("shape", MULTI_SHAPES, ids=["bf16-d128-bs16-g4", "fp16-d128-bs16-g16",
                                                    "bf16-d64-bs16-g3", "bf16-d128-bs256-g1"])
def test_lane_sim_multi_token_and_window(sim_lib, shape, native):
    """Ragged query lengths (1 up to more rows than a tile), causal among a sequence's query
    tokens, sliding windows at their edges, shuffled blocks and NaN-poisoned unused slots,
    plain and with the default transforms (rotation, key smoothing, sink)."""
    dtype, head, bs, gqa, hkv, seq_lens, q_lens, windows = shape
    for name in ("plain", "default"):
        prob, query, cu = _multi_problem(seq_lens, q_lens, hkv, head, bs, gqa, dtype, seed=21,
                                         config=TRANSFORM_CONFIGS[name])
        for w in windows:
            call = _transform_call(prob, query, head ** -0.5, cu_query_lens=cu, sliding_window=w)
            out, ref = _check(sim_lib, call, native, label=f"{name} W={w} {shape[:4]}")
            assert torch.isfinite(out).all(), "masked or poisoned bytes reached the output"


@pytest.mark.parametrize("partition_len", [128, 384, 1024])
def test_lane_sim_partition_lengths(sim_lib, partition_len):
    """The launcher's plan picks the partition length (any multiple of 128): partitions of one
    step, of three, and longer than every sequence, with multi-token rows, windows that cross
    partition edges and the default transforms (the sink, the un-rotation in the fused
    reduce), against the emulation with the same partitions and the reference; the tickets
    are left at zero (the simulation checks)."""
    prob, query, cu = _multi_problem([1, 97, 300, 700], [1, 3, 9, 2], 2, 128, 16, 4, seed=5,
                                     config=QuantConfig())
    for w in (0, 130):
        call = _transform_call(prob, query, 128 ** -0.5, cu_query_lens=cu, sliding_window=w)
        out = _sim_call(sim_lib, call, True, partition_len)
        assert _rel_err(out, _emulate_call(call, partition_len=partition_len)) < 1e-3
        assert _rel_err(out, _reference_call(call)) < 1e-2


def _v_scale_spread_kv(seq, shape):
    """Values whose magnitudes span 2^-60 .. 2^20 across tokens (so one 128-token step holds V
    scales far apart), every 37th token's value row all zero (scale byte 0, 2^-127); the second
    sequence's values all near 2^-118 (products with 2^(vs - 127) would leave fp32's normal
    range: the step's own reference vb keeps them in it)."""
    n, hkv, d = shape
    g = torch.Generator().manual_seed(3 + seq)
    k = torch.randn(shape, generator=g)
    lo, hi = (-60, 21) if seq == 0 else (-119, -117)
    mag = torch.exp2(torch.randint(lo, hi, (n, 1, 1), generator=g).float())
    v = torch.randn(shape, generator=g) * mag
    v[::37] = 0.0
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_v_scale_spread(sim_lib, native):
    """V scales 80 binades apart within a step and all-zero value rows: P' is normalized per
    row from its largest e 2^(vs - vb) (vb the step's largest V scale byte), so each row's
    output keeps FP8's relative accuracy whatever the magnitudes; the zero rows add nothing."""
    prob, gen = _problem([300, 54], 2, 128, 16, kv_factory=_v_scale_spread_kv)
    query = torch.randn((2, 8, 128), generator=gen).to(torch.bfloat16)
    args = (query, prob.cache, prob.block_tables, prob.seq_lens, 128 ** -0.5)
    out = run_sim(sim_lib, *args, native=native)
    assert torch.isfinite(out).all()
    ref = reference(*args)
    for s in range(2):  # each sequence on its own scale
        assert _rel_err(out[s], emulate(*args)[s]) < 1e-3
        assert _rel_err(out[s], ref[s]) < 1e-2


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_decode_through_multi_token_kernel(sim_lib, native):
    """cu_query_lens of one token per sequence runs the multi-token instantiation: the same
    bits as the decode one, with and without a window and the transforms."""
    prob, query, cu = _multi_problem([1, 54, 300], [1, 1, 1], 2, 128, 16, 4, seed=23,
                                     config=QuantConfig())
    for w in (0, 40):
        decode = _transform_call(prob, query, 128 ** -0.5, soft_cap=6.0, sliding_window=w)
        multi = dataclasses.replace(decode, cu_query_lens=cu)
        assert torch.equal(_sim_call(sim_lib, decode, native), _sim_call(sim_lib, multi, native))


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_one_visible_key_probe(sim_lib, native):
    """W = 1: every row sees exactly one key, its own position's. Its output is that key's
    value (softmax of one logit is 1), up to the rounding of P (two E4M3 terms) and of the
    output. With the sink, the row at position 0 sees the sink alone: exactly v0 R^T."""
    seq_lens, q_lens = [54, 17], [20, 17]
    for name in ("plain", "default"):
        prob, query, cu = _multi_problem(seq_lens, q_lens, 2, 64, 16, 4, seed=25,
                                         config=TRANSFORM_CONFIGS[name])
        call = _transform_call(prob, query, 0.125, cu_query_lens=cu, sliding_window=1)
        out, ref = _check(sim_lib, call, native, label=f"one key {name}")
        # the reference's output of a one-key row is the dequantized value itself (rotated back)
        err = ((out.double() - ref.double()).abs() / ref.double().abs().clamp_min(0.5)).max()
        assert err < 2 ** -6, err
        if name == "default":
            row0 = cu[1]  # sequence 1: 17 query tokens, 17 keys: its first row is position 0
            assert torch.equal(out[row0], ref[row0]), "position 0 alone: exactly v0 R^T"
        else:
            for s, q0 in ((0, 0), (1, 20)):
                for j in (0, 7):
                    p = seq_lens[s] - q_lens[s] + j
                    blk, slot = int(prob.block_tables[s, p // 16]), p % 16
                    v = decode_e2m1(unpack_fp4(prob.cache.value_cache[blk, :, slot])).double() * \
                        decode_e8m0(prob.cache.value_scales[blk, slot]).double()[:, None]  # [Hkv, D]
                    assert torch.equal(ref[q0 + j].double(),
                                       v.repeat_interleave(4, 0).to(torch.bfloat16).double())


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_masked_nan_reaches_exactly_the_rows_that_see_it(sim_lib, native):
    """A NaN scale (255) on one key gives NaN in exactly the rows whose range holds it: later
    query tokens of the sequence (causal) inside their window; earlier tokens and rows whose
    window has passed it stay finite and keep their bits. Keys that no row sees (in a
    partition that runs, 256, or in one that is skipped, 100) change nothing."""
    seq_lens, q_lens, w = [97, 300], [20, 12], 5
    prob, query, cu = _multi_problem(seq_lens, q_lens, 2, 64, 16, 4, seed=27)
    call = _transform_call(prob, query, 0.125, cu_query_lens=cu, sliding_window=w)
    base = _sim_call(sim_lib, call, native)
    for s, key in ((0, 80), (1, 290), (1, 256), (1, 100)):
        for idx in (2, 3):  # key scale, value scale
            bad = [t.clone() for t in prob.cache]
            blk, slot = int(prob.block_tables[s, key // 16]), key % 16
            bad[idx][blk, slot, 1] = 255
            call_bad = dataclasses.replace(call, key_cache=bad[0], value_cache=bad[1],
                                           key_scales=bad[2], value_scales=bad[3])
            out = _sim_call(sim_lib, call_bad, native)
            ref = _reference_call(call_bad)
            q0 = int(cu[s])
            pos = torch.arange(seq_lens[s] - q_lens[s], seq_lens[s])
            sees = (pos >= key) & (pos - w < key)
            assert bool(sees.any()) != (key in (256, 100)) and not bool(sees.all())
            for j in range(q_lens[s]):
                kv1 = out[q0 + j, 4:]
                if sees[j]:
                    assert torch.isnan(kv1).all() and torch.isnan(ref[q0 + j, 4:]).all()
                else:
                    assert torch.equal(kv1, base[q0 + j, 4:]), (s, key, j)
                assert torch.equal(out[q0 + j, :4], base[q0 + j, :4])  # the other kv head


@pytest.mark.parametrize("build,native", [("sim_lib", True), ("sim_lib", False),
                                          ("sim_lib_942", False)],
                         ids=["native", "lut", "gfx942"])
def test_lane_sim_bad_block_ids_give_nan_rows(request, build, native):
    """Block-table entries the host checks would refuse (skipped under graph capture): -1
    padding, an id past the cache, a sequence longer than its table row. No load leaves the
    caches (the sim reads real host memory: an id of 10^8 would fault); exactly the rows that
    see a bad block's tokens are NaN, every other row keeps its bits (CONTRACT section 3).
    Both architectures' kernels."""
    sim_lib = request.getfixturevalue(build)
    seq_lens, q_lens, w = [97, 300], [20, 12], 5
    prob, query, cu = _multi_problem(seq_lens, q_lens, 2, 64, 16, 4, seed=31)
    call = _transform_call(prob, query, 0.125, cu_query_lens=cu, sliding_window=w)
    base = _sim_call(sim_lib, call, native)
    assert not torch.isnan(base).any()
    num_blocks = prob.cache[0].shape[0]
    # seq 1, column 17 (keys 272..287): rows at 288..291 see keys 284 .. 287 through the window
    for bad_id in (-1, num_blocks, 10 ** 8):
        table = prob.block_tables.clone()
        table[1, 17] = bad_id
        out = _sim_call(sim_lib, dataclasses.replace(call, block_tables=table), native)
        pos = torch.arange(seq_lens[1] - q_lens[1], seq_lens[1])
        sees = (pos - w + 1 <= 287) & (pos >= 272)
        assert bool(sees.any()) and not bool(sees.all())
        q0 = int(cu[1])
        for j in range(q_lens[1]):
            if sees[j]:
                assert torch.isnan(out[q0 + j]).all(), (bad_id, j)
            else:
                assert torch.equal(out[q0 + j], base[q0 + j]), (bad_id, j)
        assert torch.equal(out[:q0], base[:q0])  # the other sequence
    # decode: sequence 1's table one column short of its 300 keys (its last 12 keys past the
    # row): all its rows NaN, sequence 0 unchanged
    dq = query[[int(cu[1]) - 1, int(cu[2]) - 1]]
    dcall = _transform_call(prob, dq, 0.125)
    dbase = _sim_call(sim_lib, dcall, native)
    short = prob.block_tables[:, :18].contiguous()
    out = _sim_call(sim_lib, dataclasses.replace(dcall, block_tables=short), native)
    assert torch.isnan(out[1]).all() and torch.equal(out[0], dbase[0])
    assert not torch.isnan(dbase).any()


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_window_edges(sim_lib, native):
    """A window wider than every sequence is no window (same bits); a window of the block
    size and one crossing the partition boundary leave out whole partitions of long sequences
    (the skipped workgroups write nothing the reduce reads: their partials stay NaN)."""
    prob, query, cu = _multi_problem([600, 97], [3, 2], 2, 64, 16, 4, seed=29)
    call = _transform_call(prob, query, 0.125, cu_query_lens=cu)
    full = _sim_call(sim_lib, call, native)
    wide = _sim_call(sim_lib, dataclasses.replace(call, sliding_window=600), native)
    assert torch.equal(full, wide)
    for w in (16, 90, 345):  # 597 - 89 .. 599 crosses 512; 345: partitions 1 and 2 of 600
        _check(sim_lib, dataclasses.replace(call, sliding_window=w), native, label=f"W={w}")
    # decode with a window: the first partitions of the 600-token sequence are never read
    dec = _transform_call(prob, query[[2, 4]], 0.125, sliding_window=16)
    _check(sim_lib, dec, native, label="decode W=16")


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_soft_cap_saturating_with_window(sim_lib, native):
    """A soft cap far below the logits (cap 2, |logit| up to ~100): tanh saturates and many
    keys share the top logit; with multi-token rows and a window, plain and transformed."""
    for name in ("plain", "default"):
        prob, query, cu = _multi_problem([54, 300], [6, 9], 2, 128, 16, 4, seed=31,
                                         config=TRANSFORM_CONFIGS[name])
        call = _transform_call(prob, 30 * query, 128 ** -0.5, soft_cap=2.0, cu_query_lens=cu,
                               sliding_window=100)
        out, ref = _check(sim_lib, call, native, label=f"saturating cap {name}")
        uncapped = _reference_call(dataclasses.replace(call, logits_soft_cap=0.0))
        assert _rel_err(uncapped, ref) > 0.1, "the cap changes the result"


@pytest.mark.parametrize("case", ["fp4 lut", "k8v4 native"])
def test_lane_sim_multi_token_does_not_depend_on_thread_order(sim_lib, case):
    """Multi-token rows with a window and a soft cap give bit-identical output whatever order
    the simulator runs the wavefronts' lanes and workgroups in (in order, reversed, shuffled):
    FP4 keys on the LUT path, E4M3 keys (K8V4) on the native one."""
    k8v4 = case.startswith("k8v4")
    prob, query, cu = _multi_problem([97, 300], [5, 2] if k8v4 else [20, 3], 2, 64, 16,
                                     8 if k8v4 else 4, seed=51 if k8v4 else 33,
                                     config=QuantConfig(),
                                     key_format="fp8_e4m3" if k8v4 else "fp4")
    call = _transform_call(prob, query, 0.125, soft_cap=4.0, cu_query_lens=cu, sliding_window=50)
    outs = []
    for mode, seed in ((0, 1), (1, 1), (2, 7)):
        sim_lib.tq_sim_set_schedule(mode, seed)
        outs.append(_sim_call(sim_lib, call, k8v4))
    sim_lib.tq_sim_set_schedule(0, 1)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_gqa_above_16(sim_lib, native):
    """GQA 32: a query token's heads take two row tiles. Decode runs as the launcher runs it
    (the multi-token kernel with cu_query_lens 0, 1, .., num_seqs), then multi-token with a
    window and a soft cap; default transforms."""
    prob, query, cu = _multi_problem([54, 300], [1, 1], 1, 64, 16, 32, seed=35,
                                     config=QuantConfig())
    decode = _transform_call(prob, query, 0.125)
    _check(sim_lib, dataclasses.replace(decode, cu_query_lens=cu), native, label="gqa 32 decode")
    prob, query, cu = _multi_problem([97, 300], [3, 2], 1, 64, 16, 32, seed=37,
                                     config=QuantConfig())
    call = _transform_call(prob, query, 0.125, soft_cap=5.0, cu_query_lens=cu, sliding_window=40)
    out, _ = _check(sim_lib, call, native, label="gqa 32 multi-token W=40")
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- K8V4 (E4M3 keys)

K8V4_LENS = [1, 54, 97] * 5 + [300, 0]  # a batch of 17: one token, odd lengths, 2 partitions, empty
K8V4_SHAPES = [  # (dtype, head, block_size, gqa, num_kv_heads): the lane simulation's K8V4 list
    (torch.bfloat16, 128, 16, 4, 2),
    (torch.bfloat16, 64, 16, 8, 1),
    (torch.bfloat16, 256, 32, 2, 1),
    (torch.float16, 128, 16, 16, 1),
]
K8V4_IDS = ["bf16-d128-bs16-g4", "bf16-d64-bs16-g8", "bf16-d256-bs32-g2", "fp16-d128-bs16-g16"]


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
@pytest.mark.parametrize("shape", K8V4_SHAPES, ids=K8V4_IDS)
def test_lane_sim_k8v4_decode(sim_lib, shape, native):
    """E4M3 keys (K8V4, the E4M3 bytes straight into the MFMA's FP8 operand), a batch of 17
    (lengths 1 / 54 / 97 / 300 / 0), shuffled blocks and 0xFF-poisoned unused slots (0xFF is an
    E4M3 NaN as well as a NaN scale), plain and with the default transforms."""
    dtype, head, bs, gqa, hkv = shape
    for name in ("plain", "default"):
        prob, gen = _problem(K8V4_LENS, hkv, head, bs, dtype, seed=41,
                             config=TRANSFORM_CONFIGS[name], key_format="fp8_e4m3")
        assert prob.cache.key_cache.dtype == torch.float8_e4m3fn
        assert prob.cache.key_cache.shape[-1] == head
        query = torch.randn((len(K8V4_LENS), hkv * gqa, head), generator=gen).to(dtype)
        call = _transform_call(prob, query, head ** -0.5)
        out, ref = _check(sim_lib, call, native, label=f"k8v4 {name} {shape}")
        assert torch.isfinite(out).all(), "poisoned slots reached the output"
        assert (out[torch.tensor(K8V4_LENS) == 0] == 0).all(), "seq_len 0 must give zeros"
        if name == "default":
            one = K8V4_LENS.index(1)
            assert torch.equal(out[one], ref[one]), "one token: exactly the un-rotated sink value"


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
@pytest.mark.parametrize("shape", [
    # rows 4 .. 80 per sequence, windows across the partition boundary, a soft cap
    pytest.param((torch.bfloat16, 128, 16, 4, 2, [1, 54, 97, 300], [1, 5, 20, 7], [0, 16, 60]),
                 marks=pytest.mark.slow),
    (torch.bfloat16, 64, 16, 8, 1, [97, 17, 1], [9, 17, 1], [0, 13]),
    (torch.bfloat16, 256, 32, 2, 1, [54, 300], [3, 2], [0, 257]),
    (torch.float16, 128, 16, 16, 1, [54, 17], [3, 17], [0, 13]),
], ids=K8V4_IDS)
def test_lane_sim_k8v4_multi_token_window_cap(sim_lib, shape, native):
    """K8V4 with several query tokens per sequence, sliding windows (a soft cap with every
    other one), plain and with the default transforms (rotation, key smoothing with q.m under
    the cap, sink)."""
    dtype, head, bs, gqa, hkv, seq_lens, q_lens, windows = shape
    for name in ("plain", "default"):
        prob, query, cu = _multi_problem(seq_lens, q_lens, hkv, head, bs, gqa, dtype, seed=45,
                                         config=TRANSFORM_CONFIGS[name], key_format="fp8_e4m3")
        for i, w in enumerate(windows):  # the soft cap on every other window
            cap = 4.0 if i % 2 else 0.0
            call = _transform_call(prob, 4 * query, head ** -0.5, soft_cap=cap,
                                   cu_query_lens=cu, sliding_window=w)
            out, _ = _check(sim_lib, call, native, label=f"k8v4 {name} W={w} cap={cap}")
            assert torch.isfinite(out).all()


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
@pytest.mark.parametrize("shape", K8V4_SHAPES, ids=K8V4_IDS)
def test_lane_sim_k8v4_one_hot_probe(sim_lib, shape, native):
    """One-hot E4M3 keys (token t at element t % D) and one query element e per head far above
    the rest: token e has the only large logit, and its one-hot value puts the output's peak
    at element 3e + 1. A key byte read from the wrong place of the row, a lane in the wrong K
    group or a wrong token-row mapping moves (or flattens) the peak."""
    dtype, head, bs, gqa, hkv = shape
    n = head - 3  # every token's key element is distinct
    prob, gen = _problem([n, 54], hkv, head, bs, dtype, kv_factory=lambda seq, shape: _identity_kv(seq, shape, key=1.5),
                         key_format="fp8_e4m3")
    nh = hkv * gqa
    query = 0.05 * torch.randn((2, nh, head), generator=gen)
    peaks = torch.tensor([[(7 * h + 11 * s + 5) % [n, 54][s] for h in range(nh)] for s in range(2)])
    for s in range(2):
        query[s, torch.arange(nh), peaks[s]] = 20.0
    query = query.to(dtype)
    args = (query, prob.cache, prob.block_tables, prob.seq_lens, 1.0)
    out = run_sim(sim_lib, *args, native=native)
    assert _rel_err(out, emulate(*args)) < 1e-3
    assert _rel_err(out, reference(*args)) < 1e-2
    for s in range(2):
        assert torch.equal(out[s].float().argmax(-1), (3 * peaks[s] + 1) % head), s
        assert (out[s].float().amax(-1) > 0.99).all()


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_k8v4_nan_and_position_zero(sim_lib, native):
    """A NaN E4M3 key byte (0x7F) or a NaN key scale on a visible token makes its kv head's
    rows NaN (the reference too) and leaves the other kv head's bits alone; with the sink,
    position 0's key bytes and scales poisoned to 0xFF change nothing."""
    prob, gen = _problem([300], 2, 128, 16, seed=47, key_format="fp8_e4m3")
    query = torch.randn((1, 8, 128), generator=gen).to(torch.bfloat16)
    rest = (prob.block_tables, prob.seq_lens, 128 ** -0.5)
    base = run_sim(sim_lib, query, prob.cache, *rest, native=native)
    blk, slot = int(prob.block_tables[0, 290 // 16]), 290 % 16
    for what in ("byte", "scale"):
        bad = [t.clone() for t in prob.cache]
        if what == "byte":
            bad[0].view(torch.uint8)[blk, 0, slot, 77] = 0x7F
        else:
            bad[2][blk, slot, 0] = 255
        out = run_sim(sim_lib, query, bad, *rest, native=native)
        assert torch.isnan(out[0, :4]).all(), what
        assert torch.equal(out[0, 4:], base[0, 4:]), what
        assert torch.isnan(reference(query, bad, *rest)[0, :4]).all(), what
    prob, gen = _problem([1, 54, 300], 2, 128, 16, seed=49, config=QuantConfig(),
                         key_format="fp8_e4m3")
    query = torch.randn((3, 8, 128), generator=gen).to(torch.bfloat16)
    call = _transform_call(prob, query, 128 ** -0.5, soft_cap=6.0)
    good = _sim_call(sim_lib, call, native)
    keys, scales = prob.cache.key_cache.clone(), prob.cache.key_scales.clone()
    for s in range(3):
        blk = int(prob.block_tables[s, 0])
        keys.view(torch.uint8)[blk, :, 0] = 0xFF
        scales[blk, 0] = 0xFF
    poisoned = dataclasses.replace(call, key_cache=keys, key_scales=scales)
    assert torch.equal(_sim_call(sim_lib, poisoned, native), good)


# --------------------------------------------------------------------------- learned sinks, lse

def _state_outputs(lib, call, native, sinks):
    """(out, lse) of the simulated kernel, the emulation and the reference for ``call`` with
    learned sinks (or None) and the lse output."""
    kw = dict(cu_query_lens=call.cu_query_lens, sliding_window=call.sliding_window)
    tensors = (call.query, (call.key_cache, call.value_cache, call.key_scales, call.value_scales),
               call.block_tables, call.seq_lens, call.scale)
    transforms = dict(rotation_signs=call.rotation_signs, seq_state=call.seq_state,
                      state_ids=call.state_ids, sink=call.sink)
    sim = run_sim(lib, *tensors, native=native, soft_cap=call.logits_soft_cap, sinks=sinks,
                  return_lse=True, **transforms, **kw)
    emu = emulate(*tensors, call.logits_soft_cap, sinks=sinks, return_lse=True, **transforms, **kw)
    ref_call = dataclasses.replace(call, sinks=sinks, return_lse=True)
    out = torch.empty_like(call.query)
    lse = torch.empty(call.query.shape[:2])
    attention_reference(ref_call, out, lse)
    return sim, emu, (out, lse)


def _lse_close(got, want, tol):
    """Equal non-finite entries (NaN, -inf), finite ones within tol."""
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin) and torch.equal(got[~fin & ~torch.isnan(want)],
                                                               want[~fin & ~torch.isnan(want)])
    err = float((got[fin] - want[fin]).abs().max()) if fin.any() else 0.0
    assert err < tol, err
    return err


STATE_CASES = [  # (key_format, config, dtype, head, bs, gqa, hkv, seq_lens, q_lens or None, window, cap)
    ("fp4", "plain", torch.bfloat16, 128, 16, 4, 2, [0, 1, 54, 97, 300], None, 0, 0.0),
    ("fp4", "default", torch.bfloat16, 128, 16, 4, 2, [0, 1, 54, 97, 300], None, 0, 0.0),
    ("fp8_e4m3", "default", torch.bfloat16, 64, 16, 8, 1, [97, 0, 1, 300], [9, 0, 1, 2], 40, 0.0),
    ("fp4", "smooth", torch.bfloat16, 64, 16, 4, 2, [300, 54, 0], [3, 5, 0], 0, 5.0),
    ("fp8_e4m3", "plain", torch.float16, 128, 16, 16, 1, [54, 17, 0], [3, 17, 0], 13, 0.0),
]


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
@pytest.mark.parametrize("case", STATE_CASES, ids=["fp4-plain", "fp4-default", "k8v4-default-multi-w40",
                                                  "fp4-smooth-multi-cap", "k8v4-plain-fp16-w13"])
def test_lane_sim_learned_sinks_and_lse(sim_lib, case, native):
    """Learned sinks (one more logit per head, no value, not capped, whatever the window) and
    the lse output (natural log, of the true logits: q.m of key smoothing included), with and
    without sinks, against the emulation and the reference; seq_len 0 rows give out 0 and lse
    -inf (the sink's logit with sinks); windows leave whole partitions out."""
    key_format, name, dtype, head, bs, gqa, hkv, seq_lens, q_lens, w, cap = case
    if q_lens is None:
        prob, gen = _problem(seq_lens, hkv, head, bs, dtype, seed=61,
                             config=TRANSFORM_CONFIGS[name], key_format=key_format)
        query, cu = torch.randn((len(seq_lens), hkv * gqa, head), generator=gen).to(dtype), None
    else:
        prob, query, cu = _multi_problem(seq_lens, q_lens, hkv, head, bs, gqa, dtype, seed=61,
                                         config=TRANSFORM_CONFIGS[name], key_format=key_format)
    call = _transform_call(prob, 2 * query, head ** -0.5, soft_cap=cap, cu_query_lens=cu,
                           sliding_window=w)
    plain_out = _sim_call(sim_lib, call, native)
    empty_rows = (torch.tensor(seq_lens) == 0) if cu is None else torch.zeros(len(query), dtype=torch.bool)
    for sinks in (None, 3.0 * torch.randn(hkv * gqa, generator=torch.Generator().manual_seed(5))):
        (out, lse), (eo, el), (ro, rl) = _state_outputs(sim_lib, call, native, sinks)
        assert _rel_err(out, eo) < 1e-3 and _rel_err(out, ro) < 1e-2
        e_emu, e_ref = _lse_close(lse, el, 1e-3), _lse_close(lse, rl, 2e-2)
        print(f"{case[:2]} sinks={sinks is not None}: lse max abs err vs emulation {e_emu:.2e}, "
              f"vs reference {e_ref:.2e}")
        if sinks is None:
            # the same output; with a record the logits carry q.m now (other fp32 roundings)
            if call.seq_state is None:
                assert torch.equal(out, plain_out), "asking for the lse changes the output"
            assert _rel_err(out, plain_out) < 1e-2
            assert (lse[empty_rows] == float("-inf")).all()
        else:
            assert torch.equal(lse[empty_rows], sinks.expand(int(empty_rows.sum()), -1))
        assert (out[empty_rows] == 0).all()


@pytest.mark.parametrize("native", [True, False], ids=["native", "lut"])
def test_lane_sim_lse_nan_rows_and_merge(sim_lib, native):
    """NaN rows: a visible NaN value scale or key scale, or a state slot outside the tensor,
    give NaN out and lse for exactly their rows. Merging the states of a split sequence
    (turboquant.merge_attention_states) gives the unsplit call's output and lse."""
    from turboquant.states import merge_attention_states

    prob, gen = _problem([300, 97], 2, 64, 16, seed=63, config=QuantConfig())
    query = torch.randn((2, 8, 64), generator=gen).to(torch.bfloat16)
    call = _transform_call(prob, query, 0.125)
    sinks = torch.randn(8, generator=gen)
    base, _, _ = _state_outputs(sim_lib, call, native, sinks)
    blk, slot = int(prob.block_tables[0, 290 // 16]), 290 % 16
    for idx in (2, 3):
        bad = [t.clone() for t in prob.cache]
        bad[idx][blk, slot, 1] = 255
        bcall = dataclasses.replace(call, key_cache=bad[0], value_cache=bad[1], key_scales=bad[2],
                                    value_scales=bad[3])
        (out, lse), _, (_, rl) = _state_outputs(sim_lib, bcall, native, sinks)
        assert torch.isnan(lse[0, 4:]).all() and torch.isnan(rl[0, 4:]).all()
        assert torch.equal(lse[0, :4], base[1][0, :4]) and torch.equal(lse[1], base[1][1])
        assert torch.isnan(out[0, 4:]).all()
    ids = call.state_ids.clone()
    ids[1] = 99
    (out, lse), _, (_, rl) = _state_outputs(sim_lib, dataclasses.replace(call, state_ids=ids),
                                            native, sinks)
    assert torch.isnan(lse[1]).all() and torch.isnan(rl[1]).all() and torch.isnan(out[1]).all()
    assert torch.equal(lse[0], base[1][0])
    # a NaN learned sink: its head's rows NaN (output and lse), the other heads' unchanged
    nan_sinks = sinks.clone()
    nan_sinks[2] = float("nan")
    (out, lse), _, (ro, rl) = _state_outputs(sim_lib, call, native, nan_sinks)
    assert torch.isnan(out[:, 2]).all() and torch.isnan(lse[:, 2]).all()
    assert torch.isnan(ro[:, 2]).all() and torch.isnan(rl[:, 2]).all()
    assert torch.equal(out[:, 3], base[0][:, 3]) and torch.equal(lse[:, 3], base[1][:, 3])
    # split sequence 0 (300 keys) into keys [0, 200) and [200, 300) through the window-free
    # multi-token path: a part's keys as their own sequence; sinks in the first part only
    plain, gen = _problem([300], 2, 64, 16, seed=65)
    q = torch.randn((1, 8, 64), generator=gen).to(torch.bfloat16)
    whole = _transform_call(plain, q, 0.125)
    (wo, wl), _, _ = _state_outputs(sim_lib, whole, native, sinks)
    tables = plain.block_tables
    first = dataclasses.replace(whole, seq_lens=torch.tensor([200], dtype=torch.int32))
    (ao, al), _, _ = _state_outputs(sim_lib, first, native, sinks)
    assert _rel_err(ao, wo) > 1e-2  # the parts differ from the whole
    # the second part as seen by a query at position 299: drop the first 192 keys (12 blocks)
    # and mask 192 .. 199 by a window of 100 keys
    second = dataclasses.replace(whole, block_tables=tables[:, 12:].contiguous(),
                                 seq_lens=torch.tensor([108], dtype=torch.int32),
                                 sliding_window=100)
    (bo, bl), _, _ = _state_outputs(sim_lib, second, native, None)
    mo, ml = merge_attention_states(ao, al, bo, bl)
    assert (ml - wl).abs().max() < 1e-3
    assert _rel_err(mo, wo) < 1e-2


# --------------------------------------------------------------------------- gfx942 (MI300X)

# The FNUZ emulation follows the gfx942 build to ~1e-4; the OCP (gfx950) emulation of the same
# data is ~1e-3 away, so this bound also says the FNUZ encodes are what runs.
GFX942_EMU_TOL = 5e-4

FNUZ_TABLE = [0x00, 0x38, 0x40, 0x44, 0x48, 0x4C, 0x50, 0x54,
              0x00, 0xB8, 0xC0, 0xC4, 0xC8, 0xCC, 0xD0, 0xD4]


def test_gfx942_fnuz_table_and_conversion(sim_lib_942):
    """The gfx942 build's FP4 decode is the 16-entry E4M3FNUZ table (code 8, -0, is 0x00: 0x80
    is FNUZ's NaN), and its model of v_cvt_pk_fp8_f32 rounds like torch's float8_e4m3fnuz."""
    lib = sim_lib_942
    assert lib.tq_sim_is_gfx942() == 1
    table = torch.tensor(FNUZ_TABLE, dtype=torch.uint8)
    assert torch.equal(table.view(torch.float8_e4m3fnuz).float(),
                       decode_e2m1(torch.arange(16, dtype=torch.uint8)))
    lo, hi = ctypes.c_uint32(), ctypes.c_uint32()
    for word in (0x76543210, 0xFEDCBA98, 0x0F1E2D3C, 0x89ABCDEF, 0x88888888):
        lib.tq_sim_decode_fp4x8(ctypes.c_uint32(word), ctypes.byref(lo), ctypes.byref(hi))
        got = [(lo.value >> (8 * i)) & 0xFF for i in range(4)] + [(hi.value >> (8 * i)) & 0xFF for i in range(4)]
        assert got == [FNUZ_TABLE[(word >> (4 * i)) & 0xF] for i in range(8)]
    xs = torch.cat([torch.randn(2000) * 30, torch.randn(500) * 1e-2, torch.randn(200) * 1e-3,
                    torch.tensor([0.0, -0.0, 240.0, -240.0, 2.0 ** -10, -(2.0 ** -11)])])
    want = xs.to(torch.float8_e4m3fnuz).view(torch.uint8)
    for fn in (lib.tq_sim_f32_to_e4m3fnuz, lib.tq_sim_f32_to_fp8):
        got = torch.tensor([fn(float(x)) for x in xs], dtype=torch.uint8)
        assert torch.equal(got, want)
    assert 0x80 not in want.tolist()  # no -0 byte
    assert lib.tq_sim_q_scale_byte(ctypes.c_float(240.0)) == 127  # Q scaled to FNUZ's 240
    assert lib.tq_sim_q_scale_byte(ctypes.c_float(241.0)) == 128


GFX942_CONFIGS = [  # (dtype, head, block_size, gqa, num_kv_heads, seq_lens)
    (torch.bfloat16, 128, 16, 4, 2, [1, 300, 517]),
    (torch.bfloat16, 256, 32, 2, 2, [129, 380]),
    (torch.float16, 128, 16, 16, 1, [513]),
]


@pytest.mark.parametrize("cfg", GFX942_CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-bs{c[2]}-g{c[3]}")
def test_gfx942_lane_sim_decode(sim_lib_942, cfg):
    """Decode on the gfx942 build against the FNUZ emulation and the reference."""
    dtype, head, bs, gqa, hkv, seq_lens = cfg
    prob, gen = _problem(seq_lens, hkv, head, bs, dtype)
    query = torch.randn((len(seq_lens), hkv * gqa, head), generator=gen).to(dtype)
    args = (query, prob.cache, prob.block_tables, prob.seq_lens, head ** -0.5)
    out = run_sim(sim_lib_942, *args, native=False)
    assert torch.isfinite(out).all(), "poisoned (0xFF) slots past seq_len reached the output"
    assert (out[torch.tensor(seq_lens) == 0] == 0).all()
    e_emu, e_ref = _rel_err(out, emulate(*args, fnuz=True)), _rel_err(out, reference(*args))
    print(f"gfx942 {cfg[:4]}: rel err vs FNUZ emulation {e_emu:.2e}, vs reference {e_ref:.2e}")
    assert e_emu < GFX942_EMU_TOL
    assert e_ref < 1e-2


def test_gfx942_lane_sim_probes(sim_lib_942):
    """The one-hot probe (any lane or byte permutation of Q, K, V moves mass), one token's K
    and V scale changed (each applied in fp32 to its own token: a column of S, a row of P), a
    NaN scale reaching exactly its kv head."""
    prob, gen = _problem([300, 140], 2, 128, 16, kv_factory=_identity_kv)
    query = torch.randn((2, 8, 128), generator=gen).to(torch.bfloat16)
    args = (query, prob.cache, prob.block_tables, prob.seq_lens, 0.5)
    out = run_sim(sim_lib_942, *args, native=False)
    assert _rel_err(out, emulate(*args, fnuz=True)) < GFX942_EMU_TOL
    assert _rel_err(out, reference(*args)) < 1e-2
    prob, gen = _problem([300], 2, 128, 16)
    query = torch.randn((1, 8, 128), generator=gen).to(torch.bfloat16)
    rest = (prob.block_tables, prob.seq_lens, 128 ** -0.5)
    base = run_sim(sim_lib_942, query, prob.cache, *rest, native=False)
    tok = 37
    blk, slot = int(prob.block_tables[0, tok // 16]), tok % 16
    for idx, delta in ((2, 3), (3, 4), (2, None), (3, None)):  # key / value scale; None: NaN
        changed = [t.clone() for t in prob.cache]
        changed[idx][blk, slot, 1] = 255 if delta is None else changed[idx][blk, slot, 1] + delta
        out = run_sim(sim_lib_942, query, changed, *rest, native=False)
        assert torch.equal(out[:, :4], base[:, :4]), "kv head 1's scale moved kv head 0"
        if delta is None:
            assert torch.isnan(out[0, 4:]).all()
        else:
            assert not torch.equal(out[:, 4:], base[:, 4:])
            assert _rel_err(out, emulate(query, changed, *rest, fnuz=True)) < GFX942_EMU_TOL


def test_gfx942_lane_sim_multi_token_transforms(sim_lib_942):
    """Multi-token rows (GQA 4, rows straddling tiles), windows, a soft cap, plain and with the
    default transforms (rotation, key smoothing, sink) on the gfx942 build."""
    for name in ("plain", "default"):
        prob, query, cu = _multi_problem([54, 300], [20, 3], 2, 64, 16, 4, seed=41,
                                         config=TRANSFORM_CONFIGS[name])
        for w, cap in ((0, 0.0), (40, 4.0)):
            call = _transform_call(prob, query, 0.125, soft_cap=cap, cu_query_lens=cu,
                                   sliding_window=w)
            out, _ = _check(sim_lib_942, call, False, fnuz=True, emu_tol=GFX942_EMU_TOL, label=f"gfx942 {name} W={w}")
            assert torch.isfinite(out).all()


def test_gfx942_has_no_native_or_k8v4_instantiation(sim_lib_942):
    """gfx942 has no scaled MFMA: the native FP4 and the K8V4 kernels are not built (rc -3)."""
    prob, gen = _problem([40], 2, 128, 16)
    query = torch.randn((1, 8, 128), generator=gen).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="rc=-3"):
        run_sim(sim_lib_942, query, prob.cache, prob.block_tables, prob.seq_lens, 0.1, native=True)
