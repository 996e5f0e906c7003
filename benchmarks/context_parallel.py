"""Decode context parallelism over the FP4 cache with torch.distributed (NCCL), one process per GPU.

    python benchmarks/context_parallel.py [--world N] [--shapes 1x1M,8x256k] [--out DIR]

Split rule: sequence s's KV blocks are cut into `world` contiguous runs of equal length; rank r
holds run r of every sequence in its own FP4 cache (its own block ids) and the sequences' state
records (identical on every rank: each rank sees every sequence's first written chunk). A decode
step on rank r is one `paged_attention_fp4(..., return_lse=True)` over its run
(`holds_first_token=True` on rank 0 only: the sink token belongs to the run holding position 0)
writing its out (bf16) and lse (fp32) straight into views of one byte buffer (B x H x (2 D + 4)
bytes per rank: no packing copy), then one NCCL all-gather of those buffers and one
`turboquant.merge_attention_states_n` over the world's views of the gathered buffer (the cuda
merge kernel, one launch), on every rank (what a tensor-parallel engine then feeds its output
projection). Equal runs give every rank the same bytes to read; the cost of the rule is that a
decode token's new KV lands on the last rank only (its run grows; an engine rebalances by
appending whole blocks round-robin).

For every shape, in the same run: one GPU (rank 0) over the whole context, and the context-
parallel step: its attention, all-gather and merge timed apart (each captured as a CUDA graph,
CUDA events; the merge also through the PyTorch reference, for comparison) and together (one
graph: attention, all-gather, merge); the merged output checked against the one-GPU output with
the cuda tests' bounds (max abs error <= 2e-2, cosine >= 0.9999) and the merged lse against the
one-GPU lse (1e-4 relative). NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import turboquant as tq  # noqa: E402
from turboquant.api import prepare_attention  # noqa: E402
from turboquant.calls import attention_op_args  # noqa: E402
from turboquant.config import PER_SEQUENCE  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
CHUNK = 65536  # tokens written per call while the caches are built
ITERS, WARMUP = 50, 10


def parse_shape(text: str) -> tuple[int, int]:
    b, ctx = text.lower().split("x")
    mult = {"k": 1024, "m": 1 << 20}.get(ctx[-1], 1)
    return int(b), int(ctx.rstrip("km")) * mult


def build_cache(batch, ctx, run, world, device, seed):
    """The FP4 cache of one run of every sequence (run None: the whole context) with its state
    records. -> (cache, state, block_tables, seq_lens)."""
    nb = ctx // BS
    j0, j1 = (0, nb) if run is None else (run * nb // world, (run + 1) * nb // world)
    local = j1 - j0
    cache = tq.allocate_cache(batch * local, HKV, BS, D, device=device)
    state = tq.allocate_state(batch, HKV, D, device=device)
    with tq.value_checks(False):
        for s in range(batch):
            for c0 in range(0, ctx, CHUNK):
                c1 = min(ctx, c0 + CHUNK)
                g = torch.Generator(device).manual_seed(seed * 1_000_003 + s * 4099 + c0 // CHUNK)
                k = torch.randn(c1 - c0, HKV, D, generator=g, device=device).bfloat16()
                v = torch.randn(c1 - c0, HKV, D, generator=g, device=device).bfloat16()
                pos = torch.arange(c0, c1, device=device)
                blk = pos // BS
                mine = (blk >= j0) & (blk < j1)
                slots = torch.where(mine, (s * local + blk - j0) * BS + pos % BS, -1)
                ids = torch.full((c1 - c0,), s, dtype=torch.int32, device=device)
                tq.reshape_and_cache_fp4(k, v, *cache, slots, seq_state=state, state_ids=ids,
                                         positions=pos if c0 == 0 else None, backend="cuda",
                                         config=PER_SEQUENCE)
    tables = (torch.arange(batch * local, dtype=torch.int32, device=device).view(batch, local))
    lens = torch.full((batch,), local * BS, dtype=torch.int32, device=device)
    return cache, state, tables, lens


def attention_graph(q, cache, state, tables, lens, holds_first_token, into=None):
    """One paged_attention_fp4 call validated once, as a function that only launches the op
    (to be captured in a CUDA graph), writing into ``into`` = (out, lse) views or new tensors:
    -> step, or (step, out, lse) when ``into`` is None."""
    call = prepare_attention(q, *cache, tables, lens, D ** -0.5, config=PER_SEQUENCE,
                             seq_state=state,
                             state_ids=torch.arange(q.shape[0], dtype=torch.int32,
                                                    device=q.device),
                             max_seq_len=int(lens.max()), return_lse=True,
                             holds_first_token=holds_first_token)
    out, lse = into if into is not None else (
        torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device))
    op = torch.ops.turboquant.paged_attention_fp4_cuda
    args = attention_op_args(call, out, lse)

    def step():
        op(*args)

    return step if into is not None else (step, out, lse)


def state_views(buf, batch):
    """The (out, lse) views of one rank's packed state: bf16 [batch, HQ, D] at byte 0, float32
    [batch, HQ] after it (16-byte aligned: HQ * D * 2 is)."""
    ob = batch * HQ * D * 2
    return (buf[:ob].view(torch.bfloat16).view(batch, HQ, D),
            buf[ob:].view(torch.float32).view(batch, HQ))


def state_buffer(batch, device):
    """One rank's send buffer (uint8, what the all-gather moves: B x H x (2 D + 4) bytes) and
    its (out, lse) views, which the attention kernel writes directly: no packing copy."""
    buf = torch.empty(batch * HQ * (2 * D + 4), dtype=torch.uint8, device=device)
    return buf, state_views(buf, batch)


def capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_us(fn, group=None):
    """Mean time of fn per call in microseconds (CUDA events), after warm-up; with a process
    group, the ranks start together and the slowest rank's time is returned."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    if group is not None:
        dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(ITERS):
        fn()
    b.record()
    torch.cuda.synchronize()
    t = torch.tensor([a.elapsed_time(b) * 1000.0 / ITERS], device="cuda")
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(rank, world, shapes, out_dir, port):
    ndev = torch.cuda.device_count()
    torch.cuda.set_device(rank % ndev)
    device = torch.device("cuda", rank % ndev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    rows = []
    for batch, ctx in shapes:
        if ctx % (BS * world):
            raise SystemExit(f"context {ctx} is not a multiple of block_size x world "
                             f"= {BS * world}")
        q = torch.randn(batch, HQ, D, generator=torch.Generator(device).manual_seed(7),
                        device=device).bfloat16()
        # one GPU over the whole context (rank 0), timed while the other ranks wait
        if rank == 0:
            whole = build_cache(batch, ctx, None, world, device, seed=1)
            step1, out1, lse1 = attention_graph(q, *whole, holds_first_token=True)
            g1 = capture(step1)
            t_one = time_us(g1.replay)
            g1.replay()
            torch.cuda.synchronize()
            ref_out, ref_lse = out1.clone(), lse1.clone()
            del whole, g1
            torch.cuda.empty_cache()
        dist.barrier()
        # the context-parallel step
        part = build_cache(batch, ctx, rank, world, device, seed=1)
        send, mine = state_buffer(batch, device)
        gathered = torch.empty(world, send.numel(), dtype=torch.uint8, device=device)
        parts = [state_views(gathered[r], batch) for r in range(world)]
        step_a = attention_graph(q, *part, holds_first_token=rank == 0, into=mine)
        merged = torch.empty(batch, HQ, D, dtype=torch.bfloat16, device=device)
        merged_lse = torch.empty(batch, HQ, dtype=torch.float32, device=device)

        def gather():
            dist.all_gather_into_tensor(gathered, send)

        def merge(backend="cuda"):
            tq.merge_attention_states_n([o for o, _ in parts], [s for _, s in parts],
                                        out=merged, lse=merged_lse, backend=backend)

        def full():
            step_a()
            gather()
            merge()

        g_attn = capture(step_a)
        g_gather = capture(gather)
        g_merge = capture(merge)
        g_merge_ref = capture(lambda: merge("reference"))
        t_attn = time_us(g_attn.replay, group=True)
        g_attn.replay()  # the states for the gather and merge timings
        t_gather = time_us(g_gather.replay, group=True)
        t_merge = time_us(g_merge.replay, group=True)
        t_merge_ref = time_us(g_merge_ref.replay, group=True)
        g_full = capture(full)
        t_step = time_us(g_full.replay, group=True)
        g_full.replay()
        torch.cuda.synchronize()
        if rank == 0:
            err = (merged.float() - ref_out.float()).abs().max().item()
            cos = torch.nn.functional.cosine_similarity(merged.float().flatten(),
                                                        ref_out.float().flatten(), dim=0).item()
            lse_err = ((merged_lse - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)).max().item()
            ok = err <= 2e-2 and cos >= 0.9999 and lse_err <= 1e-4
            row = dict(batch=batch, context=ctx, world=world, one_gpu_us=t_one,
                       cp_attention_us=t_attn, cp_allgather_us=t_gather, cp_merge_us=t_merge,
                       cp_merge_reference_us=t_merge_ref, cp_step_us=t_step,
                       allgather_bytes_per_rank=send.numel(),
                       nccl_proto=os.environ.get("NCCL_PROTO", "(NCCL's choice)"),
                       speedup=t_one / t_step, max_abs_err=err, cosine=cos, lse_rel_err=lse_err,
                       check="ok" if ok else "FAILED")
            rows.append(row)
            print(f"{batch} x {ctx}: one GPU {t_one:.1f} us | {world} GPUs: "
                  f"attention {t_attn:.1f}, "
                  f"all-gather {t_gather:.1f}, merge {t_merge:.1f} (PyTorch reference "
                  f"{t_merge_ref:.1f}), step {t_step:.1f} us (one CUDA graph) | "
                  f"speedup {t_one / t_step:.2f}x | vs one GPU: max abs err {err:.2e}, cosine "
                  f"{cos:.6f}, lse rel err {lse_err:.1e} -> {row['check']}", flush=True)
        del part, g_attn, g_gather, g_merge, g_merge_ref, g_full
        torch.cuda.empty_cache()
        dist.barrier()
    if rank == 0 and out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "context_parallel.json").write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()
    if rank == 0 and any(r["check"] != "ok" for r in rows):
        raise SystemExit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=0, help="processes (default: one per GPU)")
    ap.add_argument("--shapes", default="1x1M,8x256k", help="batch x context, comma-separated")
    ap.add_argument("--out", default="", help="directory for context_parallel.json")
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA GPUs")
    world = args.world or torch.cuda.device_count()
    from turboquant._backends import cuda as tq_cuda

    reason = tq_cuda.ensure_loaded()  # build the extension once, before the workers start
    if reason:
        raise SystemExit(f"cuda backend: {reason}")
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    print(f"{world} processes on {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; "
          f"{HQ}/{HKV}/{D}, block {BS}, bf16 queries, default config", flush=True)
    mp.spawn(worker, args=(world, shapes, args.out, args.port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
