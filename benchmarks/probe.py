"""Small one-process probes, one subcommand each.

    python benchmarks/probe.py ncu-decode [BATCH CTX]        (default 64 4096)
    python benchmarks/probe.py ncu-prefill [BATCH Q CTX]     (default 1 2048 16384)
    python benchmarks/probe.py writer [--config C] [--calls N]
    python benchmarks/probe.py locality
    python benchmarks/probe.py fp8-q-terms                   (CPU)
    python benchmarks/probe.py smoothing-exponent [--model M] [--exponents E,E] [--options O]
    python benchmarks/probe.py prefill-workspace [--shapes BxQ@L,..] [--calls N] [--rounds N]

ncu-decode, ncu-prefill and writer launch one kernel a few times for a profiler (ncu with
--launch-skip 2 --launch-count 1, or `bash benchmarks/device.sh ncu ...`, which runs them);
locality and fp8-q-terms print their measurement; smoothing-exponent prints one accuracy row
per exponent. Every GPU probe needs a CUDA GPU and the cuda backend. Run from a tree's root,
it uses that tree's turboquant.
"""
import argparse
import sys
from pathlib import Path

# the turboquant of the tree it runs from (device.sh ncu runs it inside copies of other
# commits), else of the tree it sits in
ROOT = Path.cwd() if (Path.cwd() / "turboquant").is_dir() else Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def need_cuda(args) -> None:
    import torch
    if not torch.cuda.is_available():
        sys.exit(f"probe.py {args.probe}: needs a CUDA GPU (none here)")


def ncu_decode(args) -> None:
    """One decode call shape (tune_cuda.py's make_case: 32/8/128, block 16), launched 4 times."""
    import torch
    from benchmarks.tune_cuda import attn_fn, make_case
    from turboquant._backends import cuda as tq_cuda

    batch, ctx = args.batch, args.ctx
    assert tq_cuda.BACKEND.unavailable() is None, tq_cuda.BACKEND.unavailable()
    cases, _ = make_case(batch, ctx)
    f = attn_fn(cases[0], 128 ** -0.5, ctx)
    for _ in range(4):
        f()
    torch.cuda.synchronize()


def chunked_prefill_case(batch: int, q_len: int, ctx: int):
    """(problem, query, cu_query_lens) of BATCH sequences of CTX keys whose last Q_LEN are the
    queries: 32/8/128, block 16, shuffled pages written by the cuda writer, the default config."""
    import torch
    import turboquant
    from turboquant.cache import build_paged_problem

    g = torch.Generator().manual_seed(0)
    prob = build_paged_problem([ctx] * batch, 8, 128, 16, device="cuda", generator=g,
                               write_backend="cuda", config=turboquant.QuantConfig())
    q = torch.randn(batch * q_len, 32, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    return prob, q, cu


def ncu_prefill(args) -> None:
    """One chunked-prefill call: BATCH sequences x Q query tokens at CTX context (causal),
    32/8/128, block 16, shuffled pages, the default transforms; launched 4 times."""
    import torch
    import turboquant

    prob, q, cu = chunked_prefill_case(args.batch, args.q, args.ctx)
    with turboquant.value_checks(False):
        for _ in range(4):
            turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                           128 ** -0.5, cu_query_lens=cu, backend="cuda",
                                           **prob.kwargs)
    torch.cuda.synchronize()


def writer(args) -> None:
    """The cuda cache writer under one config: 65536 tokens x 8 kv heads x D 128 bf16 in 64
    sequences whose state records are filled first (one untimed write with positions), then
    --calls steady-state writes (no positions), as `turboquant bench` times them.
    ncu: --kernel-name regex:reshape --launch-skip 1."""
    import torch
    import turboquant as tq
    from turboquant.bench.problems import writer_state

    config = tq.QuantConfig.parse(args.config)
    T, hkv, d, bs = 65536, 8, 128, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    value = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = tq.allocate_cache(T // bs, hkv, bs, d, device="cuda")
    slots = torch.randperm(T, device="cuda", generator=g)
    extra = writer_state(tq, key, value, cache, slots, config)
    with tq.value_checks(False):
        for _ in range(args.calls):
            tq.reshape_and_cache_fp4(key, value, *cache, slots, config=config, backend="cuda",
                                     **extra)
    torch.cuda.synchronize()
    print("ok", args.config)


def locality(args) -> None:
    """Does the order of a cache's blocks change the cuda backend's speed? Times 64 x 4k and
    1 x 32k (32/8/128, block 16) with a shuffled and with a sequential block table."""
    import torch
    from benchmarks.tune_cuda import attn_fn, bench_graph, hbm_bandwidth, make_case
    from turboquant._backends import cuda as tq_cuda

    assert tq_cuda.ensure_loaded() is None
    bw, _ = hbm_bandwidth()
    print(f"HBM read {bw:.0f} GB/s")
    for batch, ctx in ((64, 4096), (1, 32768)):
        for order in ("randperm", "sequential"):
            cases, nbytes = make_case(batch, ctx, copies=1 if batch > 1 else 6)
            if order == "sequential":
                for c in cases:
                    bt = c[5]
                    bt.copy_(torch.arange(bt.numel(), device="cuda", dtype=torch.int32).view_as(bt))
            fns = [attn_fn(c, 128 ** -0.5, ctx) for c in cases]
            t = bench_graph(fns * max(1, 8 // len(fns)))
            pct = 100 * nbytes / (t * 1e-6) / 1e9 / bw
            print(f"{batch} x {ctx} {order}: {t:.1f} us, {pct:.1f}% of HBM read")


def fp8_q_terms(args) -> None:
    """How exact S = Q K^T stays when Q is split into E4M3 terms (an FP8 wgmma path for the
    prefill kernel's S, issue 18) against fp16 and bf16 Q, on keys of E2M1 codes (exact in E4M3
    after a power of two). Q scaled by a power of two so that max |q| sits below E4M3's 448; a
    term is E4M3(what the terms before left). Prints max and RMS error of S relative to max /
    RMS |S|. CPU only."""
    import torch

    torch.manual_seed(0)
    d, n = 128, 4096
    q = torch.randn(64, d, dtype=torch.float64)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    k = e2m1[torch.randint(0, 8, (n, d))] * torch.where(torch.rand(n, d) < 0.5, -1.0, 1.0)
    s_ref = q @ k.T

    def err(qq):
        e = qq @ k.T - s_ref
        rms = e.pow(2).mean().sqrt() / s_ref.pow(2).mean().sqrt()
        return (e.abs().max() / s_ref.abs().max()).item(), rms.item()

    scale = 2.0 ** torch.floor(torch.log2(448.0 / q.abs().max()))
    rest, terms = q * scale, torch.zeros_like(q)
    for t in (1, 2, 3):
        term = rest.to(torch.float8_e4m3fn).to(torch.float64)
        terms, rest = terms + term, rest - term
        mx, rms = err(terms / scale)
        print(f"{t} E4M3 term(s): max {mx:.2e}, rms {rms:.2e}")
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        mx, rms = err(q.to(dt).double())
        print(f"{name} Q:          max {mx:.2e}, rms {rms:.2e}")


def smoothing_exponent(args) -> None:
    """The exponent of the key-smoothing rule (turboquant/smoothing.py: lam = a^exponent),
    measured: KLD and top-1 of the options on one model, one row per exponent."""
    from turboquant import smoothing
    from turboquant.accuracy import run_model

    print(f"model {args.model}; options {args.options}")
    for e in (float(x) for x in args.exponents.split(",")):
        smoothing.SMOOTHING_EXPONENT = e
        run = run_model(args.options.split(","), model=args.model, layers=[0])
        for r in run["rows"]:
            print(f"exponent {e:4.2f}  {r['option']:<24} KLD {r['kld']:.4f}  top-1 "
                  f"{100 * r['top1']:.1f} %  ppl {r['ppl_delta_pct']:+.2f} %", flush=True)


def prefill_workspace(args) -> None:
    """Chunked prefill with and without the decode-once workspace (csrc_cuda/prefill_workspace.cuh)
    in one process: per shape BxQ@L (32/8/128, block 16, shuffled pages, the default config),
    the call's time (the bench's time_calls: a CUDA graph of --calls calls, median of --rounds) with
    TURBOQUANT_PREFILL_WORKSPACE=0 and =1, and each mode's kernels (the bench's kernel_times:
    mean us per call of each, eager calls under the profiler); TFLOP/s over the causal FLOPs of
    the chunk; the two outputs' difference (relative RMS: 0 where the workspace holds the
    kernel's own bytes) and, with --reference, each one's relative RMS and largest error against
    the reference backend. --scale-mul multiplies the softmax scale (more peaked rows). One JSON
    line per shape."""
    import json
    import os
    import torch
    import turboquant
    from turboquant.bench.multitoken import causal_flops, parse_multi
    from turboquant.bench.timing import kernel_times, time_calls

    device = torch.device("cuda")
    for shape, row_shape in zip(args.shapes.split(","), parse_multi(args.shapes)):
        if row_shape.mix:
            sys.exit(f"probe.py prefill-workspace: {shape}: one query length per shape")
        b, q_len, ctx = row_shape.batch, row_shape.query_len, row_shape.context
        prob, q, cu = chunked_prefill_case(b, q_len, ctx)

        def call():
            return run("cuda")

        def run(backend):
            return turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                                  args.scale_mul * 128 ** -0.5, cu_query_lens=cu,
                                                  backend=backend, max_seq_len=ctx, **prob.kwargs)
        flops = causal_flops(b, q_len, ctx, 32, 128)
        row = {"shape": shape}
        with turboquant.value_checks(False):
            outs = {}
            for mode in ("0", "1"):
                os.environ["TURBOQUANT_PREFILL_WORKSPACE"] = mode
                us = time_calls([call], device, args.rounds, 1, "graph", args.calls)[0]
                outs[mode] = call()
                row[f"ws{mode}_us"] = round(us, 1)
                row[f"ws{mode}_tflops"] = round(flops / us / 1e6, 1)
                row[f"ws{mode}_kernels"] = kernel_times(call, device, args.calls)
            row["ws_pass_us"] = row["ws1_kernels"].get("prefill_workspace_kernel", 0.0)
            del os.environ["TURBOQUANT_PREFILL_WORKSPACE"]
        row["bit_identical"] = bool(torch.equal(outs["0"], outs["1"]))

        def rel(a, b):
            return float((a.float() - b.float()).norm() / b.float().norm())
        row["ws1_vs_ws0_rel"] = round(rel(outs["1"], outs["0"]), 6)
        if args.reference:
            ref = run("reference").float()
            for mode in ("0", "1"):
                row[f"ws{mode}_ref_rel"] = round(rel(outs[mode], ref), 6)
                row[f"ws{mode}_ref_max"] = round(float((outs[mode].float() - ref).abs().max()), 5)
            del ref
        print(json.dumps(row), flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    sub = ap.add_subparsers(dest="probe", required=True, metavar="PROBE")

    def add(name, fn, short):
        p = sub.add_parser(name, help=short, description=fn.__doc__)
        p.set_defaults(fn=fn)
        return p

    p = add("ncu-decode", ncu_decode,
            "one decode call shape, 4 launches (for ncu)")
    p.add_argument("batch", type=int, nargs="?", default=64)
    p.add_argument("ctx", type=int, nargs="?", default=4096)
    p = add("ncu-prefill", ncu_prefill,
            "one chunked-prefill call, 4 launches (for ncu)")
    p.add_argument("batch", type=int, nargs="?", default=1)
    p.add_argument("q", type=int, nargs="?", default=2048, help="query tokens per sequence")
    p.add_argument("ctx", type=int, nargs="?", default=16384)
    p = add("writer", writer, "the cuda cache writer under one config (for ncu)")
    p.add_argument("--config", default="default")
    p.add_argument("--calls", type=int, default=3)
    add("locality", locality,
            "shuffled against sequential block tables, timed")
    add("fp8-q-terms", fp8_q_terms,
            "S with Q as E4M3 terms against fp16 / bf16 Q (CPU)")
    p = add("prefill-workspace", prefill_workspace,
            "chunked prefill with and without the decode-once workspace, timed")
    p.add_argument("--shapes", default="1x512@4k,1x2048@16k,4x2048@16k,1x8192@64k")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reference", action="store_true", help="errors against the reference")
    p.add_argument("--scale-mul", type=float, default=1.0, help="softmax scale times this")
    p = add("smoothing-exponent", smoothing_exponent,
            "KLD / top-1 per key-smoothing exponent")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--exponents", default="0.25,0.5,0.75,1")
    p.add_argument("--options", default="default")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.probe not in ("fp8-q-terms", "smoothing-exponent"):
        need_cuda(args)
    args.fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
