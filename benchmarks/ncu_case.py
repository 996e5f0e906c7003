"""One attention call shape for ncu (benchmarks/tune_cuda.py's make_case), launched a few times."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.tune_cuda import attn_fn, make_case  # noqa: E402
from turboquant._backends import cuda as tq_cuda  # noqa: E402

batch, ctx = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (64, 4096)
assert tq_cuda.BACKEND.unavailable() is None
cases, _ = make_case(batch, ctx)
f = attn_fn(cases[0], 128 ** -0.5, ctx)
for _ in range(4):
    f()
torch.cuda.synchronize()
