"""The prefill kernel's output error against the reference (fp32 attention over the same FP4
cache) at D 64 with 64 query and 8 kv heads (gpt-oss's attention shape), one process per build
(TURBOQUANT_CUDA_EXTRA_FLAGS): max and relative (Frobenius) error, and the reference output's
RMS (the shapes of h100-2026-11-28a/err_check.py). Argument: the key format (fp4 when absent,
or fp8_e4m3 for K8V4)."""
import sys

import torch

sys.path[:0] = [".", "tests/gpu"]  # run from the repository root
import test_cuda_backend as t  # noqa: E402

kf = sys.argv[1] if len(sys.argv) > 1 else "fp4"
for lens, qlens, cfg in [([4096, 4096], [512, 512], "default"), ([2048], [2048], "plain"), ([1500, 700], [700, 300], "default")]:
    prob, q, cu = t._problem(lens, 64, 8, 64, 16, dtype=torch.bfloat16, qlens=qlens, seed=3, config=cfg,
                             key_format=kf)
    ref = t._run("reference", prob, q, cu).float()
    out = t._run("cuda", prob, q, cu).float()
    e = out - ref
    print(f"d64 {kf} lens {lens} q {qlens} {cfg}: max abs err {e.abs().max().item():.3e}, rel (fro) "
          f"{(e.norm() / ref.norm()).item():.3e}, |ref| rms {ref.pow(2).mean().sqrt().item():.3e}")
