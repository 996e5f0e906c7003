"""GPU tests of the ``cuda`` backend against the reference backend (skipped, with the
registry's reason, where the backend cannot run)."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import turboquant
from turboquant import registry
from turboquant._backends import cuda as tq_cuda
from turboquant.cache import allocate_cache, build_paged_problem
from turboquant.config import PER_SEQUENCE, PLAIN, QuantConfig
from turboquant.ops import ATTENTION_SCHEMA, CACHE_WRITE_SCHEMA
from turboquant.rotation import rotation_signs
from turboquant.smoothing import allocate_state

from conftest import first_write_state

_REASON = tq_cuda.BACKEND.unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"cuda backend: {_REASON}")

ROOT = Path(__file__).resolve().parents[2]


CONFIGS = {"plain": PLAIN, "default": QuantConfig(), "rotation": QuantConfig.parse("rotation"),
           "smooth": QuantConfig.parse("smooth"), "per-sequence": PER_SEQUENCE}


def _problem(lens, hq, hkv, d, bs, dtype=torch.bfloat16, qlens=None, seed=0, spare=3,
             config="default", key_format="fp4"):
    """A paged problem written by the reference writer with ``config`` (a CONFIGS name)."""
    g = torch.Generator().manual_seed(seed)
    prob = build_paged_problem(lens, hkv, d, bs, dtype=dtype, device="cuda", generator=g,
                               write_backend="reference", spare_blocks=spare,
                               config=CONFIGS[config], key_format=key_format)
    ntok = len(lens) if qlens is None else sum(qlens)
    q = torch.randn(ntok, hq, d, generator=g).to(dtype).cuda()
    cu = None
    if qlens is not None:
        cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32,
                          device="cuda")
    return prob, q, cu


def _run(backend, prob, q, cu=None, **kw):
    return turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                          q.shape[-1] ** -0.5, cu_query_lens=cu,
                                          backend=backend, **{**prob.kwargs, **kw})


def _compare(out, ref, atol=2e-2):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all() == torch.isfinite(r).all()
    err = (o - r).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(o.flatten(), r.flatten(), dim=0).item()
    assert err <= atol, f"max abs error {err}"
    assert cos >= 0.9999, f"cosine {cos}"


# The SM90a FP8 decode kernel (attention_decode_wgmma.cuh) rounds each P' = 2^(x + e_v - m + 8)
# once to E4M3 (3 mantissa bits): by at most 2^-4 of it, and by 2^-3 / sqrt(12) of it in RMS
# (uniform within a binade's spacing, at the binade's bottom); its l sums the unrounded P'. Its
# rows are held to that: cosine >= 1 - U^2 / 2 over the call (the output's relative RMS error is
# that of a weighted mean of independently rounded weights), and in each row at most 2^-4 of the
# row's largest |value| over the fp16 kernels' 2e-2 (where one key dominates a row its weight's
# rounding moves the row by up to 2^-4 of it). Measured: cosine 0.99972 on long random rows.
FP8_P_RMS = 2.0 ** -3 / math.sqrt(12.0)


def _compare_call(out, ref, prob, q, cu=None):
    """_compare, or for the rows of the call's single-token sequences where the SM90a FP8 decode
    kernel ran them (FP4 keys, D 128, SM90) the criteria above; multi-token rows (finite) get
    _compare."""
    fp4 = prob.cache.key_cache.dtype == torch.uint8
    if not _wgmma_decode_expected(q.shape[-1], "fp4" if fp4 else "fp8_e4m3"):
        return _compare(out, ref)
    o, r = out.float(), ref.float()
    assert out.shape == ref.shape and torch.equal(torch.isfinite(o), torch.isfinite(r))
    starts = list(range(q.shape[0] + 1)) if cu is None else cu.tolist()
    single = torch.zeros(q.shape[0], dtype=torch.bool, device=o.device)
    for s_ in range(len(starts) - 1):
        single[starts[s_]] = starts[s_ + 1] == starts[s_] + 1
    single = single[:, None].expand(r.shape[:2])  # [tokens, heads]
    fin = torch.isfinite(r).all(-1)
    dec = single & fin
    if dec.any():
        od, rd = o[dec], r[dec]
        err = (od - rd).abs().amax(-1)
        tol = 2e-2 + 2.0 ** -4 * rd.abs().amax(-1)
        assert (err <= tol).all(), f"max abs error {(err - tol).max().item()} over the bound"
        cos = torch.nn.functional.cosine_similarity(od.flatten(), rd.flatten(), dim=0).item()
        assert cos >= 1 - FP8_P_RMS ** 2 / 2, f"cosine {cos}"
    multi = ~single & fin
    if multi.any():  # the multi-token rows ran the other kernels
        _compare(out[multi], ref[multi])


def test_registered_schemas_match_ops_py():
    for name, schema in (("paged_attention_fp4_cuda", ATTENTION_SCHEMA),
                         ("reshape_and_cache_fp4_cuda", CACHE_WRITE_SCHEMA)):
        op = getattr(torch.ops.turboquant, name).default
        assert str(op._schema) == f"turboquant::{name}{schema}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"turboquant::{name}", "CUDA")


def test_backend_listed_and_selected():
    rows = {r["name"]: r for r in turboquant.api.backends()}
    assert rows["cuda"]["available"], rows["cuda"]["reason"]
    prob, q, cu = _problem([5], 8, 8, 128, 16)
    call = turboquant.api.prepare_attention(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                            0.1, **prob.kwargs)
    assert registry.select("auto", "attention", call).name == "cuda"
    capped = turboquant.api.prepare_attention(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                              0.1, logits_soft_cap=5.0, **prob.kwargs)
    assert registry.select("auto", "attention", capped).name == "cuda"


# 8 / 2 heads (G = 4) runs the decode kernel, 32 / 2 (G = 16) the general kernel
@pytest.mark.parametrize("config", ["plain", "default", "per-sequence"])
@pytest.mark.parametrize("hq", [8, 32])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
def test_head_dims_block_sizes(d, bs, hq, config):
    prob, q, _ = _problem([1, 54, 97, 0, 300, 17], hq, 2, d, bs, seed=d + bs + hq, config=config)
    _compare_call(_run("cuda", prob, q), _run("reference", prob, q), prob, q)


@pytest.mark.parametrize("config", ["rotation", "smooth"])
@pytest.mark.parametrize("hq,qlens", [(8, None), (32, None), (8, [3, 1, 2, 1])])
def test_each_transform_alone(config, hq, qlens):
    """Rotation without records, records (key smoothing) without rotation, decode and the
    general kernel."""
    prob, q, cu = _problem([54, 1, 97, 300], hq, 2, 128, 16, qlens=qlens, seed=7, config=config)
    _compare_call(_run("cuda", prob, q, cu), _run("reference", prob, q, cu), prob, q, cu)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 8), (64, 8), (28, 4), (32, 1), (40, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gqa_and_dtypes(hq, hkv, dtype):
    lens = [1, 54, 97, 0, 33, 1000, 5, 16, 17, 64, 65, 128, 129, 255, 256, 257, 2]  # batch 17
    prob, q, _ = _problem(lens, hq, hkv, 128, 16, dtype=dtype, seed=hq * 7 + hkv)
    _compare_call(_run("cuda", prob, q), _run("reference", prob, q), prob, q)


@pytest.mark.parametrize("config", ["plain", "default", "per-sequence"])
def test_long_context_split_kv(config):
    prob, q, _ = _problem([9000, 20000, 4097], 32, 8, 128, 16, seed=5, config=config)
    _compare_call(_run("cuda", prob, q), _run("reference", prob, q), prob, q)
    # a user bound smaller than the table capacity
    out = _run("cuda", prob, q, max_seq_len=20000)
    _compare_call(out, _run("reference", prob, q), prob, q)


def test_long_partitions_cross_block_id_batches():
    """32 sequences of ~12k tokens: no split, so each decode warp walks ~96 tiles and moves to
    a new batch of 32 prefetched block ids twice (shuffled block table)."""
    lens = [12288 - 37 * i for i in range(32)]
    prob, q, _ = _problem(lens, 32, 8, 128, 16, seed=12, spare=0)
    _compare_call(_run("cuda", prob, q), _run("reference", prob, q), prob, q)


@pytest.mark.parametrize("hq,hkv,qlens", [
    (32, 8, [3, 8, 1, 2]), (8, 8, [8, 8, 8, 1]), (28, 4, [5, 2, 8, 7]), (64, 8, [4, 1, 8, 3]),
    (32, 8, [20, 30, 9, 33]), (64, 4, [3, 9, 1, 2])])
@pytest.mark.parametrize("window,cap,config", [(0, 0.0, "default"), (64, 0.0, "default"),
                                               (0, 30.0, "plain"), (100, 10.0, "plain"),
                                               (0, 30.0, "default"), (100, 10.0, "default")])
def test_multi_token(hq, hkv, qlens, window, cap, config):
    """Multi-token queries: up to 32 (query token, head) pairs per sequence on average run the
    decode kernel's 16-column form, more the general kernel (the last two cases: 92 and 60)."""
    prob, q, cu = _problem([700, 33, 9, 300], hq, hkv, 128, 16, qlens=qlens, seed=len(qlens),
                           config=config)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    names = _kernel_names(lambda: _run("cuda", prob, q, cu, **kw))
    general = sum(qlens) * (hq // hkv) > 32 * len(qlens)
    assert any(("fp4_kernel" if general else "decode_kernel") in n for n in names), names
    _compare(_run("cuda", prob, q, cu, **kw), _run("reference", prob, q, cu, **kw))


@pytest.mark.parametrize("window", [1, 16, 63, 1000])
@pytest.mark.parametrize("hq", [32, 16])
def test_sliding_window_decode(window, hq):
    """Windows that hold position 0 (the sink) for some sequences and not for others."""
    prob, q, _ = _problem([700, 33, 2000, 1], hq, 8, 128, 32, seed=window)
    _compare_call(_run("cuda", prob, q),
                  _run("reference", prob, q), prob, q)


@pytest.mark.parametrize("cap", [5.0, 50.0])
@pytest.mark.parametrize("config", ["plain", "rotation", "smooth", "default"])
def test_soft_cap(cap, config):
    """With key smoothing the capped logit needs q.m added back (a key center far from 0 makes
    that term large: the records here are centered on the Gaussian keys' mean, ~0, so the test
    below also shifts m)."""
    prob, q, _ = _problem([700, 33], 32, 8, 64, 16, seed=3, config=config)
    q = q * 4
    _compare_call(_run("cuda", prob, q),
                  _run("reference", prob, q), prob, q)


@pytest.mark.parametrize("hq,qlens", [(32, None), (8, None), (8, [3, 1, 1])])
def test_soft_cap_with_a_key_center_far_from_zero(hq, qlens):
    """Keys with a large common offset per channel: smoothing removes it (m ~ offset), so under
    a soft cap q.m must be added back or the logits change."""
    g = torch.Generator().manual_seed(9)

    def kv(s, shape):
        k = torch.randn(shape, generator=g) + 3.0 * torch.randn(shape[1:], generator=g)
        return k.bfloat16(), torch.randn(shape, generator=g).bfloat16()

    prob = build_paged_problem([300, 54, 1], 2, 128, 16, device="cuda", generator=g,
                               write_backend="cuda", kv_factory=kv, config=QuantConfig())
    ntok = 3 if qlens is None else sum(qlens)
    q = torch.randn(ntok, hq, 128, generator=g).bfloat16().cuda()
    cu = None if qlens is None else torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(),
                                                 dtype=torch.int32, device="cuda")
    for cap in (5.0, 30.0):
        _compare_call(_run("cuda", prob, q, cu, logits_soft_cap=cap),
                      _run("reference", prob, q, cu, logits_soft_cap=cap), prob, q, cu)


@pytest.mark.parametrize("config,factors", [("plain", (1e-6, 1e3)), ("default", (1e-6, 8.0))])
def test_large_and_small_query_scale(config, factors):
    """A bf16 query is exact in the kernels' prescaled fp16 (plain); a transformed one is fp32
    and takes one fp16 rounding (2^-11 relative on each logit): at 1000x the usual logits that
    is far beyond the tolerance, so the default config is checked up to 8x."""
    prob, q, _ = _problem([300, 40], 32, 8, 128, 16, seed=11, config=config)
    for factor in factors:
        qq = (q.float() * factor).to(q.dtype)
        _compare_call(_run("cuda", prob, qq), _run("reference", prob, qq), prob, qq)


@pytest.mark.parametrize("hq,qlens", [(8, None), (32, None), (8, [1, 1])])
def test_sink_alone_is_the_output(hq, qlens):
    """Structured: a one-token sequence sees only its sink, so the output is position 0's value
    exactly (up to the output's rounding), whatever the FP4 bytes of position 0 hold (the
    per-sequence record; the shared state's table would miss changed bytes)."""
    prob, q, cu = _problem([1, 300], hq, 2, 128, 16, qlens=qlens, seed=4, config="per-sequence")
    kc, vc, ks, vs = prob.cache
    b0 = prob.block_tables[0, 0]
    kc[b0, :, 0], vc[b0, :, 0] = 0x77, 0x77  # the cache's own bytes of position 0: ignored
    out = _run("cuda", prob, q, cu)
    v0 = prob.values[0][0].float()  # [Hkv, D]
    want = v0.repeat_interleave(hq // 2, dim=0)
    torch.testing.assert_close(out[0].float(), want, rtol=1e-2, atol=2e-2)
    _compare_call(out, _run("reference", prob, q, cu), prob, q, cu)


def test_state_slot_out_of_range_gives_nan():
    prob, q, _ = _problem([100, 100, 40], 32, 8, 128, 16, config="per-sequence")
    ids = prob.kwargs["state_ids"].clone()
    ids[1] = 10 ** 6
    with turboquant.value_checks(False):
        out = _run("cuda", prob, q, state_ids=ids)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()


def test_seq_len_zero_gives_zeros():
    prob, q, _ = _problem([0, 0, 5], 8, 2, 128, 16)
    out = _run("cuda", prob, q)
    assert (out[:2] == 0).all()


def test_nan_scale_in_used_token():
    prob, q, _ = _problem([100, 100], 8, 2, 128, 16, seed=2)
    ks = prob.cache.key_scales
    blk = prob.block_tables[0, 3].item()
    ks[blk, 5, 1] = 255  # token 53 of seq 0, kv head 1
    out = _run("cuda", prob, q)
    assert torch.isnan(out[0, 4:8]).all()  # heads of kv head 1
    assert torch.isfinite(out[0, :4]).all() and torch.isfinite(out[1]).all()
    vs = prob.cache.value_scales
    vs[prob.block_tables[1, 0].item(), 1, 0] = 255  # token 1 (position 0 is the sink's)
    out = _run("cuda", prob, q)
    assert torch.isnan(out[1, :4]).all() and torch.isfinite(out[1, 4:]).all()


def test_poisoned_unused_slots_do_not_leak():
    # build_paged_problem poisons every unwritten byte (0xFF: NaN scales); partially filled
    # last blocks must not leak into the output
    prob, q, _ = _problem([1, 15, 17, 31], 8, 2, 128, 16)
    out = _run("cuda", prob, q)
    assert torch.isfinite(out).all()
    _compare_call(out, _run("reference", prob, q), prob, q)


def test_out_of_range_block_id_gives_nan():
    prob, q, _ = _problem([100, 100, 40], 8, 2, 128, 16)
    bt = prob.block_tables.clone()
    bt[1, 2] = 10 ** 6
    bt[2, 0] = -5
    with turboquant.value_checks(False):
        out = turboquant.paged_attention_fp4(q, *prob.cache, bt, prob.seq_lens, 0.1,
                                             backend="cuda", **prob.kwargs)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    assert torch.isfinite(out[0]).all()


def _writer_inputs(n, hkv, d, dtype, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = (torch.randn(n, hkv, d, generator=g) * torch.rand(n, hkv, 1, generator=g) * 8).to(dtype)
    val = torch.randn(n, hkv, d, generator=g).to(dtype)
    # awkward values: exact ties, zeros, -0, a NaN row, an Inf, tiny and huge values
    key[0, 0] = 0
    key[1, 0] = -0.0
    key[2, 0, : 8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0])
    key[3, 0, 5] = float("nan")
    val[3, 1, 7] = float("inf")
    key[4] = key[4] * 1e-30 if dtype == torch.float32 else key[4] * 1e-3
    val[5] = val[5] * (1e30 if dtype == torch.float32 else 1e3)
    nb = n // 4 + 2
    slots = torch.randperm(nb * 16, generator=g)[:n]
    slots[6] = -1
    return key.cuda(), val.cuda(), nb, slots.cuda()


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [None, 32])
def test_cache_writer_bit_exact(d, dtype, group):
    n, hkv = 61, 3
    key, val, nb, slots = _writer_inputs(n, hkv, d, dtype, group, seed=d)
    caches = []
    for backend in ("reference", "cuda"):
        c = allocate_cache(nb, hkv, 16, d, scale_group=group, device="cuda", fill=0xAB)
        for sm in (slots, slots.int()):
            turboquant.reshape_and_cache_fp4(key, val, *c, sm, backend=backend,
                                             config=dataclasses.replace(PLAIN, scale_group=group))
        caches.append(c)
    for a, b in zip(*caches):
        assert torch.equal(a, b)
    # slot -1: token 6's bytes were not written anywhere: the fill survives in unused slots
    assert (caches[1].key_scales == 0xAB).any()


def _transform_args(prob, d):
    """The op's transform arguments for a default-config problem: each sequence's record."""
    ids = torch.arange(prob.seq_lens.shape[0], dtype=torch.int32, device="cuda")
    return (rotation_signs(d, 0, "cuda"), prob.state_records(), ids, True)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [None, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("config", ["default", "per-sequence", "rotation", "smooth"])
def test_cache_writer_transforms_bit_exact(d, group, dtype, config):
    """rotate((k - m) * (1 / lam)) and rotate(v) in registers give the reference's bytes."""
    cfg = dataclasses.replace(CONFIGS[config], scale_group=group)
    n, hkv = 61, 3
    key, val, nb, slots = _writer_inputs(n, hkv, d, dtype, group, seed=d + 1)
    kw = first_write_state(cfg, key, val, slots, nb, scale_group=group)
    caches = []
    for backend in ("reference", "cuda"):
        c = allocate_cache(nb, hkv, 16, d, scale_group=group, device="cuda", fill=0xAB)
        turboquant.reshape_and_cache_fp4(key, val, *c, slots, config=cfg, backend=backend, **kw)
        caches.append(c)
    for a, b in zip(*caches):
        assert torch.equal(a, b)


K8V4_CASES = {  # name: (lens, hq, hkv, qlens, window, cap)
    "decode": ([1, 54, 97, 0, 33, 300, 5, 16, 17, 64, 65, 128, 129, 255, 256, 257, 2], 32, 8,
               None, 0, 0.0),
    "decode_window_cap": ([1, 54, 97, 700, 33], 16, 4, None, 37, 30.0),
    "gqa16": ([1, 54, 97, 513], 32, 2, None, 0, 0.0),  # the general kernel (G > 8)
    "multi_token": ([54, 97, 33, 600, 1], 32, 8, [3, 1, 17, 40, 1], 0, 0.0),
    "multi_token_window_cap": ([54, 97, 600], 16, 8, [5, 16, 33], 64, 20.0),
}


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("config", ["plain", "default"])
@pytest.mark.parametrize("case", sorted(K8V4_CASES))
def test_k8v4_attention_matches_reference(case, config, d):
    """K8V4 (E4M3 keys) through the decode and the general kernel, against the reference on the
    same bytes: batch 17 with lengths 1/54/97/..., poisoned unused slots (0xFF: E4M3 NaN bytes and
    NaN scales), shuffled blocks, spare blocks, windows, soft cap, the transforms."""
    lens, hq, hkv, qlens, window, cap = K8V4_CASES[case]
    bs = 16 if d == 256 else 32
    prob, q, cu = _problem(lens, hq, hkv, d, bs, qlens=qlens, seed=d + len(case), config=config,
                           key_format="fp8_e4m3")
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    ref = _run("reference", prob, q, cu, **kw)
    out = _run("cuda", prob, q, cu, **kw)
    _compare(out, ref)
    if case == "decode":  # the states compose with K8V4 too
        sinks = torch.randn(hq, device="cuda")
        o_r, l_r = _run("reference", prob, q, cu, sinks=sinks, return_lse=True)
        o_c, l_c = _run("cuda", prob, q, cu, sinks=sinks, return_lse=True)
        _compare(o_c, o_r)
        fin = torch.isfinite(l_r)
        assert torch.equal(fin, torch.isfinite(l_c))
        assert torch.allclose(l_c[fin], l_r[fin], atol=2e-3, rtol=1e-4)


def test_k8v4_structured_keys_locate_each_element():
    """One-hot keys: key token j has a single nonzero element at head-dim j % D, the query is
    one-hot at element e, so exactly the tokens with j % D == e have a large logit (~23):
    a wrong byte order in the E4M3 decode or the K shared-memory swizzle moves the peak to
    other tokens (and gives a different output than the reference)."""
    d, hkv, hq = 128, 2, 8
    n = 3 * d + 5

    def factory(s, shape):
        k = torch.zeros(shape)
        idx = torch.arange(shape[0])
        k[idx, :, idx % d] = 4.0
        v = torch.randn(shape, generator=torch.Generator().manual_seed(s))
        return k.bfloat16(), v.bfloat16()

    g = torch.Generator().manual_seed(1)
    prob = build_paged_problem([n, n - 7], hkv, d, 16, device="cuda", generator=g,
                               write_backend="cuda", spare_blocks=2, config=PLAIN,
                               key_format="fp8_e4m3", kv_factory=factory)
    for e in (0, 1, 7, 8, 63, 64, 127):
        q = torch.zeros(2, hq, d, dtype=torch.bfloat16, device="cuda")
        q[:, :, e] = 64.0
        ref = _run("reference", prob, q)
        out = _run("cuda", prob, q)
        _compare(out, ref)


def _kernel_names(fn):
    """Names of the CUDA kernels one call of fn launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


# chunked prefill through the prefill kernel (rows per sequence >= PREFILL_ROWS on average):
# (seq_lens, hq, hkv, d, bs, query tokens per sequence, dtype)
PREFILL_CASES = {
    "ragged chunks, block 16": ([700, 33, 300, 129], 32, 8, 128, 16, [300, 33, 1, 129], torch.bfloat16),
    "whole sequences, block 64": ([200, 77], 32, 8, 128, 64, [200, 77], torch.float16),
    "d 64, GQA 7, block 32": ([500, 90], 28, 4, 64, 32, [64, 90], torch.bfloat16),
    "one chunk across blocks, block 256": ([1500], 16, 2, 128, 256, [700], torch.bfloat16),
    "MHA, a chunk not at the end of a block": ([410, 263], 8, 8, 128, 16, [133, 200], torch.bfloat16),
}


@pytest.mark.parametrize("window", [0, 100])
def test_decodes_first_run_as_their_own_call(window):
    """num_decodes: a chunked-prefill step in vLLM's order (17 decode rows of awkward lengths
    first, then chunks of 600 and 54 tokens) runs the decode rows through the decode kernel's
    one-token form and the chunks through the prefill kernel; the output and the lse match the
    reference, with a NaN-scaled token in one decode sequence and one chunk."""
    lens = [1, 54, 97] + [300 + 37 * i for i in range(14)] + [700, 54]
    qlens = [1] * 17 + [600, 54]
    prob, q, cu = _problem(lens, 32, 8, 128, 16, qlens=qlens, seed=12)
    for s, tok in ((2, 40), (17, 650)):  # sequence 2's key 40, the chunk's key 650
        prob.cache.value_scales[prob.block_tables[s, tok // 16], tok % 16, 3] = 255
    kw = dict(sliding_window=window, return_lse=True)
    names = _kernel_names(lambda: _run("cuda", prob, q, cu, num_decodes=17, **kw))
    assert any("prefill" in n for n in names), names
    assert _decode_ran(names) and not _multi_token_form(names), names
    out, lse = _run("cuda", prob, q, cu, num_decodes=17, **kw)
    ref, ref_lse = _run("reference", prob, q, cu, **kw)
    rows = torch.isfinite(ref.float()).all(-1)
    assert torch.equal(rows, torch.isfinite(out.float()).all(-1)) and not rows.all()
    _compare_call(out, ref, prob, q, cu)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    tol = 2e-3 + 1e-4 * ref_lse.abs()  # as test_multi_token_kernels_states_and_k8v4's
    if torch.cuda.get_device_capability() == (9, 0):  # the chunks' (and decode rows') S on FP8
        tol = tol + _fp8_s_logit_bound(prob, q, cu, **kw)
    assert ((lse - ref_lse).abs()[fin] <= tol[fin]).all()


@pytest.mark.parametrize("window,cap,config", [(0, 0.0, "default"), (0, 0.0, "plain"),
                                               (100, 0.0, "default"), (0, 30.0, "default"),
                                               (37, 10.0, "plain"), (1, 0.0, "default")])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_kernel_matches_reference(case, window, cap, config):
    """Long chunks run the prefill kernel (one fp16 decode of each KV step shared by 8 row
    tiles): against the reference on ragged chunks (1 to 700 tokens), chunks crossing blocks,
    block sizes 16-256, shuffled blocks with 0xFF-poisoned unused slots, windows (W = 1: one key),
    soft caps, the transforms and the sink, D 64 / 128, bf16 / fp16, GQA 1 / 4 / 7 / 8."""
    lens, hq, hkv, d, bs, qlens, dtype = PREFILL_CASES[case]
    prob, q, cu = _problem(lens, hq, hkv, d, bs, dtype=dtype, qlens=qlens, seed=len(case) + window,
                           config=config)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    ref = _run("reference", prob, q, cu, **kw)
    names = _kernel_names(lambda: _run("cuda", prob, q, cu, **kw))
    assert any("prefill" in n for n in names), names
    _compare(_run("cuda", prob, q, cu, **kw), ref)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("key_format", ["fp4", "fp8_e4m3"])
def test_prefill_kernel_structured_keys_and_values(key_format, d):
    """One-hot keys (token j: 4.0 at head-dim j % D) and values (token j: 1.0 at (5 j + 3) % D),
    query token i one-hot (48.0) at element i % D: each row's weight sits on the visible tokens
    with j % D == i % D, so its output is a few known one-hots. A wrong K or V fragment map,
    ldmatrix address, swizzle or chunk map of the prefill kernel (D 64's half-used FP8 K rows
    included) moves the peaks (the output differs from the reference's by O(1)), which random
    data would show as noise only."""
    n = 3 * 128 + 37
    _one_hot_check(key_format, [n, n - 70], [n - 5, n - 90], "prefill", d=d)


def _one_hot_check(key_format, lens, qlens, kernel, d=128, hkv=2, hq=8):
    """The one-hot probe: keys (token j: 4.0 at head-dim j % D) and values (token j: 1.0 at
    (5 j + 3) % D), query token i one-hot (48.0) at element i % D; the call must run the kernel
    whose name holds ``kernel``, and match the reference. qlens None: decode (one query token
    per sequence)."""
    def factory(s, shape):
        idx = torch.arange(shape[0])
        k, v = torch.zeros(shape), torch.zeros(shape)
        k[idx, :, idx % d] = 4.0
        v[idx, :, (5 * idx + 3) % d] = 1.0
        return k.bfloat16(), v.bfloat16()

    g = torch.Generator().manual_seed(3)
    prob = build_paged_problem(lens, hkv, d, 16, device="cuda", generator=g,
                               write_backend="cuda", spare_blocks=2, config=PLAIN, kv_factory=factory,
                               key_format=key_format)
    cu = None if qlens is None else torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(),
                                                 dtype=torch.int32, device="cuda")
    ntok = len(lens) if qlens is None else sum(qlens)
    q = torch.zeros(ntok, hq, d, dtype=torch.bfloat16, device="cuda")
    tok = torch.arange(ntok, device="cuda")
    q[tok, :, tok % d] = 48.0
    ref = _run("reference", prob, q, cu)
    assert any(kernel in nm for nm in _kernel_names(lambda: _run("cuda", prob, q, cu)))
    out = _run("cuda", prob, q, cu)
    _compare(out, ref)
    assert ref.float().abs().max() > 0.2  # the peaks are there


@pytest.mark.parametrize("config", ["default", "plain"])
def test_prefill_kernel_scale_spread(config):
    """Key scales lowered by 0-24 binades per token and value scales by 0-20 (the writer's
    stay within a few of each other; lowered only, so that the output keeps its magnitude and
    the absolute bound holds): P' carries each token's 2^(V byte - VM) and the logits its
    2^(K byte - 127) over the whole range; against the reference."""
    prob, q, cu = _problem([700, 300], 32, 8, 128, 16, qlens=[300, 300], seed=9, config=config)
    g = torch.Generator().manual_seed(5)
    for name, lo, hi in (("key_scales", -24, 0), ("value_scales", -20, 0)):
        s = getattr(prob.cache, name)
        d = torch.randint(lo, hi + 1, s.shape, generator=g).to(s.device)
        s.copy_((s.int() + d).clamp(1, 254).to(s.dtype))
    ref = _run("reference", prob, q, cu)
    assert any("prefill" in n for n in _kernel_names(lambda: _run("cuda", prob, q, cu)))
    _compare(_run("cuda", prob, q, cu), ref)


def _check_bad_block_gives_nan(prob, q, cu, first):
    """Sequence 1's fourth block id out of range: its query rows (first ..) are NaN, the
    others finite (value checks off; no read out of bounds)."""
    bt = prob.block_tables.clone()
    bt[1, 3] = 10 ** 6
    with turboquant.value_checks(False):
        out = turboquant.paged_attention_fp4(q, *prob.cache, bt, prob.seq_lens, 0.1, cu_query_lens=cu,
                                             backend="cuda", **prob.kwargs)
    torch.cuda.synchronize()
    assert torch.isnan(out[first:]).all() and torch.isfinite(out[:first]).all()


@pytest.mark.parametrize("which", ["key_scales", "value_scales"])
def test_prefill_kernel_nan_scale_and_bad_block(which):
    """A NaN key or value scale of a visible token makes exactly the rows that see it NaN
    (causal: the chunk's later tokens; a NaN value scale takes the kernel's step path that
    selects 0 for masked tokens); an out-of-range block id makes the sequence's rows NaN, never
    a read."""
    prob, q, cu = _problem([300, 200], 8, 2, 128, 16, qlens=[200, 150], seed=4)
    blk = prob.block_tables[0, 10].item()  # tokens 160..175 of sequence 0
    scales = getattr(prob.cache, which)
    old = scales[blk, 4, 1].item()
    scales[blk, 4, 1] = 255  # token 164, kv head 1
    out = _run("cuda", prob, q, cu)
    # sequence 0's chunk is positions 100..299: query token i (position 100 + i) sees 164 for i >= 64
    assert torch.isnan(out[64:200, 4:8]).all() and torch.isfinite(out[:64, 4:8]).all()
    assert torch.isfinite(out[:, :4]).all() and torch.isfinite(out[200:]).all()
    scales[blk, 4, 1] = old
    _check_bad_block_gives_nan(prob, q, cu, 200)


def test_prefill_kernel_non_finite_query_rows():
    """A NaN or an infinite query element makes exactly its (token, head) row NaN, and leaves the
    CTA's other rows as the reference has them: the Q prescale takes the finite maximum, and the
    FP8 S path (two E4M3 terms, whose conversion would saturate an infinity to 448) turns an
    infinity into NaN."""
    prob, q, cu = _problem([300, 200], 8, 2, 128, 16, qlens=[200, 150], seed=5)
    q[10, 1, 7] = float("nan")
    q[70, 5, 100] = float("inf")
    q[250, 6, 0] = -float("inf")
    assert any("prefill" in n for n in _kernel_names(lambda: _run("cuda", prob, q, cu)))
    out, ref = _run("cuda", prob, q, cu), _run("reference", prob, q, cu)
    bad = torch.zeros(out.shape[:2], dtype=torch.bool, device=out.device)
    bad[10, 1] = bad[70, 5] = bad[250, 6] = True
    assert torch.isnan(out[bad]).all()
    assert torch.isfinite(out[~bad]).all()
    _compare(out[~bad], ref[~bad])


# short multi-token queries (speculative decoding) through the decode kernel's multi-token forms
# (tuning::use_spec_kernel: at most 32 (query token, head) pairs per sequence on average; 8
# columns where they average at most 8, tuning::spec_columns, else 16):
# (seq_lens, hq, hkv, d, bs, query tokens per sequence, dtype)
SPEC_CASES = {
    "batch 17, 1-8 tokens, block 16": ([1, 54, 97, 300, 16, 17, 33, 8, 700, 129, 5, 64, 65, 2, 250,
                                        31, 1000], 32, 8, 128, 16,
                                       [1, 4, 8, 2, 3, 5, 7, 1, 4, 6, 2, 8, 3, 2, 5, 1, 4], torch.bfloat16),
    "d 64, GQA 7 (a token's heads across CTAs), block 32": ([300, 54, 97, 9], 28, 4, 64, 32, [3, 8, 2, 5],
                                                            torch.float16),
    "MHA, block 64 (8 columns)": ([1000, 2, 513], 8, 8, 128, 64, [8, 2, 5], torch.bfloat16),
    "batch 17, 1-3 tokens (8 columns), block 16": ([1, 54, 97, 300, 16, 17, 33, 8, 700, 129, 5, 64, 65, 2,
                                                   250, 31, 1000], 32, 8, 128, 16,
                                                  [1, 2, 3, 2, 1, 2, 2, 1, 3, 2, 2, 1, 2, 2, 2, 3, 1],
                                                  torch.bfloat16),
    "d 64, GQA 7, one token each (8 columns), block 32": ([300, 54, 97, 9], 28, 4, 64, 32, [1, 1, 1, 1],
                                                         torch.float16),
    "long context, 2 tokens (8 columns, partitions)": ([20000, 9000], 32, 8, 128, 16, [2, 2], torch.bfloat16),
    "GQA 16 (two CTAs per sequence), block 256": ([1500, 400], 32, 2, 128, 256, [2, 1], torch.bfloat16),
    "long context (split into partitions)": ([20000, 9000], 32, 8, 128, 16, [4, 4], torch.bfloat16),
}


def _decode_ran(names) -> bool:
    """Whether a decode kernel ran: the warp-MMA one or, on SM90 (FP4 keys, D 128), the FP8
    warpgroup one."""
    return any("decode_kernel" in n or "decode_wgmma_kernel" in n for n in names)


def _wgmma_decode_expected(d=128, key_format="fp4") -> bool:
    return torch.cuda.get_device_capability()[0] == 9 and d == 128 and key_format == "fp4"


@pytest.mark.parametrize("key_format,d", [("fp4", 128), ("fp8_e4m3", 128), ("fp4", 64)])
def test_decode_kernel_choice_and_structured_keys(key_format, d):
    """Decode runs the FP8 warpgroup kernel on SM90 for FP4 keys at D 128 and the warp-MMA
    kernel otherwise (K8V4 keys, D 64, other GPUs); the one-hot probe through it (query i's
    peaks at the keys j with j % D == i % D, over lengths that cross 64-token steps and blocks),
    where a wrong K / V fragment map, ldmatrix address or swizzle moves the peaks."""
    kernel = "decode_wgmma_kernel" if _wgmma_decode_expected(d, key_format) else "decode_kernel"
    _one_hot_check(key_format, [3 * 128 + 37, 300, 1, 97, 64, 65], None, kernel, d=d)


def _multi_token_form(names) -> set:
    """The columns (8 or 16) of the decode kernel's multi-token instantiations among the kernel
    names (demangled: `decode_kernel<D, T, states, e4m3, NB, true>`, or mangled)."""
    forms = set()
    for n in names:
        m = re.search(r"decode_kernel<[^>]*(\d), true>", n) or re.search(r"decode_kernelI.*Li(\d)ELb1E", n)
        if m:
            forms.add(8 * int(m.group(1)))
    return forms


def _spec_ran(prob, q, cu, **kw):
    """The call ran the decode kernel's multi-token form that tuning::spec_columns names (8
    columns where the (query token, head) pairs average at most 8 per sequence) and no general
    kernel."""
    names = _kernel_names(lambda: _run("cuda", prob, q, cu, **kw))
    cols = 8 if q.shape[0] * (q.shape[1] // prob.cache.key_cache.shape[1]) <= 8 * (cu.numel() - 1) else 16
    return _multi_token_form(names) == {cols} and not any("fp4_kernel" in n for n in names)


@pytest.mark.parametrize("window,cap,config", [(0, 0.0, "default"), (0, 0.0, "plain"),
                                               (100, 0.0, "default"), (0, 30.0, "default"),
                                               (37, 10.0, "plain"), (1, 0.0, "default"),
                                               (3, 0.0, "default")])
@pytest.mark.parametrize("case", sorted(SPEC_CASES))
def test_spec_kernel_matches_reference(case, window, cap, config):
    """Short multi-token queries run the decode kernel with (query token, head) columns, each
    column with its own causal / window key range: against the reference on ragged query
    counts (1-8 tokens, a sequence of 1 key with 1 query), batch 17, lengths 1 / 54 / 97,
    blocks 16-256, shuffled blocks with 0xFF-poisoned unused slots, windows shorter than the
    query count (W = 1, 3: each token sees a different set), soft caps, the transforms and the
    sink, D 64 / 128, bf16 / fp16, GQA 1 / 4 / 7 / 16, split-KV partitions."""
    lens, hq, hkv, d, bs, qlens, dtype = SPEC_CASES[case]
    prob, q, cu = _problem(lens, hq, hkv, d, bs, dtype=dtype, qlens=qlens, seed=len(case) + window,
                           config=config)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    assert _spec_ran(prob, q, cu, **kw)
    _compare(_run("cuda", prob, q, cu, **kw), _run("reference", prob, q, cu, **kw))


def _fp8_s_logit_bound(prob, q, cu, **kw):
    """Per (query token, head): a bound on how far the SM90a prefill and decode kernels'
    logits (FP8 S: q' = the transformed query, prescaled per CTA or head, as two E4M3 terms)
    can lie from the reference's, and so its lse (|lse(s + e) - lse(s)| <= max |e|; the soft cap's tanh only
    shrinks e). Two round-to-nearest E4M3 terms leave |q'_d - Q1_d - Q2_d| <= 2^-8 |q'_d| in the
    normal range and <= 2^-10 of the prescaled unit below it, i.e. 2^-17 max |q'| of the CTA
    (its prescale puts that in [2^7, 2^8)); the keys k' enter exactly (E5M2 / E4M3 bytes times
    powers of two); Hopper's FP8 MMAs add their products with ~14 significant bits (DeepSeek-V3's
    measurement of the H800's FP8 GEMM accumulation), 2^-13 of sum_d |q'_d k'_d| at most. So
    |e_k| <= scale sum_d ((2^-8 + 2^-13) |q'_d| + 2^-17 max |q'|) |k'_kd|, taken over every key
    of the sequence (the sink key, fp32 in the kernel, included: a looser bound) and max |q'|
    over the sequence's rows of the kv head. Derived, not tuned."""
    from turboquant.reference import _gather_tokens, _state_record
    from turboquant.rotation import rotate
    from turboquant.shared_state import call_with_records
    from turboquant.smoothing import KEY_SCALE, SINK_KEY
    call = call_with_records(turboquant.api.prepare_attention(
        q, *prob.cache, prob.block_tables, prob.seq_lens, q.shape[-1] ** -0.5, cu_query_lens=cu,
        **{**prob.kwargs, **kw}))
    hkv, d = call.num_kv_heads, call.head_dim
    g = call.num_heads // hkv
    group = None if call.scale_group == d else call.scale_group
    starts = list(range(call.num_seqs + 1)) if cu is None else call.cu_query_lens.tolist()
    bound = torch.zeros(q.shape[0], call.num_heads, device=q.device)
    for s_, n in enumerate(call.seq_lens.tolist()):
        q0, q1 = starts[s_], starts[s_ + 1]
        if q1 == q0 or n == 0:
            continue
        qs = call.query[q0:q1].float().view(q1 - q0, hkv, g, d)
        record = _state_record(call, s_)
        if record is not None:
            qs = qs * record[None, :, None, KEY_SCALE]
        if call.rotation_signs is not None:
            qs = rotate(qs, call.rotation_signs)
        k = _gather_tokens(call.key_cache, call.key_scales, call.block_tables[s_], group, 0, n,
                           call.block_size)  # [Hkv, n, D]
        if call.sink:
            k[:, 0] = record[:, SINK_KEY]
        qmax = qs.abs().amax(dim=(0, 2, 3))  # [Hkv]
        dq = (2.0 ** -8 + 2.0 ** -13) * qs.abs() + 2.0 ** -17 * qmax[None, :, None, None]  # [nq, Hkv, g, D]
        e = torch.einsum("qhgd,hkd->qhgk", dq, k.abs()).amax(dim=-1) * call.scale
        bound[q0:q1] = e.reshape(q1 - q0, hkv * g)
    return bound


@pytest.mark.parametrize("key_format", ["fp4", "fp8_e4m3"])
@pytest.mark.parametrize("states", ["none", "lse", "lse+sinks"])
@pytest.mark.parametrize("kernel,case", [
    ("prefill", "ragged chunks, block 16"), ("prefill", "d 64, GQA 7, block 32"),
    ("spec", "batch 17, 1-8 tokens, block 16"), ("spec", "long context (split into partitions)"),
    ("spec", "batch 17, 1-3 tokens (8 columns), block 16")])
def test_multi_token_kernels_states_and_k8v4(kernel, case, states, key_format):
    """The prefill kernel and the decode kernel's multi-token forms (16 and 8 columns) with
    K8V4 keys (E4M3 bytes, decoded like FP4 or, on the SM90a prefill kernel's FP8 S, taken as
    stored) and with the lse output and learned sinks (the general kernel's epilogue
    semantics), default transforms, a window and a soft cap: output and lse against the
    reference; the lse within 2e-3 + 1e-4 |lse|, plus Q's two-term E4M3 rounding where S runs
    on FP8 tensor cores (the SM90a prefill kernel: _fp8_s_logit_bound)."""
    lens, hq, hkv, d, bs, qlens, dtype = (PREFILL_CASES if kernel == "prefill" else SPEC_CASES)[case]
    prob, q, cu = _problem(lens, hq, hkv, d, bs, dtype=dtype, qlens=qlens, seed=len(states),
                           key_format=key_format)
    kw = dict(sliding_window=50, logits_soft_cap=20.0)
    if states != "none":
        kw["return_lse"] = True
    if states == "lse+sinks":
        kw["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(9)).cuda()
    if kernel == "prefill":
        assert any("prefill" in n for n in _kernel_names(lambda: _run("cuda", prob, q, cu, **kw)))
    else:
        assert _spec_ran(prob, q, cu, **kw)
    ref, out = _run("reference", prob, q, cu, **kw), _run("cuda", prob, q, cu, **kw)
    if states == "none":
        _compare(out, ref)
        return
    _compare(out[0], ref[0])
    fin = torch.isfinite(ref[1])
    assert torch.equal(fin, torch.isfinite(out[1]))
    tol = 2e-3 + 1e-4 * ref[1].abs()
    if kernel == "prefill" and torch.cuda.get_device_capability() == (9, 0):  # S on FP8 tensor cores
        tol = tol + _fp8_s_logit_bound(prob, q, cu, **kw)
    assert ((out[1] - ref[1]).abs()[fin] <= tol[fin]).all(), ((out[1] - ref[1]).abs()[fin].max(), tol[fin].min())


@pytest.mark.parametrize("key_format", ["fp4", "fp8_e4m3"])
@pytest.mark.parametrize("qlens", [[4, 8], [2, 1]], ids=["16-columns", "8-columns"])
def test_spec_kernel_structured_keys_and_values(key_format, qlens):
    """The one-hot probe through the decode kernel's multi-token forms: 16 columns (4 and 8
    query tokens) and 8 columns (2 and 1: 6 pairs per sequence on average)."""
    _one_hot_check(key_format, [3 * 128 + 37, 300], qlens, "decode_kernel")


@pytest.mark.parametrize("which", ["key_scales", "value_scales"])
@pytest.mark.parametrize("nq", [4, 2], ids=["16-columns", "8-columns"])
def test_spec_kernel_nan_scale_seen_by_later_tokens_only(which, nq):
    """A NaN key or value scale of key 301 - nq: of a sequence's nq query tokens (at positions
    300 - nq .. 299) the first, which does not see it, stays finite and the others are NaN, for
    the heads of that kv head only; a value scale of 255 thus reaches a CTA whose other columns
    must not take it (P' = 0 by selection, not 0 x NaN). An out-of-range block id makes the
    sequence's rows NaN. Both multi-token forms (4 tokens x 4 heads: 16 columns; 2: 8)."""
    prob, q, cu = _problem([300, 200], 8, 2, 128, 16, qlens=[nq, nq], seed=4)
    assert _spec_ran(prob, q, cu)
    pos = 301 - nq
    blk = prob.block_tables[0, pos // 16].item()
    scales = getattr(prob.cache, which)
    old = scales[blk, pos % 16, 1].item()
    scales[blk, pos % 16, 1] = 255  # kv head 1: heads 4..7
    out = _run("cuda", prob, q, cu)
    assert torch.isnan(out[1:nq, 4:8]).all() and torch.isfinite(out[0, 4:8]).all()
    assert torch.isfinite(out[:, :4]).all() and torch.isfinite(out[nq:]).all()
    scales[blk, pos % 16, 1] = old
    _check_bad_block_gives_nan(prob, q, cu, nq)


@pytest.mark.parametrize("kernel,hq,hkv,lens,qlens", [
    ("decode_kernel", 8, 2, [2, 40], [4, 1]),      # 16-column form: 10 columns per sequence
    ("decode_kernel", 8, 2, [1, 40], [3, 1]),      # 8-column form: 8 columns per sequence
    ("fp4_kernel", 32, 2, [2, 40], [4, 1]),        # general kernel: 40 columns per sequence
    ("prefill", 8, 2, [2, 300], [4, 200])])        # prefill kernel: 408 rows per sequence
def test_more_query_tokens_than_keys_with_the_sink(kernel, hq, hkv, lens, qlens):
    """With value checks off, a sequence of 2 keys with 4 query tokens (or 1 key with 3): tokens
    0 and 1 sit at positions -2 and -1 and see nothing, not even the sink token (position 0,
    from the state record), so their rows are zeros as in the reference; the other rows match
    it too."""
    prob, q, cu = _problem(lens, hq, hkv, 128, 16, qlens=qlens, seed=5)
    with turboquant.value_checks(False):
        assert any(kernel in n for n in _kernel_names(lambda: _run("cuda", prob, q, cu)))
        out, ref = _run("cuda", prob, q, cu), _run("reference", prob, q, cu)
    assert (out[:2] == 0).all() and (ref[:2] == 0).all()
    _compare(out, ref)


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("config", ["plain", "default", "per-sequence", "rotation", "smooth"])
def test_k8v4_cache_writer_bit_exact(d, dtype, config):
    """K8V4 (E4M3 keys, FP4 values): the cuda writer's bytes are the reference's, with every
    transform, on the awkward values of _writer_inputs (ties, zeros, -0, NaN, Inf, tiny, huge)."""
    cfg = CONFIGS[config]
    n, hkv = 61, 3
    key, val, nb, slots = _writer_inputs(n, hkv, d, dtype, None, seed=d + 2)
    key[7, 1] = key[7, 1] * 2.0 ** -20  # E4M3 subnormals after the scale
    kw = first_write_state(cfg, key, val, slots, nb, key_format="fp8_e4m3")
    caches = []
    for backend in ("reference", "cuda"):
        c = allocate_cache(nb, hkv, 16, d, device="cuda", fill=0xAB, key_format="fp8_e4m3")
        turboquant.reshape_and_cache_fp4(key, val, *c, slots, config=cfg, backend=backend, **kw)
        caches.append(c)
    for a, b in zip(*caches):
        assert torch.equal(_bytes(a), _bytes(b))
    assert (_bytes(caches[1].key_cache) == 0xAB).any()  # unused slots keep the fill


LSE_CASES = {  # name: (lens, hq, hkv, qlens, window, cap)
    "decode": ([1, 54, 97, 0, 33, 1000, 5, 16, 17, 64, 65, 128, 129, 255, 256, 257, 2], 32, 8,
               None, 0, 0.0),
    "decode-split-kv": ([9000, 20000, 4097], 32, 8, None, 0, 0.0),
    "decode-window-cap": ([300, 54, 97, 1], 16, 4, None, 40, 5.0),
    "general-g16-cap": ([54, 97, 0, 700], 64, 4, None, 0, 5.0),
    "multi-window": ([40, 70, 9], 8, 2, [3, 5, 1], 24, 0.0),
    "multi-split-kv-cap": ([12000, 70], 8, 2, [2, 3], 0, 4.0),
}


@pytest.mark.parametrize("config", ["plain", "default"])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("case", sorted(LSE_CASES))
def test_lse_and_sinks_match_reference(case, with_sinks, config):
    """The log-sum-exp output and learned sinks in the decode kernel, the general kernel and
    the split-KV reduce, against the reference (awkward lengths, a zero-length sequence, a NaN
    key scale in a used token, and a NaN value scale: its rows' lse NaN too, where the logits
    stay finite; outside a window it reaches no row)."""
    lens, hq, hkv, qlens, window, cap = LSE_CASES[case]
    prob, q, cu = _problem(lens, hq, hkv, 128, 16, qlens=qlens, seed=len(case), config=config)
    ks, vs = prob.cache.key_scales, prob.cache.value_scales
    tok = 0 if config == "plain" else 1  # (the default config's key 0 is the sink's record)
    ks[prob.block_tables[-1, 0], tok] = 255  # NaN rows for the last sequence
    vs[prob.block_tables[1, 0], tok] = 255  # ... and for the second where it sees its key
    sinks = (torch.randn(hq, generator=torch.Generator().manual_seed(3)) * 3).cuda() if with_sinks else None
    kw = dict(sliding_window=window, logits_soft_cap=cap, sinks=sinks, return_lse=True)
    out, lse = _run("cuda", prob, q, cu, **kw)
    ref, ref_lse = _run("reference", prob, q, cu, **kw)
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), "NaN rows differ"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "empty rows differ"
    fin = torch.isfinite(ref_lse)
    assert fin.any()
    tol = 1e-4 + 1e-4 * ref_lse.abs()
    if qlens is None and _wgmma_decode_expected():  # S on FP8 tensor cores (l sums exact P')
        tol = tol + _fp8_s_logit_bound(prob, q, None, **kw)
    assert ((lse - ref_lse).abs()[fin] <= tol[fin]).all(), (lse - ref_lse).abs()[fin].max()
    rows = torch.isfinite(ref.float()).all(-1)
    assert torch.equal(rows, torch.isfinite(out.float()).all(-1))
    _compare_call(out, ref, prob, q, cu)


# Decode shapes whose KV range the plan splits into a few partitions (batch 17 x 8 kv heads, up
# to 1500 keys: 4 on H100 / H200), merged by the reduce pass: ragged lengths (0, 1, 54, 97), a
# window that leaves partitions with no key (empty partials), a NaN key scale, a bad block id.
SPLIT_CASES = {
    "ragged": ([1500, 0, 1, 54, 97, 1499, 700, 1024, 1100, 3, 1200, 1300, 999, 1400, 64, 1450, 1333], None),
    "window": ([1500, 1490, 1, 54, 97, 1499, 700, 1024, 1100, 3, 1200, 1300, 999, 1400, 64, 1450, 1333], 100),
}


@pytest.mark.parametrize("config", ["plain", "default"])
@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_split_decode_matches_reference(case, config):
    """Decode split into partitions and merged by the reduce pass against the reference: rows,
    lse and learned sinks, NaN rows where a seen key's scale is NaN, NaN rows for a bad block id
    in sight, the empty partials of partitions a window leaves without a key."""
    lens, window = SPLIT_CASES[case]
    prob, q, _ = _problem(lens, 32, 8, 128, 16, seed=11, config=config)
    tok = 0 if config == "plain" else 1
    prob.cache.key_scales[prob.block_tables[5, 40], tok] = 255  # key 640 (+1) of sequence 5
    bt = prob.block_tables.clone()
    bt[7, 60] = 10 ** 6  # sequence 7's keys 960-975, in sight with the window too
    sinks = (torch.randn(32, generator=torch.Generator().manual_seed(5)) * 3).cuda()
    kw = dict(sliding_window=window or 0, sinks=sinks, return_lse=True)
    with turboquant.value_checks(False):
        out, lse = turboquant.paged_attention_fp4(q, *prob.cache, bt, prob.seq_lens, q.shape[-1] ** -0.5,
                                                  backend="cuda", **{**prob.kwargs, **kw})
    ref, ref_lse = _run("reference", prob, q, **kw)
    assert torch.isnan(out[7].float()).all() and torch.isnan(lse[7]).all()
    keep = torch.ones(len(lens), dtype=torch.bool, device=out.device)
    keep[7] = False
    lse, ref_lse = lse[keep], ref_lse[keep]
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), "NaN rows differ"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "empty rows differ"
    fin = torch.isfinite(ref_lse)
    tol = 1e-4 + 1e-4 * ref_lse.abs()
    if _wgmma_decode_expected():  # (sequence 5's bound counts its NaN key, out of the window's sight)
        tol = tol + _fp8_s_logit_bound(prob, q, None, **kw)[keep].nan_to_num(nan=float("inf"))
    assert ((lse - ref_lse).abs()[fin] <= tol[fin]).all(), (lse - ref_lse).abs()[fin].max()
    _compare_call(out[keep], ref[keep], prob, q[keep])


def test_block_sizes_outside_16_to_256_are_declined():
    for bs in (8, 512):
        prob, q, _ = _problem([40], 8, 8, 128, bs, config="plain")
        call = turboquant.api.prepare_attention(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                                0.1, **prob.kwargs)
        assert f"block_size {bs} outside [16, 256]" in tq_cuda.BACKEND.check_attention(call)


def test_lse_off_leaves_the_output_unchanged():
    prob, q, _ = _problem([300, 54, 97], 32, 8, 128, 16, seed=2)
    out = _run("cuda", prob, q)
    out2, _ = _run("cuda", prob, q, return_lse=True)
    assert torch.equal(out, out2)


def test_cuda_graph_replay_with_lse_and_sinks():
    prob, q, _ = _problem([3000, 54, 97], 32, 8, 128, 16, seed=4)
    sinks = torch.randn(32, device="cuda")
    eager, eager_lse = _run("cuda", prob, q, sinks=sinks, return_lse=True)
    out, lse = torch.empty_like(eager), torch.empty_like(eager_lse)
    op = torch.ops.turboquant.paged_attention_fp4_cuda
    args = (q, *prob.cache, prob.block_tables, prob.seq_lens, None, q.shape[-1] ** -0.5, 0, 0.0,
            prob.block_tables.shape[1] * 16, *_transform_args(prob, 128), sinks, lse)
    op(out, *args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(out, *args)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        op(out, *args)
    out.zero_()
    lse.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)


def test_opcheck_both_ops():
    prob, q, cu = _problem([40, 7], 16, 4, 128, 16, qlens=[3, 2])
    out = torch.empty_like(q)
    for transforms in ((None, None, None, False), _transform_args(prob, 128)):
        args = (out, q, *prob.cache, prob.block_tables, prob.seq_lens, cu, 0.1, 0, 0.0,
                prob.block_tables.shape[1] * 16, *transforms)
        torch.library.opcheck(torch.ops.turboquant.paged_attention_fp4_cuda.default, args)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    torch.library.opcheck(torch.ops.turboquant.paged_attention_fp4_cuda.default,
                          args + (torch.randn(16, device="cuda"), lse))
    key, val, nb, slots = _writer_inputs(9, 2, 128, torch.bfloat16, None)
    c = allocate_cache(nb, 2, 16, 128, device="cuda")
    state = allocate_state(2, 2, 128, device="cuda")
    state.normal_()
    for transforms in ((None, None, None),
                       (rotation_signs(128, 0, "cuda"), state,
                        torch.zeros(9, dtype=torch.int32, device="cuda"))):
        torch.library.opcheck(torch.ops.turboquant.reshape_and_cache_fp4_cuda.default,
                              (key, val, *c, slots, *transforms))


def test_cuda_graph_replay_equals_eager():
    prob, q, _ = _problem([3000, 54, 97], 32, 8, 128, 16)
    op = torch.ops.turboquant.paged_attention_fp4_cuda
    cap = prob.block_tables.shape[1] * 16
    out = torch.empty_like(q)
    args = (q, *prob.cache, prob.block_tables, prob.seq_lens, None, 0.088, 0, 0.0, cap,
            *_transform_args(prob, 128))
    op(out, *args)
    eager = out.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(out, *args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op(out, *args)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # new query values, same graph
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    _compare_call(out, turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables,
                                                      prob.seq_lens, 0.088, backend="reference",
                                                      **prob.kwargs), prob, q)


def test_torch_compile_fullgraph():
    prob, q, _ = _problem([300, 54], 32, 8, 128, 16)
    cap = prob.block_tables.shape[1] * 16

    def f(q, kc, vc, ks, vs, bt, sl):
        out = torch.empty_like(q)
        torch.ops.turboquant.paged_attention_fp4_cuda(out, q, kc, vc, ks, vs, bt, sl, None,
                                                      0.088, 0, 0.0, cap, None, None, None, False)
        return out * 2

    cf = torch.compile(f, fullgraph=True)
    plain = _problem([300, 54], 32, 8, 128, 16, config="plain")[0]
    args = (q, *plain.cache, plain.block_tables, plain.seq_lens)
    torch.testing.assert_close(cf(*args), f(*args), rtol=0, atol=0)

    # the transform arguments (rotation signs, state records, sink) trace too
    def g(q, kc, vc, ks, vs, bt, sl, signs, state, ids):
        out = torch.empty_like(q)
        torch.ops.turboquant.paged_attention_fp4_cuda(out, q, kc, vc, ks, vs, bt, sl, None,
                                                      0.088, 0, 0.0, cap, signs, state, ids, True)
        return out * 2

    args = (q, *prob.cache, prob.block_tables, prob.seq_lens, *_transform_args(prob, 128)[:3])
    torch.testing.assert_close(torch.compile(g, fullgraph=True)(*args), g(*args), rtol=0, atol=0)


SANITIZER_CASE = textwrap.dedent("""
    import torch, turboquant
    from turboquant._backends import cuda
    from turboquant.cache import build_paged_problem
    g = torch.Generator().manual_seed(0)
    for d, bs, lens, qlens, cfg, kf in ((128, 16, [1, 54, 97, 0, 300], None, "default", "fp4"),
                                        (128, 16, [300, 97], [150, 40], "default", "fp4"),
                                        (64, 32, [260, 70], [90, 70], "plain", "fp4"),
                                        (64, 16, [260, 70], [90, 70], "default", "fp8_e4m3"),
                                        (128, 16, [300, 97], [150, 40], "default", "fp8_e4m3"),
                                        (64, 32, [70, 9], [3, 2], "default", "fp4"),
                                        (256, 64, [129, 5], None, "plain", "fp4"),
                                        (128, 16, [5000, 3], None, "default", "fp4"),
                                        (128, 16, [1, 54, 97, 0, 300], None, "default", "fp8_e4m3"),
                                        (64, 32, [70, 9], [3, 2], "plain", "fp8_e4m3"),
                                        (256, 16, [129, 5], None, "default", "fp8_e4m3"),
                                        (256, 32, [129, 40], [3, 2], "default", "fp8_e4m3"),
                                        (128, 16, [5000, 60], [4, 8], "default", "fp4"),
                                        (128, 16, [5000, 60], [4, 8], "default", "fp8_e4m3"),
                                        (128, 16, [5000, 60], [2, 1], "default", "fp4"),
                                        (64, 32, [70, 9], [2, 1], "default", "fp8_e4m3")):
        prob = build_paged_problem(lens, 2, d, bs, device="cuda", generator=g,
                                   write_backend="cuda", spare_blocks=2,
                                   config=turboquant.QuantConfig.parse(cfg), key_format=kf)
        nt = len(lens) if qlens is None else sum(qlens)
        q = torch.randn(nt, 8, d, device="cuda", dtype=torch.bfloat16)
        cu = None if qlens is None else torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32,
                                                      device="cuda")
        for win in (0, 20):
            turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.1,
                                           cu_query_lens=cu, sliding_window=win, backend="cuda",
                                           **prob.kwargs)
        turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.1,
                                       cu_query_lens=cu, backend="cuda", return_lse=True,
                                       sinks=torch.zeros(8, device="cuda"), **prob.kwargs)
        # a caller's workspace of exactly the bytes the call needs (taken where the call takes
        # the workspace pass: with TURBOQUANT_PREFILL_WORKSPACE=1 every multi-token call here)
        need = turboquant.prefill_workspace_bytes(len(lens), max(lens), 2, d, key_format=kf)
        if cu is not None and need:
            turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.1,
                                           cu_query_lens=cu, backend="cuda", max_seq_len=max(lens),
                                           workspace=torch.empty(need, dtype=torch.uint8,
                                                                 device="cuda"), **prob.kwargs)
        bt = prob.block_tables.clone(); bt[0, 0] = 10 ** 6
        kw = dict(prob.kwargs)
        if "state_ids" in kw:
            kw["state_ids"] = kw["state_ids"].clone(); kw["state_ids"][-1] = 10 ** 6
        with turboquant.value_checks(False):
            turboquant.paged_attention_fp4(q, *prob.cache, bt, prob.seq_lens, 0.1,
                                           cu_query_lens=cu, backend="cuda", **kw)
    torch.cuda.synchronize()
    print("SANITIZER_CASE_OK")
""")


# memcheck: no out-of-bounds or misaligned access; racecheck: no shared-memory hazard between
# threads (the prefill kernel's producer and consumer warps hand tiles over by named barriers).
# (synccheck is not run: it reports "Divergent thread(s) in block" at the prefill kernel's first
# named barrier that its producer and consumer warps reach from different code, which the PTX
# barrier allows (bar.arrive / bar.sync hand-offs are that); docs/cuda-kernels.md, "Known limits and open directions".)
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="no compute-sanitizer")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(tmp_path, tool):
    script = tmp_path / "case.py"
    script.write_text(SANITIZER_CASE)
    # every tensor its own cudaMalloc, so that memcheck sees a read past one's end
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    r = subprocess.run(["compute-sanitizer", "--tool", tool, "--error-exitcode", "3",
                        sys.executable, str(script)], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0 and "SANITIZER_CASE_OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    # memcheck / synccheck end with "ERROR SUMMARY: 0 errors", racecheck with "RACECHECK
    # SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    summary = re.search(r"(ERROR|RACECHECK) SUMMARY: (\d+) (errors|hazards displayed \((\d+) errors, (\d+) warnings\))",
                        r.stdout + r.stderr)
    assert summary and summary.group(2) == "0", r.stdout[-3000:] + r.stderr[-3000:]
