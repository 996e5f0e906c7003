"""Timing for ``python -m turboquant bench``: the two figures of a decode call (single and
chained), the plain repeated-call timing of the writer and the multi-token rows, the kernels a
call runs, and the measured HBM bandwidth (the denominator of every "% of bandwidth").

What each figure is (``TIMING_FIGURES`` says it in the bench's JSON too):

- single (``time_single``): one call of an input set captured alone in a CUDA graph (one graph
  per set), the graphs replayed round-robin, each replay timed on its own between two CUDA
  events; the median over ``repeats`` replays. One call with its graph launch on the device.
- chained (``time_chained`` of a ``chain``): one CUDA graph of N calls where call i's query is
  call i-1's output and call i uses input set i % n_sets; time per call = the replay's time
  / N, the median over ``repeats`` replays. What a model's consecutive layers see.

In graph mode the host queues the timed replays behind a GPU spin (``torch.cuda._sleep``), so
each replay starts when the previous one ends and no host launch cost is in the figure.
``timing="eager"`` times the same calls launched from Python (host launch gaps included); a
capture that fails is timed eagerly and the note says so. On the CPU: the wall clock.
"""
from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
from typing import Callable, NamedTuple, Optional, Sequence

import torch

GB = 1e9
GiB = 1 << 30
# GPU clock cycles of spin per timed launch queued behind it (~50 us at 2 GHz; a replay's host
# cost is ~5-10 us), so the host has queued every timed launch before the GPU reaches them
SPIN_CYCLES_PER_LAUNCH = 100_000

TIMING_FIGURES = {
    "chained": "fp4_us, sdpa_us, peer_<fmt>_us: one CUDA graph of calls_per_timing calls, "
               "call i's query = call i-1's output (two query buffers in turn; SDPA hands on "
               "the tensor it returns), call i on input set i % n_sets; replay time / calls, "
               "median of --repeats replays; GB/s, % of bandwidth and speedups use it",
    "single": "fp4_us_single, sdpa_us_single, peer_<fmt>_us_single: one CUDA graph holding "
              "one call per input set, the graphs replayed round-robin, each replay timed on "
              "its own; median of --repeats replays (the graph launch on the device included)",
    "graph": "timed replays queued behind a GPU spin: device time, no host launch cost",
    "eager": "the same calls launched from Python, host launch gaps included",
    "wall": "CPU (--allow-cpu): wall clock; not a performance figure",
}

# one decode call of an input set: (query, output buffer or None) -> the output it wrote
Step = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _launchers(fns: Sequence[Callable[[], object]], device: torch.device, warmup: int,
               timing: str) -> tuple:
    """Warm each of ``fns`` up on a side stream (what graph capture wants), then with
    ``timing="graph"`` capture each in its own CUDA graph. The graphs share one memory pool:
    they are replayed one at a time on one stream, in their capture order.
    -> (the callables to time: the graphs' replays or ``fns`` themselves, "graph" or "eager",
    note: why a capture failed, or '')."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            for f in fns:
                f()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    if timing != "graph":
        return list(fns), "eager", ""
    graphs = []
    try:
        pool = torch.cuda.graph_pool_handle()
        for f in fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                f()
            graphs.append(graph)
        torch.cuda.synchronize(device)
    except Exception as exc:  # capture failed: time eagerly and say why
        msg = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
        return list(fns), "eager", (f"graph capture failed ({type(exc).__name__}: {msg}), "
                                    "timed eager")
    return [g.replay for g in graphs], "graph", ""


def _spin(launches: int) -> None:
    """Keep the GPU busy while the host queues ``launches`` timed launches behind it."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(SPIN_CYCLES_PER_LAUNCH * launches)


def _times_us(fns: Sequence[Callable[[], object]], device: torch.device, repeats: int,
              warmup: int, timing: str) -> tuple:
    """``repeats`` timed launches, launch k running ``fns[k % len(fns)]`` (round-robin, after
    ``warmup`` untimed passes over ``fns``), each timed on its own. -> (the times in
    microseconds, "graph", "eager" or "wall", note)."""
    repeats, warmup = max(1, repeats), max(1, warmup)
    if device.type != "cuda":
        for k in range(warmup * len(fns)):
            fns[k % len(fns)]()
        times = []
        for k in range(repeats):
            t0 = time.perf_counter()
            fns[k % len(fns)]()
            times.append((time.perf_counter() - t0) * 1e6)
        return times, "wall", ""

    launchers, used, note = _launchers(fns, device, warmup, timing)
    n = len(launchers)
    for k in range(warmup * n):  # every graph replayed before it is timed (its upload)
        launchers[k % n]()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    if used == "graph":
        _spin(repeats)
    for i in range(repeats):
        starts[i].record()
        launchers[i % n]()
        ends[i].record()
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    del launchers
    return times, used, note


def time_single(calls: Sequence[Callable[[], object]], device: torch.device, repeats: int,
                warmup: int, timing: str) -> tuple:
    """Median time of one call launched on its own, in microseconds: ``calls`` holds one
    closure per input set; each is captured alone in a CUDA graph (``timing="graph"``), the
    graphs replayed round-robin so consecutive replays read different sets, each replay timed
    between its own CUDA events. Returns ``(us, timing_used, note)``."""
    times, used, note = _times_us(calls, device, repeats, warmup, timing)
    return _median(times), used, note


def time_chained(run: Callable[[], object], n_calls: int, device: torch.device, repeats: int,
                 warmup: int, timing: str) -> tuple:
    """Median time per call of ``run``, which launches ``n_calls`` calls (a ``chain``),
    captured whole in one CUDA graph (``timing="graph"``): replay time / ``n_calls``.
    Returns ``(us_per_call, timing_used, note)``."""
    times, used, note = _times_us([run], device, repeats, warmup, timing)
    return _median(times) / n_calls, used, note


def time_calls(calls: Sequence[Callable[[], object]], device: torch.device, repeats: int,
               warmup: int, timing: str, min_calls: int) -> tuple:
    """Median time of one call, in microseconds, of independent calls: ``calls`` holds one
    closure per input set, run round-robin in whole passes over the sets, at least
    ``min_calls`` calls in one CUDA graph; time per call = replay time / calls (the cache
    writer and the multi-token rows). Returns ``(us_per_call, timing_used, calls, note)``."""
    seq = list(calls) * max(1, math.ceil(min_calls / len(calls)))

    def run_all():
        for f in seq:
            f()

    us, used, note = time_chained(run_all, len(seq), device, repeats, warmup, timing)
    return us, used, len(seq), note


def chain(steps: Sequence[Step], buffers: tuple, n_calls: int) -> Callable[[], torch.Tensor]:
    """One launch of ``n_calls`` dependent calls: call i runs ``steps[i % len(steps)]`` (the
    input sets in turn) on query ``x`` with output buffer ``buffers[(i + 1) % 2]``, and what it
    returns is the next call's query; the first call reads ``buffers[0]``. A step that writes
    the buffer it is given (``out=``: FP4, FlashInfer) thus reads buffer i % 2 and writes
    buffer (i + 1) % 2, never the one it reads; a step that allocates its output (SDPA has no
    ``out=``) hands that tensor on. Nothing runs between calls. Returns the last output."""
    def run() -> torch.Tensor:
        x = buffers[0]
        for i in range(n_calls):
            x = steps[i % len(steps)](x, buffers[(i + 1) % 2])
        return x

    return run


class DecodeTimes(NamedTuple):
    """The two figures of one decode call (microseconds per call)."""
    single_us: float
    chained_us: float
    timing: str  # how the chained figure was timed: graph, eager or wall
    chain_calls: int  # calls in one chained replay
    note: str


def time_decode(steps: Sequence[Step], queries: Sequence[torch.Tensor],
                outs: Optional[Sequence[torch.Tensor]], device: torch.device, repeats: int,
                warmup: int, timing: str, min_calls: int) -> DecodeTimes:
    """Single and chained figures of a decode call with one ``Step`` per input set:
    ``steps[s](queries[s], outs[s])`` (``outs`` None: the steps allocate their output).
    Chained: whole passes over the sets, at least ``min_calls`` calls, the query buffers a
    copy of ``queries[0]`` and a buffer like it."""
    singles = [functools.partial(step, queries[s], None if outs is None else outs[s])
               for s, step in enumerate(steps)]
    single_us, used_1, note_1 = time_single(singles, device, repeats, warmup, timing)
    n = len(steps) * max(1, math.ceil(min_calls / len(steps)))
    buffers = (queries[0].clone(), torch.empty_like(queries[0]))
    chained_us, used_n, note_n = time_chained(chain(steps, buffers, n), n, device, repeats,
                                              warmup, timing)
    notes = [f"{what}: {note}" for what, note in (("single", note_1), ("chained", note_n))
             if note]
    if used_1 != used_n:
        notes.append(f"single timed {used_1}")
    return DecodeTimes(single_us, chained_us, used_n, n, "; ".join(notes))


def _device_kernels(fn: Callable[[], object], device: torch.device, calls: int) -> list:
    """(name, us) of every device kernel that ``calls`` eager calls of ``fn`` run under
    torch.profiler (after one call outside it)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize(device)
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if str(getattr(e, "device_type", "")).endswith("CUDA")]


def _names(events: list, top: int) -> str:
    """The ``top`` kernels of ``events`` ((name, us) pairs) by total time, longest first."""
    totals: dict = {}
    for name, us in events:
        totals[name] = totals.get(name, 0.0) + us
    return " | ".join(k[:80] for k in sorted(totals, key=totals.get, reverse=True)[:top])


def _means(events: list, calls: int) -> dict:
    """Mean time per call (us) of each kernel of ``events``, by its name up to its template
    arguments."""
    import re
    means: dict = {}
    for name, us in events:
        short = re.search(r"(\w+)\s*[<(]", name + "(").group(1)
        means[short] = means.get(short, 0.0) + us / calls
    return {k: round(v, 1) for k, v in means.items()}


def kernel_names(fn: Callable[[], object], device: torch.device, top: int = 2) -> str:
    """The device kernels one call of ``fn`` runs, longest first (torch.profiler), so a row
    says which kernel was timed (e.g. which SDPA kernel torch picked). '' if unavailable."""
    if device.type != "cuda":
        return ""
    try:
        return _names(_device_kernels(fn, device, 1), top)
    except Exception as exc:  # diagnostic only
        return f"(profiler failed: {type(exc).__name__})"


def kernel_times(fn: Callable[[], object], device: torch.device, calls: int = 5) -> dict:
    """Mean device time per call (us) of each kernel ``fn`` runs, by its name up to its
    template arguments, from ``calls`` eager calls under torch.profiler: where a call's time
    goes. {} off CUDA or where the profiler fails."""
    if device.type != "cuda":
        return {}
    try:
        return _means(_device_kernels(fn, device, calls), calls)
    except Exception:  # noqa: BLE001 - diagnostic only
        return {}


def kernel_profile(fn: Callable[[], object], device: torch.device, calls: int = 5,
                   top: int = 2) -> tuple[str, dict]:
    """``kernel_names`` and ``kernel_times`` of ``fn`` from one profiled run of ``calls``
    calls: ('', {}) off CUDA, the failure's name and {} where the profiler fails."""
    if device.type != "cuda":
        return "", {}
    try:
        events = _device_kernels(fn, device, calls)
    except Exception as exc:  # diagnostic only
        return f"(profiler failed: {type(exc).__name__})", {}
    return _names(events, top), _means(events, calls)


# --------------------------------------------------------------------------------------------
# HBM bandwidth


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
        sync(device)
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
