"""The reference backend against an independent float64 implementation written here."""
import math

import pytest
import torch

import turboquant as tq
from turboquant.cache import build_paged_problem
from turboquant.config import PLAIN
from turboquant.reference import attention_reference
from turboquant.calls import make_attention_call
from turboquant.rotation import rotation_signs

from conftest import dequant_f64


def attention_f64(query, cache, block_tables, seq_lens, scale, cu_query_lens=None,
                  sliding_window=0, soft_cap=0.0):
    """Loop-by-loop float64 paged attention over the dequantized cache."""
    kc, vc, ks, vs = cache
    nb, hkv, bs, half = kc.shape
    d = 2 * half
    group = d if ks.dim() == 3 else 32
    if ks.dim() == 3:
        ks, vs = ks.unsqueeze(-1), vs.unsqueeze(-1)
    num_tokens, hq, _ = query.shape
    g = hq // hkv
    out = torch.zeros(num_tokens, hq, d, dtype=torch.float64)
    num_seqs = seq_lens.shape[0]
    cu = list(range(num_seqs + 1)) if cu_query_lens is None else cu_query_lens.tolist()
    for s in range(num_seqs):
        n = int(seq_lens[s])
        nq = cu[s + 1] - cu[s]
        if n == 0:
            continue
        tok = torch.arange(n)
        blk = block_tables[s, tok // bs].long()
        off = tok % bs
        k = dequant_f64(kc[blk, :, off], ks[blk, off], group)  # [n, Hkv, D]
        v = dequant_f64(vc[blk, :, off], vs[blk, off], group)
        for j in range(nq):
            t = cu[s] + j
            p = n - nq + j
            lo = 0 if sliding_window == 0 else max(0, p - sliding_window + 1)
            for h in range(hq):
                kh, vh = k[lo:p + 1, h // g], v[lo:p + 1, h // g]
                logits = (kh @ query[t, h].double()) * scale
                if soft_cap:
                    logits = soft_cap * torch.tanh(logits / soft_cap)
                w = torch.softmax(logits, dim=0)
                out[t, h] = w @ vh
    return out


def run_case(seq_lens, hq, hkv, d, bs, *, query_lens=None, group=None, window=0, cap=0.0,
             dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prob = build_paged_problem(seq_lens, hkv, d, bs, dtype=dtype, scale_group=group,
                               generator=gen, spare_blocks=3, config=PLAIN)
    cu = None
    if query_lens is None:
        num_tokens = len(seq_lens)
    else:
        cu = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
        num_tokens = int(cu[-1])
    query = (torch.randn(num_tokens, hq, d, generator=gen) * 2).to(dtype)
    scale = 1.0 / math.sqrt(d)
    out = tq.paged_attention_fp4(query, *prob.cache, prob.block_tables, prob.seq_lens, scale,
                                 cu_query_lens=cu, sliding_window=window, logits_soft_cap=cap,
                                 backend="reference", **prob.kwargs)
    ref = attention_f64(query, prob.cache, prob.block_tables, prob.seq_lens, scale, cu, window,
                        cap)
    return out, ref, prob, query


def assert_close(out, ref):
    assert not torch.isnan(out).any()
    # bf16 output rounding: 2^-8 relative; fp32 math differences are far smaller
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=2e-3)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (16, 4), (16, 2)])  # GQA 1 / 4 / 8
def test_awkward_batch_gqa(hq, hkv):
    lens = [1, 54, 97, 16, 33, 0, 128, 7, 65, 2, 97, 54, 1, 31, 17, 64, 100]  # batch 17
    out, ref, _, _ = run_case(lens, hq, hkv, 64, 16)
    assert_close(out, ref)
    assert (out[5] == 0).all()  # seq_len 0 gives zeros


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [None, 32])
def test_head_dims_and_scale_groups(d, group):
    out, ref, _, _ = run_case([1, 54, 97], 8, 2, d, 32, group=group)
    assert_close(out, ref)


@pytest.mark.parametrize("bs", [16, 64, 256])
def test_block_sizes(bs):
    out, ref, _, _ = run_case([1, 300, 97, 513], 4, 1, 64, bs)
    assert_close(out, ref)


def test_multi_token_causal():
    out, ref, _, _ = run_case([10, 54, 97, 5], 8, 2, 64, 16, query_lens=[3, 1, 8, 5])
    assert_close(out, ref)


def test_sliding_window_and_multi_token():
    out, ref, _, _ = run_case([100, 54, 7], 8, 2, 64, 16, query_lens=[4, 2, 1], window=20)
    assert_close(out, ref)


def test_soft_cap():
    out, ref, _, _ = run_case([97, 54], 8, 2, 64, 16, cap=5.0)
    assert_close(out, ref)
    # the cap must matter with large logits: compare with the uncapped output
    uncapped, _, _, _ = run_case([97, 54], 8, 2, 64, 16)
    assert (out.float() - uncapped.float()).abs().max() > 1e-2


def test_fp16_query():
    out, ref, _, _ = run_case([33, 97], 8, 2, 128, 16, dtype=torch.float16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=1e-3)


def test_poisoned_tail_never_reaches_output():
    """Unused slots are 0xFF (NaN scales) already; also fill the block-table padding with a
    real block full of NaNs: the output must stay finite and unchanged."""
    out, ref, prob, query = run_case([5, 54], 4, 1, 64, 16)
    assert_close(out, ref)
    kc, vc, ks, vs = prob.cache
    tail_block = int(prob.block_tables[0, 0])
    assert (ks[tail_block, 5:] == 255).all()  # the rest of sequence 0's only block is poison
    spare = sorted(set(range(kc.shape[0])) - set(prob.block_tables.flatten().tolist()))[0]
    assert (ks[spare] == 255).all()
    tables = prob.block_tables.clone()
    tables[tables < 0] = spare  # padding now names a real block full of NaN
    again = tq.paged_attention_fp4(query, *prob.cache, tables, prob.seq_lens, 1 / 8, **prob.kwargs)
    assert torch.equal(again, out)


def test_nan_scale_in_a_visible_token_gives_nan():
    out, ref, prob, query = run_case([20, 20], 4, 1, 64, 16)
    kc, vc, ks, vs = prob.cache
    b = int(prob.block_tables[1, 0])
    vs[b, 3, 0] = 255
    again = tq.paged_attention_fp4(query, kc, vc, ks, vs, prob.block_tables, prob.seq_lens, 0.125, **prob.kwargs)
    assert torch.isnan(again[1]).all() and not torch.isnan(again[0]).any()
    ks[b, 3, 0] = 255
    vs[b, 3, 0] = 0
    again = tq.paged_attention_fp4(query, kc, vc, ks, vs, prob.block_tables, prob.seq_lens, 0.125, **prob.kwargs)
    assert torch.isnan(again[1]).all()


def test_nan_outside_the_window_does_not_leak():
    gen = torch.Generator().manual_seed(3)
    prob = build_paged_problem([64], 1, 64, 16, generator=gen, config=PLAIN)
    kc, vc, ks, vs = prob.cache
    b0 = int(prob.block_tables[0, 0])
    ks[b0, 0, 0] = 255
    vs[b0, 0, 0] = 255  # token 0 is NaN, outside a window of 8 ending at token 63
    query = torch.randn(1, 2, 64, generator=gen).bfloat16()
    out = tq.paged_attention_fp4(query, *prob.cache, prob.block_tables, prob.seq_lens, 0.125,
                                 sliding_window=8, **prob.kwargs)
    assert not torch.isnan(out).any()


def test_chunked_equals_unchunked():
    gen = torch.Generator().manual_seed(5)
    prob = build_paged_problem([300, 97], 2, 64, 16, generator=gen, config=PLAIN)
    query = torch.randn(2, 8, 64, generator=gen).bfloat16()
    call = make_attention_call(query, *prob.cache, prob.block_tables, prob.seq_lens, 0.2)
    a = torch.empty(2, 8, 64, dtype=torch.float32)
    b = torch.empty(2, 8, 64, dtype=torch.float32)
    attention_reference(call, a, chunk_tokens=16)
    attention_reference(call, b, chunk_tokens=4096)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_out_argument_is_written_and_returned():
    out, ref, prob, query = run_case([9, 3], 4, 2, 64, 16)
    buf = torch.full_like(query, float("nan"))
    res = tq.paged_attention_fp4(query, *prob.cache, prob.block_tables, prob.seq_lens,
                                 1 / 8, out=buf, **prob.kwargs)
    assert res is buf and torch.equal(buf, out)


def test_torch_library_op_checks():
    gen = torch.Generator().manual_seed(9)
    prob = build_paged_problem([20, 7], 2, 64, 16, generator=gen)  # the default config
    query = torch.randn(2, 4, 64, generator=gen).bfloat16()
    out = torch.empty_like(query)
    signs = rotation_signs(64)
    records = prob.state_records()
    ids = torch.arange(2, dtype=torch.int32)
    for transforms in ((None, None, None, False), (signs, records, ids, True)):
        args = (out, query, *prob.cache, prob.block_tables, prob.seq_lens, None, 0.125, 0, 0.0,
                32, *transforms)
        torch.library.opcheck(torch.ops.turboquant.paged_attention_fp4_reference.default, args)
    key = torch.randn(3, 2, 64, generator=gen)
    cache = tq.allocate_cache(4, 2, 16, 64)
    for transforms in ((None, None, None), (signs, records, torch.tensor([0, 1, 0], dtype=torch.int32))):
        torch.library.opcheck(torch.ops.turboquant.reshape_and_cache_fp4_reference.default,
                              (key, key, *cache, torch.tensor([0, 5, -1]), *transforms))


def test_torch_compile_fullgraph():
    gen = torch.Generator().manual_seed(11)
    prob = build_paged_problem([20, 7], 2, 64, 16, generator=gen)  # the default config
    query = torch.randn(2, 4, 64, generator=gen).bfloat16()

    def f(q):
        return tq.paged_attention_fp4(q * 2, *prob.cache, prob.block_tables, prob.seq_lens,
                                      0.125, backend="reference", **prob.kwargs)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(query), f(query))


def test_num_decodes_runs_the_decodes_and_the_rest_apart():
    """num_decodes = 5 (five one-token sequences first, then chunks of 120 and 54 tokens): the
    two calls give the one call's bits, output and lse, under the default transforms, a
    window and learned sinks; a count the query lengths contradict, or past the sequences,
    is refused by name."""
    g = torch.Generator().manual_seed(5)
    lens, qlens = [40, 1, 97, 17, 300, 300, 97], [1, 1, 1, 1, 1, 120, 54]
    prob = build_paged_problem(lens, 2, 64, 16, generator=g, write_backend="reference")
    q = torch.randn(sum(qlens), 8, 64, generator=g).bfloat16()
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    sinks = torch.randn(8, generator=g)

    def run(nd):
        return tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.125,
                                      cu_query_lens=cu, sliding_window=64, sinks=sinks,
                                      return_lse=True, num_decodes=nd, **prob.kwargs)
    (one, one_lse), (two, two_lse) = run(0), run(5)
    assert torch.equal(one, two) and torch.equal(one_lse, two_lse)
    for nd in (6, 7):
        with pytest.raises(ValueError, match=f"num_decodes: the first {nd} sequences"):
            run(nd)
    with pytest.raises(ValueError, match=r"num_decodes: expected an int in \[0, 7\]"):
        run(8)


def test_leading_decodes_counts_the_one_token_sequences_in_front():
    """leading_decodes (what an engine or the bench passes as num_decodes): the one-token
    sequences before the first longer one, from query_start_loc on the host; a step of only
    decodes counts them all, one that starts with a chunk none; entries past num_seqs (an
    engine's padded query_start_loc) are not read."""
    from turboquant.calls import leading_decodes

    def qsl(lens, pad=()):
        return torch.tensor([0] + torch.tensor(list(lens) + list(pad)).cumsum(0).tolist())
    assert leading_decodes(qsl([1, 1, 1, 1, 1, 120, 54]), 7) == 5
    assert leading_decodes(qsl([1, 1, 1]), 3) == 3
    assert leading_decodes(qsl([2048, 1, 1]), 3) == 0
    assert leading_decodes(qsl([1, 1], pad=[5, 5]), 2) == 2
    assert leading_decodes(qsl([]), 0) == 0
