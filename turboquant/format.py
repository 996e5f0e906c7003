"""The FP4 KV-cache format (CONTRACT.md section 1), bit-exact, in vectorized PyTorch.

Every backend (CUDA, SM120, gfx950) reads and writes exactly these bytes; this module is the
definition they are tested against. It runs on CPU and GPU tensors alike.

- E2M1 code (4 bits): sign in bit 3, magnitude index in bits 2..0 -> 0, .5, 1, 1.5, 2, 3, 4, 6.
  Encoding rounds to nearest with ties to the even code and saturates at 6. The sign bit is
  the input's sign bit, so -0.0 and small negatives that round to zero give code 8 (-0), as
  the hardware conversion (cvt.rn.satfinite.e2m1x2.f32) does.
- Packing: two codes per byte, even element index in the low nibble.
- E8M0 scale byte b: 2^(b - 127); b == 255 is NaN; b == 0 is 2^-127 (not 1.0).
- Scale rule ("smallest"): for a group with max magnitude amax > 0, the smallest power of two
  s with amax / s <= 6 (clamped to the byte range [0, 254]); amax == 0 gives b = 0; a group
  holding NaN or Inf gives b = 255 and all-zero codes.
- Groups: one scale per (token, head) over all D elements (``group=D``, the default), or one
  per 32 elements (``group=32``, the OCP MX block).
- An optional second scale rule, "mse" (see ``quantize_fp4``), is a named option of the cache
  writer (``QuantConfig(scale_rule="mse")``), never a silent change; readers are unaffected.
- The second key format (K8V4: FP8 keys, FP4 values; ``quantize_e4m3``): one OCP E4M3 byte per
  element (sign, 4 exponent bits of bias 7, 3 mantissa bits; largest finite 448, no infinity,
  S.1111.111 is NaN) with one E8M0 scale per (token, head) by the same rule with 448 in place of
  6: the smallest power of two s with amax / s <= 448, so no element saturates; the value
  x / s (exact) rounds to the nearest E4M3 value, ties to even; a group holding NaN or Inf gets
  b = 255 and all-zero bytes.
"""
from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
MX_GROUP = 32

# Rounding thresholds between neighbouring magnitude codes c and c+1, with the comparison that
# sends an exact tie to the even code: from an even c the input must exceed the midpoint,
# from an odd c reaching it is enough.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
               (3.5, True), (5.0, False))


_E2M1_TABLES: dict = {}


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    """All 16 code values: [16] (codes 8..15 are the negatives; code 8 is -0.0). Made once per
    (device, dtype) and kept, so that a call captured in a CUDA graph copies nothing from the
    host (traced as a constant under torch.compile)."""
    if torch.compiler.is_compiling():
        mags = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
        return torch.cat([mags, -mags])
    key = (str(torch.device(device) if device is not None else "cpu"), dtype)
    table = _E2M1_TABLES.get(key)
    if table is None:
        mags = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
        table = _E2M1_TABLES[key] = torch.cat([mags, -mags])
    return table


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Float tensor (already divided by its scale) -> uint8 codes 0..15, same shape."""
    a = x.abs().float()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t, tie_up in _THRESHOLDS:
        mag += (a >= t) if tie_up else (a > t)
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values, same shape."""
    return e2m1_table(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., D] -> packed bytes [..., D/2] (even index in the low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: expected an even last dimension, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., D/2] -> uint8 codes [..., D]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def decode_e8m0(b: torch.Tensor) -> torch.Tensor:
    """uint8 scale bytes -> float32 2^(b-127); 255 -> NaN; 0 -> 2^-127."""
    e = b.to(torch.int32) - E8M0_BIAS
    value = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    return torch.where(b == E8M0_NAN, torch.full_like(value, float("nan")), value)


def e8m0_for_amax(amax: torch.Tensor, code_max: float = E2M1_MAX) -> torch.Tensor:
    """Group max magnitudes (float, may hold NaN/Inf) -> uint8 scale bytes by the rule above.

    The exponent is the smallest integer e with amax <= code_max * 2^e (6 for E2M1 codes, 448
    for E4M3). An estimate from log2 is corrected both ways against exact float64 products, so
    no rounding of log2 can move it.
    """
    a = amax.double()
    finite = torch.isfinite(a)
    pos = finite & (a > 0)
    safe = torch.where(pos, a, torch.ones_like(a))
    e = torch.ceil(torch.log2(safe / code_max))
    e = torch.where(safe > code_max * torch.exp2(e), e + 1, e)
    e = torch.where(safe <= code_max * torch.exp2(e - 1), e - 1, e)
    b = torch.clamp(e + E8M0_BIAS, 0, 254)
    b = torch.where(pos, b, torch.zeros_like(b))
    b = torch.where(finite, b, torch.full_like(b, E8M0_NAN))
    return b.to(torch.uint8)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    d = x.shape[-1]
    if group <= 0 or d % group:
        raise ValueError(f"group: expected a divisor of the last dimension {d}, got {group}")
    if group % 2:
        raise ValueError(f"group: expected an even group size, got {group}")
    return x.reshape(*x.shape[:-1], d // group, group)


def _encode_group(g: torch.Tensor, b: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """Grouped values [..., G, group] and their scale bytes [..., G] -> codes [..., G, group]."""
    # Divide by a power of two: exact (no rounding) for every value that can round to a code.
    scaled = g / decode_e8m0(torch.where(finite, b, torch.zeros_like(b))).unsqueeze(-1)
    codes = encode_e2m1(scaled)
    return torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))


def quantize_fp4(x: torch.Tensor, group: int | None = None, rule: str = "smallest"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes uint8 [..., D/2], scales uint8 [..., D/group]).

    ``group=None`` means one scale over the whole last dimension; the caller drops the
    trailing size-1 dimension of the scales for the per-(token, head) layout.
    ``rule="smallest"`` is CONTRACT.md's rule. ``rule="mse"`` also tries the exponent one below
    it (which saturates the largest elements at 6 but halves the step) and keeps whichever
    gives the smaller sum of squared errors over the group, computed in float64; a tie keeps
    the "smallest" exponent.
    """
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    if rule not in ("smallest", "mse"):
        raise ValueError(f"rule: expected 'smallest' or 'mse', got {rule!r}")
    group = x.shape[-1] if group is None else group
    g = _grouped(x.float(), group)
    amax = g.abs().amax(dim=-1)
    finite = torch.isfinite(g).all(dim=-1)
    amax = torch.where(finite, amax, torch.full_like(amax, float("nan")))
    b = e8m0_for_amax(amax)
    codes = _encode_group(g, b, finite)
    if rule == "mse":
        lower = torch.where(finite & (amax > 0) & (b > 0), b - 1, b)
        lower_codes = _encode_group(g, lower, finite)

        def sq_err(c, sb):
            deq = decode_e2m1(c).double() * decode_e8m0(sb).double().unsqueeze(-1)
            return (deq - g.double()).pow(2).sum(dim=-1)

        better = sq_err(lower_codes, lower) < sq_err(codes, b)
        b = torch.where(better, lower, b)
        codes = torch.where(better.unsqueeze(-1), lower_codes, codes)
    return pack_fp4(codes.flatten(-2)), b


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, group: int | None = None
                   ) -> torch.Tensor:
    """(codes uint8 [..., D/2], scales uint8 [..., D/group]) -> float32 [..., D]. With one
    scale over the whole row (``group=None``) the scales may also come without the trailing
    size-1 dimension, as the cache stores them ([..., ] per (token, head))."""
    values = decode_e2m1(unpack_fp4(packed))
    if group is None and scales.shape == values.shape[:-1]:
        scales = scales.unsqueeze(-1)
    group = values.shape[-1] if group is None else group
    g = _grouped(values, group)
    if scales.shape != g.shape[:-1]:
        raise ValueError(f"scales: expected shape {tuple(g.shape[:-1])}, got {tuple(scales.shape)}")
    return (g * decode_e8m0(scales).unsqueeze(-1)).flatten(-2)


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (E4M3 bytes uint8 [..., D], scales uint8 [...]): one
    E8M0 scale per row by the rule in the module docstring (448 in place of 6)."""
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    g = x.float()
    finite = torch.isfinite(g).all(dim=-1)
    amax = torch.where(finite, g.abs().amax(dim=-1), torch.full_like(g[..., 0], float("nan")))
    b = e8m0_for_amax(amax, E4M3_MAX)
    # dividing by a power of two is exact where the result is a normal float; |x / s| <= 448,
    # so the conversion never meets its out-of-range case
    scaled = g / decode_e8m0(torch.where(finite, b, torch.zeros_like(b))).unsqueeze(-1)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes)), b


def dequantize_e4m3(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(E4M3 bytes uint8 [..., D], scales uint8 [...]) -> float32 [..., D]; scale 255 gives NaN."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"codes/scales: expected uint8, got {codes.dtype} / {scales.dtype}")
    if scales.shape != codes.shape[:-1]:
        raise ValueError(f"scales: expected shape {tuple(codes.shape[:-1])}, got {tuple(scales.shape)}")
    return codes.view(torch.float8_e4m3fn).float() * decode_e8m0(scales).unsqueeze(-1)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of y as an approximation of x, in dB."""
    x = x.double()
    noise = (x - y.double()).pow(2).sum()
    return float(10 * torch.log10(x.pow(2).sum() / noise))
