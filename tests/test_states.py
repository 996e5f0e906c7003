"""Attention states (issue 15): the log-sum-exp output, learned sinks and the merge of partial
states, on the reference backend, against float64 attention over the dequantized cache."""
import math

import pytest
import torch

import turboquant as tq
from turboquant import registry
from turboquant.cache import build_paged_problem
from turboquant.config import PLAIN, QuantConfig
from turboquant.reference import _gather_tokens
from turboquant.rotation import unrotate
from turboquant.smoothing import KEY_CENTER, KEY_SCALE, SINK_KEY

NAN = float("nan")
CUDA_REASON = None if torch.cuda.is_available() else "no CUDA device"
if CUDA_REASON is None:
    from turboquant._backends import cuda as _cuda

    CUDA_REASON = _cuda.BACKEND.unavailable()
BACKENDS = ["reference", pytest.param("cuda", marks=pytest.mark.skipif(
    CUDA_REASON is not None, reason=f"cuda backend: {CUDA_REASON}"))]


def _device(backend):
    return "cuda" if backend == "cuda" else "cpu"


def true_keys_values(prob, s, config):
    """Sequence s's keys and values as the cache holds them, back in the model's frame:
    float64 [Hkv, n, D] (un-rotated, un-smoothed; position 0 from the sink record)."""
    call_group = None
    kc, vc, ks, vs = prob.cache
    n, bs = int(prob.seq_lens[s]), kc.shape[2]
    k = _gather_tokens(kc, ks, prob.block_tables[s], call_group, 0, n, bs).double()
    v = _gather_tokens(vc, vs, prob.block_tables[s], call_group, 0, n, bs).double()
    rec = None
    if config.uses_state:
        rec = prob.state_records()[s].double()
        if config.sink:
            k[:, 0] = rec[:, SINK_KEY]
            v[:, 0] = rec[:, SINK_KEY + 1]
    if config.rotation:
        signs = tq.rotation.rotation_signs(k.shape[-1], config.rotation_seed).double()
        k, v = unrotate(k, signs), unrotate(v, signs)
    if config.key_smoothing:
        k = k * rec[:, None, KEY_SCALE] + rec[:, None, KEY_CENTER]
    return k, v


def dense_attention(prob, config, query, scale, cu=None, window=0, cap=0.0, sinks=None):
    """float64 (out, lse) [T, H, D], [T, H] of the true logits over the cached keys."""
    hkv = prob.cache.key_cache.shape[1]
    T, H, D = query.shape
    g = H // hkv
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    starts = cu.tolist() if cu is not None else list(range(T + 1))
    for s in range(len(prob.seq_lens)):
        q0, q1 = starts[s], starts[s + 1]
        n = int(prob.seq_lens[s])
        k, v = true_keys_values(prob, s, config)
        for t in range(q0, q1):
            pos = n - (q1 - q0) + (t - q0)
            keys = torch.arange(n)
            vis = keys <= pos
            if window:
                vis &= keys > pos - window
            for h in range(H):
                x = scale * (k[h // g] @ query[t, h].double())
                if cap:
                    x = cap * torch.tanh(x / cap)
                x = torch.where(vis, x, -math.inf)
                if sinks is not None:
                    x = torch.cat([x, sinks[h].double().view(1)])
                    vv = torch.cat([v[h // g], torch.zeros(1, D, dtype=torch.float64)])
                else:
                    vv = v[h // g]
                lse[t, h] = torch.logsumexp(x, 0)
                out[t, h] = torch.softmax(x, 0) @ vv if n or sinks is not None else 0
    return out, lse


CASES = {  # name: (seq lens, query lens or None, window, soft cap, config)
    "decode-plain": ([1, 54, 97], None, 0, 0.0, PLAIN),
    "decode-default": ([2, 54, 97], None, 0, 0.0, QuantConfig()),
    "decode-default-cap": ([2, 54, 97], None, 0, 5.0, QuantConfig()),
    "multi-default-window": ([40, 70], [3, 5], 24, 0.0, QuantConfig()),
    "multi-smooth-cap-window": ([33, 97], [4, 1], 16, 4.0, QuantConfig(sink=False)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("with_sinks", [False, True])
def test_lse_and_sinks_match_float64(name, with_sinks):
    lens, qlens, window, cap, config = CASES[name]
    gen = torch.Generator().manual_seed(7)
    hkv, g, d = 2, 3, 64
    prob = build_paged_problem(lens, hkv, d, 16, generator=gen, config=config)
    T = len(lens) if qlens is None else sum(qlens)
    q = torch.randn(T, hkv * g, d, generator=gen).bfloat16()
    cu = None if qlens is None else torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).int()
    sinks = torch.randn(hkv * g, generator=gen) * 2 if with_sinks else None
    out, lse = tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.125,
                                      cu_query_lens=cu, sliding_window=window,
                                      logits_soft_cap=cap, sinks=sinks, return_lse=True,
                                      backend="reference", **prob.kwargs)
    want_out, want_lse = dense_attention(prob, config, q, 0.125, cu, window, cap, sinks)
    assert lse.dtype == torch.float32 and lse.shape == (T, hkv * g)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), want_out, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_of_empty_and_nan_rows(backend):
    gen = torch.Generator().manual_seed(1)
    dev = _device(backend)
    prob = build_paged_problem([0, 20, 30], 1, 64, 16, generator=gen, config=PLAIN, device=dev)
    kc, vc, ks, vs = prob.cache
    b = prob.block_tables[2, 0]
    ks[b, 3] = 255  # a NaN key scale in sequence 2, seen by its decode query
    q = torch.randn(3, 2, 64, generator=gen).bfloat16().to(dev)
    sinks = torch.tensor([0.5, -1.0], device=dev)
    for s_arg in (None, sinks):
        out, lse = tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.1,
                                          sinks=s_arg, return_lse=True, backend=backend,
                                          **prob.kwargs)
        assert torch.equal(out[0].float(), torch.zeros(2, 64, device=dev))
        want0 = torch.full((2,), -math.inf, device=dev) if s_arg is None else sinks
        assert torch.equal(lse[0], want0)
        assert torch.isfinite(lse[1]).all() and torch.isfinite(out[1]).all()
        assert torch.isnan(lse[2]).all() and torch.isnan(out[2]).all()


def test_sinks_lower_the_weights_only():
    """A sink of -inf changes nothing; a large one drives O to 0 and lse to the sink."""
    gen = torch.Generator().manual_seed(3)
    prob = build_paged_problem([17, 40], 2, 64, 16, generator=gen)
    q = torch.randn(2, 4, 64, generator=gen).bfloat16()
    args = (q, *prob.cache, prob.block_tables, prob.seq_lens, 0.125)
    base, lse = tq.paged_attention_fp4(*args, return_lse=True, **prob.kwargs)
    same, lse_same = tq.paged_attention_fp4(*args, sinks=torch.full((4,), -math.inf),
                                            return_lse=True, **prob.kwargs)
    assert torch.equal(same, base) and torch.equal(lse_same, lse)
    big, lse_big = tq.paged_attention_fp4(*args, sinks=torch.full((4,), 200.0), return_lse=True,
                                          **prob.kwargs)
    assert big.float().abs().max() < 1e-30 and torch.allclose(lse_big, torch.full_like(lse, 200.0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", [PLAIN, QuantConfig(sink=False), QuantConfig()],
                         ids=["plain", "rot+smooth", "default"])
def test_split_over_two_calls_merges_to_one(config, backend):
    """Each sequence's blocks split between two calls (context parallelism): the merged state
    equals one call over all of them. Split points include 0 (a part with no key) and the
    whole sequence; unused slots are NaN-poisoned. The later part says holds_first_token=False
    (its first key is not the sequence's sink token)."""
    gen = torch.Generator().manual_seed(11)
    dev = _device(backend)
    lens, bs = [1, 54, 97, 16, 33], 16
    prob = build_paged_problem(lens, 2, 64, bs, generator=gen, config=config, device=dev)
    q = torch.randn(len(lens), 8, 64, generator=gen).bfloat16().to(dev)
    sinks = torch.randn(8, generator=gen).to(dev)
    whole, lse = tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.125,
                                        sinks=sinks, return_lse=True, backend=backend,
                                        **prob.kwargs)
    # blocks of part A per sequence: 0 (A empty) .. all (B empty); with the sink token, part A
    # holds every sequence's position 0 (holds_first_token is per call)
    cut = [1 if config.sink else 0, 2, 1, 1, 3]
    width = prob.block_tables.shape[1]
    table_a = torch.full_like(prob.block_tables, -1)
    table_b = torch.full_like(prob.block_tables, -1)
    lens_a, lens_b = [], []
    for s, (n, c) in enumerate(zip(lens, cut)):
        na = min(n, c * bs)
        table_a[s, :c] = prob.block_tables[s, :c]
        table_b[s, :width - c] = prob.block_tables[s, c:]
        lens_a.append(na)
        lens_b.append(n - na)
    part = {}
    for name, table, ls, sk in (("a", table_a, lens_a, sinks), ("b", table_b, lens_b, None)):
        part[name] = tq.paged_attention_fp4(q, *prob.cache, table,
                                            torch.tensor(ls, dtype=torch.int32, device=dev), 0.125,
                                            sinks=sk, return_lse=True, backend=backend,
                                            holds_first_token=name == "a", **prob.kwargs)
    merged, merged_lse = tq.merge_attention_states(*part["a"], *part["b"])
    torch.testing.assert_close(merged_lse, lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged.float(), whole.float(), rtol=1.6e-2, atol=1e-2)


def test_merge_is_exact_in_fp32_and_keeps_nan():
    gen = torch.Generator().manual_seed(5)
    oa, ob = torch.randn(6, 4, 32, generator=gen), torch.randn(6, 4, 32, generator=gen)
    la, lb = torch.randn(6, 4, generator=gen) * 5, torch.randn(6, 4, generator=gen) * 5
    la[0, 0] = -math.inf  # part a empty: b alone, whatever a's O holds
    oa[0, 0] = NAN
    la[1, 1] = lb[1, 1] = -math.inf  # both empty: 0, -inf
    lb[2, 2] = NAN  # a NaN row stays NaN
    out, lse = tq.merge_attention_states(oa, la, ob, lb)
    want_lse = torch.logaddexp(la.double(), lb.double())
    wa = torch.exp(la.double() - want_lse)[..., None]
    wb = torch.exp(lb.double() - want_lse)[..., None]
    want = wa * oa.double() + wb * ob.double()
    want[0, 0] = ob[0, 0].double()
    want[1, 1] = 0
    keep = torch.ones(6, 4, dtype=torch.bool)
    keep[2, 2] = False
    torch.testing.assert_close(out[keep].double(), want[keep], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse[keep].double(), want_lse[keep], rtol=1e-6, atol=1e-6)
    assert lse[1, 1] == -math.inf and torch.isnan(lse[2, 2]) and torch.isnan(out[2, 2]).all()


@pytest.mark.parametrize("bad, match", [
    (dict(sinks=torch.zeros(4, dtype=torch.float16)), "sinks"),
    (dict(sinks=torch.zeros(3)), "sinks"),
])
def test_bad_sinks_name_the_argument(bad, match):
    prob = build_paged_problem([5], 1, 64, 16, generator=torch.Generator().manual_seed(0))
    q = torch.randn(1, 4, 64).bfloat16()
    with pytest.raises((TypeError, ValueError), match=match):
        tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.1, **bad,
                               **prob.kwargs)


def test_merge_rejects_mismatched_states():
    o, s = torch.zeros(2, 3, 8), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="lse_b"):
        tq.merge_attention_states(o, s, o, torch.zeros(3, 2))
    with pytest.raises(TypeError, match="lse_a"):
        tq.merge_attention_states(o, s.double(), o, s)
    with pytest.raises(ValueError, match="out_b"):
        tq.merge_attention_states(o, s, o.bfloat16(), s)


def test_kernels_without_states_decline_with_a_reason():
    from turboquant._backends import sm120
    from turboquant.api import prepare_attention

    prob = build_paged_problem([5], 1, 64, 16, generator=torch.Generator().manual_seed(0))
    q = torch.randn(1, 4, 64).bfloat16()
    call = prepare_attention(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.1,
                             return_lse=True, sinks=torch.zeros(4), **prob.kwargs)
    reason = sm120.BACKEND.check_attention(call)
    assert "return_lse" in reason and "sinks" in reason, reason


def _merge_case(parts, rows=(17, 5), d=64, dtype=torch.float32, device="cpu", seed=3):
    """R parts with every edge rule on one row each: a part -inf with a NaN O (row 0), every
    part -inf (row 1), a NaN lse (row 2), a +inf lse (row 3), a part 200 nats below the others
    whose NaN O drops with its underflowed weight (row 4); the other rows random, lse spread
    over +-20."""
    gen = torch.Generator().manual_seed(seed)
    outs = [torch.randn(*rows, d, generator=gen) for _ in range(parts)]
    lses = [torch.randn(*rows, generator=gen) * 20 for _ in range(parts)]
    outs[0][0, 0] = NAN
    lses[0][0, 0] = -math.inf
    for s in lses:
        s[0, 1] = -math.inf
    lses[-1][0, 2] = NAN
    lses[parts // 2][0, 3] = math.inf
    if parts > 1:
        outs[1][0, 4] = NAN
        lses[1][0, 4] = lses[0][0, 4] - 200
    return ([o.to(dtype).to(device) for o in outs], [s.to(device) for s in lses])


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_merge_n_follows_the_definition(parts):
    """merge_attention_states_n against the formula in float64 and the edge rules."""
    outs, lses = _merge_case(parts)
    out, lse = tq.merge_attention_states_n(outs, lses)
    ls = torch.stack(lses).double()
    want_lse = torch.logsumexp(ls, 0)
    w = torch.exp(ls - want_lse)
    want = sum(torch.where(w[r, ..., None] > 0, w[r, ..., None] * outs[r].double(), 0.0)
               for r in range(parts))
    keep = torch.ones(17, 5, dtype=torch.bool)
    keep[0, :5] = False  # the edge rows, checked below
    torch.testing.assert_close(out[keep].double(), want[keep], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse[keep].double(), want_lse[keep], rtol=1e-6, atol=1e-6)
    if parts > 1:  # row 0: part 0 is empty, whatever its O
        others = torch.stack(lses[1:]).double()[:, 0, 0]
        wo = torch.exp(others - torch.logsumexp(others, 0))
        want0 = sum(wo[r] * outs[r + 1][0, 0].double() for r in range(parts - 1))
        torch.testing.assert_close(out[0, 0].double(), want0, rtol=2e-6, atol=2e-6)
    else:
        assert (out[0, 0] == 0).all() and lse[0, 0] == -math.inf
    assert (out[0, 1] == 0).all() and lse[0, 1] == -math.inf
    for r in (2, 3):
        assert torch.isnan(out[0, r]).all() and torch.isnan(lse[0, r])
    assert not torch.isnan(out[0, 4]).any()


def test_merge_n_of_two_is_the_pairwise_merge():
    outs, lses = _merge_case(2)
    a = tq.merge_attention_states(outs[0], lses[0], outs[1], lses[1])
    b = tq.merge_attention_states_n(outs, lses)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(CUDA_REASON is not None, reason=f"cuda backend: {CUDA_REASON}")
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256, 6])
def test_merge_kernel_matches_the_reference(parts, dtype, d):
    """The cuda merge kernel against the reference op on the same device, edge rows included
    (17 tokens x 5 heads; D 6 is narrower than a warp's pair loads)."""
    outs, lses = _merge_case(parts, d=d, dtype=dtype, device="cuda")
    got = tq.merge_attention_states_n(outs, lses, backend="cuda")
    want = tq.merge_attention_states_n(outs, lses, backend="reference")
    # fp32 outputs: a weight exp(lse_r - lse) carries the rounding of lse itself (|lse| up to
    # ~80 here, one ulp = |lse| 2^-23) as a relative error; two ulps of the largest |lse|
    finite = want[1][torch.isfinite(want[1])]
    rel = 2 * finite.abs().max().item() * 2.0 ** -23
    tol = dict(rtol=rel, atol=rel) if dtype == torch.float32 else {}
    torch.testing.assert_close(got[0], want[0], equal_nan=True, **tol)
    torch.testing.assert_close(got[1], want[1], equal_nan=True, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isnan(got[0]), torch.isnan(want[0]))


@pytest.mark.skipif(CUDA_REASON is not None, reason=f"cuda backend: {CUDA_REASON}")
def test_merge_kernel_reads_views_of_one_buffer_under_a_cuda_graph():
    """Context parallelism's layout: each rank's bf16 out and fp32 lse are views of one byte
    buffer (an all-gather's output); the merge is captured in a CUDA graph (no host sync) and
    its replay follows new contents of the buffer."""
    world, t, h, d = 3, 4, 8, 128
    ob = t * h * d * 2
    buf = torch.empty(world, ob + t * h * 4, dtype=torch.uint8, device="cuda")
    views = [(buf[r, :ob].view(torch.bfloat16).view(t, h, d),
              buf[r, ob:].view(torch.float32).view(t, h)) for r in range(world)]
    out = torch.empty(t, h, d, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(t, h, device="cuda")

    def fill(seed):
        outs, lses = _merge_case(world, rows=(t, h), d=d, dtype=torch.bfloat16, seed=seed)
        for (o, s), o_new, s_new in zip(views, outs, lses):
            o.copy_(o_new)
            s.copy_(s_new)
        return [o.cuda() for o in outs], [s.cuda() for s in lses]

    fill(1)
    merge = lambda: tq.merge_attention_states_n(  # noqa: E731
        [o for o, _ in views], [s for _, s in views], out=out, lse=lse, backend="cuda")
    merge()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        merge()
    outs, lses = fill(2)
    g.replay()
    want = tq.merge_attention_states_n(outs, lses, backend="reference")
    torch.testing.assert_close(out, want[0], equal_nan=True)
    torch.testing.assert_close(lse, want[1], equal_nan=True, rtol=1e-6, atol=1e-6)


def test_merge_backends_say_why_they_cannot_run():
    """CPU tensors: only the reference merges them; the others give their reason, and a named
    backend that cannot run raises with it."""
    outs, lses = _merge_case(2)
    call = registry.MergeCall(tuple(outs), tuple(lses), torch.empty_like(outs[0]),
                              torch.empty_like(lses[0]))
    for name in ("sm120", "aiter"):
        assert "not implemented" in registry.get(name).check_merge(call)
    assert "not on a CUDA device" in registry.get("cuda").check_merge(call)
    with pytest.raises(ValueError, match="backend='cuda' cannot run this call: "):
        tq.merge_attention_states_n(outs, lses, backend="cuda")
    rows = registry.explain("merge", call)
    assert [r["name"] for r in rows if r["chosen"]] == ["reference"]
    assert all(r["reason"] for r in rows if not r["chosen"])


@pytest.mark.parametrize("call, match", [
    (lambda o, s: tq.merge_attention_states_n([], []), "outs"),
    (lambda o, s: tq.merge_attention_states_n([o] * 9, [s] * 9), "outs"),
    (lambda o, s: tq.merge_attention_states_n([o, o], [s]), "lses"),
    (lambda o, s: tq.merge_attention_states_n([o, o[:1]], [s, s]), r"outs\[1\]"),
    (lambda o, s: tq.merge_attention_states_n([o, o], [s, s.double()]), r"lses\[1\]"),
    (lambda o, s: tq.merge_attention_states_n([o, o], [s, s[:1]]), r"lses\[1\]"),
    (lambda o, s: tq.merge_attention_states_n([o.int()], [s]), r"outs\[0\]"),
    (lambda o, s: tq.merge_attention_states_n([o], [s], out=o.half()), "out"),
    (lambda o, s: tq.merge_attention_states_n([o], [s], lse=s[:1]), "lse"),
])
def test_merge_n_rejects_bad_arguments_naming_them(call, match):
    o, s = torch.zeros(2, 3, 8), torch.zeros(2, 3)
    with pytest.raises((TypeError, ValueError), match=match):
        call(o, s)


def test_lse_out_receives_the_lse():
    prob = build_paged_problem([5, 40], 2, 64, 16, generator=torch.Generator().manual_seed(2))
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    buf = torch.full((2 * 4 * 64 * 2 + 2 * 4 * 4,), 0xFF, dtype=torch.uint8)
    out_v = buf[:1024].view(torch.bfloat16).view(2, 4, 64)
    lse_v = buf[1024:].view(torch.float32).view(2, 4)
    out, lse = tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.125,
                                      return_lse=True, out=out_v, lse_out=lse_v, **prob.kwargs)
    want, want_lse = tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                            0.125, return_lse=True, **prob.kwargs)
    assert lse.data_ptr() == lse_v.data_ptr() and out.data_ptr() == out_v.data_ptr()
    assert torch.equal(lse_v, want_lse) and torch.equal(out_v, want)
    with pytest.raises(ValueError, match="lse_out"):
        tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.125,
                               lse_out=lse_v, **prob.kwargs)
    with pytest.raises((TypeError, ValueError), match="lse_out"):
        tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.125,
                               return_lse=True, lse_out=lse_v[:1], **prob.kwargs)
