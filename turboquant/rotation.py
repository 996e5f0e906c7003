"""Randomized Hadamard rotation of the head dimension.

R = H_D diag(s) / sqrt(D) with H_D the Sylvester Hadamard matrix and s random signs from a
seed: orthogonal, so q.k = (q R).(k R) and sum p v = (sum p (v R)) R^T exactly in real
arithmetic. It spreads an outlier channel over all D channels, so one scale per head stops
being set by one channel. Rows are rotated by ``x @ R`` and un-rotated by ``y @ R.T``.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=32)
def _rotation_cpu(head_dim: int, seed: int) -> torch.Tensor:
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim: the Hadamard rotation needs a power of two, got {head_dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.float64) * 2 - 1
    return (signs[:, None] * h) / head_dim ** 0.5


def rotation_matrix(head_dim: int, seed: int = 0, device=None, dtype=torch.float32
                    ) -> torch.Tensor:
    """The orthogonal [D, D] rotation for ``head_dim`` and ``seed``."""
    return _rotation_cpu(head_dim, seed).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, seed: int = 0, inverse: bool = False) -> torch.Tensor:
    """x [..., D] -> x @ R (or x @ R.T), computed in fp32, returned in x's dtype."""
    r = rotation_matrix(x.shape[-1], seed, x.device)
    return (x.float() @ (r.T if inverse else r)).to(x.dtype)
