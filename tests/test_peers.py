"""The FlashInfer peer caches of ``bench --peers`` (turboquant.bench.peers), on the CPU: each format's
pages hold the dense K/V of the right sequence and position, and its values are what the format
can hold (the peer itself runs only on a CUDA device with flashinfer, tests/gpu)."""
from __future__ import annotations

import pytest
import torch

from turboquant.bench import peers
from turboquant.format import sqnr_db


def _problem(page=16, nseq=3, hkv=2, length=64, d=64):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(nseq, hkv, length, d, generator=g).bfloat16()
    v = torch.randn(nseq, hkv, length, d, generator=g).bfloat16()
    nblk = length // page
    tables = torch.randperm(nseq * nblk, generator=g).to(torch.int32).view(nseq, nblk)
    return k, v, tables


def _gather(x, tables, s):
    """Sequence s's tokens [Hkv, L, D] from pages [P, Hkv, page, D]."""
    return x[tables[s].long()].transpose(0, 1).flatten(1, 2)


@pytest.mark.parametrize("fmt,floor_db", [("bf16", 60.0), ("fp8", 28.0), ("nvfp4", 18.5)])
def test_pages_hold_each_sequence_in_order(fmt, floor_db):
    k, v, tables = _problem()
    cache = peers.PeerCache(fmt, k, v, tables, tables.numel(), 16, chunk=2)
    for which, dense in (("k", k), ("v", v)):
        vals = cache.values(which)
        for s in range(k.shape[0]):
            got = _gather(vals, tables, s)
            assert sqnr_db(dense[s].float(), got) >= floor_db, (fmt, which, s)
        # a page shifted by one breaks the match: the check can fail
        wrong = _gather(vals, tables.roll(1, dims=1), 0)
        assert sqnr_db(dense[0].float(), wrong) < 3.0


def test_nvfp4_bytes_and_scales():
    """E2M1 codes with the even element in the low nibble, E4M3 block scales of 16 elements:
    the global scale g = 448 * 6 / amax takes a block of 3.0s to 448 * 6, stored as code 7
    (6.0) with block scale 448."""
    x = torch.full((1, 1, 16, 16), 3.0)
    x[0, 0, 1, 1] = -3.0  # element 1 of token 1: high nibble of byte 0 is -6.0 (code 15)
    cache = peers.PeerCache("nvfp4", x, x, torch.zeros(1, 1, dtype=torch.int32), 1, 16)
    g = peers.E4M3_MAX * 6.0 / 3.0
    assert cache.k_scale == pytest.approx(1 / g)
    assert cache.k[0, 0, 0, 0].item() == 0x77 and cache.k[0, 0, 1, 0].item() == 0xF7
    assert cache.k_sf[0, 0, 0, 0].float().item() == 448.0
    assert torch.equal(cache.values("k"), x)


def test_bytes_per_token_and_bad_tables():
    assert peers.kv_bytes_per_token("bf16", 8, 128) == 2 * 8 * 256
    assert peers.kv_bytes_per_token("fp8", 8, 128) == 2 * 8 * 128
    assert peers.kv_bytes_per_token("nvfp4", 8, 128) == 2 * 8 * (64 + 8)
    k, v, tables = _problem()
    with pytest.raises(ValueError, match="tables"):
        peers.PeerCache("fp8", k, v, tables[:, :2], tables.numel(), 16)
    with pytest.raises(ValueError, match="fmt"):
        peers.PeerCache("int4", k, v, tables, tables.numel(), 16)


def test_peers_say_why_they_cannot_run_here():
    why = peers.flashinfer_unavailable()
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the reason depends on flashinfer")
    assert why is not None


class _FakeDecode:
    """Stands in for FlashInferDecode on the CPU: writes q / 2 into ``out`` and logs which set,
    query buffer and output buffer each call had."""
    log: list = []

    def __init__(self, cache, num_heads, tables, seq_lens, page, scale, tensor_cores):
        self.tables, self.tc = tables, tensor_cores

    def __call__(self, q, out):
        _FakeDecode.log.append((self.tables.data_ptr(), q.data_ptr(), out.data_ptr(), self.tc))
        return torch.mul(q, 0.5, out=out)


def test_time_peers_records_single_and_chained_figures(monkeypatch):
    """Each format gets both figures from the bench's timer; the chained one, which picks the
    faster of the tensor-core variants and feeds each output into the next query, is
    ``peer_<fmt>_us``."""
    import functools

    from turboquant.bench import timing as bench_timing

    k, v, tables = _problem(nseq=4, length=32)  # 2 sets of batch 2
    block_tables = tables.view(2, 2, -1)
    query = torch.randn(2, 2, 4, 64).bfloat16()
    monkeypatch.setattr(peers, "check_format", lambda *a: None)
    monkeypatch.setattr(peers, "FlashInferDecode", _FakeDecode)
    _FakeDecode.log = []
    timer = functools.partial(bench_timing.time_decode, device=torch.device("cpu"), repeats=2,
                              warmup=1, timing="graph", min_calls=4)
    rec = peers.time_peers(timer, k, v, query, block_tables,
                           torch.full((2,), 32, dtype=torch.int32), 16, 0.125, 100)
    for fmt in peers.PEER_FORMATS:
        assert rec[f"peer_{fmt}_us"] > 0 and rec[f"peer_{fmt}_us_single"] > 0
        assert rec[f"peer_{fmt}_bytes"] == 2 * 32 * peers.kv_bytes_per_token(fmt, 2, 64) + 100
    assert "slower: bf16" in rec["peer_note"] and "chained" in rec["peer_note"]
    # bf16 without tensor cores: single calls first (1 warm-up pass + 2 timed over 2 sets),
    # then chains of 4 calls (1 warm-up + 2 timed) whose query is the previous call's output
    first = [e for e in _FakeDecode.log if not e[3]][:4 + 12]
    single, chained = first[:4], first[4:]
    assert [q for _t, q, _o, _tc in single] == [query[i % 2].data_ptr() for i in range(4)]
    assert [t for t, *_ in chained] == [block_tables[i % 2].data_ptr() for i in range(12)]
    for (_t, _q, out, _tc), (_t2, q_next, _o2, _tc2) in zip(chained, chained[1:]):
        assert q_next == out


def test_peer_fields_and_table_have_both_figures():
    fields = peers.peer_fields()
    for fmt in peers.PEER_FORMATS:
        i = fields.index(f"peer_{fmt}_us")
        assert fields[i + 1] == f"peer_{fmt}_us_single"
    r = {"status": "ok", "shape": "32/8/128", "batch": 1, "context": 1024, "config": "default",
         "fp4_us": 5.0, "fp4_us_single": 7.5, "peer_bf16_us": 10.0, "peer_bf16_us_single": 12.5,
         "peer_bf16_pct_bw": 50.0, "peer_bf16_speedup": 2.0, "peer_note": ""}
    lines = peers.format_table([r])
    assert "chained / single" in lines[0]
    assert "5.0 /    7.5 us" in lines[2] and "10.0 /   12.5 us  50.0 %  2.00x" in lines[2]


# --------------------------------------------------------------------------------------------
# the prefill peers of the multi-token rows, against a fake flashinfer on the CPU


class _FakePrefill:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` on the CPU: causal attention over
    the pages it was planned with, one query token and head at a time (written apart from
    ``peers.reference_attention``). ``offset`` is added to every output (a wrong peer),
    ``shift`` moves the diagonal (``shift`` = Q - L aligns it top-left), ``raises`` names
    backends whose plan fails; ``log`` records (backend, uniform_q_len) per plan and the
    backend per run."""
    offset, shift, raises = 0.0, 0, ()
    log: list = []

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, backend="auto"):
        assert kv_layout == "HND" and use_cuda_graph and workspace.dtype == torch.uint8
        self.bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
                     paged_kv_last_page_len_buf)
        self.backend = backend

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=False, sm_scale=None,
             q_data_type=None, kv_data_type=None, o_data_type=None, uniform_q_len=None):
        if self.backend in _FakePrefill.raises:
            raise RuntimeError(f"{self.backend} is not supported here")
        assert causal and q_data_type == o_data_type == torch.bfloat16
        # CUDA-graph mode: the arrays planned are the fixed buffers given at construction
        for buf, x in zip(self.bufs, (qo_indptr, paged_kv_indptr, paged_kv_indices,
                                      paged_kv_last_page_len)):
            assert buf is x
        self.page, self.scale, self.kv_heads = page_size, sm_scale, num_kv_heads
        _FakePrefill.log.append((self.backend, uniform_q_len))

    def run(self, q, paged_kv_cache, k_scale=None, v_scale=None, out=None):
        _FakePrefill.log.append(self.backend)
        qo, kv_indptr, indices, last = (b.tolist() for b in self.bufs)
        k, v = (x.float() for x in paged_kv_cache)  # [pages, Hkv, page, D]
        group = q.shape[1] // self.kv_heads
        for s in range(len(qo) - 1):
            pages = indices[kv_indptr[s]:kv_indptr[s + 1]]
            n = (len(pages) - 1) * self.page + last[s]
            n_q = qo[s + 1] - qo[s]
            for j in range(n_q):
                seen = n - n_q + j + 1 + _FakePrefill.shift
                for h in range(q.shape[1]):
                    keys = torch.cat([k[p, h // group] for p in pages])[:seen] * (k_scale or 1.0)
                    vals = torch.cat([v[p, h // group] for p in pages])[:seen] * (v_scale or 1.0)
                    p_ = torch.softmax(keys @ q[qo[s] + j, h].float() * self.scale, 0)
                    out[qo[s] + j, h] = p_ @ vals + _FakePrefill.offset
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import sys
    import types

    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(peers, "_checked", {})
    for name, value in (("log", []), ("offset", 0.0), ("shift", 0), ("raises", ())):
        monkeypatch.setattr(_FakePrefill, name, value)  # what a test changes is undone
    return _FakePrefill


def test_reference_attention_is_causal_bottom_right():
    """Q = L is SDPA's causal triangle; Q < L sees the L - Q earlier keys too; one query sees
    everything (decode)."""
    g = torch.Generator().manual_seed(1)
    k, v, tables = _problem(nseq=2, hkv=2, length=32, d=16)
    kp, vp = (torch.zeros(tables.numel(), 2, 16, 16) for _ in range(2))
    for s in range(2):
        kp[tables[s].long()] = k[s].float().unflatten(1, (-1, 16)).transpose(0, 1)
        vp[tables[s].long()] = v[s].float().unflatten(1, (-1, 16)).transpose(0, 1)
    lens = torch.tensor([32, 20], dtype=torch.int32)
    for q_lens in ((32, 20), (5, 1)):
        cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
        q = torch.randn(sum(q_lens), 4, 16, generator=g)
        got = peers.reference_attention(q, kp, vp, tables, lens, cu, 0.25)
        for s in range(2):
            n, nq = int(lens[s]), q_lens[s]
            mask = torch.arange(n)[None, :] <= (n - nq + torch.arange(nq))[:, None]
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[cu[s]:cu[s + 1]].transpose(0, 1), k[s, :, :n].float().repeat_interleave(2, 0),
                v[s, :, :n].float().repeat_interleave(2, 0), attn_mask=mask, scale=0.25)
            torch.testing.assert_close(got[cu[s]:cu[s + 1]], ref.transpose(0, 1),
                                       atol=1e-5, rtol=1e-5)


def test_prefill_check_passes_attention_and_rejects_the_rest(fake_flashinfer):
    for fmt in peers.PREFILL_FORMATS:
        assert peers.check_prefill(fmt, "fa2", 4, 2, 32, 16, torch.device("cpu")) is None
    assert ("fa2", None) in fake_flashinfer.log  # the ragged check plans without the hint
    fake_flashinfer.offset = 0.05
    why = peers.check_prefill("bf16", "fa3", 4, 2, 32, 16, torch.device("cpu"))
    assert "differs from fp32 attention over its own bytes" in why
    fake_flashinfer.offset, fake_flashinfer.shift = 0.0, -3  # a diagonal in the wrong place
    assert "differs" in peers.check_prefill("fp8", "fa3", 4, 2, 32, 16, torch.device("cpu"))
    fake_flashinfer.shift, fake_flashinfer.raises = 0, ("cudnn",)
    why = peers.check_prefill("bf16", "cudnn", 4, 2, 32, 16, torch.device("cpu"))
    assert why.startswith("RuntimeError: cudnn is not supported")


def _prefill_timer(us_by_backend):
    """A stand-in for timing.time_calls: runs the calls once, the time by backend."""
    def time_calls(calls):
        for c in calls:
            c()
        return us_by_backend[_FakePrefill.log[-1]], "graph", len(calls), ""
    return time_calls


def test_time_prefill_peers_keeps_the_fastest_checked_backend(fake_flashinfer, monkeypatch):
    k, v, tables = _problem(nseq=2, hkv=2, length=32, d=32)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    query = torch.randn(8, 4, 32).bfloat16()
    lens = torch.full((2,), 32, dtype=torch.int32)
    args = (k, v, query, tables, lens, cu, 16, 32 ** -0.5)
    rec = peers.time_prefill_peers(_prefill_timer({"fa3": 5.0, "fa2": 7.0}), *args)
    assert rec["peer_bf16_us"] == 5.0 and rec["peer_fp8_us"] == 7.0
    assert rec["peer_note"] == ("timed bf16/fa3 5.0 us (graph), fp8/fa2 7.0 us (graph); "
                                "slower: bf16/fa2 7.0 us (graph)")
    assert ("fa3", 4) in fake_flashinfer.log  # timed with every sequence's 4 queries as hint
    # fa3 unavailable: fa2 is bf16's row and the note says why fa3 is not
    monkeypatch.setattr(peers, "_checked", {})
    fake_flashinfer.raises = ("fa3",)
    rec = peers.time_prefill_peers(_prefill_timer({"fa2": 7.0}), *args)
    assert rec["peer_bf16_us"] == 7.0
    assert "bf16/fa3: RuntimeError: fa3 is not supported here" in rec["peer_note"]
    # a peer computing something else: no figure, the note says so
    monkeypatch.setattr(peers, "_checked", {})
    fake_flashinfer.raises, fake_flashinfer.offset = (), 0.5
    rec = peers.time_prefill_peers(_prefill_timer({"fa3": 5.0, "fa2": 7.0}), *args)
    assert set(rec) == {"peer_note"}
    for name in ("bf16/fa3", "bf16/fa2", "fp8/fa2"):
        assert f"{name}: output differs from fp32 attention" in rec["peer_note"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="--allow-cpu runs only where CUDA is absent")
@pytest.mark.parametrize("peer", ["fake", "absent"])
def test_multi_token_rows_get_the_prefill_peers(peer, tmp_path, capsys, monkeypatch,
                                                fake_flashinfer):
    """``bench --no-decode --multi-token ... --peers`` on the CPU: with a (fake) flashinfer the
    rows get each format's time, TFLOP/s and speedup in bench.json, bench_multitoken.csv and
    the table; without it the columns stay empty and the note says why."""
    import argparse
    import csv
    import json
    import sys

    from turboquant.bench import multitoken as bench_multitoken
    from turboquant.bench import run as bench

    if peer == "fake":
        monkeypatch.setattr(peers, "flashinfer_unavailable", lambda: None)
    else:
        monkeypatch.delitem(sys.modules, "flashinfer")
        monkeypatch.setattr(peers, "flashinfer_unavailable", lambda: "no flashinfer here")
    argv = ["--allow-cpu", "--quick", "--no-decode", "--no-writer", "--no-plot", "--peers",
            "--shapes", "4/2/32", "--multi-token", "2x4@64", "--repeats", "1",
            "--out", str(tmp_path)]
    assert bench.main(bench.add_arguments(argparse.ArgumentParser()).parse_args(argv)) == 0
    text = capsys.readouterr().out
    row, = json.loads((tmp_path / "bench.json").read_text())["multi_token_rows"]
    csv_row, = csv.DictReader((tmp_path / "bench_multitoken.csv").open())
    assert list(csv_row) == bench_multitoken.FIELDS and row["status"] == "ok"
    assert "FI_bf16_TF/s" in text and "FI_fp8_TF/s" in text
    if peer == "absent":
        assert row["peer_note"] == "no flashinfer here" and "# peers: no flashinfer here" in text
        assert all(row[f"peer_{f}_us"] == "" for f in peers.PREFILL_FORMATS)
        return
    for fmt in peers.PREFILL_FORMATS:
        us = row[f"peer_{fmt}_us"]
        assert us > 0 and float(csv_row[f"peer_{fmt}_us"]) == pytest.approx(us)
        assert row[f"peer_{fmt}_tflops"] == pytest.approx(row["flops"] / us * 1e-6)
        assert row[f"peer_{fmt}_speedup"] == pytest.approx(us / row["fp4_us"])
    assert row["peer_note"].startswith("timed bf16/") and "fp8/fa2" in row["peer_note"]
    table = [line for line in text.splitlines() if line.startswith("   4/2/32")]
    cols = bench_multitoken.HEADER.split()
    vals = table[-1].split()
    i = cols.index("FI_bf16_TF/s")
    assert vals[i] == f"{row['peer_bf16_tflops']:.1f}" and vals[i + 1] == (
        f"{row['peer_bf16_speedup']:.2f}")
    assert f"# peers: {row['peer_note']}" in text
