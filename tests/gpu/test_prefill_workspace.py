"""The prefill kernel's decode-once workspace (csrc_cuda/prefill_workspace.cuh): a pass decodes
each KV tile of a long chunked-prefill call once, and the prefill kernel copies the decoded
tiles instead of decoding them per CTA. The tiles hold the same bytes the kernel's own decode
writes, so the output must be bit-identical to the kernel without the workspace (NaN rows
included), on every case the prefill kernel's tests use; and it must match the reference on the
structured probe. TURBOQUANT_PREFILL_WORKSPACE=1 / 0 forces the path on / off per call."""
import os
import shutil
from contextlib import contextmanager

import pytest
import torch

import turboquant
from turboquant import registry

import test_cuda_backend as base
from test_cuda_backend import (PREFILL_CASES, _check_bad_block_gives_nan, _compare, _kernel_names,
                               _one_hot_check, _problem, _run)

pytestmark = [pytest.mark.gpu]
_REASON = registry.get("cuda").unavailable()
if _REASON is None and torch.cuda.get_device_capability()[0] != 9:
    _REASON = "the workspace path is the SM90a (wgmma) prefill kernel's"
pytestmark.append(pytest.mark.skipif(_REASON is not None, reason=f"prefill workspace: {_REASON}"))

WS_KERNEL = "prefill_workspace_kernel"


@contextmanager
def workspace(mode: str):
    """TURBOQUANT_PREFILL_WORKSPACE=mode for the calls inside (the binding reads it per call)."""
    old = os.environ.get("TURBOQUANT_PREFILL_WORKSPACE")
    os.environ["TURBOQUANT_PREFILL_WORKSPACE"] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ["TURBOQUANT_PREFILL_WORKSPACE"]
        else:
            os.environ["TURBOQUANT_PREFILL_WORKSPACE"] = old


def _both(fn):
    """fn() with the workspace and without it; asserts which kernels each ran."""
    with workspace("1"):
        names = _kernel_names(fn)
        assert any(WS_KERNEL in n for n in names) and any("prefill" in n for n in names), names
        on = fn()
    with workspace("0"):
        assert not any(WS_KERNEL in n for n in _kernel_names(fn))
        off = fn()
    return on, off


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("window,cap,config,key_format", [
    (0, 0.0, "default", "fp4"), (0, 0.0, "plain", "fp4"), (100, 0.0, "default", "fp4"),
    (37, 10.0, "plain", "fp4"), (1, 0.0, "default", "fp4"), (0, 30.0, "default", "fp8_e4m3"),
    (100, 0.0, "plain", "fp8_e4m3")])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_bit_identical_to_the_kernel_decoding(case, window, cap, config, key_format):
    """Ragged chunks (1 to 700 tokens), chunks crossing blocks, block sizes 16-256, shuffled
    blocks with poisoned unused slots, windows (W = 1: one key), soft caps, the transforms and the
    sink, FP4 and K8V4 keys, D 64 / 128, bf16 / fp16, GQA 1 / 4 / 7 / 8: the same bits."""
    lens, hq, hkv, d, bs, qlens, dtype = PREFILL_CASES[case]
    prob, q, cu = _problem(lens, hq, hkv, d, bs, dtype=dtype, qlens=qlens, seed=len(case) + window,
                           config=config, key_format=key_format)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    on, off = _both(lambda: _run("cuda", prob, q, cu, **kw))
    _same(on, off)
    _compare(on, _run("reference", prob, q, cu, **kw))


@pytest.mark.parametrize("with_sinks", [False, True])
def test_lse_and_learned_sinks(with_sinks):
    """The states instantiation (lse output, learned sinks): output and lse bit-identical, with
    a NaN scale in a used token (its rows' lse NaN)."""
    prob, q, cu = _problem([700, 33, 300, 129], 32, 8, 128, 16, qlens=[300, 33, 1, 129], seed=7)
    prob.cache.key_scales[prob.block_tables[-1, 0], 1] = 255
    sinks = torch.randn(32, generator=torch.Generator().manual_seed(3)).cuda() if with_sinks else None
    kw = dict(sinks=sinks, return_lse=True)
    (on, on_lse), (off, off_lse) = _both(lambda: _run("cuda", prob, q, cu, **kw))
    _same(on, off)
    _same(on_lse, off_lse)
    assert torch.isnan(on_lse).any() and torch.isfinite(on_lse).any()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("key_format", ["fp4", "fp8_e4m3"])
def test_structured_keys_and_values(key_format, d):
    """The one-hot probe through the workspace: a tile placed or decoded wrongly moves the peaks."""
    n = 3 * 128 + 37
    with workspace("1"):
        _one_hot_check(key_format, [n, n - 70], [n - 5, n - 90], WS_KERNEL, d=d)


@pytest.mark.parametrize("which", ["key_scales", "value_scales"])
def test_nan_scale_and_bad_block(which):
    """A NaN scale of a visible token makes exactly the rows that see it NaN; an out-of-range
    block id makes the sequence's rows NaN and is never read (the workspace pass writes zeros
    and a flag for it)."""
    prob, q, cu = _problem([300, 200], 8, 2, 128, 16, qlens=[200, 150], seed=4)
    blk = prob.block_tables[0, 10].item()
    scales = getattr(prob.cache, which)
    old = scales[blk, 4, 1].item()
    scales[blk, 4, 1] = 255  # token 164, kv head 1: query token i >= 64 of sequence 0 sees it
    on, off = _both(lambda: _run("cuda", prob, q, cu))
    _same(on, off)
    assert torch.isnan(on[64:200, 4:8]).all() and torch.isfinite(on[:64, 4:8]).all()
    scales[blk, 4, 1] = old
    with workspace("1"):
        _check_bad_block_gives_nan(prob, q, cu, 200)


def test_sequence_longer_than_max_seq_len_gives_nan_rows():
    """With value checks off, a sequence longer than max_seq_len (the workspace holds its first
    256 keys) is never read past the workspace: the rows whose CTA needs a later key are NaN
    (every row that sees key 256 or later), the others and the other sequence keep their bits."""
    prob, q, cu = _problem([300, 200], 8, 2, 128, 16, qlens=[200, 150], seed=6)
    with workspace("1"), turboquant.value_checks(False):
        out = turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                             0.1, cu_query_lens=cu, backend="cuda", max_seq_len=256,
                                             **prob.kwargs)
    with workspace("0"):
        ref = turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                             0.1, cu_query_lens=cu, backend="cuda", **prob.kwargs)
    torch.cuda.synchronize()
    nan = torch.isnan(out.float()).all(-1)
    assert nan[156:200].all()  # query token i of sequence 0 sees keys up to 100 + i
    assert not nan[:28].any() and not nan[200:].any()
    _same(out[~nan], ref[~nan])


def test_cuda_graph_replay_equals_eager():
    """Captured in a CUDA graph (the workspace allocated inside the capture by the caching
    allocator), the replay gives the eager call's bits."""
    prob, q, cu = _problem([700, 300], 32, 8, 128, 16, qlens=[300, 300], seed=8)
    with workspace("1"):
        eager = _run("cuda", prob, q, cu)
        _run("cuda", prob, q, cu)  # warm up (build, attributes) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _run("cuda", prob, q, cu)
        graph.replay()
        torch.cuda.synchronize()
    _same(out, eager)


def test_the_callers_workspace():
    """A workspace the caller sized with prefill_workspace_bytes (poisoned: its contents are not
    read before they are written): the pass runs into it, the output has the bits of the call's
    own allocation, and the call allocates nothing of that size; captured in a CUDA graph, the
    replay gives the same bits. One 16 bytes short: no pass (the kernel decodes itself), the
    same bits. Misaligned, or another device's type: the op's named error."""
    prob, q, cu = _problem([4000, 3000], 32, 8, 128, 16, qlens=[300, 300], seed=9)
    need = turboquant.prefill_workspace_bytes(2, 4000, 8, 128)
    assert need == 2 * 63 * 8 * 24832  # ceil(4000 / 64) steps, 24832 bytes a tile at D 128
    assert turboquant.prefill_workspace_bytes(1, 1 << 24, 8, 128) == 1 << 30  # the bound
    out = torch.empty_like(q)

    def run(ws=None):
        return _run("cuda", prob, q, cu, max_seq_len=4000, out=out, workspace=ws).clone()
    ws = torch.full((need,), 0xFF, dtype=torch.uint8, device="cuda")
    with workspace("1"):
        own = run()
        assert any(WS_KERNEL in n for n in _kernel_names(lambda: run(ws)))
        ws.fill_(0xFF)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _run("cuda", prob, q, cu, max_seq_len=4000, out=out, workspace=ws)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < need // 4
        _same(out, own)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _run("cuda", prob, q, cu, max_seq_len=4000, out=out, workspace=ws)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _same(out, own)
        short = ws[:need - 16]
        assert not any(WS_KERNEL in n for n in _kernel_names(lambda: run(short)))
        _same(run(short), own)
    with pytest.raises(RuntimeError, match="workspace.*16-byte aligned"):
        op_args = turboquant.calls.attention_op_args(
            turboquant.api.prepare_attention(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                             0.1, cu_query_lens=cu, **prob.kwargs), out)
        torch.ops.turboquant.paged_attention_fp4_cuda(*op_args[:-3], ws[1:], *op_args[-2:])


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="no compute-sanitizer")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_with_the_workspace(tmp_path, tool, monkeypatch):
    """The cuda backend's sanitizer case with the workspace forced on: every call of it that
    runs the prefill kernel (chunks with windows, lse and sinks, K8V4 keys, D 64, a bad block
    id, a state slot out of range) takes the two stages; no access out of bounds, no
    shared-memory hazard between the producers' copies and the row warps."""
    monkeypatch.setenv("TURBOQUANT_PREFILL_WORKSPACE", "1")
    base.test_compute_sanitizer(tmp_path, tool)
