"""Tuning/timing script of the cuda backend (not the user-facing benchmark CLI).

    PYTHONUNBUFFERED=1 python benchmarks/tune_cuda.py [--check] [--quick]

Measures, in one process: HBM read bandwidth (torch.sum over 2 GiB fp32), the attention kernel
on the issue-4 shapes (32 q heads / 8 kv heads / D 128, block 16) with inputs rotated across
several cache copies when the working set would fit in L2, and the cache writer. Reports
time, effective GB/s (bytes that must be read: K and V codes D/2 + scale 1 per token per kv
head, plus Q and O) and % of the measured bandwidth. ``--check`` first compares a few shapes
with the reference backend.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import turboquant  # noqa: E402
from turboquant._backends import cuda as tq_cuda  # noqa: E402


def bench_events(fn, iters=200, warmup=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def bench_graph(fns, reps=20):
    """Capture one call of each fn (a list, rotating inputs) in a CUDA graph; us per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(ts)


def hbm_bandwidth():
    x = torch.randn(512 * 1024 * 1024, device="cuda")  # 2 GiB
    t = bench_events(lambda: x.sum(), iters=30, warmup=5)
    bw = x.numel() * 4 / (t * 1e-6) / 1e9
    y = torch.empty_like(x)
    tc = bench_events(lambda: y.copy_(x), iters=20, warmup=3)
    del x, y
    return bw, 2 * 512 * 1024 * 1024 * 4 / (tc * 1e-6) / 1e9


def make_case(batch, ctx, hq=32, hkv=8, d=128, bs=16, dtype=torch.bfloat16, copies=1):
    nbps = (ctx + bs - 1) // bs
    nb = batch * nbps
    cases = []
    for _ in range(copies):
        kc = torch.randint(0, 256, (nb, hkv, bs, d // 2), dtype=torch.uint8, device="cuda")
        vc = torch.randint(0, 256, (nb, hkv, bs, d // 2), dtype=torch.uint8, device="cuda")
        ks = torch.randint(118, 124, (nb, bs, hkv), dtype=torch.uint8, device="cuda")
        vs = torch.randint(118, 124, (nb, bs, hkv), dtype=torch.uint8, device="cuda")
        bt = torch.randperm(nb, device="cuda", dtype=torch.int32).view(batch, nbps)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        cases.append((q, kc, vc, ks, vs, bt, sl, out))
    bytes_needed = batch * ctx * hkv * (d + 2) + 2 * batch * hq * d * q.element_size()
    return cases, bytes_needed


def attn_fn(case, scale, max_seq_len):
    q, kc, vc, ks, vs, bt, sl, out = case
    op = torch.ops.turboquant.paged_attention_fp4_cuda

    def f():
        op(out, q, kc, vc, ks, vs, bt, sl, None, scale, 0, 0.0, max_seq_len, None, None, None, False)
    return f


def check(quick):
    from turboquant.cache import build_paged_problem
    torch.manual_seed(0)
    rows = []
    shapes = [
        # (seq_lens, hq, hkv, d, bs, dtype, window, cap, qlens)
        ([1, 54, 97, 0, 300], 32, 8, 128, 16, torch.bfloat16, 0, 0.0, None),
        ([513, 2000], 32, 8, 128, 16, torch.float16, 0, 0.0, None),
        ([77, 130], 8, 8, 64, 32, torch.bfloat16, 0, 0.0, None),
        ([77, 1030], 16, 2, 256, 64, torch.bfloat16, 0, 0.0, None),
        ([5000], 64, 8, 128, 256, torch.bfloat16, 0, 0.0, None),
        ([700, 33], 32, 4, 128, 16, torch.bfloat16, 100, 0.0, None),
        ([700, 33], 32, 8, 128, 16, torch.bfloat16, 0, 30.0, None),
        ([700, 33, 9], 32, 8, 128, 16, torch.bfloat16, 0, 0.0, [3, 8, 1]),
        ([700, 33, 9], 28, 4, 128, 128, torch.float16, 64, 20.0, [5, 2, 8]),
    ]
    if quick:
        shapes = shapes[:3]
    for (lens, hq, hkv, d, bs, dtype, win, cap, qlens) in shapes:
        g = torch.Generator().manual_seed(1)
        prob = build_paged_problem(lens, hkv, d, bs, dtype=dtype, device="cuda", generator=g,
                                   write_backend="reference", spare_blocks=2)  # default config
        ntok = len(lens) if qlens is None else sum(qlens)
        q = torch.randn(ntok, hq, d, generator=g).to(dtype).cuda()
        cu = None
        if qlens is not None:
            cu = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32,
                              device="cuda")
        kw = dict(cu_query_lens=cu, sliding_window=win, logits_soft_cap=cap, **prob.kwargs)
        if cap > 0:  # the cuda kernels decline a soft cap with state records: plain config
            prob = build_paged_problem(lens, hkv, d, bs, dtype=dtype, device="cuda",
                                       generator=torch.Generator().manual_seed(1),
                                       write_backend="reference", spare_blocks=2,
                                       config=turboquant.QuantConfig.parse("plain"))
            kw.update(prob.kwargs, shared_state=None)
        ref = turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                             d ** -0.5, backend="reference", **kw)
        try:
            out = turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables,
                                                 prob.seq_lens, d ** -0.5, backend="cuda", **kw)
        except RuntimeError as e:  # restricted tuning builds (TQ_ONLY_D128_BF16)
            print(f"check lens={lens} d={d} {dtype}: skipped ({str(e).splitlines()[0][:80]})")
            continue
        err = (out.float() - ref.float()).abs().max().item()
        cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(),
                                                    dim=0).item()
        rows.append((lens, hq, hkv, d, bs, str(dtype), win, cap, qlens, err, cos))
        print(f"check lens={lens} hq={hq} hkv={hkv} d={d} bs={bs} {dtype} win={win} cap={cap} "
              f"q={qlens}: maxabs={err:.3e} cos={cos:.6f}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", help="batch x context list instead of the defaults, e.g. 1x32768,16x16384")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per cache block (16)")
    args = ap.parse_args()
    reason = tq_cuda.BACKEND.unavailable()
    if reason:
        print("cuda backend unavailable:", reason)
        sys.exit(1)
    print(torch.cuda.get_device_name(), torch.__version__)
    if args.check:
        check(args.quick)
    bw, copy_bw = hbm_bandwidth()
    print(f"HBM read bandwidth (torch.sum fp32 2 GiB): {bw:.0f} GB/s; copy (r+w): {copy_bw:.0f} GB/s")
    results = []
    shapes = [(64, 4096), (1, 4096), (1, 32768), (128, 1024), (16, 8192), (32, 4096)]
    if args.quick:
        shapes = shapes[:3]
    if args.shapes:
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
    for batch, ctx in shapes:
        probe, nbytes = make_case(batch, ctx, bs=args.block_size, copies=1)
        copies = max(1, min(16, int(3 * 60e6 // nbytes) + 1)) if nbytes < 200e6 else 1
        cases, nbytes = make_case(batch, ctx, bs=args.block_size, copies=copies)
        fns = [attn_fn(c, 128 ** -0.5, ctx) for c in cases]
        i = [0]

        def rot():
            fns[i[0] % len(fns)]()
            i[0] += 1
        t_ev = bench_events(rot)
        t_gr = bench_graph(fns * max(1, 8 // len(fns)))
        t_one = bench_graph(fns[:1])  # one call per replay (the graph launch included)
        gbs = nbytes / (t_gr * 1e-6) / 1e9
        results.append((batch, ctx, t_ev, t_gr, t_one, gbs, 100 * gbs / bw))
        print(f"attn batch {batch:4d} x {ctx:6d} (block {args.block_size}): eager {t_ev:8.2f} us, "
              f"graph {t_gr:8.2f} us, one call per replay {t_one:8.2f} us, "
              f"{gbs:7.0f} GB/s = {100 * gbs / bw:5.1f}% of HBM (copies={copies})", flush=True)
        del cases, fns, probe
    # cache writer
    ntok, hkv, d = 65536, 8, 128
    nb = ntok // 16
    key = torch.randn(ntok, hkv, d, device="cuda", dtype=torch.bfloat16)
    val = torch.randn(ntok, hkv, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(nb, hkv, 16, d // 2, dtype=torch.uint8, device="cuda")
    vc = torch.zeros_like(kc)
    ks = torch.zeros(nb, 16, hkv, dtype=torch.uint8, device="cuda")
    vs = torch.zeros_like(ks)
    op = torch.ops.turboquant.reshape_and_cache_fp4_cuda
    nbytes = 2 * key.numel() * 2 + 2 * ntok * hkv * (d // 2 + 1) + ntok * 8
    for kind, slots in (("contiguous slots (prefill)", torch.arange(ntok, device="cuda")),
                        ("shuffled slots", torch.randperm(ntok, device="cuda"))):
        t = bench_events(lambda: op(key, val, kc, vc, ks, vs, slots, None, None, None), iters=50)
        gbs = nbytes / (t * 1e-6) / 1e9
        print(f"cache writer {ntok} tok x {hkv} heads x {d} bf16, {kind}: {t:.1f} us, "
              f"{gbs:.0f} GB/s = {100 * gbs / bw:.1f}% of HBM read bw (bytes read+written)")
    print("\nSUMMARY bw_GBs=%.0f" % bw)
    for r in results:
        print("batch=%d ctx=%d eager_us=%.2f graph_us=%.2f single_us=%.2f GBs=%.0f pct=%.1f" % r)


if __name__ == "__main__":
    main()
