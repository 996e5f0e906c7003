"""Peer rows for ``python -m turboquant bench --peers``: FlashInfer's paged decode
(``BatchDecodeWithPagedKVCacheWrapper``, what vLLM and SGLang call on NVIDIA) over BF16, FP8
E4M3 and NVFP4 KV caches holding the same K/V, in the same pages (page = turboquant block,
same block table, HND), timed in the same run as turboquant's rows.

A peer that computes something else is not a baseline: before a format is timed, it runs on a
small ragged problem (3 sequences of 1, 37 and 100 tokens, shuffled pages) and is compared with
fp32 attention over the values its own bytes hold (BF16 as stored; FP8 times its scale; NVFP4
decoded here from E2M1 codes, E4M3 block scales and the global scale). A format whose error
exceeds ``CHECK_TOL`` is reported, not timed.

Caches (what each peer stores per token and kv head, D = head dim):
  bf16   2D bytes per tensor.
  fp8    D bytes, one fp32 scale per tensor (amax / 448), passed as k_scale / v_scale.
  nvfp4  D/2 bytes of E2M1 codes (even element in the low nibble) and D/16 E4M3 scales of 16
         elements each (amax / 6 after a global scale g = 448 * 6 / amax of the tensor), k_scale
         = 1 / g. FlashInfer runs NVFP4 only in its tensor-core path on SM90 (fa2).
Each format is timed with ``use_tensor_cores`` False and True where FlashInfer has both, with
the bench's two figures (single: one call per CUDA-graph replay; chained: call i's query is call
i-1's output, ``FlashInferDecode(q, out)`` writing ``run(..., out=out)``); the faster by the
chained figure is the row's (the other is in the notes).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .format import E2M1_MAX, decode_e2m1, encode_e2m1, pack_fp4, unpack_fp4

PEER_FORMATS = ("bf16", "fp8", "nvfp4")
CHECK_TOL = 2e-2  # max abs error of a peer's output (bf16) against fp32 over its own bytes
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
WORKSPACE_BYTES = 256 * 2**20
_checked: dict = {}  # (format, tensor cores, heads, kv heads, D, page) -> reason or None


def flashinfer_unavailable() -> Optional[str]:
    """Why the FlashInfer peers cannot run here, or None."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason
        return (f"flashinfer is not importable ({type(exc).__name__}: {str(exc)[:100]}); "
                "pip install flashinfer-python to get the peer rows")
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def kv_bytes_per_token(fmt: str, num_kv_heads: int, head_dim: int) -> int:
    """K plus V bytes a peer format stores per token (all kv heads)."""
    per = {"bf16": 2 * head_dim, "fp8": head_dim,
           "nvfp4": head_dim // 2 + head_dim // NVFP4_BLOCK}[fmt]
    return 2 * num_kv_heads * per


# ---------------------------------------------------------------------------- quantizers


def _nvfp4_quantize(x: torch.Tensor, g: float) -> tuple:
    """x [..., D] -> (codes uint8 [..., D/2], E4M3 scales [..., D/16]) of x * g."""
    y = x.float() * g
    blocks = y.unflatten(-1, (-1, NVFP4_BLOCK))
    sf = (blocks.abs().amax(-1) / E2M1_MAX).to(torch.float8_e4m3fn)
    s = sf.float().unsqueeze(-1)
    q = torch.where(s > 0, blocks / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    return pack_fp4(encode_e2m1(q.clamp(-E2M1_MAX, E2M1_MAX).flatten(-2))), sf


def _nvfp4_dequantize(codes: torch.Tensor, sf: torch.Tensor, g: float) -> torch.Tensor:
    v = decode_e2m1(unpack_fp4(codes)).unflatten(-1, (-1, NVFP4_BLOCK))
    return (v * sf.float().unsqueeze(-1)).flatten(-2) / g


class PeerCache:
    """One format's paged K and V (HND: [pages, Hkv, page, D]) filled from dense K/V
    [num_seqs, Hkv, L, D] through ``tables`` [num_seqs, L / page] (page ids), in chunks of
    sequences."""

    def __init__(self, fmt: str, dense_k: torch.Tensor, dense_v: torch.Tensor,
                 tables: torch.Tensor, num_pages: int, page: int, chunk: int = 8):
        if fmt not in PEER_FORMATS:
            raise ValueError(f"fmt: expected one of {PEER_FORMATS}, got {fmt!r}")
        nseq, hkv, length, d = dense_k.shape
        if length % page or tables.shape != (nseq, length // page):
            raise ValueError(f"tables: expected [{nseq}, {length // page}] page ids for "
                             f"contexts of {length} tokens in pages of {page}")
        self.fmt, self.k_scale, self.v_scale = fmt, None, None
        dev = dense_k.device
        row = {"bf16": d, "fp8": d, "nvfp4": d // 2}[fmt]
        dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}[fmt]
        self.k = torch.zeros(num_pages, hkv, page, row, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.k_sf = self.v_sf = None
        scales = {}
        for name, dense in (("k", dense_k), ("v", dense_v)):
            amax = float(dense.float().abs().amax().clamp_min(1e-30))
            scales[name] = {"bf16": 1.0, "fp8": amax / E4M3_MAX,
                            "nvfp4": E4M3_MAX * E2M1_MAX / amax}[fmt]
        if fmt == "nvfp4":
            self.k_sf = torch.zeros(num_pages, hkv, page, d // NVFP4_BLOCK,
                                    dtype=torch.float8_e4m3fn, device=dev)
            self.v_sf = torch.zeros_like(self.k_sf)
        for i0 in range(0, nseq, chunk):
            i1 = min(nseq, i0 + chunk)
            ids = tables[i0:i1].reshape(-1).long()
            for name, dense in (("k", dense_k), ("v", dense_v)):
                # [n, Hkv, L, D] -> [n * L/page, Hkv, page, D], one slab per page
                x = dense[i0:i1].unflatten(2, (-1, page)).transpose(1, 2).flatten(0, 1)
                s = scales[name]
                if fmt == "bf16":
                    getattr(self, name)[ids] = x.to(torch.bfloat16)
                elif fmt == "fp8":
                    getattr(self, name)[ids] = (x.float() / s).to(torch.float8_e4m3fn)
                else:
                    codes, sf = _nvfp4_quantize(x, s)
                    getattr(self, name)[ids] = codes
                    getattr(self, name + "_sf")[ids] = sf
        # what run() multiplies the stored values by
        self.k_scale = {"bf16": None, "fp8": scales["k"], "nvfp4": 1.0 / scales["k"]}[fmt]
        self.v_scale = {"bf16": None, "fp8": scales["v"], "nvfp4": 1.0 / scales["v"]}[fmt]
        self._g = scales

    def values(self, which: str) -> torch.Tensor:
        """The values the peer's bytes hold, fp32 [pages, Hkv, page, D]."""
        x = getattr(self, which)
        if self.fmt == "bf16":
            return x.float()
        if self.fmt == "fp8":
            return x.float() * self._g[which]
        return _nvfp4_dequantize(x, getattr(self, which + "_sf"), self._g[which])

    def nbytes(self) -> int:
        n = self.k.numel() * self.k.element_size() * 2
        return n + (2 * self.k_sf.numel() if self.k_sf is not None else 0)


# ---------------------------------------------------------------------------- the wrapper


class FlashInferDecode:
    """FlashInfer's paged decode planned for one batch: ``tables`` [B, nblk] page ids,
    ``seq_lens`` [B] int32; a CUDA-graph-safe wrapper (fixed index buffers)."""

    def __init__(self, cache: PeerCache, num_heads: int, tables: torch.Tensor,
                 seq_lens: torch.Tensor, page: int, scale: float, tensor_cores: bool):
        import flashinfer

        dev = tables.device
        b = tables.shape[0]
        nblk = (seq_lens + page - 1) // page
        self.indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        self.indptr[1:] = torch.cumsum(nblk, 0)
        cols = torch.arange(tables.shape[1], device=dev)
        self.indices = tables[cols[None, :] < nblk[:, None]].to(torch.int32).contiguous()
        self.last = (seq_lens - (nblk - 1) * page).to(torch.int32)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.cache = cache
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last)
        hkv, d = cache.k.shape[1], cache.v.shape[-1] * (2 if cache.fmt == "nvfp4" else 1)
        self.wrapper.plan(self.indptr, self.indices, self.last, num_heads, hkv, d, page,
                          q_data_type=torch.bfloat16, kv_data_type=cache.k.dtype,
                          sm_scale=scale)

    def __call__(self, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        c = self.cache
        kw = {}
        if c.k_scale is not None:
            kw = {"k_scale": c.k_scale, "v_scale": c.v_scale}
        if c.fmt == "nvfp4":
            kw["kv_cache_sf"] = (c.k_sf, c.v_sf)
        return self.wrapper.run(q, (c.k, c.v), out=out, **kw)


def check_format(fmt: str, tensor_cores: bool, num_heads: int, num_kv_heads: int,
                 head_dim: int, page: int, device) -> Optional[str]:
    """Run the peer on a small ragged problem against fp32 attention over its own bytes: None
    if it matches, else why not (cached per configuration)."""
    key = (fmt, tensor_cores, num_heads, num_kv_heads, head_dim, page)
    if key in _checked:
        return _checked[key]
    gen = torch.Generator(device=device).manual_seed(7)
    lens = torch.tensor([1, 37, 100], device=device, dtype=torch.int32)
    nblk = -(-int(lens.max()) // page)
    length = nblk * page
    k = torch.randn(3, num_kv_heads, length, head_dim, device=device, generator=gen)
    v = torch.randn(3, num_kv_heads, length, head_dim, device=device, generator=gen)
    tables = torch.randperm(3 * nblk, device=device, generator=gen).to(torch.int32).view(3, nblk)
    q = torch.randn(3, num_heads, head_dim, device=device, generator=gen).bfloat16()
    scale = head_dim ** -0.5
    try:
        cache = PeerCache(fmt, k, v, tables, 3 * nblk, page)
        run = FlashInferDecode(cache, num_heads, tables, lens, page, scale, tensor_cores)
        got = run(q, torch.empty_like(q)).float()
    except Exception as exc:  # noqa: BLE001 - the peer cannot run this: say so
        _checked[key] = f"{type(exc).__name__}: {str(exc).strip()[:160]}"
        return _checked[key]
    kv = [cache.values(w) for w in ("k", "v")]  # [pages, Hkv, page, D]
    g = num_heads // num_kv_heads
    err = 0.0
    for s in range(3):
        n = int(lens[s])
        ks, vs = (x[tables[s].long()].transpose(0, 1).flatten(1, 2)[:, :n] for x in kv)
        logits = torch.einsum("hgd,htd->hgt", q[s].float().view(num_kv_heads, g, -1), ks) * scale
        ref = torch.einsum("hgt,htd->hgd", logits.softmax(-1), vs).reshape(num_heads, -1)
        err = max(err, float((got[s] - ref).abs().max()))
    _checked[key] = None if err <= CHECK_TOL else (
        f"output differs from fp32 attention over its own bytes by {err:.3g} (> {CHECK_TOL})")
    return _checked[key]


def time_peers(time_decode: Callable, dense_k: torch.Tensor, dense_v: torch.Tensor,
               query: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               page: int, scale: float, q_bytes: int) -> dict:
    """The peer fields of one bench row: ``peer_<fmt>_us`` (chained), ``peer_<fmt>_us_single``
    and ``peer_<fmt>_bytes`` per format (or the reason it was not timed in ``peer_note``).
    ``query`` [n_sets, B, Hq, D], ``block_tables`` [n_sets, B, nblk]; dense K/V
    [n_sets * B, Hkv, L, D]. ``time_decode(steps, queries, outs)`` times one call per set,
    ``steps[s](q, out)`` (a ``FlashInferDecode`` of set s: its ``run(q, ..., out=out)``), and
    returns its single and chained figures (``turboquant.bench_timing.DecodeTimes``: in the
    chain, call i's query is call i-1's output). The faster variant by the chained figure is
    the format's row."""
    n_sets, b, hq, d = query.shape
    hkv, length = dense_k.shape[1], dense_k.shape[2]
    rec, notes = {}, []
    flat = block_tables.reshape(n_sets * b, -1)
    for fmt in PEER_FORMATS:
        cache = runs = outs = None
        best = None
        for tc in ((True,) if fmt == "nvfp4" else (False, True)):
            name = f"{fmt}{'/tc' if tc else ''}"
            why = check_format(fmt, tc, hq, hkv, d, page, query.device)
            if why is not None:
                notes.append(f"{name}: {why}")
                continue
            try:
                if cache is None:
                    cache = PeerCache(fmt, dense_k, dense_v, flat, int(flat.max()) + 1, page)
                runs = [FlashInferDecode(cache, hq, block_tables[s], seq_lens, page, scale, tc)
                        for s in range(n_sets)]
                outs = torch.empty_like(query)
                t = time_decode(runs, query, outs)
            except Exception as exc:  # noqa: BLE001 - a peer that fails here is noted
                notes.append(f"{name}: {type(exc).__name__}: {str(exc).strip()[:120]}")
                continue
            if t.note:
                notes.append(f"{name}: {t.note}")
            tag = f"{name} {t.chained_us:.1f} us chained, {t.single_us:.1f} single ({t.timing})"
            if best is None or t.chained_us < best[0].chained_us:
                if best is not None:
                    notes.append(f"slower: {best[1]}")
                best = (t, tag)
            else:
                notes.append(f"slower: {tag}")
        if best is not None:
            rec[f"peer_{fmt}_us"] = best[0].chained_us
            rec[f"peer_{fmt}_us_single"] = best[0].single_us
            rec[f"peer_{fmt}_bytes"] = (b * length * kv_bytes_per_token(fmt, hkv, d)
                                        + q_bytes)
        # one format's cache at a time (a BF16 copy of 128 x 32k tokens is 17 GB)
        cache = runs = outs = None
        torch.cuda.empty_cache()
    rec["peer_note"] = "; ".join(notes)
    return rec


def peer_fields() -> list:
    """The peer columns of a bench row: per format the chained time (``_us``), the single-call
    time (``_us_single``), the bytes, % of bandwidth and turboquant's speedup (both from the
    chained time), then ``peer_note``."""
    return [f"peer_{f}_{x}" for f in PEER_FORMATS
            for x in ("us", "us_single", "bytes", "pct_bw", "speedup")] + ["peer_note"]


def finish(rec: dict, fp4_us: float, bw_ref: float, gb: float) -> None:
    """% of the measured bandwidth on each peer's own bytes, and turboquant's speedup."""
    for fmt in PEER_FORMATS:
        us = rec.get(f"peer_{fmt}_us")
        if not us:
            continue
        gbps = rec[f"peer_{fmt}_bytes"] / (us * 1e-6) / gb
        rec[f"peer_{fmt}_pct_bw"] = 100.0 * gbps / bw_ref if bw_ref > 0 else ""
        rec[f"peer_{fmt}_speedup"] = us / fp4_us if fp4_us and math.isfinite(fp4_us) else ""


def format_table(rows: list) -> list:
    """Lines of the peer table (rows with any peer figure or note), or []: per format the
    chained / single times, % of bandwidth and turboquant's speedup (chained)."""
    rows = [r for r in rows if r.get("status") == "ok" and
            (any(r.get(f"peer_{f}_us") for f in PEER_FORMATS) or r.get("peer_note"))]
    if not rows:
        return []

    def times(chained, single) -> str:
        return f"{chained:7.1f} /{single:7.1f} us"

    def cell(r, f):
        us = r.get(f"peer_{f}_us")
        if not us:
            return f"{'-':>34}"
        return (f"{times(us, r[f'peer_{f}_us_single'])} {r[f'peer_{f}_pct_bw']:5.1f} % "
                f"{r[f'peer_{f}_speedup']:5.2f}x")

    lines = ["FlashInfer peers (time per call chained / single, % of measured read bw on the "
             "peer's own bytes and turboquant's speedup over it, both chained):",
             f"{'shape':>9} {'batch':>5} {'ctx':>6} {'config':>10} {'turboquant':>19} "
             + " ".join(f"{'FlashInfer ' + f:>34}" for f in PEER_FORMATS)]
    for r in rows:
        lines.append(f"{r['shape']:>9} {r['batch']:>5} {r['context']:>6} {r['config']:>10} "
                     f"{times(r['fp4_us'], r['fp4_us_single'])} "
                     + " ".join(cell(r, f) for f in PEER_FORMATS))
        if r.get("peer_note"):
            lines.append(f"{'':>9}   # {r['peer_note']}")
    return lines
