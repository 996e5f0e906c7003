"""Issue 39: what the shared state costs a decode call on the GPU today (cuda backend).

The reader hands the kernels one record per sequence built from the layer's sink table
(``turboquant.shared_state.records``: a gather of each sequence's position-0 bytes, the
fingerprint, the table lookup, in torch operations). This times one decode call, inside a CUDA
graph (as engines replay them), with ``seq_state`` records the engine keeps (today's default)
and with ``shared_state`` (``rotation+calibrated+sink``), same cache bytes, same shapes, in one
process, alternating; the record building alone; and a decode step's cache write (one token
per sequence) with each.

    python benchmarks/shared_state_cost.py [--batches 1,16,64,128] [--contexts 4096,16384]
                                           [--iters 200] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import turboquant as tq  # noqa: E402
from context_parallel import capture  # noqa: E402  (benchmarks/: a graph after warm-up)
from turboquant.config import PER_SEQUENCE, QuantConfig  # noqa: E402
from turboquant.shared_state import records  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


def graph_time(fn, iters: int) -> float:
    """us per call of fn replayed in a CUDA graph (median of 5 runs of iters replays)."""
    g = capture(fn)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(times)[2]


def run(batch: int, context: int, iters: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    nblk = context // BS
    num_blocks = batch * nblk + 1
    cfg_seq, cfg_shared = PER_SEQUENCE, QuantConfig()
    cache_a = tq.allocate_cache(num_blocks, HKV, BS, D, device="cuda")
    cache_b = tq.allocate_cache(num_blocks, HKV, BS, D, device="cuda")
    table = (torch.randperm(batch * nblk, device="cuda", generator=g) + 1).view(batch, nblk).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    pos = torch.arange(context, device="cuda")
    seq_state = tq.allocate_state(batch, HKV, D, device="cuda")
    shared = tq.allocate_shared_state(HKV, D, num_blocks, device="cuda")
    for s in range(batch):  # one prefill per sequence, as an engine writes them
        slots = (table[s].long()[:, None] * BS + torch.arange(BS, device="cuda")).view(-1)
        k = torch.randn(context, HKV, D, device="cuda", generator=g).bfloat16()
        v = torch.randn(context, HKV, D, device="cuda", generator=g).bfloat16()
        ids = torch.full((context,), s, device="cuda", dtype=torch.int32)
        tq.reshape_and_cache_fp4(k, v, *cache_a, slots, config=cfg_seq, seq_state=seq_state,
                                 state_ids=ids, positions=pos)
        tq.reshape_and_cache_fp4(k, v, *cache_b, slots, config=cfg_shared, shared_state=shared,
                                 positions=pos)
    q = torch.randn(batch, HQ, D, device="cuda", generator=g).bfloat16()
    out = torch.empty_like(q)
    sid = torch.arange(batch, device="cuda", dtype=torch.int32)
    a = lambda: tq.paged_attention_fp4(q, *cache_a, table, lens, D ** -0.5, out=out,  # noqa: E731
                                       max_seq_len=context, config=cfg_seq,
                                       seq_state=seq_state, state_ids=sid)
    b = lambda: tq.paged_attention_fp4(q, *cache_b, table, lens, D ** -0.5, out=out,  # noqa: E731
                                       max_seq_len=context, config=cfg_shared,
                                       shared_state=shared)
    r = lambda: records(shared, tuple(cache_b), table, lens, None)  # noqa: E731
    # a decode step's write: one token per sequence (its last slot, written again)
    last = table[:, -1].long() * BS + BS - 1
    kd = torch.randn(batch, HKV, D, device="cuda", generator=g).bfloat16()
    pd = torch.full((batch,), context - 1, device="cuda")
    wa = lambda: tq.reshape_and_cache_fp4(kd, kd, *cache_a, last, config=cfg_seq,  # noqa: E731
                                          seq_state=seq_state, state_ids=sid)
    wb = lambda: tq.reshape_and_cache_fp4(kd, kd, *cache_b, last, config=cfg_shared,  # noqa: E731
                                          shared_state=shared, positions=pd)
    with tq.value_checks(False):
        rows = {"seq_state_us": [], "shared_state_us": [], "records_us": [],
                "write_seq_state_us": [], "write_shared_state_us": []}
        for _ in range(2):  # alternating
            rows["seq_state_us"].append(graph_time(a, iters))
            rows["shared_state_us"].append(graph_time(b, iters))
            rows["records_us"].append(graph_time(r, iters))
            rows["write_seq_state_us"].append(graph_time(wa, iters))
            rows["write_shared_state_us"].append(graph_time(wb, iters))
    res = {"batch": batch, "context": context, **{k: min(v) for k, v in rows.items()}}
    res["overhead_pct"] = 100 * (res["shared_state_us"] / res["seq_state_us"] - 1)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64,128")
    p.add_argument("--contexts", default="4096,16384")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json")
    a = p.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    print("| batch x context | seq_state us | shared_state us | records alone us | overhead | "
          "decode write: seq_state / shared_state us |")
    print("|---|---|---|---|---|---|")
    res = []
    for c in (int(x) for x in a.contexts.split(",")):
        for bt in (int(x) for x in a.batches.split(",")):
            r = run(bt, c, a.iters)
            res.append(r)
            print(f"| {bt} x {c // 1024}k | {r['seq_state_us']:.1f} | {r['shared_state_us']:.1f} "
                  f"| {r['records_us']:.1f} | {r['overhead_pct']:+.1f} % | "
                  f"{r['write_seq_state_us']:.1f} / {r['write_shared_state_us']:.1f} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
