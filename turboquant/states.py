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

R parts merge the same way (``merge_attention_states_n``), with m = max_r lse_r:

    lse = m + log(sum_r exp(lse_r - m)),   O = sum_r exp(lse_r - lse) O_r

Edge rules, the same on every backend: a part with lse -inf weighs 0 whatever its O (a NaN O
included); every part -inf gives O = 0 and lse -inf; a NaN or +inf lse makes the row NaN (O
and lse); a weight that underflows to 0 drops its part. The reference below is the definition
(fp32); the cuda backend runs it as one kernel (``csrc_cuda/merge_states.cuh``), the rest
of the backends decline with a reason and the reference runs.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .ops import MERGE_STATES_SCHEMA, define
from .registry import MergeCall, select


MAX_PARTS = 8  # parts one call merges (the cuda kernel's limit; 8 GPUs of context parallelism)
REFERENCE_OP = "turboquant::merge_attention_states_reference"


def _merge_reference(out: torch.Tensor, lse: torch.Tensor, outs: list, lses: list) -> None:
    """The definition (module docstring), in fp32, into ``out`` and ``lse``."""
    ls = torch.stack([x.float() for x in lses])  # [R, T, H]
    bad = torch.isnan(ls).any(0) | (ls == float("inf")).any(0)
    m = ls.amax(0)
    empty = m == float("-inf")
    m_safe = torch.where(empty | bad, 0.0, m)
    alive = ls > float("-inf")
    total = torch.where(alive, torch.exp(ls - m_safe), 0.0).sum(0)
    merged_lse = torch.where(empty, float("-inf"), m_safe + torch.log(total))
    merged_lse = torch.where(bad, float("nan"), merged_lse)
    ref = torch.where(empty | bad, 0.0, merged_lse)
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for r, o in enumerate(outs):
        w = torch.where(alive[r] & ~bad, torch.exp(ls[r] - ref), 0.0)[..., None]
        acc = acc + torch.where(w != 0, w * o.float(), 0.0)
    acc = torch.where(bad[..., None], float("nan"), acc)
    out.copy_(acc)
    lse.copy_(merged_lse)


define(REFERENCE_OP, MERGE_STATES_SCHEMA)
torch.library.impl(REFERENCE_OP, "CompositeExplicitAutograd")(_merge_reference)


def merge_attention_states_n(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], *,
                             out: Optional[torch.Tensor] = None,
                             lse: Optional[torch.Tensor] = None, backend: str = "auto"
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge R attention states (1 <= R <= 8) of the same rows over disjoint key sets.

    outs: R tensors [num_tokens, num_heads, D] of one dtype (fp16/bf16/fp32) and device; lses:
    R float32 [num_tokens, num_heads] (natural log). Returns (out, lse): out like outs[0]
    (written into ``out`` when given), lse float32 (into ``lse`` when given). ``backend``:
    'auto' (the cuda kernel for CUDA tensors where the extension runs, else the reference),
    or a backend's name, which raises with the reason when it cannot run the call. No host
    synchronization: the parts may be views of one buffer (an all-gather's output).
    """
    outs, lses = list(outs), list(lses)
    if not 1 <= len(outs) <= MAX_PARTS:
        raise ValueError(f"outs: expected 1 to {MAX_PARTS} states, got {len(outs)}")
    if len(lses) != len(outs):
        raise ValueError(f"lses: expected {len(outs)} tensors like outs, got {len(lses)}")
    first = outs[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 3:
        raise ValueError(f"outs[0]: expected [num_tokens, num_heads, D], got "
                         f"{getattr(first, 'shape', type(first).__name__)}")
    if first.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"outs[0]: expected float16, bfloat16 or float32, got {first.dtype}")
    for i, (o, s) in enumerate(zip(outs, lses)):
        if o.shape != first.shape or o.dtype != first.dtype:
            raise ValueError(f"outs[{i}]: expected {tuple(first.shape)} {first.dtype} like "
                             f"outs[0], got {tuple(o.shape)} {o.dtype}")
        if s.dtype != torch.float32:
            raise TypeError(f"lses[{i}]: expected float32, got {s.dtype}")
        if tuple(s.shape) != tuple(first.shape[:2]):
            raise ValueError(f"lses[{i}]: expected shape {tuple(first.shape[:2])}, "
                             f"got {tuple(s.shape)}")
    devices = {t.device for t in outs + lses}
    if len(devices) != 1:
        raise ValueError(f"outs, lses: expected one device, got {sorted(map(str, devices))}")
    if out is None:
        out = torch.empty_like(first, memory_format=torch.contiguous_format)
    elif out.shape != first.shape or out.dtype != first.dtype or out.device != first.device:
        raise ValueError(f"out: expected {tuple(first.shape)} {first.dtype} on {first.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if lse is None:
        lse = torch.empty(first.shape[:2], dtype=torch.float32, device=first.device)
    elif (tuple(lse.shape) != tuple(first.shape[:2]) or lse.dtype != torch.float32
          or lse.device != first.device):
        raise ValueError(f"lse: expected float32 {tuple(first.shape[:2])} on {first.device}, "
                         f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
    call = MergeCall(outs=tuple(outs), lses=tuple(lses), out=out, lse=lse)
    select(backend, "merge", call).merge_states(call)
    return out, lse


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor, out: Optional[torch.Tensor] = None,
                           backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets.

    out_a, out_b: [num_tokens, num_heads, D] (same dtype); lse_a, lse_b: float32 [num_tokens,
    num_heads] (natural log). Returns (out, lse): out like out_a (written into ``out`` when
    given), lse float32. ``merge_attention_states_n`` with two parts (computed in fp32).
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
    return merge_attention_states_n([out_a, out_b], [lse_a, lse_b], out=out, backend=backend)
