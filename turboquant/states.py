"""Attention states an engine can compose: merging partial results by their log-sum-exp.

An attention state of a set of keys is the pair (O, lse): O the softmax-weighted sum of their
values, lse the natural-log log-sum-exp of their logits (``paged_attention_fp4(...,
return_lse=True)``). Two states over disjoint key sets merge exactly into the state over their
union:

    lse = log(exp(lse_a) + exp(lse_b)),   O = exp(lse_a - lse) O_a + exp(lse_b - lse) O_b

That is how a sequence split over several calls (context parallelism across GPUs, a shared
prefix and a per-request suffix) gets the output of one call over all its keys. A part that sees
no key has lse -inf and contributes nothing (whatever its O); a NaN row stays NaN. Learned sinks
(``sinks=``) belong to exactly one of the parts, like any key.
"""
from __future__ import annotations

from typing import Optional

import torch


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor, out: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets.

    out_a, out_b: [num_tokens, num_heads, D] (same dtype); lse_a, lse_b: float32 [num_tokens,
    num_heads] (natural log). Returns (out, lse): out like out_a (written into ``out`` when
    given), lse float32. Computed in fp32: exact to fp32 rounding.
    """
    for name, o, s in (("out_a", out_a, lse_a), ("out_b", out_b, lse_b)):
        if o.dim() != 3:
            raise ValueError(f"{name}: expected [num_tokens, num_heads, D], got {tuple(o.shape)}")
        lse_name = "lse_" + name[-1]
        if s.dtype != torch.float32:
            raise TypeError(f"{lse_name}: expected float32, got {s.dtype}")
        if tuple(s.shape) != tuple(o.shape[:2]):
            raise ValueError(f"{lse_name}: expected shape {tuple(o.shape[:2])}, "
                             f"got {tuple(s.shape)}")
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise ValueError(f"out_b: expected {tuple(out_a.shape)} {out_a.dtype} like out_a, got "
                         f"{tuple(out_b.shape)} {out_b.dtype}")
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b)}
    if len(devices) != 1:
        raise ValueError(f"out_a, lse_a, out_b, lse_b: expected one device, "
                         f"got {sorted(map(str, devices))}")
    if out is not None and (out.shape != out_a.shape or out.dtype != out_a.dtype
                            or out.device != out_a.device):
        raise ValueError(f"out: expected {tuple(out_a.shape)} {out_a.dtype} on {out_a.device}")
    lse = torch.logaddexp(lse_a, lse_b)
    # weights relative to the merged lse; a part with lse -inf weighs 0 (also when both are
    # -inf: the merged row is 0 with lse -inf), NaN stays NaN
    finite = lse > float("-inf")
    safe = torch.where(finite, lse, 0.0)
    w_a = torch.where(lse_a > float("-inf"), torch.exp(lse_a - safe), 0.0)
    w_b = torch.where(lse_b > float("-inf"), torch.exp(lse_b - safe), 0.0)
    merged = (torch.where(w_a[..., None] != 0, w_a[..., None] * out_a.float(), 0.0)
              + torch.where(w_b[..., None] != 0, w_b[..., None] * out_b.float(), 0.0))
    merged = torch.where(torch.isnan(lse)[..., None], float("nan"), merged)
    if out is None:
        return merged.to(out_a.dtype), lse
    out.copy_(merged)
    return out, lse
