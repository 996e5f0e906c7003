"""Multi-token rows of ``python -m turboquant bench --multi-token BxQ@L,...``: chunked prefill
(a chunk of Q new tokens per sequence attending to everything in the cache) and speculative
decoding (Q = 2-8), causal, each sequence L tokens long of which the last Q are its queries;
a mixed step (``B1xQ1+B2xQ2@L``, e.g. ``1x2048+64x1@16k``: one chunk and 64 decode rows in one
call, what a chunked-prefill engine's step looks like) gives its sequences their own Q; written
decodes first (``64x1+1x2048@16k``, the order vLLM gives a step) it passes ``num_decodes``, so
that the decode rows run as their own call.

Per row: turboquant (``paged_attention_fp4`` with ``cu_query_lens``) on an FP4 (or K8V4) cache
written from dense BF16 K/V, and PyTorch SDPA on the dense BF16 K/V [B, Hkv, L, D] with
``enable_gqa`` and the causal offset given as an explicit boolean mask [Q, L] (query j sees
keys 0 .. L - Q + j; ``is_causal`` would align the diagonal top-left, which is wrong for
Q < L); the SDPA kernel torch picked is named in the row. FLOPs are counted exactly for the
causal shape: 4 * Hq * D * (keys each query token sees, summed); bytes as for decode (codes +
scales + records read once, Q read, O written), so the table gives both TFLOP/s and % of the
measured read bandwidth. ``pass_us``: the decode-once workspace pass of the call
(``csrc_cuda/prefill_workspace.cuh``; part of ``fp4_us``), timed on its own by the profiler,
blank where the call takes none. One input set per row (the caches of these rows exceed L2
except the smallest, which the row notes).

With ``--peers`` (and flashinfer importable on a CUDA device), FlashInfer's paged prefill over a
BF16 and an FP8 E4M3 (per-tensor scale) paged cache of the same dense K/V in the same pages
(page = turboquant block, the row's block tables, HND), causal with the same bottom-right
diagonal, each checked against fp32 attention over its own bytes before it is timed
(``turboquant.bench.peers.time_prefill_peers``: the backends tried, the check, how it is timed):
``peer_<fmt>_us`` timed as turboquant's (``time_calls``), ``peer_<fmt>_tflops`` from the same
causal FLOP count, ``peer_<fmt>_speedup`` = peer us / turboquant us, ``peer_note`` (the backend
that ran, or why a format was not timed; without flashinfer, why not). The table gets the peers'
TFLOP/s and speedups as columns, the note on a line of its own; the records go to bench.json
(``multi_token_rows``) and to ``bench_multitoken.csv`` in ``--out``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

import torch

from . import peers
from ..calls import leading_decodes
from .problems import (cache_config, checks_off, fill_cache, fp4_attention_bytes,
                       parse_int_list, state_bytes, state_kwargs, torch_dtype)
from .report import table_row, write_csv
from .timing import GB, kernel_names, kernel_times, time_calls

FIELDS = ["shape", "batch", "query_len", "context", "config", "status", "fp4_us", "tflops",
          "pct_bw", "pass_us", "bytes", "flops", "sdpa_us", "sdpa_tflops", "sdpa_kernels",
          "speedup", "rel_err_vs_sdpa", "note"] + [
              f"peer_{f}_{x}" for f in peers.PREFILL_FORMATS for x in ("us", "tflops", "speedup")
          ] + ["peer_note"]


@dataclasses.dataclass(frozen=True)
class MultiRow:
    batch: int
    query_len: int
    context: int
    # a mixed step (B1xQ1+B2xQ2+...@L, e.g. one chunk and decode rows): its (count, Q) groups;
    # batch is their sequences, query_len the longest Q
    mix: tuple = ()

    def query_lens(self) -> list:
        """The query tokens of each sequence."""
        return [q for b, q in self.mix for _ in range(b)] if self.mix else \
            [self.query_len] * self.batch

    def label(self):
        """The row's query-length column: Q, or the mix as written (2048+64x1)."""
        if not self.mix:
            return self.query_len
        return "+".join(str(q) if b == 1 else f"{b}x{q}" for b, q in self.mix)


def parse_multi(text: str) -> list:
    """'1x2048@16k,64x4@4k' -> [MultiRow(1, 2048, 16384), MultiRow(64, 4, 4096)]; a mixed
    step '1x2048+64x1@16k' -> MultiRow(65, 2048, 16384, ((1, 2048), (64, 1)))."""
    rows = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = re.fullmatch(r"(\d+x\d+(?:\+\d+x\d+)*)@(\w+)", part)
        if not m:
            raise ValueError(f"--multi-token: expected BxQ@L or B1xQ1+B2xQ2@L (e.g. 1x2048@16k, "
                             f"1x2048+64x1@16k), got {part!r}")
        length = parse_int_list(m.group(2))[0]
        groups = tuple(tuple(int(x) for x in g.split("x")) for g in m.group(1).split("+"))
        if not all(b >= 1 and 1 <= q <= length for b, q in groups):
            raise ValueError(f"--multi-token {part}: need batch >= 1 and 1 <= Q <= L")
        if len(groups) == 1:
            rows.append(MultiRow(groups[0][0], groups[0][1], length))
        else:
            rows.append(MultiRow(sum(b for b, _ in groups), max(q for _, q in groups), length,
                                 groups))
    return rows


def causal_flops(batch: int, query_len: int, context: int, num_heads: int, head_dim: int) -> int:
    """Q.K^T and P.V multiply-adds (2 FLOPs each) of causal attention where query j of a
    sequence sees context - query_len + j + 1 keys."""
    keys = query_len * (context - query_len) + query_len * (query_len + 1) // 2
    return 4 * num_heads * head_dim * keys * batch


def run_multi_row(tq, shape: tuple, row: MultiRow, config_name: str, args, device,
                  bw_ref: float) -> dict:
    hq, hkv, d = shape
    b, q, length = row.batch, row.query_len, row.context
    qls = row.query_lens()
    ntok = sum(qls)
    bs = args.block_size
    config, key_format = cache_config(config_name, args)
    dtype = torch_dtype(args.dtype)
    elem = torch.finfo(dtype).bits // 8
    rec = {f: "" for f in FIELDS}
    rec.update(shape=f"{hq}/{hkv}/{d}", batch=b, query_len=row.label(), context=length,
               config=config_name)
    if length % bs:
        rec.update(status="skipped", note=f"context {length} is not a multiple of the block")
        return rec
    nblk = length // bs
    gen = torch.Generator(device=device).manual_seed(args.seed * 7 + b * 131 + ntok * 17 + length)
    dense_k = torch.randn(b, hkv, length, d, device=device, dtype=dtype, generator=gen)
    dense_v = torch.randn(b, hkv, length, d, device=device, dtype=dtype, generator=gen)
    query = torch.randn(ntok, hq, d, device=device, dtype=dtype, generator=gen)
    out = torch.empty_like(query)
    cache = tq.allocate_cache(b * nblk, hkv, bs, d, scale_group=args.scale_group or None,
                              device=device, key_format=key_format)
    tables = torch.randperm(b * nblk, device=device, generator=gen).to(torch.int32).view(b, nblk)
    state = fill_cache(tq, cache, config, dense_k, dense_v, tables, bs, 512 * 2**20)
    seq_lens = torch.full((b,), length, device=device, dtype=torch.int32)
    cu = torch.tensor([0] + qls, device=device, dtype=torch.int64).cumsum(0).to(torch.int32)
    scale = 1.0 / math.sqrt(d)
    kw = {"config": config,
          **state_kwargs(state, torch.arange(b, device=device, dtype=torch.int32))}

    # a mixed step that starts with decode rows (64x1+1x2048: an engine's decode-first order)
    # runs them as their own call (num_decodes); the other order as one call
    num_decodes = leading_decodes(cu.cpu(), b) if row.mix else 0

    def fp4():
        tq.paged_attention_fp4(query, *cache, tables, seq_lens, scale, cu_query_lens=cu,
                               out=out, backend=args.backend, max_seq_len=length,
                               num_decodes=num_decodes, **kw)

    flops = sum(causal_flops(1, qi, length, hq, d) for qi in qls)
    # the cache once, Q read and O written
    nbytes = (fp4_attention_bytes(b, length, hq, hkv, d, args.scale_group, elem, 0, key_format)
              + 2 * ntok * hq * d * elem + state_bytes(b, hkv, d, config))
    notes = []
    with checks_off(tq):
        us, used, _n, note = time_calls([fp4], device, args.repeats, args.warmup, args.timing,
                                        args.min_calls)
        # the decode-once workspace pass, timed on its own (the profiler, eager calls)
        rec["pass_us"] = kernel_times(fp4, device).get("prefill_workspace_kernel", "")
    if note:
        notes.append("fp4: " + note)
    rec.update(status="ok", fp4_us=us, flops=flops, bytes=nbytes, tflops=flops / us * 1e-6,
               pct_bw=100.0 * nbytes / (us * 1e-6) / GB / bw_ref if bw_ref > 0 else "")
    if nbytes * 4 < 50 * 2**20:
        notes.append("one input set: its cache may sit in L2")
    if getattr(args, "peers", False):
        why = peers.flashinfer_unavailable()
        if why is not None:
            rec["peer_note"] = why
        else:
            rec.update(peers.time_prefill_peers(
                lambda calls: time_calls(calls, device, args.repeats, args.warmup, args.timing,
                                         args.min_calls),
                dense_k, dense_v, query, tables, seq_lens, cu, bs, scale))
            for fmt in peers.PREFILL_FORMATS:
                p_us = rec.get(f"peer_{fmt}_us")
                if p_us:
                    rec.update({f"peer_{fmt}_tflops": flops / p_us * 1e-6,
                                f"peer_{fmt}_speedup": p_us / us})

    if not args.no_sdpa and row.mix:
        notes.append("SDPA: uniform rows only")
    elif not args.no_sdpa:
        q4 = query.view(b, q, hq, d).transpose(1, 2)  # [B, Hq, Q, D]
        pos = torch.arange(length, device=device)
        mask = pos[None, :] <= (length - q + torch.arange(q, device=device))[:, None]

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(
                q4, dense_k, dense_v, attn_mask=mask, scale=scale, enable_gqa=True)
        try:
            s_us, _u, _n, s_note = time_calls([sdpa], device, args.repeats, args.warmup,
                                              args.timing, args.min_calls)
            ref = sdpa().transpose(1, 2).reshape(b * q, hq, d).float()
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            notes.append(f"SDPA failed: {type(exc).__name__}: {str(exc).strip()[:120]}")
        else:
            if s_note:
                notes.append("sdpa: " + s_note)
            with checks_off(tq):
                fp4()
            err = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
            rec.update(sdpa_us=s_us, sdpa_tflops=flops / s_us * 1e-6, speedup=s_us / us,
                       rel_err_vs_sdpa=err, sdpa_kernels=kernel_names(sdpa, device, top=1))
            if not math.isfinite(err) or err > 0.5:
                notes.append("CHECK: FP4 output far from SDPA (quantization alone gives ~0.1)")
    rec["note"] = "; ".join(notes)
    return rec


HEADER = (f"{'shape':>9} {'batch':>5} {'q':>5} {'ctx':>6} {'fp4_us':>9} {'TFLOP/s':>7} "
          f"{'%bw':>5} {'pass_us':>7} {'sdpa_us':>9} {'TFLOP/s':>7} {'speedup':>7} {'rel_err':>7} "
          + " ".join(f"{'FI_' + f + '_TF/s':>12} {'speedup':>7}" for f in peers.PREFILL_FORMATS)
          + " config")
PEER_LEGEND = ("FI_<fmt>_TF/s: FlashInfer paged prefill over a BF16 / FP8 cache of the same K/V "
               "and pages (--peers), speedup = its time / turboquant's")


def format_row(r: dict) -> str:
    """One multi-token row of the table (``HEADER``), the SDPA kernel torch picked last; the
    peer note, where there is one, on a second line."""
    sdpa = f"  sdpa: {r['sdpa_kernels'][:60]}" if r.get("sdpa_kernels") else ""
    line = table_row(r, (("shape", 9), ("batch", 5), ("query_len", 5), ("context", 6)),
                     (("fp4_us", "9.1f"), ("tflops", "7.1f"), ("pct_bw", "5.1f"),
                      ("pass_us", "7.1f"), ("sdpa_us", "9.1f"), ("sdpa_tflops", "7.1f"),
                      ("speedup", "7.2f"), ("rel_err_vs_sdpa", "7.3f"))
                     + tuple((f"peer_{f}_{x}", spec) for f in peers.PREFILL_FORMATS
                             for x, spec in (("tflops", "12.1f"), ("speedup", "7.2f"))),
                     f"{r['config']}{sdpa}")
    if r.get("status") == "ok" and r.get("peer_note"):
        line += f"\n{'':>9}   # peers: {r['peer_note']}"
    return line


def run_all(tq, shapes, rows, configs, args, device, bw_ref) -> list:
    """Every (shape, row, config): the records, printed as they come."""
    out = []
    print("\nmulti-token rows (causal; SDPA on dense BF16 with an explicit [Q, L] mask):")
    if getattr(args, "peers", False):
        print(PEER_LEGEND)
    print(HEADER, flush=True)
    for shape in shapes:
        for row in rows:
            for name in configs:
                try:
                    rec = run_multi_row(tq, shape, row, name, args, device, bw_ref)
                except Exception as exc:  # noqa: BLE001 - a failed row is reported
                    rec = {f: "" for f in FIELDS}
                    rec.update(shape="/".join(map(str, shape)), batch=row.batch,
                               query_len=row.label(), context=row.context, config=name,
                               status="error", note=f"{type(exc).__name__}: {str(exc)[:200]}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                out.append(rec)
                print(format_row(rec), flush=True)
    if out:
        os.makedirs(args.out, exist_ok=True)
        write_csv(os.path.join(args.out, "bench_multitoken.csv"), out, FIELDS)
        print(f"wrote bench_multitoken.csv in {args.out}", flush=True)
    return out
