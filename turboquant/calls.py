"""Checked calls: every op's arguments validated and bundled (``AttentionCall``,
``CacheWrite``), and the positional arguments each backend's op takes from them. The public API
(``turboquant.api``) and the backends both build on this module; it knows no backend.

Validation comes in two kinds:

- Metadata checks (dtype, shape, device, divisibility) cost nothing and always run; they work
  on fake tensors too, so ``torch.compile`` traces them away.
- Value checks read index tensors (block ids in range, seq_lens within what the block table
  holds, cu_query_lens non-decreasing). On a GPU that is a host synchronization, so they are
  skipped during CUDA-graph capture and ``torch.compile`` tracing, and can be switched off
  with ``turboquant.value_checks(False)`` (or ``TURBOQUANT_VALUE_CHECKS=0``) on a serving hot
  path. Kernels never read out of bounds regardless: a block id outside the cache gives NaN
  output for that sequence instead of a read.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from .registry import AttentionCall, CacheWrite

QUERY_DTYPES = (torch.bfloat16, torch.float16)
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32,)

_value_checks = os.environ.get("TURBOQUANT_VALUE_CHECKS", "1") != "0"


@contextlib.contextmanager
def _restore(previous: bool):
    global _value_checks
    try:
        yield
    finally:
        _value_checks = previous


def value_checks(enabled: bool):
    """Turn the value checks on or off. Usable as a plain call or as a context manager
    (``with turboquant.value_checks(False): ...`` restores the previous setting)."""
    global _value_checks
    previous, _value_checks = _value_checks, bool(enabled)
    return _restore(previous)


def values_checkable(t: torch.Tensor) -> bool:
    if not _value_checks or torch.compiler.is_compiling():
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_tensor(name: str, t, dtypes, ndims) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if t.dim() not in ndims:
        want = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(t.shape)}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def check_output(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    """A caller-allocated output: its dtype, shape and device, and contiguous."""
    check_tensor(name, t, (dtype,), (len(shape),))
    check_shape(name, t, tuple(shape))
    check_device(device, **{name: t})
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def check_device(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the query's device), "
                             f"got one on {t.device}")


def _cache_geometry(key_cache, value_cache, key_scales, value_scales, num_kv_heads=None):
    """Check the paged cache and its scales; return (num_blocks, Hkv, block_size, D, group,
    key_format): key_format "fp4", or "fp8_e4m3" for a K8V4 cache (E4M3 key bytes
    [num_blocks, Hkv, block_size, D] as torch.float8_e4m3fn, one scale per (token, head))."""
    check_tensor("key_cache", key_cache, (torch.uint8, torch.float8_e4m3fn), (4,))
    k8 = key_cache.dtype == torch.float8_e4m3fn
    nb, hkv, bs, last = key_cache.shape
    if num_kv_heads is not None and hkv != num_kv_heads:
        raise ValueError(f"key_cache: expected {num_kv_heads} kv heads in dim 1 "
                         f"[num_blocks, num_kv_heads, block_size, D/2], got shape "
                         f"{tuple(key_cache.shape)}")
    d = last if k8 else 2 * last
    if bs < 1 or bs & (bs - 1):
        raise ValueError(f"key_cache: expected a power-of-two block size in dim 2, got {bs}")
    check_tensor("value_cache", value_cache, (torch.uint8,), (4,))
    if not k8 and tuple(value_cache.shape) == (nb, hkv, bs, last // 2) and last % 2 == 0:
        raise ValueError("key_cache: D bytes per token and head where value_cache holds D/2: E4M3 "
                         "key bytes of a K8V4 cache are passed as torch.float8_e4m3fn "
                         "(key_cache.view(torch.float8_e4m3fn)); an FP4 cache holds D/2")
    if k8 and value_cache.shape == key_cache.shape:
        raise ValueError("key_cache: float8_e4m3fn keys hold D bytes per token and head, twice "
                         "value_cache's D/2; these hold D/2, like FP4 codes (pass them as uint8)")
    check_shape("value_cache", value_cache, (nb, hkv, bs, d // 2))
    check_tensor("key_scales", key_scales, (torch.uint8,), (3, 4))
    if k8 and key_scales.dim() != 3:
        raise ValueError(f"key_scales: a K8V4 cache has one scale per (token, head), "
                         f"[num_blocks, block_size, num_kv_heads], got shape "
                         f"{tuple(key_scales.shape)}")
    if key_scales.dim() == 3:
        group = d
        check_shape("key_scales", key_scales, (nb, bs, hkv))
    else:
        if d % 32:
            raise ValueError(f"key_scales: per-32 scales need a head dim divisible by 32, got {d}")
        group = 32
        check_shape("key_scales", key_scales, (nb, bs, hkv, d // 32))
    check_tensor("value_scales", value_scales, (torch.uint8,), (3, 4))
    check_shape("value_scales", value_scales, key_scales.shape)
    return nb, hkv, bs, d, group, "fp8_e4m3" if k8 else "fp4"


def make_attention_call(query, key_cache, value_cache, key_scales, value_scales, block_tables,
                        seq_lens, scale, cu_query_lens=None, sliding_window=0,
                        logits_soft_cap=0.0, max_seq_len=None, check_values=True
                        ) -> AttentionCall:
    """Validate the arguments of paged_attention_fp4 and bundle them."""
    check_tensor("query", query, QUERY_DTYPES, (3,))
    num_tokens, num_heads, d = query.shape
    nb, hkv, bs, dc, group, key_format = _cache_geometry(key_cache, value_cache, key_scales,
                                                         value_scales)
    if dc != d:
        raise ValueError(f"key_cache/value_cache: expected D/2 = {d // 2} FP4 bytes per token "
                         f"(query head dim {d}) in dim 3, got {dc // 2}")
    if num_heads % hkv:
        raise ValueError(f"query: expected num_heads divisible by num_kv_heads ({hkv}), "
                         f"got {num_heads}")
    check_tensor("block_tables", block_tables, INDEX_DTYPES, (2,))
    check_tensor("seq_lens", seq_lens, INDEX_DTYPES, (1,))
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected {num_seqs} rows (one per seq_lens entry), "
                         f"got shape {tuple(block_tables.shape)}")
    if cu_query_lens is None:
        if num_tokens != num_seqs:
            raise ValueError(f"query: expected one token per sequence ({num_seqs}) without "
                             f"cu_query_lens, got {num_tokens}")
    else:
        check_tensor("cu_query_lens", cu_query_lens, INDEX_DTYPES, (1,))
        check_shape("cu_query_lens", cu_query_lens, (num_seqs + 1,))
    check_device(query.device, key_cache=key_cache, value_cache=value_cache,
                 key_scales=key_scales, value_scales=value_scales, block_tables=block_tables,
                 seq_lens=seq_lens, cu_query_lens=cu_query_lens)
    if not isinstance(scale, (float, int)) or isinstance(scale, bool):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    if not isinstance(sliding_window, int) or sliding_window < 0:
        raise ValueError(f"sliding_window: expected an int >= 0 (0 = off), got {sliding_window!r}")
    if not isinstance(logits_soft_cap, (float, int)) or logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap: expected a float >= 0 (0 = off), "
                         f"got {logits_soft_cap!r}")
    capacity = block_tables.shape[1] * bs
    if max_seq_len is None:
        max_seq_len = capacity
    elif not isinstance(max_seq_len, int) or not 0 <= max_seq_len <= capacity:
        raise ValueError(f"max_seq_len: expected an int in [0, {capacity}] (the block table "
                         f"holds {capacity} tokens), got {max_seq_len!r}")
    if check_values and values_checkable(seq_lens):
        _check_attention_values(block_tables, seq_lens, cu_query_lens, num_tokens, nb, bs,
                                max_seq_len)
    return AttentionCall(
        query=query, key_cache=key_cache, value_cache=value_cache, key_scales=key_scales,
        value_scales=value_scales, block_tables=block_tables, seq_lens=seq_lens,
        cu_query_lens=cu_query_lens, scale=float(scale), sliding_window=sliding_window,
        logits_soft_cap=float(logits_soft_cap), max_seq_len=max_seq_len, num_seqs=num_seqs,
        num_heads=num_heads, num_kv_heads=hkv, head_dim=d, block_size=bs, num_blocks=nb,
        scale_group=group, key_format=key_format)


def leading_decodes(query_start_loc_cpu: torch.Tensor, num_seqs: int) -> int:
    """The sequences at the front of a step with one query token each (what ``num_decodes``
    counts), from a host copy of query_start_loc [>= num_seqs + 1] (no device sync)."""
    q = query_start_loc_cpu[1:num_seqs + 1] - query_start_loc_cpu[:num_seqs]
    other = torch.nonzero(q != 1)
    return int(other[0, 0]) if other.numel() else int(num_seqs)


def check_num_decodes(num_decodes, cu_query_lens, num_seqs: int) -> None:
    """paged_attention_fp4's ``num_decodes``: an int in [0, num_seqs]; with the value checks,
    the first ``num_decodes`` sequences of ``cu_query_lens`` one query token each (before the
    call is split on it, so its two parts' own checks cannot see a wrong count)."""
    if not isinstance(num_decodes, int) or isinstance(num_decodes, bool) or \
            not 0 <= num_decodes <= num_seqs:
        raise ValueError(f"num_decodes: expected an int in [0, {num_seqs}] (the sequences), "
                         f"got {num_decodes!r}")
    if cu_query_lens is not None and num_decodes and isinstance(cu_query_lens, torch.Tensor) \
            and values_checkable(cu_query_lens):
        head = cu_query_lens[:num_decodes + 1].cpu()
        if not torch.equal(head, torch.arange(num_decodes + 1, dtype=head.dtype)):
            raise ValueError(f"num_decodes: the first {num_decodes} sequences must have one "
                             f"query token each, but cu_query_lens starts {head.tolist()[:16]}")


def _check_attention_values(block_tables, seq_lens, cu_query_lens, num_tokens, num_blocks,
                            block_size, max_seq_len):
    lens = seq_lens.cpu()
    if num_tokens and lens.numel() and (lens.min() < 0 or lens.max() > max_seq_len):
        raise ValueError(f"seq_lens: expected values in [0, {max_seq_len}] (what the block "
                         f"table or max_seq_len allows), got min {int(lens.min())}, "
                         f"max {int(lens.max())}")
    used = torch.arange(block_tables.shape[1]) < ((lens + block_size - 1) // block_size)[:, None]
    ids = block_tables.cpu()[used]
    if ids.numel() and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)][0]
        raise ValueError(f"block_tables: expected block ids in [0, {num_blocks}) in the entries "
                         f"a sequence uses, got {int(bad)}")
    if cu_query_lens is not None:
        cu = cu_query_lens.cpu()
        if cu[0] != 0 or cu[-1] != num_tokens:
            raise ValueError(f"cu_query_lens: expected to start at 0 and end at the number of "
                             f"query tokens {num_tokens}, got {cu[0].item()} .. {cu[-1].item()}")
        q = cu[1:] - cu[:-1]
        if (q < 0).any():
            raise ValueError("cu_query_lens: expected non-decreasing values, got "
                             f"{cu.tolist()[:16]}")
        if (q > lens).any():
            i = int(torch.nonzero(q > lens)[0])
            raise ValueError(f"cu_query_lens: sequence {i} has {int(q[i])} query tokens but "
                             f"seq_len {int(lens[i])}; expected at most seq_len")


def make_cache_write(key, value, key_cache, value_cache, key_scales, value_scales,
                     slot_mapping, check_values=True, scale_rule="smallest",
                     rotation_signs=None, seq_state=None, state_ids=None) -> CacheWrite:
    """Validate the arguments of reshape_and_cache_fp4 and bundle them."""
    check_tensor("key", key, KV_DTYPES, (3,))
    check_tensor("value", value, (key.dtype,), (3,))
    check_shape("value", value, key.shape)
    num_tokens, hkv, d = key.shape
    nb, _, bs, dc, group, key_format = _cache_geometry(key_cache, value_cache, key_scales,
                                                       value_scales, num_kv_heads=hkv)
    if dc != d:
        raise ValueError(f"key_cache/value_cache: expected D/2 = {d // 2} FP4 bytes per token "
                         f"(key head dim {d}) in dim 3, got {dc // 2}")
    check_tensor("slot_mapping", slot_mapping, (torch.int64, torch.int32), (1,))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_device(key.device, value=value, key_cache=key_cache, value_cache=value_cache,
                 key_scales=key_scales, value_scales=value_scales, slot_mapping=slot_mapping)
    if num_tokens and check_values and values_checkable(slot_mapping):
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= nb * bs:
            raise ValueError(f"slot_mapping: expected slots in [-1, {nb * bs}) "
                             f"(num_blocks * block_size), got min {lo}, max {hi}")
    return CacheWrite(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                      key_scales=key_scales, value_scales=value_scales,
                      slot_mapping=slot_mapping, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      num_blocks=nb, scale_group=group, scale_rule=scale_rule,
                      rotation_signs=rotation_signs, seq_state=seq_state, state_ids=state_ids,
                      key_format=key_format)


def attention_op_args(call: AttentionCall, out: torch.Tensor,
                      lse: Optional[torch.Tensor] = None) -> tuple:
    """The positional arguments of every ``paged_attention_fp4_<backend>`` op (ATTENTION_SCHEMA)."""
    return (out, call.query, call.key_cache, call.value_cache, call.key_scales,
            call.value_scales, call.block_tables, call.seq_lens, call.cu_query_lens,
            call.scale, call.sliding_window, call.logits_soft_cap, call.max_seq_len,
            call.rotation_signs, call.seq_state, call.state_ids, call.sink, call.sinks, lse,
            call.workspace, call.sink_kv, call.sink_tags)


def cache_write_op_args(write: CacheWrite) -> tuple:
    """The positional arguments of every ``reshape_and_cache_fp4_<backend>`` op."""
    return (write.key, write.value, write.key_cache, write.value_cache, write.key_scales,
            write.value_scales, write.slot_mapping, write.rotation_signs, write.seq_state,
            write.state_ids)
