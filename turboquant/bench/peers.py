"""Peer rows for ``python -m turboquant bench --peers``, timed in the same run as turboquant's
rows, over KV caches holding the same K/V in the same pages (page = turboquant block, same block
tables, HND layout), bf16 query and output, sm_scale = 1 / sqrt(D):

- decode rows: FlashInfer's paged decode (``BatchDecodeWithPagedKVCacheWrapper``, what vLLM and
  SGLang call on NVIDIA) over BF16, FP8 E4M3 and NVFP4 caches (``time_peers``);
- multi-token rows (``--multi-token``): FlashInfer's paged prefill
  (``BatchPrefillWithPagedKVCacheWrapper``) over BF16 and FP8 E4M3 caches, causal with the
  diagonal bottom-right aligned (query j of a sequence with Q queries and L keys sees keys
  0 .. L - Q + j, as turboquant's rows), its backends tried in turn (``PREFILL_BACKENDS``: bf16
  fa3 then fa2, fp8 fa2, since fa3 takes an FP8 cache only with an FP8 query), the fastest that
  passes the check being the row's (``time_prefill_peers``). Each is timed like turboquant's
  multi-token rows (``timing.time_calls``: independent calls in one CUDA graph, time per
  call = replay / calls), ``run(q, (k, v), out=out)`` into a fixed output buffer, the wrapper
  created with ``use_cuda_graph=True`` and fixed index buffers, planned with ``uniform_q_len``
  = Q (every sequence has Q queries: without it FlashInfer's CUDA-graph plan sizes its query tile
  for the ragged worst case).

A peer that computes something else is not a baseline: before a format (and, for prefill, a
backend) is timed, it runs on a small ragged problem (3 sequences of 1, 37 and 100 keys in
shuffled pages; decode: one query each, prefill: 1, 5 and 40 causal queries) and is compared with
fp32 attention over the values its own bytes hold (``reference_attention``: BF16 as stored; FP8
times its scale; NVFP4 decoded here from E2M1 codes, E4M3 block scales and the global scale). A
format or backend whose error exceeds ``CHECK_TOL``, or that raises, is reported in the row's
``peer_note``, not timed.

Caches (what each peer stores per token and kv head, D = head dim):
  bf16   2D bytes per tensor.
  fp8    D bytes, one fp32 scale per tensor (amax / 448), passed as k_scale / v_scale.
  nvfp4  D/2 bytes of E2M1 codes (even element in the low nibble) and D/16 E4M3 scales of 16
         elements each (amax / 6 after a global scale g = 448 * 6 / amax of the tensor), k_scale
         = 1 / g. FlashInfer runs NVFP4 only in its tensor-core path on SM90 (fa2).
Each decode format is timed with ``use_tensor_cores`` False and True where FlashInfer has both,
with the bench's two figures (single: one call per CUDA-graph replay; chained: call i's query is
call i-1's output, ``FlashInferDecode(q, out)`` writing ``run(..., out=out)``); the faster by
the chained figure is the row's (the other is in the notes).
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Optional

import torch

from ..format import E2M1_MAX, decode_e2m1, encode_e2m1, pack_fp4, unpack_fp4

PEER_FORMATS = ("bf16", "fp8", "nvfp4")
PREFILL_FORMATS = ("bf16", "fp8")
# backends tried per format, in turn (fa3 runs an FP8 cache only with an FP8 query)
PREFILL_BACKENDS = {"bf16": ("fa3", "fa2"), "fp8": ("fa2",)}
CHECK_KV_LENS = (1, 37, 100)  # the check problem's keys per sequence
CHECK_QUERY_LENS = (1, 5, 40)  # and its causal queries per sequence (prefill)
CHECK_TOL = 2e-2  # max abs error of a peer's output (bf16) against fp32 over its own bytes
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
WORKSPACE_BYTES = 256 * 2**20
_checked: dict = {}  # (peer, format, variant, heads, kv heads, D, page) -> reason or None


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


# ---------------------------------------------------------------------------- the wrappers


def page_indices(tables: torch.Tensor, seq_lens: torch.Tensor, page: int) -> tuple:
    """FlashInfer's paged-KV description of a batch: tables [B, nblk] page ids, seq_lens [B]
    -> (indptr int32 [B + 1], indices int32 [pages used], last_page_len int32 [B]), on the
    tables' device."""
    nblk = (seq_lens + page - 1) // page
    indptr = torch.zeros(tables.shape[0] + 1, dtype=torch.int32, device=tables.device)
    indptr[1:] = torch.cumsum(nblk, 0)
    cols = torch.arange(tables.shape[1], device=tables.device)
    indices = tables[cols[None, :] < nblk[:, None]].to(torch.int32).contiguous()
    return indptr, indices, (seq_lens - (nblk - 1) * page).to(torch.int32)


class _FlashInferPaged:
    """What FlashInfer's paged decode and prefill share: the page indices of a batch
    (``tables`` [B, nblk] page ids, ``seq_lens`` [B] int32) in fixed buffers for CUDA graphs,
    the workspace, and the call ``run(q, (k, v), [k_scale, v_scale, kv_cache_sf,] out=out)``."""

    def __init__(self, cache: PeerCache, tables: torch.Tensor, seq_lens: torch.Tensor,
                 page: int):
        self.indptr, self.indices, self.last = page_indices(tables, seq_lens, page)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=tables.device)
        self.cache = cache
        self.head_dim = cache.v.shape[-1] * (2 if cache.fmt == "nvfp4" else 1)
        self.wrapper = None

    def __call__(self, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        c = self.cache
        kw = {}
        if c.k_scale is not None:
            kw = {"k_scale": c.k_scale, "v_scale": c.v_scale}
        if c.fmt == "nvfp4":
            kw["kv_cache_sf"] = (c.k_sf, c.v_sf)
        return self.wrapper.run(q, (c.k, c.v), out=out, **kw)


class FlashInferDecode(_FlashInferPaged):
    """FlashInfer's paged decode planned for one batch: ``tables`` [B, nblk] page ids,
    ``seq_lens`` [B] int32; a CUDA-graph-safe wrapper (fixed index buffers)."""

    def __init__(self, cache: PeerCache, num_heads: int, tables: torch.Tensor,
                 seq_lens: torch.Tensor, page: int, scale: float, tensor_cores: bool):
        import flashinfer

        super().__init__(cache, tables, seq_lens, page)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last)
        self.wrapper.plan(self.indptr, self.indices, self.last, num_heads, cache.k.shape[1],
                          self.head_dim, page, q_data_type=torch.bfloat16,
                          kv_data_type=cache.k.dtype, sm_scale=scale)


class FlashInferPrefill(_FlashInferPaged):
    """FlashInfer's paged prefill planned for one batch, causal (bottom-right aligned): the
    queries of sequence s are rows ``cu_query_lens[s]:cu_query_lens[s + 1]`` of q [sum Q, Hq, D],
    its keys the first ``seq_lens[s]`` tokens of its pages ``tables[s]``; ``backend`` one of
    FlashInfer's (fa2, fa3, ...); a CUDA-graph-safe wrapper (fixed index buffers)."""

    def __init__(self, cache: PeerCache, num_heads: int, tables: torch.Tensor,
                 seq_lens: torch.Tensor, cu_query_lens: torch.Tensor, page: int, scale: float,
                 backend: str):
        import flashinfer

        super().__init__(cache, tables, seq_lens, page)
        self.qo_indptr = cu_query_lens.to(torch.int32).clone()
        q_lens = (self.qo_indptr[1:] - self.qo_indptr[:-1]).tolist()
        uniform = q_lens[0] if len(set(q_lens)) == 1 else None
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr,
            paged_kv_indptr_buf=self.indptr, paged_kv_indices_buf=self.indices,
            paged_kv_last_page_len_buf=self.last, backend=backend)
        self.wrapper.plan(self.qo_indptr, self.indptr, self.indices, self.last, num_heads,
                          cache.k.shape[1], self.head_dim, page, causal=True, sm_scale=scale,
                          q_data_type=torch.bfloat16, kv_data_type=cache.k.dtype,
                          o_data_type=torch.bfloat16, uniform_q_len=uniform)


# ---------------------------------------------------------------------------- the check


def reference_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                        tables: torch.Tensor, kv_lens: torch.Tensor,
                        cu_query_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 causal attention, fp32 [sum Q, Hq, D]: the queries of sequence s, rows
    ``cu_query_lens[s]:cu_query_lens[s + 1]`` of q [sum Q, Hq, D], over its first ``kv_lens[s]``
    keys / values in pages [P, Hkv, page, D] through ``tables[s]``, the diagonal bottom-right
    aligned (query j of Q sees keys 0 .. L - Q + j; one query sees all L: decode); GQA query
    head h reads kv head h // (Hq / Hkv)."""
    hq, hkv = q.shape[1], k_pages.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for s in range(tables.shape[0]):
        n, q0, q1 = int(kv_lens[s]), int(cu_query_lens[s]), int(cu_query_lens[s + 1])
        ks, vs = (x[tables[s].long()].transpose(0, 1).flatten(1, 2)[:, :n]
                  for x in (k_pages, v_pages))  # [Hkv, n, D]
        qs = q[q0:q1].float().view(q1 - q0, hkv, hq // hkv, -1)  # [Q, Hkv, G, D]
        logits = torch.einsum("qhgd,htd->qhgt", qs, ks.float()) * scale
        last = n - (q1 - q0) + torch.arange(q1 - q0, device=q.device)  # last key of each query
        seen = torch.arange(n, device=q.device)[None, :] <= last[:, None]  # [Q, n]
        logits = logits.masked_fill(~seen[:, None, None, :], float("-inf"))
        out[q0:q1] = torch.einsum("qhgt,htd->qhgd", logits.softmax(-1),
                                  vs.float()).reshape(q1 - q0, hq, -1)
    return out


def _check(key: tuple, fmt: str, num_heads: int, num_kv_heads: int, head_dim: int, page: int,
           device, query_lens: tuple, make_run: Callable) -> Optional[str]:
    """Run a peer on the small ragged problem (``CHECK_KV_LENS`` keys, ``query_lens`` causal
    queries per sequence, shuffled pages) against ``reference_attention`` over its own bytes:
    None if it matches, else why not (cached under ``key``). ``make_run(cache, tables, kv_lens,
    cu_query_lens, scale)`` gives the peer's call ``(q, out) -> out``."""
    if key in _checked:
        return _checked[key]
    gen = torch.Generator(device=device).manual_seed(7)
    nseq = len(CHECK_KV_LENS)
    lens = torch.tensor(CHECK_KV_LENS, device=device, dtype=torch.int32)
    nblk = -(-max(CHECK_KV_LENS) // page)
    k = torch.randn(nseq, num_kv_heads, nblk * page, head_dim, device=device, generator=gen)
    v = torch.randn(nseq, num_kv_heads, nblk * page, head_dim, device=device, generator=gen)
    tables = torch.randperm(nseq * nblk, device=device, generator=gen).to(torch.int32)
    tables = tables.view(nseq, nblk)
    cu = torch.tensor([0, *itertools.accumulate(query_lens)], device=device, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, device=device, generator=gen).bfloat16()
    scale = head_dim ** -0.5
    try:
        cache = PeerCache(fmt, k, v, tables, nseq * nblk, page)
        got = make_run(cache, tables, lens, cu, scale)(q, torch.empty_like(q)).float()
    except Exception as exc:  # noqa: BLE001 - the peer cannot run this: say so
        _checked[key] = f"{type(exc).__name__}: {str(exc).strip()[:160]}"
        return _checked[key]
    ref = reference_attention(q, cache.values("k"), cache.values("v"), tables, lens, cu, scale)
    err = float((got - ref).abs().max())
    _checked[key] = None if err <= CHECK_TOL else (
        f"output differs from fp32 attention over its own bytes by {err:.3g} (> {CHECK_TOL})")
    return _checked[key]


def check_format(fmt: str, tensor_cores: bool, num_heads: int, num_kv_heads: int,
                 head_dim: int, page: int, device) -> Optional[str]:
    """The decode peer (one query per sequence) on the check problem: None if it matches fp32
    attention over its own bytes, else why not (cached per configuration)."""
    return _check(("decode", fmt, tensor_cores, num_heads, num_kv_heads, head_dim, page), fmt,
                  num_heads, num_kv_heads, head_dim, page, device, (1,) * len(CHECK_KV_LENS),
                  lambda c, t, lens, cu, scale: FlashInferDecode(c, num_heads, t, lens, page,
                                                                 scale, tensor_cores))


def check_prefill(fmt: str, backend: str, num_heads: int, num_kv_heads: int, head_dim: int,
                  page: int, device) -> Optional[str]:
    """The prefill peer on ``backend`` on the check problem (``CHECK_QUERY_LENS`` causal
    queries): None if it matches fp32 attention over its own bytes, else why not (cached)."""
    return _check(("prefill", fmt, backend, num_heads, num_kv_heads, head_dim, page), fmt,
                  num_heads, num_kv_heads, head_dim, page, device, CHECK_QUERY_LENS,
                  lambda c, t, lens, cu, scale: FlashInferPrefill(c, num_heads, t, lens, cu,
                                                                  page, scale, backend))


# ---------------------------------------------------------------------------- timing


def _fastest(formats: tuple, variants: Callable, check: Callable, make_cache: Callable,
             time_one: Callable, notes: list) -> dict:
    """Per format, its variants ``variants(fmt)`` [(arg, name)] each checked first
    (``check(fmt, arg)``: None or why not), the format's cache made once
    (``make_cache(fmt)``) for the first that passes, each timed by ``time_one(cache, arg)`` ->
    (us to compare, result, tag, timing note); the fastest kept: {fmt: (result, tag)}. Why a
    variant was not timed, its timing note and the slower variants' tags go to ``notes``. One
    format's cache at a time (a BF16 copy of 128 x 32k tokens is 17 GB)."""
    best_of = {}
    for fmt in formats:
        cache = best = None
        for arg, name in variants(fmt):
            why = check(fmt, arg)
            if why is not None:
                notes.append(f"{name}: {why}")
                continue
            try:
                if cache is None:
                    cache = make_cache(fmt)
                us, result, tag, note = time_one(cache, arg)
            except Exception as exc:  # noqa: BLE001 - a peer that fails here is noted
                notes.append(f"{name}: {type(exc).__name__}: {str(exc).strip()[:120]}")
                continue
            if note:
                notes.append(f"{name}: {note}")
            if best is None or us < best[0]:
                if best is not None:
                    notes.append(f"slower: {best[2]}")
                best = (us, result, tag)
            else:
                notes.append(f"slower: {tag}")
        if best is not None:
            best_of[fmt] = best[1:]
        cache = None
        torch.cuda.empty_cache()
    return best_of


def time_peers(time_decode: Callable, dense_k: torch.Tensor, dense_v: torch.Tensor,
               query: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               page: int, scale: float, q_bytes: int) -> dict:
    """The peer fields of one bench row: ``peer_<fmt>_us`` (chained), ``peer_<fmt>_us_single``
    and ``peer_<fmt>_bytes`` per format (or the reason it was not timed in ``peer_note``).
    ``query`` [n_sets, B, Hq, D], ``block_tables`` [n_sets, B, nblk]; dense K/V
    [n_sets * B, Hkv, L, D]. ``time_decode(steps, queries, outs)`` times one call per set,
    ``steps[s](q, out)`` (a ``FlashInferDecode`` of set s: its ``run(q, ..., out=out)``), and
    returns its single and chained figures (``turboquant.bench.timing.DecodeTimes``: in the
    chain, call i's query is call i-1's output). The faster variant by the chained figure is
    the format's row."""
    n_sets, b, hq, d = query.shape
    hkv, length = dense_k.shape[1], dense_k.shape[2]
    notes = []
    flat = block_tables.reshape(n_sets * b, -1)

    def time_one(cache, tc):
        runs = [FlashInferDecode(cache, hq, block_tables[s], seq_lens, page, scale, tc)
                for s in range(n_sets)]
        t = time_decode(runs, query, torch.empty_like(query))
        tag = (f"{cache.fmt}{'/tc' if tc else ''} {t.chained_us:.1f} us chained, "
               f"{t.single_us:.1f} single ({t.timing})")
        return t.chained_us, t, tag, t.note

    best = _fastest(
        PEER_FORMATS, lambda fmt: [(tc, f"{fmt}{'/tc' if tc else ''}")
                                   for tc in ((True,) if fmt == "nvfp4" else (False, True))],
        lambda fmt, tc: check_format(fmt, tc, hq, hkv, d, page, query.device),
        lambda fmt: PeerCache(fmt, dense_k, dense_v, flat, int(flat.max()) + 1, page),
        time_one, notes)
    rec = {}
    for fmt, (t, _tag) in best.items():
        rec[f"peer_{fmt}_us"] = t.chained_us
        rec[f"peer_{fmt}_us_single"] = t.single_us
        rec[f"peer_{fmt}_bytes"] = b * length * kv_bytes_per_token(fmt, hkv, d) + q_bytes
    rec["peer_note"] = "; ".join(notes)
    return rec


def time_prefill_peers(time_calls: Callable, dense_k: torch.Tensor, dense_v: torch.Tensor,
                       query: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                       cu_query_lens: torch.Tensor, page: int, scale: float) -> dict:
    """The peer fields of one multi-token row: ``peer_<fmt>_us`` per format of
    ``PREFILL_FORMATS`` (FlashInfer's paged prefill on the fastest of ``PREFILL_BACKENDS[fmt]``
    that passes the check) and ``peer_note`` (the backends timed, then why a format or backend
    was not timed, the slower backends). Dense K/V [B, Hkv, L, D] in pages ``tables`` [B, nblk];
    ``query`` [sum Q, Hq, D] (taken as bf16), sequence s's rows
    ``cu_query_lens[s]:cu_query_lens[s + 1]``, the last Q of its ``seq_lens[s]`` tokens.
    ``time_calls(calls)`` times the closures ``calls`` (``timing.time_calls`` with the
    bench's settings: -> (us per call, timing used, calls, note))."""
    hq, d = query.shape[1], query.shape[2]
    q = query if query.dtype == torch.bfloat16 else query.bfloat16()
    notes = []

    def time_one(cache, backend):
        run = FlashInferPrefill(cache, hq, tables, seq_lens, cu_query_lens, page, scale, backend)
        out = torch.empty_like(q)
        us, used, _calls, note = time_calls([lambda: run(q, out)])
        return us, us, f"{cache.fmt}/{backend} {us:.1f} us ({used})", note

    best = _fastest(
        PREFILL_FORMATS, lambda fmt: [(bk, f"{fmt}/{bk}") for bk in PREFILL_BACKENDS[fmt]],
        lambda fmt, bk: check_prefill(fmt, bk, hq, dense_k.shape[1], d, page, query.device),
        lambda fmt: PeerCache(fmt, dense_k, dense_v, tables, int(tables.max()) + 1, page),
        time_one, notes)
    rec = {f"peer_{fmt}_us": us for fmt, (us, _tag) in best.items()}
    if best:
        notes.insert(0, "timed " + ", ".join(tag for _us, tag in best.values()))
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
