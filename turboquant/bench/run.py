"""``python -m turboquant bench``: decode attention against the memory roofline.

What it measures, in one run (CONTRACT.md section 6):

1. The GPU's HBM read bandwidth, measured here: the best of several read-only kernels
   (``torch.sum`` over float32, a bf16 ``torch.mv`` GEMV, a Triton streaming read where Triton
   is installed) over one buffer (default 4 GiB, far larger than L2); bytes = the buffer's
   size; each the median of ``--bw-repeats`` timings with CUDA events. This *read* figure is
   the denominator of every "% of bandwidth" column (``torch.sum`` alone measured 2.96-3.04
   TB/s on an H100 SXM while cuDNN SDPA read at 3.13 TB/s, hence the best-of). A
   device-to-device copy (bytes = read + written) is measured too, for context only.
2. For each shape (query heads / kv heads / head dim), batch and context:
   - a dense BF16 cache ``k, v: [batch, kv_heads, context, D]`` of random normal values;
   - the same values written into an FP4 paged cache by ``turboquant.reshape_and_cache_fp4``
     through a random permutation of the physical blocks (random block tables);
   - ``turboquant.paged_attention_fp4`` (``--backend``, default ``auto``) timed inside
     ``turboquant.value_checks(False)`` (no host syncs) with ``max_seq_len`` passed;
   - ``torch.nn.functional.scaled_dot_product_attention`` on the dense BF16 cache,
     ``q: [batch, q_heads, 1, D]``, ``enable_gqa=True`` (or K/V repeated to the query heads
     beforehand where this torch lacks ``enable_gqa``; the row's ``sdpa_gqa`` field says
     which), whatever SDPA kernel torch picks.
   Timing: two figures per call (FP4, SDPA and each ``--peers`` format), each the median over
   ``--repeats`` timed replays, CUDA events around each replay (``turboquant.bench.timing``):
   - chained (``fp4_us``, ``sdpa_us``, ``peer_<fmt>_us``): one CUDA graph of
     ``calls_per_timing`` calls (whole passes over the input sets, at least ``--min-calls``)
     where call i's query is call i-1's output: two query buffers [batch, q_heads, D] in turn,
     call i reads buffer i % 2 and writes its output into buffer (i + 1) % 2 (SDPA, which has
     no ``out=``, reads the tensor its previous call returned); no kernel is added between
     calls, and call i uses input set i % ``n_sets``. Time per call = replay time / calls:
     what a model's consecutive layers see. GB/s, % of bandwidth and speedups use it.
   - single (``fp4_us_single``, ``sdpa_us_single``, ``peer_<fmt>_us_single``): one CUDA graph
     holding one call per input set, the graphs replayed round-robin (consecutive replays read
     different sets), each replay timed on its own: one call with its graph launch on the
     device.
   Each graph is replayed before it is timed; the timed replays are queued behind a GPU spin,
   so each starts when the previous one ends and no host launch cost is in a figure.
   ``--timing eager`` times the same calls launched from Python, host launch gaps included; a
   figure whose capture fails is timed eagerly and the row's note says so.
   L2: each row builds ``n_sets`` independent input sets (FP4 blocks, block tables, queries,
   dense caches) so that one pass over the sets holds at least ``--l2-multiple`` (default 4)
   times the L2 size of FP4 bytes; consecutive calls use different sets, so small shapes
   (batch 1 x 1k is about 2 MB of FP4) are measured from HBM, not from L2. SDPA and the peers
   rotate among the same sets.
   A row is skipped, and says so, when its dense BF16 cache + FP4 cache + working memory
   would not fit in the GPU's free memory.
   ``rel_err_vs_sdpa`` = ||FP4 out - SDPA out|| / ||SDPA out|| on set 0: the quantization
   error (about 0.1 on random data), a sanity check that the timed kernel computes attention.
3. The cache writer: ``reshape_and_cache_fp4`` on ``--writer-tokens`` tokens (default 64k) of
   the first shape's kv heads / head dim, bf16 input, slots in randomly permuted blocks; one
   CUDA graph of ``--min-calls`` / 2 calls of the same input, time per call = replay / calls.

Byte counting (GB = 1e9 bytes; the same formulas are unit-tested, ``turboquant.bench.problems``):

- FP4 attention: K codes + V codes (D/2 bytes each per token per kv head) + K scales +
  V scales (D/group bytes each per token per kv head: 1 with the default one scale per token
  and head) + Q read + O written (num_heads * D * 2 bytes per sequence each). Block tables and
  seq_lens (4 bytes per block / per sequence, < 0.1%) are not counted.
- SDPA: dense K + V (kv_heads * D * 2 bytes per token each) + Q + O.
- Writer: key + value input read (num_kv_heads * D * element size per token each) + codes
  written (D/2 per token per kv head, K and V) + scales written (D/group per token per kv
  head, K and V). The slot mapping (8 bytes per token) is not counted.

Outputs under ``--out`` (default ``./bench_out``, ``turboquant.bench.report``): ``bench.json``
(everything, with metadata), ``bench.csv`` (attention rows), ``bench_writer.csv`` (the writer
row) and ``bench.png`` (roofline-style plot: bytes per call vs achieved GB/s, FP4 and SDPA, the
measured bandwidth as a horizontal line; skipped with a message when matplotlib is not
installed).

Without CUDA, ``bench`` says it needs a CUDA GPU and returns 2, unless ``--allow-cpu``, which
runs tiny shapes on the CPU (the ``reference`` backend under ``auto``) with wall-clock timing
(both figures, each call or chain timed on its own): that exercises the code path only; its
numbers are not performance figures.
Return value: 0 when every row ran or was skipped for memory, 1 when a row failed, 2 when
nothing could run.
"""
from __future__ import annotations

import argparse
import datetime
import math
import sys

import torch

from ..rotation import rotation_signs
from ..shared_state import writer_records
from . import multitoken, peers
from .problems import (BYTE_COUNTING, Row, build_decode_problem, cache_config, checks_off,
                       dense_attention_bytes, fp4_attention_bytes, fp4_steps, parse_int,
                       parse_int_list, row_memory, sdpa_steps, sets_for, state_bytes,
                       torch_dtype, writer_bytes, writer_state)
from .report import (ATTENTION_FIELDS, HEADER, WRITER_FIELDS, device_meta, format_row,
                     format_writer, note_max_observed, write_files)
from .timing import (GB, GiB, TIMING_FIGURES, kernel_names, kernel_profile,
                     measure_bandwidth, time_calls, time_decode)

DEFAULT_SHAPES = "32/8/128,64/8/128"
DEFAULT_BATCHES = "1,16,64,128"
DEFAULT_CONTEXTS = "1k,4k,16k,32k"
QUICK_SHAPES = "32/8/128"
QUICK_BATCHES = "1,64"
QUICK_CONTEXTS = "1k,16k"
CPU_SHAPES = "8/2/64"
CPU_BATCHES = "1,2"
CPU_CONTEXTS = "64,256"
CPU_QUICK_BATCHES = "1,2"
CPU_QUICK_CONTEXTS = "64"

# --------------------------------------------------------------------------------------------
# argument parsing


def parse_shapes(text: str) -> list:
    """``"32/8/128,64/8/128"`` -> ``[(32, 8, 128), (64, 8, 128)]`` (q heads / kv heads / D);
    ``x`` and ``:`` work as separators too."""
    shapes = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        fields = part.replace("x", "/").replace(":", "/").split("/")
        try:
            hq, hkv, d = (int(f) for f in fields)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected shapes like 32/8/128 (q heads/kv heads/head dim), got {part!r}")
        if hq <= 0 or hkv <= 0 or d <= 0 or hq % hkv or d % 2:
            raise argparse.ArgumentTypeError(
                f"shape {part!r}: q heads must be a multiple of kv heads, head dim even")
        shapes.append((hq, hkv, d))
    return shapes


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` options to ``parser`` (the ``bench`` subcommand's parser)."""
    g = parser.add_argument_group("what to run")
    g.add_argument("--shapes", default=None,
                   help=f"comma list of qheads/kvheads/headdim (default {DEFAULT_SHAPES}; "
                        f"--quick: {QUICK_SHAPES}; --allow-cpu without CUDA: {CPU_SHAPES})")
    g.add_argument("--batches", default=None,
                   help=f"comma list of batch sizes (default {DEFAULT_BATCHES}; "
                        f"--quick: {QUICK_BATCHES})")
    g.add_argument("--contexts", default=None,
                   help=f"comma list of context lengths, k = 1024 (default {DEFAULT_CONTEXTS};"
                        f" --quick: {QUICK_CONTEXTS})")
    g.add_argument("--quick", action="store_true",
                   help="a few rows only (one shape, 2 batches x 2 contexts), fewer repeats")
    g.add_argument("--block-size", type=int, default=16, help="tokens per cache block (16)")
    g.add_argument("--scale-group", type=int, default=0, choices=[0, 32],
                   help="elements per E8M0 scale: 0 = head dim, one per token and head "
                        "(default), or 32")
    g.add_argument("--configs", default="default",
                   help="comma-separated cache formats, each timed at every shape: QuantConfig "
                        "names (FP4 keys), e.g. 'default,plain' for the transforms on and off, "
                        "or k8v4[/NAME] for E4M3 keys (default: default)")
    g.add_argument("--backend", default="auto",
                   help="paged_attention_fp4 and timed cache-writer backend (default auto)")
    g.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16",
                   help="query / dense cache / writer input dtype (default bf16)")
    g.add_argument("--no-sdpa", action="store_true", help="skip the dense SDPA baseline")
    g.add_argument("--peers", action="store_true",
                   help="FlashInfer paged decode over BF16, FP8 and NVFP4 caches of the same "
                        "K/V and pages (decode rows) and its paged prefill over BF16 and FP8 "
                        "(multi-token rows), each checked against fp32 over its own bytes first "
                        "(turboquant.bench.peers; skipped with the reason when flashinfer is "
                        "absent)")
    g.add_argument("--no-writer", action="store_true", help="skip the cache-writer row")
    g.add_argument("--multi-token", default="",
                   help="multi-token rows BxQ@L (B sequences of L tokens, the last Q of each "
                        "its causal queries: chunked prefill, speculative decoding), e.g. "
                        "'1x2048@16k,64x4@4k' (turboquant.bench.multitoken)")
    g.add_argument("--no-decode", action="store_true",
                   help="skip the decode rows (e.g. with --multi-token)")
    g.add_argument("--writer-tokens", type=parse_int, default=64 * 1024,
                   help="tokens per cache-writer call (default 64k)")
    g.add_argument("--allow-cpu", action="store_true",
                   help="without CUDA, run tiny shapes on the CPU (tests only; not a benchmark)")
    g.add_argument("--seed", type=int, default=0, help="random seed (0)")
    g.add_argument("--no-kernel-names", action="store_true",
                   help="do not profile one call per row to record the kernels that ran")

    t = parser.add_argument_group("timing")
    t.add_argument("--repeats", type=int, default=None,
                   help="timed replays per figure (single and chained), the median is "
                        "reported (default 20; --quick 10; CPU 3)")
    t.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (3)")
    t.add_argument("--timing", choices=["graph", "eager"], default="graph",
                   help="graph: CUDA-graph replay, launch overhead excluded as in a server's "
                        "decode graph (default); eager: Python launches")
    t.add_argument("--min-calls", type=int, default=10,
                   help="at least this many calls per chained replay (10)")
    t.add_argument("--l2-multiple", type=float, default=4.0,
                   help="rotate among input sets whose FP4 bytes total >= this many L2 "
                        "sizes (4)")
    t.add_argument("--bw-bytes", type=parse_int, default=4 * GiB,
                   help="bandwidth-measurement buffer in bytes (default 4 GiB)")
    t.add_argument("--bw-repeats", type=int, default=20,
                   help="bandwidth timings, the median is reported (20)")

    o = parser.add_argument_group("output")
    o.add_argument("--out", default="bench_out",
                   help="directory for bench.json, bench.csv, bench_writer.csv, bench.png "
                        "(default ./bench_out)")
    o.add_argument("--no-plot", action="store_true", help="do not write bench.png")
    return parser


# --------------------------------------------------------------------------------------------
# the API


def _api():
    import turboquant as tq  # lazy: turboquant.cli imports this module

    return tq


def _backend_status(tq) -> list:
    return tq.backends()


def _select(kind: str, requested: str, *call_args, **kwargs) -> str:
    """The backend ``requested`` resolves to for these arguments (what ``auto`` picks); for
    kind 'attention' the arguments of ``paged_attention_fp4``, for 'cache_write' those of the
    writer op (``calls.make_cache_write``)."""
    from .. import api, calls, registry

    with calls.value_checks(False):
        if kind == "attention":
            call = api.prepare_attention(*call_args, **kwargs)
        else:
            call = calls.make_cache_write(*call_args, check_values=False, **kwargs)
    return registry.select(requested, kind, call).name


def _sdpa_has_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    q = torch.randn(1, 4, 1, 16, device=device, dtype=dtype)
    k = torch.randn(1, 2, 8, 16, device=device, dtype=dtype)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        return True
    except TypeError:
        return False


# --------------------------------------------------------------------------------------------
# one attention row


def run_row(tq, row: Row, args, device: torch.device, bw_ref: float, l2_bytes: int,
            gqa: bool, config_name: str = "default") -> dict:
    """One attention row: FP4 (and the ``--peers``, and SDPA unless ``--no-sdpa``) timed single
    and chained over ``n_sets`` input sets (module docstring), GB/s and % of ``bw_ref`` from the
    chained times, the FP4 output of set 0 checked against SDPA's."""
    config, key_format = cache_config(config_name, args)
    dtype = torch_dtype(args.dtype)
    elem = torch.finfo(dtype).bits // 8
    bs = args.block_size
    hq, hkv, d = row.num_heads, row.num_kv_heads, row.head_dim
    B, L = row.batch, row.context
    group = args.scale_group or d
    fp4_bytes = (fp4_attention_bytes(B, L, hq, hkv, d, args.scale_group, elem,
                                     key_format=key_format)
                 + state_bytes(B, hkv, d, config))
    sdpa_bytes = dense_attention_bytes(B, L, hq, hkv, d, elem)
    if not gqa:
        sdpa_bytes = dense_attention_bytes(B, L, hq, hq, d, elem)
    rec = {f: "" for f in ATTENTION_FIELDS}
    rec.update(shape=f"{hq}/{hkv}/{d}", num_heads=hq, num_kv_heads=hkv, head_dim=d,
               block_size=bs, scale_group=group, config=config_name, batch=B, context=L,
               fp4_bytes=fp4_bytes, sdpa_bytes="" if args.no_sdpa else sdpa_bytes,
               floor_us=fp4_bytes / (bw_ref * GB) * 1e6 if bw_ref > 0 else "",
               sdpa_gqa="" if args.no_sdpa else ("enable_gqa" if gqa else "repeated"))

    n_sets = sets_for(row, args, l2_bytes, key_format)
    chunk_bytes = 512 * 2**20
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * 0.92)

        def need(n):
            return row_memory(row, n, bs, args.scale_group, elem, not args.no_sdpa, gqa,
                              chunk_bytes, key_format)
        while n_sets > 1 and need(n_sets) > budget:
            n_sets = max(1, n_sets // 2)
        if need(n_sets) > budget:
            rec.update(status="skipped",
                       note=f"does not fit: needs ~{need(n_sets) / GiB:.1f} GiB (dense BF16 + "
                            f"FP4 + work), {free / GiB:.1f} GiB free")
            return rec
    rec["n_sets"] = n_sets

    p = build_decode_problem(tq, row, n_sets, config, key_format, dtype, bs, args.scale_group,
                             args.seed, device, chunk_bytes)
    rec["backend"] = _select("attention", args.backend, p.query[0], *p.cache,
                             p.block_tables[0], p.seq_lens, p.scale, max_seq_len=L,
                             **p.set_kwargs[0])

    def timed(steps, queries, outs):
        return time_decode(steps, queries, outs, device, args.repeats, args.warmup,
                           args.timing, args.min_calls)

    fp4 = fp4_steps(tq, p, args.backend, L)
    notes = []
    with checks_off(tq):
        t = timed(fp4, p.query, p.out)
    if t.note:
        notes.append("fp4: " + t.note)
    fp4_us = t.chained_us
    rec.update(timing=t.timing, calls_per_timing=t.chain_calls, fp4_us=fp4_us,
               fp4_us_single=t.single_us, fp4_GBps=fp4_bytes / (fp4_us * 1e-6) / GB)
    rec["fp4_pct_bw"] = 100.0 * rec["fp4_GBps"] / bw_ref if bw_ref > 0 else ""
    if not args.no_kernel_names:
        with checks_off(tq):
            rec["fp4_kernels"], times = kernel_profile(lambda: fp4[0](p.query[0], p.out[0]),
                                                       device)
            rec["fp4_kernel_us"] = " | ".join(f"{k} {v}" for k, v in times.items())

    if getattr(args, "peers", False) and device.type == "cuda":
        why = peers.flashinfer_unavailable()
        if why is not None:
            rec["peer_note"] = why
        else:
            with checks_off(tq):
                rec.update(peers.time_peers(timed, p.dense_k, p.dense_v, p.query,
                                            p.block_tables, p.seq_lens, bs, p.scale,
                                            2 * B * hq * d * elem))
            peers.finish(rec, fp4_us, bw_ref, GB)

    if not args.no_sdpa:
        sdpa = sdpa_steps(p, gqa)
        p.dense_k = p.dense_v = None  # where K/V were repeated, only the copy is kept
        q4 = [p.query[s].unsqueeze(2) for s in range(n_sets)]  # [B, Hq, 1, D]
        try:
            ts = timed(sdpa, q4, None)
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # the baseline alone failed
            notes.append(f"SDPA failed: {type(exc).__name__}: {str(exc).strip()[:160]}")
            rec.update(status="ok", note="; ".join(notes), sdpa_gqa="")
            return rec
        if ts.note:
            notes.append("sdpa: " + ts.note)
        if ts.timing != t.timing:
            notes.append(f"sdpa timed {ts.timing}")
        rec.update(sdpa_us=ts.chained_us, sdpa_us_single=ts.single_us,
                   sdpa_GBps=sdpa_bytes / (ts.chained_us * 1e-6) / GB,
                   speedup=ts.chained_us / fp4_us)
        rec["sdpa_pct_bw"] = 100.0 * rec["sdpa_GBps"] / bw_ref if bw_ref > 0 else ""
        if not args.no_kernel_names:
            rec["sdpa_kernels"] = kernel_names(lambda: sdpa[0](q4[0], None), device)
        # sanity: FP4 output of set 0 against SDPA on the unquantized cache
        p.out[0].fill_(float("nan"))
        with checks_off(tq):
            fp4[0](p.query[0], p.out[0])
        ref = sdpa[0](q4[0], None).squeeze(2).float()
        got = p.out[0].float()
        err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        rec["rel_err_vs_sdpa"] = err
        if not math.isfinite(err) or err > 0.5:
            notes.append("CHECK: FP4 output far from SDPA (quantization alone gives ~0.1)")
    rec["status"] = "ok"
    rec["note"] = "; ".join(notes)
    return rec

def run_writer(tq, args, device: torch.device, bw_ref: float, shape: tuple,
               config_name: str = "default") -> dict:
    _hq, hkv, d = shape
    config, key_format = cache_config(config_name, args)
    dtype = torch_dtype(args.dtype)
    elem = torch.finfo(dtype).bits // 8
    bs = args.block_size
    group = args.scale_group or d
    T = args.writer_tokens
    nbytes = writer_bytes(T, hkv, d, args.scale_group, elem, key_format)
    rec = {f: "" for f in WRITER_FIELDS}
    rec.update(num_tokens=T, num_kv_heads=hkv, head_dim=d, block_size=bs, scale_group=group,
               config=config_name, dtype=args.dtype, bytes=nbytes)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed + 17)
    nblk = math.ceil(T / bs)
    key = torch.randn(T, hkv, d, device=device, dtype=dtype, generator=gen)
    value = torch.randn(T, hkv, d, device=device, dtype=dtype, generator=gen)
    kc, vc, ks, vs = tq.allocate_cache(nblk, hkv, bs, d, scale_group=args.scale_group or None,
                                       device=device, key_format=key_format)
    perm = torch.randperm(nblk, device=device, generator=gen)
    pos = torch.arange(T, device=device)
    slots = (perm[pos // bs] * bs + pos % bs).long()
    extra = writer_state(tq, key, value, (kc, vc, ks, vs), slots, config)
    op_state = {}  # the writer op's state: the records, or the shared state's layer record
    if config.key_smoothing is not None:
        shared = extra.get("shared_state")
        op_state = extra if shared is None else dict(zip(("seq_state", "state_ids"),
                                                         writer_records(shared, T)))
    signs = rotation_signs(d, config.rotation_seed, device) if config.rotation else None
    backend = args.backend
    note = ""
    op_args = (key, value, kc, vc, ks, vs, slots)
    try:
        rec["backend"] = _select("cache_write", backend, *op_args, scale_rule=config.scale_rule,
                                 rotation_signs=signs, **op_state)
    except ValueError as exc:  # the named attention backend has no writer: time auto's
        backend = "auto"
        rec["backend"] = _select("cache_write", backend, *op_args, scale_rule=config.scale_rule,
                                 rotation_signs=signs, **op_state)
        note = f"--backend {args.backend} cannot write ({str(exc)[:100]}); timed auto"

    def f():
        tq.reshape_and_cache_fp4(*op_args, config=config, backend=backend, **extra)

    with checks_off(tq):
        us, used, _n, tnote = time_calls([f], device, args.repeats, args.warmup, args.timing,
                                         max(1, args.min_calls // 2))
    rec.update(status="ok", timing=used, us=us, GBps=nbytes / (us * 1e-6) / GB,
               note="; ".join(x for x in (note, tnote) if x))
    rec["pct_bw"] = 100.0 * rec["GBps"] / bw_ref if bw_ref > 0 else ""
    return rec


# --------------------------------------------------------------------------------------------
# entry point


def main(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    if not cuda and not getattr(args, "allow_cpu", False):
        print("turboquant bench: needs a CUDA GPU (torch.cuda.is_available() is False here). "
              "--allow-cpu runs tiny shapes on the CPU to exercise the code; its numbers are "
              "not performance figures.", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    on_cpu = device.type == "cpu"

    try:
        shapes = parse_shapes(args.shapes or (CPU_SHAPES if on_cpu else
                                              QUICK_SHAPES if args.quick else DEFAULT_SHAPES))
        batches = parse_int_list(args.batches or (
            (CPU_QUICK_BATCHES if args.quick else CPU_BATCHES) if on_cpu else
            QUICK_BATCHES if args.quick else DEFAULT_BATCHES))
        contexts = parse_int_list(args.contexts or (
            (CPU_QUICK_CONTEXTS if args.quick else CPU_CONTEXTS) if on_cpu else
            QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS))
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        for c in configs:
            cache_config(c, args)
        multi_rows = multitoken.parse_multi(args.multi_token)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        print(f"turboquant bench: {exc}", file=sys.stderr)
        return 2
    if not (shapes and batches and contexts and configs):
        print("turboquant bench: nothing to run (empty --shapes/--batches/--contexts)",
              file=sys.stderr)
        return 2
    if args.repeats is None:
        args.repeats = 3 if on_cpu else (10 if args.quick else 20)
    if on_cpu:
        args.bw_bytes = min(args.bw_bytes, 64 * 2**20)
        args.bw_repeats = min(args.bw_repeats, 5)
        args.writer_tokens = min(args.writer_tokens, 1024)
        args.min_calls = min(args.min_calls, 2)
        args.warmup = min(args.warmup, 1)
    elif args.quick:
        args.bw_repeats = min(args.bw_repeats, 10)

    try:
        tq = _api()
    except Exception as exc:
        print(f"turboquant bench: cannot load the turboquant API: {exc}", file=sys.stderr)
        return 2

    torch.manual_seed(args.seed)
    meta = device_meta(device)
    status = _backend_status(tq)
    meta.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                argv=sys.argv, backend_requested=args.backend, backends=status,
                timing=args.timing, repeats=args.repeats, warmup=args.warmup,
                min_calls=args.min_calls, l2_multiple=args.l2_multiple, dtype=args.dtype,
                block_size=args.block_size, scale_group=args.scale_group or "head_dim",
                turboquant=getattr(tq, "__version__", ""), timing_figures=TIMING_FIGURES)
    l2 = 0 if on_cpu else meta.get("l2_bytes", 0)

    timing = "wall clock" if on_cpu else args.timing
    print(f"turboquant bench on {meta['name']} ({device}), torch {torch.__version__}, "
          f"backend {args.backend}, timing {timing}, median of {args.repeats}", flush=True)
    if on_cpu:
        print("  CPU run (--allow-cpu): wall-clock timing on tiny shapes; these numbers are "
              "not performance figures", flush=True)
    for b in status:
        if isinstance(b, dict) and "name" in b:
            why = "" if b.get("available") else f" ({b.get('reason', '')})"
            print(f"  backend {b['name']}: "
                  f"{'available' if b.get('available') else 'unavailable'}{why}", flush=True)

    bandwidth = measure_bandwidth(device, args.bw_bytes, args.bw_repeats)
    bw = bandwidth["reference_GBps"]
    print(f"bandwidth: read {bandwidth['read_GBps']:.0f} GB/s ({bandwidth['read_method']}); "
          + ", ".join(f"{k} {v['GBps']:.0f}" for k, v in bandwidth["methods"].items())
          + f" GB/s; copy {bandwidth.get('copy_GBps', float('nan')):.0f} GB/s "
          f"({bandwidth.get('copy_method', '')}); '%bw' = % of the read figure", flush=True)
    if l2:
        print(f"L2 {l2 / 2**20:.0f} MiB: each row rotates among 'sets' input sets holding >= "
              f"{args.l2_multiple:g} x L2 of FP4 bytes (SDPA rotates among the same sets)",
              flush=True)
    print("fp4_us, sdpa_us: per call of a chain (call i's query = call i-1's output; GB/s, %bw "
          "and speedup from these); single_us, sdpa_single: one call alone", flush=True)

    gqa = _sdpa_has_gqa(device, torch_dtype(args.dtype)) if not args.no_sdpa else True
    if not gqa:
        print("  this torch's SDPA lacks enable_gqa: K/V are repeated to the query heads "
              "before timing, and SDPA bytes count the repeated cache", flush=True)

    rows = []
    failed = 0
    print(HEADER, flush=True)
    for (hq, hkv, d) in ([] if args.no_decode else shapes):
        for B in batches:
            for L in contexts:
                for name in configs:
                    try:
                        rec = run_row(tq, Row(hq, hkv, d, B, L), args, device, bw, l2, gqa,
                                      name)
                    except Exception as exc:
                        failed += 1
                        rec = {f: "" for f in ATTENTION_FIELDS}
                        rec.update(shape=f"{hq}/{hkv}/{d}", num_heads=hq, num_kv_heads=hkv,
                                   head_dim=d, block_size=args.block_size, config=name,
                                   batch=B, context=L, status="error",
                                   note=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    rows.append(rec)
                    print(format_row(rec), flush=True)
                    for line in peers.format_table([rec])[2:]:
                        print("  peers:" + line, flush=True)

    multi = multitoken.run_all(tq, shapes, multi_rows, configs, args, device, bw) \
        if multi_rows else []

    writers = []
    for name in ([] if args.no_writer else configs):
        try:
            writer = run_writer(tq, args, device, bw, shapes[0], name)
        except Exception as exc:
            failed += 1
            writer = {f: "" for f in WRITER_FIELDS}
            writer.update(num_tokens=args.writer_tokens, config=name, status="error",
                          note=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        writers.append(writer)

    ceiling_note = note_max_observed(rows, bandwidth)

    doc = {
        "meta": meta,
        "bandwidth": bandwidth,
        "byte_counting": {**BYTE_COUNTING, "GB": GB},
        "rows": rows,
        "multi_token_rows": multi,
        "writers": writers,
    }
    written, plot_msg = write_files(
        args.out, doc, rows, writers,
        None if args.no_plot else f"turboquant FP4 decode vs dense BF16 SDPA, {meta['name']}")

    if not args.no_kernel_names and any(r.get("fp4_kernels") for r in rows):
        print("\nkernels per row, from its profiled calls (longest first):")
        for r in rows:
            if r.get("fp4_kernels") or r.get("sdpa_kernels"):
                print(f"  {r['shape']} b{r['batch']} ctx{r['context']}: "
                      f"fp4 [{r.get('fp4_kernels', '')}]  sdpa [{r.get('sdpa_kernels', '')}]")
                if r.get("fp4_kernel_us"):
                    print(f"    fp4 device us per call: {r['fp4_kernel_us']}")

    # the whole table again last, so the end of the output holds it
    print()
    print(f"summary: {meta['name']}, HBM read {bandwidth['read_GBps']:.0f} GB/s "
          f"(copy {bandwidth.get('copy_GBps', float('nan')):.0f}), backend {args.backend}, "
          f"timing {timing}, median of {args.repeats}")
    print(HEADER)
    for r in rows:
        print(format_row(r))
    for writer in writers:
        print(format_writer(writer))
    for line in peers.format_table(rows):
        print(line)
    if multi:
        print("multi-token rows:")
        print(multitoken.HEADER)
        for r in multi:
            print(multitoken.format_row(r))
    if ceiling_note:
        print(ceiling_note)
    print(f"wrote {', '.join(written)} in {args.out}")
    if plot_msg:
        print(f"note: {plot_msg}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m turboquant.bench.run",
                                     description="FP4 paged decode attention vs the memory "
                                                 "roofline and dense BF16 SDPA")
    return add_arguments(parser)


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))