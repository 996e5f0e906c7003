"""One chunked-prefill call for ncu: BATCH sequences x Q query tokens at CTX context (causal),
32/8/128, block 16, shuffled pages, the default transforms; launched a few times.
   python benchmarks/ncu_prefill_case.py [BATCH Q CTX]   (default 1 2048 16384)"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import turboquant  # noqa: E402
from turboquant.cache import build_paged_problem  # noqa: E402

batch, q_len, ctx = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (1, 2048, 16384)
g = torch.Generator().manual_seed(0)
prob = build_paged_problem([ctx] * batch, 8, 128, 16, device="cuda", generator=g, write_backend="cuda",
                           config=turboquant.QuantConfig())
q = torch.randn(batch * q_len, 32, 128, device="cuda", dtype=torch.bfloat16)
cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
with turboquant.value_checks(False):
    for _ in range(4):
        turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 128 ** -0.5,
                                       cu_query_lens=cu, backend="cuda", **prob.kwargs)
torch.cuda.synchronize()
