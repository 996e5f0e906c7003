"""Does the order of a cache's blocks change the cuda backend's speed? Times batch 64 x 4k and 1 x 32k
(32/8/128, block 16) with a shuffled and with a sequential block table, in one process.

    python benchmarks/locality_check.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.tune_cuda import attn_fn, bench_graph, hbm_bandwidth, make_case  # noqa: E402
from turboquant._backends import cuda as tq_cuda  # noqa: E402

assert tq_cuda.ensure_loaded() is None
bw, _ = hbm_bandwidth()
print(f"HBM read {bw:.0f} GB/s")
for batch, ctx in ((64, 4096), (1, 32768)):
    for order in ("randperm", "sequential"):
        cases, nbytes = make_case(batch, ctx, copies=1 if batch > 1 else 6)
        if order == "sequential":
            for c in cases:
                bt = c[5]
                c[5].copy_(torch.arange(bt.numel(), device="cuda", dtype=torch.int32).view_as(bt))
        fns = [attn_fn(c, 128 ** -0.5, ctx) for c in cases]
        t = bench_graph(fns * max(1, 8 // len(fns)))
        print(f"{batch} x {ctx} {order}: {t:.1f} us, {100 * nbytes / (t * 1e-6) / 1e9 / bw:.1f}% of HBM read")
