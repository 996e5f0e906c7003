import math

import pytest
import torch


def e2m1_value(code: int) -> float:
    """E2M1 from the CONTRACT.md formula, written independently of turboquant.format."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return math.copysign(mag, sign)


E2M1_F64 = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)


def dequant_f64(packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """Independent decoder: packed [..., D/2] uint8, scales [..., D/group] -> float64 [..., D]."""
    lo = (packed & 0xF).long()
    hi = (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).flatten(-2)
    vals = E2M1_F64[codes]
    s = torch.pow(2.0, scales.double() - 127)
    s = torch.where(scales == 255, torch.full_like(s, float("nan")), s)
    s = s.repeat_interleave(group, dim=-1)
    return vals * s


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def first_write_state(config, key, value, slots, num_blocks, *, scale_group=None,
                      key_format="fp4") -> dict:
    """The state arguments two writers under test both read, set by one first write on the
    reference backend (3 interleaved sequences: token t at position t // 3 of sequence t % 3):
    the default's shared state (its smoothing taken from the keys with NaN and Inf zeroed), the
    per-sequence records ("sequence" smoothing), or {} for a config without state."""
    import turboquant

    if not config.uses_state:
        return {}
    n, hkv, d = key.shape
    dev = key.device
    pos = torch.arange(n, device=dev) // 3
    first = turboquant.allocate_cache(num_blocks, hkv, 16, d, scale_group=scale_group,
                                      device=dev, key_format=key_format)
    if config.needs_slots:
        kw = dict(seq_state=turboquant.allocate_state(4, hkv, d, dev),
                  state_ids=(torch.arange(n, device=dev) % 3).to(torch.int32))
    else:
        kw = dict(shared_state=turboquant.allocate_shared_state(hkv, d, num_blocks, device=dev))
        key = key.nan_to_num(0.0, 0.0, 0.0)
    turboquant.reshape_and_cache_fp4(key, value, *first, slots, config=config, positions=pos,
                                     backend="reference", **kw)
    return kw
