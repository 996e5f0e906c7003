"""Randomized Hadamard rotation of the head dimension, defined by a fast Walsh-Hadamard transform.

R = diag(s) H / sqrt(D), with H the Sylvester Hadamard matrix (H[i, j] = (-1)^popcount(i & j))
and s random signs from a seed: orthogonal, so q.k = (q R).(k R) and sum p v = (sum p (v R)) R^T
exactly in real arithmetic. It spreads an outlier channel over all D channels, so one scale per
head stops being set by one channel.

The rounding is part of the format (the writer's FP4 codes depend on it), so it is defined here
step by step, in fp32, and every kernel follows the same steps:

    rotate(x)   = fwht(x * s) * D^-0.5        (= x @ R)
    unrotate(y) = fwht(y) * D^-0.5 * s        (= y @ R^T)

``fwht`` is the unnormalized transform in log2(D) butterfly stages h = 1, 2, 4, .., D/2; stage h
maps each pair (x[i], x[i + h]) with i & h == 0 to (x[i] + x[i + h], x[i] - x[i + h]). Each
stage is exact up to one fp32 rounding per element, so a kernel that runs the same stages in the
same order gets the same bits. ``D^-0.5`` is the fp32 constant ``rotation_norm(D)``.
"""
from __future__ import annotations

import torch


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim: the Hadamard rotation needs a power of two >= 2, "
                         f"got {head_dim} (a config with rotation=False, e.g. "
                         f"QuantConfig(rotation=False), stores this head dim)")


_MASK64 = (1 << 64) - 1


def _signs_list(head_dim: int, seed: int) -> list:
    """The signs as Python floats: sign i is the top bit of the i-th output of a splitmix64
    stream started at ``seed`` (set: -1). Plain integer arithmetic, so a kernel, another
    language or a traced graph computes the same signs."""
    _check_head_dim(head_dim)
    out, state = [], seed & _MASK64
    for _ in range(head_dim):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        out.append(-1.0 if z >> 63 else 1.0)
    return out


_SIGNS: dict = {}


def rotation_signs(head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """The random signs s, float32 [D] of +-1, for ``head_dim`` and ``seed`` (cached per
    device; traced as a constant under torch.compile)."""
    if torch.compiler.is_compiling():
        return torch.tensor(_signs_list(head_dim, seed), dtype=torch.float32, device=device)
    key = (head_dim, seed, str(torch.device(device) if device is not None else "cpu"))
    if key not in _SIGNS:
        _SIGNS[key] = torch.tensor(_signs_list(head_dim, seed), dtype=torch.float32,
                                   device=device)
    return _SIGNS[key]


def rotation_norm(head_dim: int) -> float:
    """D^-0.5 as the fp32 constant every implementation multiplies by."""
    return float(torch.tensor(head_dim ** -0.5, dtype=torch.float32))


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of the last dimension, float32, stages h = 1 .. D/2."""
    d = x.shape[-1]
    _check_head_dim(d)
    y = x.float()
    h = 1
    while h < d:
        pairs = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(*y.shape[:-1], d)
        h *= 2
    return y


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x R in float32 (``signs`` from ``rotation_signs``)."""
    return fwht(x.float() * signs) * rotation_norm(x.shape[-1])


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """y [..., D] -> y R^T in float32."""
    return fwht(y) * rotation_norm(y.shape[-1]) * signs


def rotation_matrix(head_dim: int, seed: int = 0, device=None, dtype=torch.float32
                    ) -> torch.Tensor:
    """The orthogonal [D, D] matrix R (for tests and analysis; the data path uses ``rotate``)."""
    eye = torch.eye(head_dim, dtype=torch.float64)
    h = fwht(eye).double()  # fwht of the unit rows: H (symmetric)
    s = torch.tensor(_signs_list(head_dim, seed), dtype=torch.float64)
    return (s[:, None] * h / head_dim ** 0.5).to(device=device, dtype=dtype)
