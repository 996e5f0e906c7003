"""The prefill kernel's output error against the reference (fp32 attention over the same K8V4
cache: E4M3 keys, FP4 values), one process per build (TURBOQUANT_CUDA_EXTRA_FLAGS): max and
relative (Frobenius) error, and the reference output's RMS (the FP4 shapes of
h100-2026-11-28a/err_check.py)."""
import sys

import torch

sys.path[:0] = [".", "tests/gpu"]  # run from the repository root
import test_cuda_backend as t  # noqa: E402

for lens, qlens, cfg in [([4096, 4096], [512, 512], "default"), ([2048], [2048], "plain"), ([1500, 700], [700, 300], "default")]:
    prob, q, cu = t._problem(lens, 32, 8, 128, 16, dtype=torch.bfloat16, qlens=qlens, seed=3, config=cfg,
                             key_format="fp8_e4m3")
    ref = t._run("reference", prob, q, cu).float()
    out = t._run("cuda", prob, q, cu).float()
    e = out - ref
    print(f"k8v4 lens {lens} q {qlens} {cfg}: max abs err {e.abs().max().item():.3e}, rel (fro) "
          f"{(e.norm() / ref.norm()).item():.3e}, |ref| rms {ref.pow(2).mean().sqrt().item():.3e}")
