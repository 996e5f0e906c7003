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
   Timing: CUDA events around a CUDA graph that replays ``calls_per_timing`` calls (default
   ``--timing graph``, as a server's decode graph; ``eager`` times the same calls launched
   from Python, launch gaps included; a row whose capture fails is timed eagerly and says
   so); time per call = event time / calls; the median over ``--repeats`` repetitions.
   L2: each row builds ``n_sets`` independent input sets (FP4 blocks, block tables, queries,
   dense caches) so that one pass over the sets holds at least ``--l2-multiple`` (default 4)
   times the L2 size of FP4 bytes; consecutive calls use different sets, so small shapes
   (batch 1 x 1k is about 2 MB of FP4) are measured from HBM, not from L2. SDPA rotates among
   the same sets (4x the bytes).
   A row is skipped, and says so, when its dense BF16 cache + FP4 cache + working memory
   would not fit in the GPU's free memory.
   ``rel_err_vs_sdpa`` = ||FP4 out - SDPA out|| / ||SDPA out|| on set 0: the quantization
   error (about 0.1 on random data), a sanity check that the timed kernel computes attention.
3. The cache writer: ``reshape_and_cache_fp4`` on ``--writer-tokens`` tokens (default 64k) of
   the first shape's kv heads / head dim, bf16 input, slots in randomly permuted blocks.

Byte counting (GB = 1e9 bytes; the same formulas are unit-tested):

- FP4 attention: K codes + V codes (D/2 bytes each per token per kv head) + K scales +
  V scales (D/group bytes each per token per kv head: 1 with the default one scale per token
  and head) + Q read + O written (num_heads * D * 2 bytes per sequence each). Block tables and
  seq_lens (4 bytes per block / per sequence, < 0.1%) are not counted.
- SDPA: dense K + V (kv_heads * D * 2 bytes per token each) + Q + O.
- Writer: key + value input read (num_kv_heads * D * element size per token each) + codes
  written (D/2 per token per kv head, K and V) + scales written (D/group per token per kv
  head, K and V). The slot mapping (8 bytes per token) is not counted.

Outputs under ``--out`` (default ``./bench_out``): ``bench.json`` (everything, with metadata),
``bench.csv`` (attention rows), ``bench_writer.csv`` (the writer row) and ``bench.png``
(roofline-style plot: bytes per call vs achieved GB/s, FP4 and SDPA, the measured bandwidth
as a horizontal line; skipped with a message when matplotlib is not installed).

Without CUDA, ``bench`` says it needs a CUDA GPU and returns 2, unless ``--allow-cpu``, which
runs tiny shapes on the CPU (the ``reference`` backend under ``auto``) with wall-clock timing:
that exercises the code path only; its numbers are not performance figures.
Return value: 0 when every row ran or was skipped for memory, 1 when a row failed, 2 when
nothing could run.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import peers
from .config import parse_cache_format
from .rotation import rotation_signs

GB = 1e9
GiB = 1 << 30

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

ATTENTION_FIELDS = [
    "shape",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "scale_group",
    "config",
    "batch",
    "context",
    "status",
    "backend",
    "timing",
    "n_sets",
    "calls_per_timing",
    "fp4_bytes",
    "fp4_us",
    "fp4_GBps",
    "fp4_pct_bw",
    "floor_us",
    "sdpa_bytes",
    "sdpa_us",
    "sdpa_GBps",
    "sdpa_pct_bw",
    "sdpa_gqa",
    "speedup",
    "rel_err_vs_sdpa",
    "fp4_kernels",
    "sdpa_kernels",
    "note",
] + peers.peer_fields()

WRITER_FIELDS = [
    "num_tokens",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "scale_group",
    "config",
    "dtype",
    "status",
    "backend",
    "timing",
    "bytes",
    "us",
    "GBps",
    "pct_bw",
    "note",
]


# --------------------------------------------------------------------------------------------
# byte counting (pure functions, unit-tested against hand computation)


def _groups(head_dim: int, scale_group: int) -> int:
    group = scale_group or head_dim
    if head_dim % group:
        raise ValueError(f"scale_group: expected a divisor of head_dim {head_dim}, got {group}")
    return head_dim // group


def _key_row_bytes(head_dim: int, key_format: str) -> int:
    return head_dim if key_format == "fp8_e4m3" else head_dim // 2


def fp4_attention_bytes(batch: int, context: int, num_heads: int, num_kv_heads: int,
                        head_dim: int, scale_group: int = 0, q_elem_bytes: int = 2,
                        query_len: int = 1, key_format: str = "fp4") -> int:
    """Bytes a decode call must move: K and V codes + K and V scales + Q read + O written
    (K8V4, ``key_format="fp8_e4m3"``: D key bytes per token and head instead of D/2)."""
    tokens = batch * context
    codes = tokens * num_kv_heads * (_key_row_bytes(head_dim, key_format) + head_dim // 2)
    scales = 2 * tokens * num_kv_heads * _groups(head_dim, scale_group)
    q = batch * query_len * num_heads * head_dim * q_elem_bytes
    return codes + scales + 2 * q


def dense_attention_bytes(batch: int, context: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, elem_bytes: int = 2, query_len: int = 1) -> int:
    """Bytes SDPA on a dense cache must move: K + V + Q read + O written."""
    kv = 2 * batch * context * num_kv_heads * head_dim * elem_bytes
    q = batch * query_len * num_heads * head_dim * elem_bytes
    return kv + 2 * q


def writer_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, scale_group: int = 0,
                 in_elem_bytes: int = 2, key_format: str = "fp4") -> int:
    """Bytes the cache writer must move: K + V input read + codes + scales written."""
    read = 2 * num_tokens * num_kv_heads * head_dim * in_elem_bytes
    codes = num_tokens * num_kv_heads * (_key_row_bytes(head_dim, key_format) + head_dim // 2)
    scales = 2 * num_tokens * num_kv_heads * _groups(head_dim, scale_group)
    return read + codes + scales


def fp4_cache_bytes(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                    scale_group: int = 0, key_format: str = "fp4") -> int:
    """Bytes allocated for the K+V codes and K+V scales of ``num_blocks`` blocks."""
    per_token = num_kv_heads * (_key_row_bytes(head_dim, key_format) + head_dim // 2
                                + 2 * _groups(head_dim, scale_group))
    return num_blocks * block_size * per_token


# --------------------------------------------------------------------------------------------
# argument parsing


def _parse_int(text: str) -> int:
    t = str(text).strip().lower()
    mult = 1
    if t.endswith("k"):
        mult, t = 1024, t[:-1]
    elif t.endswith("m"):
        mult, t = 1024 * 1024, t[:-1]
    try:
        value = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer like 4096 or 4k, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_int_list(text: str) -> list:
    """``"1,16,1k"`` -> ``[1, 16, 1024]``."""
    return [_parse_int(p) for p in text.split(",") if p.strip()]


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
                        "K/V and pages, each checked against fp32 over its own bytes first "
                        "(turboquant.peers; skipped with the reason when flashinfer is absent)")
    g.add_argument("--no-writer", action="store_true", help="skip the cache-writer row")
    g.add_argument("--multi-token", default="",
                   help="multi-token rows BxQ@L (B sequences of L tokens, the last Q of each "
                        "its causal queries: chunked prefill, speculative decoding), e.g. "
                        "'1x2048@16k,64x4@4k' (turboquant.bench_multitoken)")
    g.add_argument("--no-decode", action="store_true",
                   help="skip the decode rows (e.g. with --multi-token)")
    g.add_argument("--writer-tokens", type=_parse_int, default=64 * 1024,
                   help="tokens per cache-writer call (default 64k)")
    g.add_argument("--allow-cpu", action="store_true",
                   help="without CUDA, run tiny shapes on the CPU (tests only; not a benchmark)")
    g.add_argument("--seed", type=int, default=0, help="random seed (0)")
    g.add_argument("--no-kernel-names", action="store_true",
                   help="do not profile one call per row to record the kernels that ran")

    t = parser.add_argument_group("timing")
    t.add_argument("--repeats", type=int, default=None,
                   help="timed repetitions per measurement, the median is reported "
                        "(default 20; --quick 10; CPU 3)")
    t.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (3)")
    t.add_argument("--timing", choices=["graph", "eager"], default="graph",
                   help="graph: CUDA-graph replay, launch overhead excluded as in a server's "
                        "decode graph (default); eager: Python launches")
    t.add_argument("--min-calls", type=int, default=10,
                   help="at least this many calls per timed repetition (10)")
    t.add_argument("--l2-multiple", type=float, default=4.0,
                   help="rotate among input sets whose FP4 bytes total >= this many L2 "
                        "sizes (4)")
    t.add_argument("--bw-bytes", type=_parse_int, default=4 * GiB,
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
# timing


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(calls: Sequence[Callable[[], object]], device: torch.device, repeats: int,
               warmup: int, timing: str, min_calls: int) -> tuple:
    """Median time of one call, in microseconds.

    ``calls`` holds one closure per input set; a timed repetition runs them round-robin,
    whole passes over the sets, at least ``min_calls`` calls.
    Returns ``(us_per_call, timing_used, calls_per_repetition, note)``.
    """
    passes = max(1, math.ceil(min_calls / len(calls)))
    seq = list(calls) * passes
    n = len(seq)
    note = ""
    repeats = max(1, repeats)

    def run_all():
        for f in seq:
            f()

    if device.type != "cuda":
        for _ in range(max(1, warmup)):
            run_all()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_all()
            times.append((time.perf_counter() - t0) / n * 1e6)
        return _median(times), "wall", n, note

    # warm-up on a side stream (what graph capture wants; harmless for eager timing)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            run_all()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)

    graph = None
    if timing == "graph":
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_all()
            torch.cuda.synchronize(device)
        except Exception as exc:  # capture failed: time eagerly and say why
            graph = None
            msg = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
            note = f"graph capture failed ({type(exc).__name__}: {msg}), timed eager"
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(device)
    used = "graph" if graph is not None else "eager"
    step = graph.replay if graph is not None else run_all

    for _ in range(max(1, warmup)):
        step()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        starts[i].record()
        step()
        ends[i].record()
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) * 1e3 / n for s, e in zip(starts, ends)]
    del graph
    return _median(times), used, n, note


def kernel_names(fn: Callable[[], object], device: torch.device, top: int = 2) -> str:
    """The device kernels one call of ``fn`` runs, longest first (torch.profiler), so a row
    says which kernel was timed (e.g. which SDPA kernel torch picked). '' if unavailable."""
    if device.type != "cuda":
        return ""
    try:
        from torch.profiler import ProfilerActivity, profile

        import warnings

        fn()
        torch.cuda.synchronize(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize(device)
        kernels = []
        for e in prof.key_averages():
            if not str(getattr(e, "device_type", "")).endswith("CUDA"):
                continue
            t = (getattr(e, "self_device_time_total", None)
                 or getattr(e, "self_cuda_time_total", 0) or 0)
            kernels.append((t, e.key))
        kernels.sort(reverse=True)
        return " | ".join(k[:80] for _t, k in kernels[:top])
    except Exception as exc:  # diagnostic only
        return f"(profiler failed: {type(exc).__name__})"


_TRITON_READ = None


def _triton_read_kernel():
    """A streaming read kernel (Triton): each program sums ``ITERS`` contiguous tiles of
    ``BLOCK`` float32 elements and writes one partial sum. None where Triton is missing."""
    global _TRITON_READ
    if _TRITON_READ is None:
        try:
            import triton
            import triton.language as tl

            @triton.jit
            def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
                pid = tl.program_id(0).to(tl.int64)
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                base = pid * BLOCK * ITERS
                for i in range(ITERS):
                    offs = base + i * BLOCK + tl.arange(0, BLOCK)
                    acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
                tl.store(out_ptr + pid, tl.sum(acc, axis=0))

            _TRITON_READ = _read
        except Exception:  # no Triton: the method is skipped
            _TRITON_READ = False
    return _TRITON_READ or None


def triton_read_sum(buf: torch.Tensor, block: int = 2048, iters: int = 16) -> torch.Tensor:
    """Sum of a flat float32 tensor through the Triton read kernel (partial sums, then torch)."""
    kernel = _triton_read_kernel()
    if kernel is None:
        raise RuntimeError("triton is not available")
    n = buf.numel()
    programs = -(-n // (block * iters))
    partial = torch.empty(programs, dtype=torch.float32, device=buf.device)
    kernel[(programs,)](buf, partial, n, BLOCK=block, ITERS=iters, num_warps=8)
    return partial


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int, warmup: int = 3) -> dict:
    """HBM read bandwidth, the best of several read-only kernels over one buffer (default
    4 GiB, >> L2), each the median of ``repeats`` timings with CUDA events:

    - ``sum``: ``torch.sum`` over the float32 buffer;
    - ``gemv``: ``torch.mv`` of the buffer viewed as a bf16 [rows, 4096] matrix (cuBLAS; the
      vector and result, < 0.1% of the bytes, are not counted);
    - ``triton``: a Triton streaming-read kernel (on a GPU, where Triton is installed).

    Bytes = the buffer's size. The reference figure is the largest of these (no kernel reads
    faster than the memory can deliver, so the largest is the tightest lower bound of the
    true read bandwidth). A device-to-device copy (bytes = read + written) is measured too and
    reported for context only."""
    numel = max(1, nbytes // 4)
    # random bf16 pairs: finite both as float32 (the sum) and as bf16 (the gemv); never zeros
    buf = torch.rand(2 * numel, dtype=torch.bfloat16, device=device).view(torch.float32)
    nbytes = numel * 4
    result = {"buffer_bytes": nbytes, "repeats": repeats, "methods": {}}

    def timed(fn) -> float:
        for _ in range(warmup):
            fn()
        _sync(device)
        ts = []
        for _ in range(max(1, repeats)):
            if device.type == "cuda":
                s = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                ts.append(s.elapsed_time(e) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
        return _median(ts)

    methods = result["methods"]
    t = timed(lambda: buf.sum())
    methods["sum"] = {"GBps": nbytes / t / GB, "s": t,
                      "what": f"torch.sum over {nbytes / GiB:.2f} GiB float32, bytes = buffer"}
    cols = 4096
    rows = nbytes // 2 // cols
    if rows:
        try:
            mat = buf.view(torch.bfloat16)[:rows * cols].view(rows, cols)
            vec = torch.rand(cols, dtype=torch.bfloat16, device=device)
            mbytes = rows * cols * 2
            t = timed(lambda: torch.mv(mat, vec))
            methods["gemv"] = {"GBps": mbytes / t / GB, "s": t,
                               "what": f"torch.mv bf16 [{rows}, {cols}] matrix, bytes = matrix"}
            del mat, vec
        except Exception as exc:
            methods["gemv"] = {"GBps": float("nan"), "what": f"failed: {type(exc).__name__}"}
    if device.type == "cuda":
        try:
            small = buf[:min(numel, 1 << 22)]
            ref = float(small.double().sum())
            got = float(triton_read_sum(small).double().sum())
            if not abs(got - ref) <= 1e-4 * abs(ref) + 1.0:
                raise RuntimeError(f"triton read kernel gave a wrong sum ({got} vs {ref})")
            t = timed(lambda: triton_read_sum(buf))
            methods["triton"] = {"GBps": nbytes / t / GB, "s": t,
                                 "what": "Triton streaming sum (2048 x 16 floats per program), "
                                         "bytes = buffer"}
        except Exception as exc:
            methods["triton"] = {"GBps": float("nan"),
                                 "what": f"skipped: {type(exc).__name__}: {str(exc)[:80]}"}
    try:
        dst = torch.empty_like(buf)
        t_copy = timed(lambda: dst.copy_(buf))
        result["copy_s"] = t_copy
        result["copy_GBps"] = 2 * nbytes / t_copy / GB
        result["copy_method"] = f"copy of {nbytes / GiB:.2f} GiB, bytes = read + written"
        del dst
    except torch.OutOfMemoryError:
        result["copy_GBps"] = float("nan")
        result["copy_method"] = "skipped: out of memory"
    del buf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    finite = {k: v["GBps"] for k, v in methods.items() if math.isfinite(v["GBps"])}
    best = max(finite, key=finite.get)
    result["read_GBps"] = finite[best]
    result["read_method"] = f"best read-only kernel: {best} ({methods[best]['what']})"
    result["reference_GBps"] = result["read_GBps"]
    result["reference"] = "read:" + best
    return result


# --------------------------------------------------------------------------------------------
# the API


def _api():
    import turboquant as tq  # lazy: turboquant.cli imports this module

    return tq


def checks_off(tq):
    """``turboquant.value_checks(False)`` for the duration, restoring the previous setting."""
    return tq.value_checks(False)


def _backend_status(tq) -> list:
    return tq.backends()


def _select(kind: str, requested: str, *call_args, **kwargs) -> str:
    """The backend ``requested`` resolves to for these arguments (what ``auto`` picks); for
    kind 'attention' the arguments of ``paged_attention_fp4``, for 'cache_write' those of the
    writer op (``api.make_cache_write``)."""
    from . import api, registry

    with api.value_checks(False):
        if kind == "attention":
            call = api.prepare_attention(*call_args, **kwargs)
        else:
            call = api.make_cache_write(*call_args, check_values=False, **kwargs)
    return registry.select(requested, kind, call).name


# --------------------------------------------------------------------------------------------
# one attention row


@dataclass
class Row:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    context: int


def _dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _sdpa_has_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    q = torch.randn(1, 4, 1, 16, device=device, dtype=dtype)
    k = torch.randn(1, 2, 8, 16, device=device, dtype=dtype)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        return True
    except TypeError:
        return False


def row_memory(row: Row, n_sets: int, block_size: int, scale_group: int, elem: int,
               sdpa: bool, gqa: bool, chunk_bytes: int, key_format: str = "fp4") -> int:
    """Device bytes a row needs: FP4 cache, dense cache, Q/O, block tables, work space."""
    nblk = math.ceil(row.context / block_size)
    fp4 = fp4_cache_bytes(n_sets * row.batch * nblk, row.num_kv_heads, block_size,
                          row.head_dim, scale_group, key_format)
    dense = 2 * n_sets * row.batch * row.num_kv_heads * row.context * row.head_dim * elem
    if sdpa and not gqa:  # the repeated copy exists next to the kv-head cache for a moment
        dense += dense * row.num_heads // row.num_kv_heads
    qo = 4 * n_sets * row.batch * row.num_heads * row.head_dim * elem
    tables = n_sets * row.batch * nblk * 4
    work = 3 * chunk_bytes + 256 * 2**20  # writer chunk copies + slots, kernel workspaces
    return fp4 + dense + qo + tables + work


def _sets_for(row: Row, args, l2_bytes: int, key_format: str = "fp4") -> int:
    nblk = math.ceil(row.context / args.block_size)
    set_fp4 = fp4_cache_bytes(row.batch * nblk, row.num_kv_heads, args.block_size,
                              row.head_dim, args.scale_group, key_format)
    if not l2_bytes:
        return 1
    return max(1, math.ceil(args.l2_multiple * l2_bytes / set_fp4))


def _config(name: str, args) -> tuple:
    """The cache format ``name`` (a QuantConfig name, or ``k8v4[/NAME]``) with the bench's
    scale group -> (QuantConfig, key_format)."""
    config, key_format = parse_cache_format(name)
    if key_format == "fp8_e4m3" and args.scale_group:
        raise ValueError(f"--configs {name}: K8V4 has one scale per (token, head); drop "
                         f"--scale-group {args.scale_group}")
    return dataclasses.replace(config, scale_group=args.scale_group or None), key_format


def state_bytes(batch: int, num_kv_heads: int, head_dim: int, config) -> int:
    """What the reader takes from the state records: lam (and the sink's key and value), fp32."""
    if not config.uses_state:
        return 0
    return batch * num_kv_heads * head_dim * 4 * (1 + 2 * config.sink)


def fill_cache(tq, cache, config, dense_k: torch.Tensor, dense_v: torch.Tensor,
               tables: torch.Tensor, block_size: int, chunk_bytes: int):
    """Write the dense K/V [num_seqs, Hkv, L, D] into ``cache`` through ``tables``
    [num_seqs, L / block_size] with the "auto" writer, a chunk of sequences at a time; sequence i
    keeps its state record (if ``config`` has one) in slot i. -> the state tensor or None."""
    nseq, hkv, length, d = dense_k.shape
    device = dense_k.device
    per_seq = 2 * length * hkv * d * dense_k.element_size()
    spc = max(1, chunk_bytes // per_seq)
    pos = torch.arange(length, device=device)
    state = tq.allocate_state(nseq, hkv, d, device) if config.uses_state else None
    with checks_off(tq):
        for i0 in range(0, nseq, spc):
            i1 = min(nseq, i0 + spc)
            k = dense_k[i0:i1].permute(0, 2, 1, 3).reshape(-1, hkv, d)
            v = dense_v[i0:i1].permute(0, 2, 1, 3).reshape(-1, hkv, d)
            slots = (tables[i0:i1][:, pos // block_size].long() * block_size
                     + pos % block_size).reshape(-1)
            extra = {}
            if state is not None:
                ids = torch.arange(i0, i1, device=device, dtype=torch.int32)
                extra = dict(seq_state=state, state_ids=ids.repeat_interleave(length),
                             positions=pos.repeat(i1 - i0))
            tq.reshape_and_cache_fp4(k, v, *cache, slots, config=config, **extra)
            del k, v, slots, extra
    _sync(device)
    return state


def run_row(tq, row: Row, args, device: torch.device, bw_ref: float, l2_bytes: int,
            gqa: bool, config_name: str = "default") -> dict:
    config, key_format = _config(config_name, args)
    dtype = _dtype(args.dtype)
    elem = torch.finfo(dtype).bits // 8
    bs = args.block_size
    hq, hkv, d = row.num_heads, row.num_kv_heads, row.head_dim
    B, L = row.batch, row.context
    group = args.scale_group or d
    nblk = math.ceil(L / bs)
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

    n_sets = _sets_for(row, args, l2_bytes, key_format)
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

    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed * 1000003 + hq * 7919 + B * 131 + L)
    nseq = n_sets * B
    total_blocks = nseq * nblk
    # dense cache (the SDPA baseline and the source of the FP4 cache): [n_sets*B, Hkv, L, D]
    dense_k = torch.randn(nseq, hkv, L, d, device=device, dtype=dtype, generator=gen)
    dense_v = torch.randn(nseq, hkv, L, d, device=device, dtype=dtype, generator=gen)
    query = torch.randn(n_sets, B, hq, d, device=device, dtype=dtype, generator=gen)
    out = torch.empty_like(query)

    cache = tq.allocate_cache(total_blocks, hkv, bs, d, scale_group=args.scale_group or None,
                              device=device, key_format=key_format)
    perm = torch.randperm(total_blocks, device=device, generator=gen).to(torch.int32)
    block_tables = perm.view(n_sets, B, nblk)
    seq_lens = torch.full((B,), L, device=device, dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)

    state = fill_cache(tq, cache, config, dense_k, dense_v, block_tables.view(nseq, nblk), bs,
                       chunk_bytes)

    def attn_kwargs(s):
        if state is None:
            return {"config": config}
        return {"config": config, "seq_state": state,
                "state_ids": torch.arange(s * B, (s + 1) * B, device=device, dtype=torch.int32)}

    set_kwargs = [attn_kwargs(s) for s in range(n_sets)]
    rec["backend"] = _select("attention", args.backend, query[0], *cache, block_tables[0],
                             seq_lens, scale, max_seq_len=L, **set_kwargs[0])

    def fp4_call(s):
        q, o, bt, kw = query[s], out[s], block_tables[s], set_kwargs[s]

        def f():
            tq.paged_attention_fp4(q, *cache, bt, seq_lens, scale, out=o,
                                   backend=args.backend, max_seq_len=L, **kw)
        return f

    notes = []
    with checks_off(tq):
        fp4_us, used, ncalls, note = time_calls([fp4_call(s) for s in range(n_sets)], device,
                                                args.repeats, args.warmup, args.timing,
                                                args.min_calls)
    if note:
        notes.append("fp4: " + note)
    rec.update(timing=used, calls_per_timing=ncalls, fp4_us=fp4_us,
               fp4_GBps=fp4_bytes / (fp4_us * 1e-6) / GB)
    rec["fp4_pct_bw"] = 100.0 * rec["fp4_GBps"] / bw_ref if bw_ref > 0 else ""
    if not args.no_kernel_names:
        with checks_off(tq):
            rec["fp4_kernels"] = kernel_names(fp4_call(0), device)

    if getattr(args, "peers", False) and device.type == "cuda":
        why = peers.flashinfer_unavailable()
        if why is not None:
            rec["peer_note"] = why
        else:
            with checks_off(tq):
                rec.update(peers.time_peers(
                    lambda calls: time_calls(calls, device, args.repeats, args.warmup,
                                             args.timing, args.min_calls),
                    dense_k, dense_v, query, block_tables, seq_lens, bs, scale,
                    2 * B * hq * d * elem))
            peers.finish(rec, fp4_us, bw_ref, GB)

    if not args.no_sdpa:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if gqa:
            ks, vs = dense_k, dense_v
            kw = {"enable_gqa": True}
        else:  # older torch: materialise the GQA repeat outside the timing
            ks = dense_k.repeat_interleave(hq // hkv, dim=1)
            vs = dense_v.repeat_interleave(hq // hkv, dim=1)
            kw = {}
        del dense_k, dense_v

        def sdpa_call(s):
            q4 = query[s].unsqueeze(2)  # [B, Hq, 1, D]
            k4, v4 = ks[s * B:(s + 1) * B], vs[s * B:(s + 1) * B]

            def f():
                return sdpa(q4, k4, v4, scale=scale, **kw)
            return f

        try:
            sdpa_us, used_s, _n, note = time_calls([sdpa_call(s) for s in range(n_sets)],
                                                   device, args.repeats, args.warmup,
                                                   args.timing, args.min_calls)
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # the baseline alone failed
            notes.append(f"SDPA failed: {type(exc).__name__}: {str(exc).strip()[:160]}")
            rec.update(status="ok", note="; ".join(notes), sdpa_gqa="")
            return rec
        if note:
            notes.append("sdpa: " + note)
        if used_s != used:
            notes.append(f"sdpa timed {used_s}")
        rec.update(sdpa_us=sdpa_us, sdpa_GBps=sdpa_bytes / (sdpa_us * 1e-6) / GB,
                   speedup=sdpa_us / fp4_us)
        rec["sdpa_pct_bw"] = 100.0 * rec["sdpa_GBps"] / bw_ref if bw_ref > 0 else ""
        if not args.no_kernel_names:
            rec["sdpa_kernels"] = kernel_names(sdpa_call(0), device)
        # sanity: FP4 output of set 0 against SDPA on the unquantized cache
        out[0].fill_(float("nan"))
        with checks_off(tq):
            fp4_call(0)()
        ref = sdpa_call(0)().squeeze(2).float()
        got = out[0].float()
        err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        rec["rel_err_vs_sdpa"] = err
        if not math.isfinite(err) or err > 0.5:
            notes.append("CHECK: FP4 output far from SDPA (quantization alone gives ~0.1)")
    rec["status"] = "ok"
    rec["note"] = "; ".join(notes)
    return rec


def writer_state(tq, key, value, cache, slots, config, sequences: int = 64) -> dict:
    """For a writer timed in its steady state: the tokens of ``key``/``value`` [T, Hkv, D]
    belong to ``sequences`` equal runs whose state records (if ``config`` keeps them) are filled
    by one first write, untimed; -> the ``seq_state``/``state_ids`` arguments of the timed
    writes (no positions: no record is filled again), or {}."""
    if not config.uses_state:
        return {}
    T, hkv, d = key.shape
    state = tq.allocate_state(sequences, hkv, d, key.device)
    pos = torch.arange(T, device=key.device)
    ids = (pos * sequences // T).to(torch.int32)
    first = (ids.long() * T + sequences - 1) // sequences  # each run's first token
    with checks_off(tq):
        tq.reshape_and_cache_fp4(key, value, *cache, slots, config=config, seq_state=state,
                                 state_ids=ids, positions=pos - first)
    return dict(seq_state=state, state_ids=ids)


def run_writer(tq, args, device: torch.device, bw_ref: float, shape: tuple,
               config_name: str = "default") -> dict:
    _hq, hkv, d = shape
    config, key_format = _config(config_name, args)
    dtype = _dtype(args.dtype)
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
    op_state = extra if config.key_smoothing is not None else {}
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
# printing and files


def _fmt(v, spec: str) -> str:
    if v == "" or v is None:
        return "-"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


HEADER = (f"{'shape':>9} {'batch':>5} {'ctx':>6} {'sets':>4} {'fp4_us':>8} {'fp4_GB/s':>8} "
          f"{'%bw':>5} {'floor_us':>8} {'sdpa_us':>8} {'sdpa_GB/s':>9} {'%bw':>5} "
          f"{'speedup':>7} {'rel_err':>7} backend config")


def format_row(r: dict) -> str:
    if r.get("status") != "ok":
        return (f"{r['shape']:>9} {r['batch']:>5} {r['context']:>6}  "
                f"{r.get('status')}: {r.get('note', '')}")
    line = (f"{r['shape']:>9} {r['batch']:>5} {r['context']:>6} {r['n_sets']:>4} "
            f"{_fmt(r['fp4_us'], '8.1f'):>8} {_fmt(r['fp4_GBps'], '8.0f'):>8} "
            f"{_fmt(r['fp4_pct_bw'], '5.1f'):>5} {_fmt(r['floor_us'], '8.1f'):>8} "
            f"{_fmt(r['sdpa_us'], '8.1f'):>8} {_fmt(r['sdpa_GBps'], '9.0f'):>9} "
            f"{_fmt(r['sdpa_pct_bw'], '5.1f'):>5} {_fmt(r['speedup'], '7.2f'):>7} "
            f"{_fmt(r['rel_err_vs_sdpa'], '7.3f'):>7} {r.get('backend', '')}/{r['timing']}"
            f" {r.get('config', '')}")
    if r.get("note"):
        line += "  # " + r["note"]
    return line


def format_writer(w: dict) -> str:
    if w.get("status") != "ok":
        return f"cache writer: {w.get('status')}: {w.get('note', '')}"
    return (f"cache writer ({w['backend']}/{w['timing']}, {w['config']}): {w['num_tokens']} tokens x "
            f"{w['num_kv_heads']} kv heads x D {w['head_dim']} {w['dtype']}: {w['us']:.1f} us, "
            f"{w['GBps']:.0f} GB/s, {_fmt(w['pct_bw'], '.1f')}% of measured read bandwidth "
            f"(bytes {w['bytes']} = input read + codes + scales written)"
            + (f"  # {w['note']}" if w.get("note") else ""))


def write_csv(path: str, rows: list, fields: list) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def write_plot(path: str, rows: list, bandwidth: dict, title: str) -> Optional[str]:
    """Roofline-style plot; returns None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("matplotlib is not installed: bench.png not written (pip install matplotlib; "
                "bench.json and bench.csv hold every number)")
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return "no completed rows: bench.png not written"
    fig, ax = plt.subplots(figsize=(9, 6))
    shapes = sorted({r["shape"] for r in ok})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, shp in enumerate(shapes):
        rs = [r for r in ok if r["shape"] == shp]
        c = colors[i % len(colors)]
        ax.scatter([r["fp4_bytes"] for r in rs], [r["fp4_GBps"] for r in rs], color=c,
                   marker="o", label=f"FP4 paged {shp}")
        rs2 = [r for r in rs if r.get("sdpa_GBps") not in ("", None)]
        if rs2:
            ax.scatter([r["sdpa_bytes"] for r in rs2], [r["sdpa_GBps"] for r in rs2], color=c,
                       marker="x", label=f"SDPA dense BF16 {shp}")
    bw = bandwidth.get("read_GBps")
    if bw:
        ax.axhline(bw, color="k", linestyle="-", linewidth=1,
                   label=f"measured HBM read {bw:.0f} GB/s")
    cbw = bandwidth.get("copy_GBps")
    if cbw and math.isfinite(cbw):
        ax.axhline(cbw, color="gray", linestyle="--", linewidth=1,
                   label=f"measured copy (read+write) {cbw:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_xlabel("bytes moved per call (K/V + scales + Q + O)")
    ax.set_ylabel("achieved GB/s (1e9 B/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------
# entry point


def _device_meta(device: torch.device) -> dict:
    meta = {"device": str(device), "torch": torch.__version__,
            "python": platform.python_version()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta.update(name=p.name, sm=f"{p.major}.{p.minor}",
                    multiprocessors=p.multi_processor_count, memory_bytes=p.total_memory,
                    l2_bytes=int(getattr(p, "L2_cache_size", 0) or 50 * 2**20),
                    cuda=torch.version.cuda)
    else:
        meta.update(name=platform.processor() or platform.machine(), l2_bytes=0)
    return meta


def note_max_observed(rows: list, bandwidth: dict) -> str:
    """A kernel that reads faster than the read-only kernels (cuDNN SDPA did, by 2-3%, on an
    H100) shows the memory delivers at least that: record the highest rate any row reached
    in ``bandwidth['max_observed_GBps']`` and return a note with the FP4 rows' share of it
    ('' when no row beat the read figure)."""
    bw = bandwidth["reference_GBps"]
    ok = [r for r in rows if r.get("status") == "ok"]
    observed = [(r.get(k), k[:-5], r) for r in ok for k in ("sdpa_GBps", "fp4_GBps")]
    observed = [o for o in observed if isinstance(o[0], float) and math.isfinite(o[0])]
    if not observed:
        return ""
    top, kind, r = max(observed, key=lambda o: o[0])
    bandwidth["max_observed_GBps"] = max(top, bw)
    if top <= bw:
        return ""
    bandwidth["max_observed_by"] = f"{kind} {r['shape']} batch {r['batch']} context {r['context']}"
    shares = ", ".join(f"{100 * x['fp4_GBps'] / top:.0f}" for x in ok)
    return (f"note: {bandwidth['max_observed_by']} read at {top:.0f} GB/s, "
            f"{100 * top / bw:.1f}% of the read-kernel figure, so the memory delivers at least "
            f"that; the FP4 rows reach {shares}% of it")


def main(args: argparse.Namespace) -> int:
    from . import bench_multitoken  # it imports this module

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
            _config(c, args)
        multi_rows = bench_multitoken.parse_multi(args.multi_token)
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
    meta = _device_meta(device)
    status = _backend_status(tq)
    meta.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                argv=sys.argv, backend_requested=args.backend, backends=status,
                timing=args.timing, repeats=args.repeats, warmup=args.warmup,
                min_calls=args.min_calls, l2_multiple=args.l2_multiple, dtype=args.dtype,
                block_size=args.block_size, scale_group=args.scale_group or "head_dim",
                turboquant=getattr(tq, "__version__", ""))
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

    gqa = _sdpa_has_gqa(device, _dtype(args.dtype)) if not args.no_sdpa else True
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

    multi = bench_multitoken.run_all(tq, shapes, multi_rows, configs, args, device, bw) \
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

    os.makedirs(args.out, exist_ok=True)
    doc = {
        "meta": meta,
        "bandwidth": bandwidth,
        "byte_counting": {
            "fp4": "2*B*L*Hkv*D/2 codes + 2*B*L*Hkv*(D/group) scales + 2*B*Hq*D*elem (Q, O)",
            "sdpa": "2*B*L*Hkv*D*elem (dense K, V) + 2*B*Hq*D*elem (Q, O)",
            "writer": "2*T*Hkv*D*elem input + 2*T*Hkv*D/2 codes + 2*T*Hkv*(D/group) scales",
            "GB": GB,
        },
        "rows": rows,
        "multi_token_rows": multi,
        "writers": writers,
    }
    json_path = os.path.join(args.out, "bench.json")
    with open(json_path, "w") as fh:
        json.dump(doc, fh, indent=2, default=str)
    write_csv(os.path.join(args.out, "bench.csv"), rows, ATTENTION_FIELDS)
    if writers:
        write_csv(os.path.join(args.out, "bench_writer.csv"), writers, WRITER_FIELDS)
    plot_msg = None
    if not args.no_plot:
        plot_msg = write_plot(os.path.join(args.out, "bench.png"), rows, bandwidth,
                              f"turboquant FP4 decode vs dense BF16 SDPA, {meta['name']}")

    if not args.no_kernel_names and any(r.get("fp4_kernels") for r in rows):
        print("\nkernels of one profiled call per row (longest first):")
        for r in rows:
            if r.get("fp4_kernels") or r.get("sdpa_kernels"):
                print(f"  {r['shape']} b{r['batch']} ctx{r['context']}: "
                      f"fp4 [{r.get('fp4_kernels', '')}]  sdpa [{r.get('sdpa_kernels', '')}]")

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
        print(bench_multitoken.HEADER)
        for r in multi:
            print(bench_multitoken.format_row(r))
    if ceiling_note:
        print(ceiling_note)
    written = ["bench.json", "bench.csv"] + (["bench_writer.csv"] if writers else [])
    if not args.no_plot and not plot_msg:
        written.append("bench.png")
    print(f"wrote {', '.join(written)} in {args.out}")
    if plot_msg and not args.no_plot:
        print(f"note: {plot_msg}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m turboquant.bench",
                                     description="FP4 paged decode attention vs the memory "
                                                 "roofline and dense BF16 SDPA")
    return add_arguments(parser)


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
