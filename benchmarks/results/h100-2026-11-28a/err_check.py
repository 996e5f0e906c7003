"""The prefill kernel's output error against the reference (fp32 attention over the same
FP4 cache), one process per build (TURBOQUANT_CUDA_EXTRA_FLAGS): max and relative (Frobenius)
error, and the reference output's RMS."""
import sys

import torch

sys.path[:0] = [".", "tests/gpu"]  # run from the repository root
import test_cuda_backend as t  # noqa: E402

for lens, qlens, cfg in [([4096, 4096], [512, 512], "default"), ([2048], [2048], "plain"), ([1500, 700], [700, 300], "default")]:
    prob, q, cu = t._problem(lens, 32, 8, 128, 16, dtype=torch.bfloat16, qlens=qlens, seed=3, config=cfg)
    ref = t._run("reference", prob, q, cu).float()
    out = t._run("cuda", prob, q, cu).float()
    e = out - ref
    print(f"lens {lens} q {qlens} {cfg}: max abs err {e.abs().max().item():.3e}, rel (fro) "
          f"{(e.norm() / ref.norm()).item():.3e}, |ref| rms {ref.pow(2).mean().sqrt().item():.3e}")
