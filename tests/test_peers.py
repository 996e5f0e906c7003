"""The FlashInfer peer caches of ``bench --peers`` (turboquant.peers), on the CPU: each format's
pages hold the dense K/V of the right sequence and position, and its values are what the format
can hold (the peer itself runs only on a CUDA device with flashinfer, tests/gpu)."""
from __future__ import annotations

import pytest
import torch

from turboquant import peers
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

    from turboquant import bench_timing

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
