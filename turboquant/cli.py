"""Command line: ``python -m turboquant [run|bench|accuracy|backends] ...``.

With no subcommand it runs the main job (``run``): build a paged cache of realistic shape,
quantize it through reshape_and_cache_fp4, run paged_attention_fp4 on the best backend, and
compare with BF16 attention on the unquantized cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from . import api
from .calls import value_checks
from .cache import build_paged_problem, kv_bytes_per_token

# Default sizes: a 2-core CPU runs the reference in seconds; a GPU gets a serving-sized batch.
CPU_DEFAULTS = {"batch": 4, "context": 2048, "iters": 3}
GPU_DEFAULTS = {"batch": 64, "context": 4096, "iters": 20}


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def dense_attention(query, keys, values, scale, num_kv_heads):
    """Attention of one query token per sequence over dense K/V, fp32 math: [B, H, D]."""
    outs = []
    for s, (k, v) in enumerate(zip(keys, values)):
        q = query[s].float()  # [H, D]
        h, d = q.shape
        g = h // num_kv_heads
        if k.shape[0] == 0:
            outs.append(torch.zeros_like(q))
            continue
        qg = q.view(num_kv_heads, g, d)
        logits = torch.einsum("kgd,tkd->kgt", qg, k.float()) * scale
        p = torch.softmax(logits, dim=-1)
        outs.append(torch.einsum("kgt,tkd->kgd", p, v.float()).reshape(h, d))
    return torch.stack(outs)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, iters):
    fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_main(args) -> int:
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ValueError(f"--device: expected a torch device such as cpu or cuda, got "
                         f"{args.device!r}") from None
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    batch = args.batch or defaults["batch"]
    context = args.context or defaults["context"]
    iters = args.iters or defaults["iters"]
    hq, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    group = None if args.scale_group == "token" else 32
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    quiet = args.json
    gen = torch.Generator().manual_seed(args.seed)

    _progress(f"[1/4] building a paged cache: batch {batch} x {context} tokens, {hq}/{hkv} "
              f"heads, D {d}, block {bs} on {device}", quiet)
    t0 = time.perf_counter()
    problem = build_paged_problem([context] * batch, hkv, d, bs, dtype=dtype, device=device,
                                  scale_group=group, generator=gen, write_backend=args.backend)
    _sync(device)
    build_s = time.perf_counter() - t0
    query = torch.randn(batch, hq, d, generator=gen).to(dtype).to(device)
    scale = d ** -0.5
    cache = problem.cache
    call_args = (query, *cache, problem.block_tables, problem.seq_lens, scale)
    call = api.prepare_attention(*call_args, **problem.kwargs)
    from . import registry
    backend = registry.select(args.backend, "attention", call).name

    _progress(f"[2/4] paged_attention_fp4 on backend '{backend}'", quiet)
    out = torch.empty_like(query)
    with value_checks(False):
        def attend():
            api.paged_attention_fp4(*call_args, out=out, backend=backend,
                                    max_seq_len=context, **problem.kwargs)
        seconds = _time(attend, device, iters)

    _progress("[3/4] BF16 attention on the unquantized cache", quiet)
    ref = dense_attention(query, problem.keys, problem.values, scale, hkv)

    _progress("[4/4] comparing", quiet)
    o, r = out.float(), ref.float()
    cos = torch.nn.functional.cosine_similarity(o.flatten(), r.flatten(), dim=0).item()
    rel = ((o - r).norm() / r.norm()).item()
    max_abs = (o - r).abs().max().item()
    tokens = batch * context
    fp4_bytes = tokens * kv_bytes_per_token(hkv, d, group)
    bf16_bytes = tokens * 2 * hkv * d * 2
    read_bytes = fp4_bytes + 2 * query.numel() * query.element_size()
    result = {
        "backend": backend,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "batch": batch, "context": context, "num_heads": hq, "num_kv_heads": hkv,
        "head_dim": d, "block_size": bs, "scale_group": args.scale_group,
        "query_dtype": args.dtype,
        "kv_bytes_bf16": bf16_bytes, "kv_bytes_fp4": fp4_bytes,
        "kv_compression": bf16_bytes / fp4_bytes,
        "cosine": cos, "max_abs_error": max_abs, "relative_error": rel,
        "time_per_call_us": seconds * 1e6, "effective_gb_per_s": read_bytes / seconds / 1e9,
        "cache_build_s": build_s,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"backend           {backend} on {result['device']}")
    print(f"shape             batch {batch} x context {context}, {hq} q heads / {hkv} kv "
          f"heads, D {d}, block {bs}, scales per {args.scale_group}, query {args.dtype}")
    print(f"KV cache bytes    BF16 {bf16_bytes / 2**20:.1f} MiB, FP4 {fp4_bytes / 2**20:.1f} MiB "
          f"({result['kv_compression']:.2f}x smaller)")
    print(f"accuracy vs BF16  cosine {cos:.6f}, max abs error {max_abs:.4f}, "
          f"relative error {rel:.4f}")
    print("                  (random Gaussian K/V: FP4 rounds every element, ~18 dB of SQNR; on "
          "real models read the KL divergence of 'python -m turboquant accuracy')")
    timing = (f"{seconds * 1e6:.1f} us (median of {iters} eager calls, value checks off), "
              f"{result['effective_gb_per_s']:.1f} GB/s effective over {read_bytes / 1e6:.1f} MB "
              f"read")
    if device.type == "cpu":
        timing += " (the reference on a CPU: not a performance figure)"
    else:
        timing += " ('python -m turboquant bench' times CUDA-graph replays against SDPA)"
    print(f"time per call     {timing}")
    return 0


def run_backends(args) -> int:
    rows = api.backends()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        state = "available" if row["available"] else f"unavailable: {row['reason']}"
        print(f"{row['name']:<10} priority {row['priority']:>3}  {state}\n"
              f"           {row['description']}")
    return 0


def _positive(text: str) -> int:
    """argparse type: an int >= 1 (0 or less is an error, not 'the default')."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _add_run_arguments(p):
    p.add_argument("--batch", type=_positive, help="sequences (default: 4 on CPU, 64 on a GPU)")
    p.add_argument("--context", type=_positive,
                   help="tokens per sequence (default: 2048 on CPU, 4096 on a GPU)")
    p.add_argument("--heads", type=_positive, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=_positive, default=8, help="kv heads (default 8)")
    p.add_argument("--head-dim", type=_positive, default=128, help="head dim D (default 128)")
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per block (default 16)")
    p.add_argument("--scale-group", choices=["token", "32"], default="token",
                   help="one E8M0 scale per (token, head) or per 32 elements (default token)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16",
                   help="query and K/V dtype (default bf16)")
    p.add_argument("--backend", default="auto",
                   help="backend name or 'auto' (default); see 'python -m turboquant backends'")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--iters", type=_positive, help="timed calls (default: 3 on CPU, 20 on a GPU)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m turboquant",
        description="FP4 KV-cache paged attention. With no subcommand, runs the main job: "
                    "build a paged cache, quantize it to FP4, run paged attention on the best "
                    "backend and compare with BF16 attention on the unquantized cache.")
    _add_run_arguments(parser)
    sub = parser.add_subparsers(dest="command")
    _add_run_arguments(sub.add_parser("run", help="the main job (the default)"))
    p = sub.add_parser("backends", help="list backends, whether each can run here, and why not")
    p.add_argument("--json", action="store_true", help="print JSON")
    from . import accuracy
    from .bench import run as bench
    bench.add_arguments(sub.add_parser("bench", help="benchmark against PyTorch SDPA on a "
                                                     "dense BF16 cache (needs a CUDA GPU)"))
    accuracy.add_arguments(sub.add_parser("accuracy", help="the quantization options on "
                                                           "synthetic data and SmolLM2-135M"))
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "backends":
        return run_backends(args)
    if args.command == "bench":
        from .bench import run as bench
        return bench.main(args)
    if args.command == "accuracy":
        from . import accuracy
        return accuracy.main(args)
    try:
        return run_main(args)
    except (ValueError, TypeError) as e:  # the API's argument errors name the argument
        print(f"error: {e}", file=sys.stderr)
        return 2
