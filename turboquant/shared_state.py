"""A layer's transform state that engines can share: no request slots, prefix caching, forks.

The per-sequence record (``turboquant.smoothing``) keys the transforms' state by the engine's
request slot and fills it when the sequence's position 0 is written: a request whose first
blocks come from the prefix cache (written by a finished request) has no record. Here nothing
is per sequence:

- key smoothing (m, lam) is per layer and kv head: from a calibration file when the state is
  allocated, else taken from the first write the layer sees (its keys at positions >= 1) and
  never changed after, so every block of the layer is encoded with the same m and lam;
- the sink (position 0's key and value after the writer's transform, kept beside the FP4
  cache) lives in a per-layer table addressed by the content of position 0's bytes in the
  cache: a fingerprint of the (token, kv head)'s FP4 key and value bytes and scale bytes. The
  writer enters every position-0 token it writes; a reader takes the entry whose fingerprint
  equals that of the bytes in its sequence's block 0, slot 0, else (never entered, or the
  entry since taken by another first token) reads position 0 from those FP4 bytes like any
  other key. A block shared by prefix caching or a fork carries its fingerprint with it, and
  an entry is never wrong for a block it matches: the bytes it was taken from are the block's.

Measured (``python -m turboquant accuracy --models smollm2,gemma3``, KLD against the unquantized
model; record ``benchmarks/results/2026-11-28-cpu-accuracy.json``): the default (this state, the
calibration text's smoothing) SmolLM2-135M 0.0339, Gemma 3 270M 0.0303; per-sequence records
0.0360 / 0.0284; smoothing from a first write of 256 / 16 / 1 keys 0.039 / 0.031, 0.050 / 0.050,
0.077 / 0.148 (1 key: none past position 0, so m = 0 and lam = 1). On the per-sequence record
patched to this state's parts (the tree of 924b875, record
``benchmarks/results/2026-11-28-cpu-shared-state-study.json``): the sink as bf16 cost
0.0343 -> 0.0346 / 0.0335 -> 0.0321 against fp32; an entry missed (position 0 from FP4)
0.0462 / 0.0351. The sink is kept as bf16.

Memory: S entries per layer, S = ceil(num_blocks / ENTRY_BLOCKS), each (4 D + 8) bytes per kv
head, against a block's 16 x 2 x (D / 2 + 1) FP4 bytes per kv head at block size 16: 1.6 % of
the FP4 cache at D 64 to 256 (0.8 / 0.4 / 0.2 % at blocks of 32 / 64 / 128), plus 3 D floats per
kv head for the smoothing.

The cuda backend's attention kernels take the state as it is (the layer's record and the sink
table; a kernel's CTA that merges the sink looks its entry up). The other backends' kernels
read the per-sequence record: ``records`` builds one per sequence of the call from the table,
with no host synchronization (``call_with_records``). The functions below are the definition
in torch operations; on CUDA tensors, where the cuda backend's library loads, ``records`` and
``enter_sinks`` run its two kernels instead (``csrc_cuda/shared_state.cuh``, one launch each:
the ~80 small operations of the definition cost 150-300 us inside a CUDA graph on an H200).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch

from . import registry
from .format import dequantize_e4m3, dequantize_fp4
from .rotation import rotate
from .smoothing import (KEY_CENTER, KEY_INV_SCALE, KEY_SCALE, LAYER_RANGE_QUANTILE, SINK_KEY,
                        SINK_VALUE, STATE_ROWS, check_smoothing, smoothing_from_keys,
                        transform_keys)
from .tensor_facts import TensorFacts

ENTRY_BLOCKS = 16  # one sink entry per this many cache blocks (at least one entry)
# The smoothing tensors whose m and lam are set: given at allocation, or taken by a write outside
# graph capture. Later writes skip taking them (host state, no sync).
_TAKEN = TensorFacts()
_M32 = 0xFFFFFFFF
# the fingerprint's two 32-bit mixes: (word multiplier, position multiplier, finalizer)
_MIX = ((0x2545F491, 0x3C6EF372, 0x2C1B3C6D), (0x297A2D39, 0x1B873593, 0x5BD1E995))


class SharedState(NamedTuple):
    """One layer's state (``allocate_shared_state``); the table's last row is scratch."""

    smoothing: torch.Tensor  # float32 [1, Hkv, 5, D]: a record, rows m, lam, 1 / lam (NaN until
    #                          taken); its sink rows unused (the writer's record as it is)
    sink_kv: torch.Tensor  # bfloat16 [S + 1, Hkv, 2, D]: position 0's K and V, transformed
    sink_tags: torch.Tensor  # int64 [S + 1, Hkv]: the entry's fingerprint (0: empty)

    @property
    def entries(self) -> int:
        return self.sink_tags.shape[0] - 1


def allocate_shared_state(num_kv_heads: int, head_dim: int, num_blocks: int, *,
                          calibration: Optional[tuple] = None, entries: Optional[int] = None,
                          device="cpu") -> SharedState:
    """One layer's shared state for a cache of ``num_blocks`` blocks: ``calibration`` (m, lam),
    float32 [num_kv_heads, D] each (this layer's entry of ``turboquant.smoothing
    .load_calibration``), or None (taken from the first write); ``entries`` sink entries
    (default ceil(num_blocks / 16))."""
    for name, v in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("num_blocks", num_blocks)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    entries = max(1, math.ceil(num_blocks / ENTRY_BLOCKS)) if entries is None else entries
    if not isinstance(entries, int) or entries < 1:
        raise ValueError(f"entries: expected an int >= 1, got {entries!r}")
    smoothing = torch.full((1, num_kv_heads, STATE_ROWS, head_dim), float("nan"), device=device)
    if calibration is not None:
        m, lam = calibration
        check_smoothing("calibration", m, lam, num_kv_heads=num_kv_heads, head_dim=head_dim)
        smoothing[0, :, KEY_CENTER], smoothing[0, :, KEY_SCALE] = m, lam
        smoothing[0, :, KEY_INV_SCALE] = 1.0 / lam
        _TAKEN.set(smoothing, True)
    return SharedState(smoothing,
                       torch.zeros(entries + 1, num_kv_heads, 2, head_dim, dtype=torch.bfloat16,
                                   device=device),
                       torch.zeros(entries + 1, num_kv_heads, dtype=torch.int64, device=device))


def check_shared_state(state, num_kv_heads: int, head_dim: int, device) -> None:
    """ValueError/TypeError naming the argument unless ``state`` is a SharedState of this
    layer's shape on ``device``."""
    if not isinstance(state, SharedState):
        raise TypeError(f"shared_state: expected a turboquant.SharedState "
                        f"(allocate_shared_state), got {type(state).__name__}")
    want = {"smoothing": ((1, num_kv_heads, STATE_ROWS, head_dim), torch.float32),
            "sink_kv": ((None, num_kv_heads, 2, head_dim), torch.bfloat16),
            "sink_tags": ((None, num_kv_heads), torch.int64)}
    for name, (shape, dtype) in want.items():
        t = getattr(state, name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise TypeError(f"shared_state.{name}: expected a {dtype} tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != len(shape) or any(w is not None and w != g for w, g in zip(shape, t.shape)):
            raise ValueError(f"shared_state.{name}: expected shape "
                             f"{['S+1' if w is None else w for w in shape]}, got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"shared_state.{name}: expected a tensor on {device}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"shared_state.{name}: expected a contiguous tensor")
    if state.sink_kv.shape[0] != state.sink_tags.shape[0] or state.sink_tags.shape[0] < 2:
        raise ValueError(f"shared_state: sink_kv and sink_tags: expected the same S + 1 >= 2 rows, "
                         f"got {state.sink_kv.shape[0]} and {state.sink_tags.shape[0]}")


def positions_from_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            num_tokens: int) -> torch.Tensor:
    """Each query token's position in its sequence from what an engine's attention metadata
    holds (vLLM's query_start_loc int32 [num_seqs + 1] and seq_lens int32 [num_seqs], a
    sequence's q query tokens being its last q positions): int64 [num_tokens], for the writer's
    ``positions``; no host synchronization."""
    t = torch.arange(num_tokens, device=seq_lens.device)
    seq = torch.searchsorted(query_start_loc[1:].long(), t, right=True)
    seq = seq.clamp_max(max(seq_lens.shape[0] - 1, 0))
    start = query_start_loc[seq].long()
    qlen = query_start_loc[seq + 1].long() - start
    return seq_lens[seq].long() - qlen + (t - start)


def fingerprints(key_cache, value_cache, key_scales, value_scales, slots: torch.Tensor
                 ) -> torch.Tensor:
    """The fingerprint of each (slot, kv head)'s bytes in the cache: its key and value rows and
    their scale bytes -> int64 [n, Hkv], odd (never 0). Slots must be valid."""
    nb, hkv, bs, _ = value_cache.shape
    slots = slots.long()
    blk, off = slots // bs, slots % bs
    n = slots.shape[0]
    if n == 0:
        return torch.empty(0, hkv, dtype=torch.int64, device=slots.device)
    parts = [key_cache.view(torch.uint8)[blk, :, off], value_cache[blk, :, off],
             key_scales[blk, off].reshape(n, hkv, -1), value_scales[blk, off].reshape(n, hkv, -1)]
    b = torch.cat(parts, dim=-1).long()
    pad = -b.shape[-1] % 4
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    b = b.view(n, hkv, -1, 4)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    idx = torch.arange(1, w.shape[-1] + 1, device=w.device)
    h = []
    for mul, pos, fin in _MIX:
        x = (w * mul + idx * pos) & _M32
        x = x ^ (x >> 15)
        x = (x * fin) & _M32
        x = x ^ (x >> 13)
        h.append(x.sum(-1) & _M32)
    return ((h[0] & 0x7FFFFFFF) << 32) | h[1] | 1


def _entry(state: SharedState, tags: torch.Tensor) -> torch.Tensor:
    return torch.remainder(tags, state.entries)


def _cuda_op(t: torch.Tensor, name: str):
    """The cuda backend's op ``name`` for tensors on a CUDA device where its library loads,
    else None (the definition runs)."""
    if not t.is_cuda or registry.get("cuda").unavailable() is not None:
        return None
    return getattr(torch.ops.turboquant, name)


def layer_record(state: SharedState, smooth: bool) -> torch.Tensor:
    """[1, Hkv, 5, D]: the layer's m, lam, 1 / lam, or the identity (0, 1, 1) without smoothing
    (the ``seq_state`` an attention call with the sink table takes, ``turboquant.ops``)."""
    if smooth:
        return state.smoothing
    ident = torch.ones_like(state.smoothing)
    ident[0, :, KEY_CENTER] = 0.0
    return ident


def writer_records(state: SharedState, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the writer op reads for a write of ``num_tokens`` tokens: the layer's record
    (``smoothing``: m, lam, 1 / lam) as a one-slot ``seq_state``, and ``state_ids`` all 0."""
    return state.smoothing, torch.zeros(num_tokens, dtype=torch.int32,
                                        device=state.smoothing.device)


def take_smoothing(state: SharedState, key: torch.Tensor, slot_mapping: torch.Tensor,
                   positions: Optional[torch.Tensor]) -> None:
    """The layer's m and lam, where not set yet, from this write's keys [n, Hkv, D] that have a
    slot (``slot_mapping`` >= 0) and, when positions are given, a position >= 1 (in place). A
    write with no such keys, or whose such keys are all equal (a lone key; an engine's warm-up,
    every slot -1 or one short prompt repeated), sets nothing: there is no spread to take a scale
    from, and the first real write takes it. Until it is set, each write reads from the device
    (the smoothing is then set, and later writes do nothing here); under graph capture it
    records nothing, so a captured graph's writes use the smoothing that an eager write set."""
    if _TAKEN.get(state.smoothing):
        return
    if state.smoothing.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    keep = slot_mapping >= 0
    if positions is not None:
        keep &= positions > 0
    kept = key[keep]
    if kept.shape[0] == 0 or not bool((kept != kept[:1]).any()):
        return
    m, lam = smoothing_from_keys(kept, quantile=LAYER_RANGE_QUANTILE)
    state.smoothing[0, :, KEY_CENTER], state.smoothing[0, :, KEY_SCALE] = m, lam
    state.smoothing[0, :, KEY_INV_SCALE] = 1.0 / lam
    _TAKEN.set(state.smoothing, True)


def enter_sinks(state: SharedState, key: torch.Tensor, value: torch.Tensor, cache: tuple,
                slot_mapping: torch.Tensor, positions: torch.Tensor,
                signs: Optional[torch.Tensor], smooth: bool = True) -> None:
    """After a write: every token of it at position 0 (with a slot) enters the table under the
    fingerprint of the bytes just written, its key transformed with the layer's smoothing
    (``smooth``) and the rotation (``signs``); of two in one write with the same entry, the
    later."""
    n, hkv, _ = key.shape
    if n == 0:
        return
    op = _cuda_op(key, "shared_enter_sinks_cuda")
    if op is not None:
        # the kernel reads each token's [Hkv, D] rows as one block (any token stride)
        key, value = (t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()
                      for t in (key, value))
        op(key, value, *cache, slot_mapping.long().contiguous(), positions.long().contiguous(),
           state.smoothing if smooth else None, state.sink_kv, state.sink_tags, signs)
        return
    s = state.entries
    live = (positions == 0) & (slot_mapping >= 0)
    slots = torch.where(live, slot_mapping.long(), 0)
    tags = fingerprints(*cache, slots)  # [n, Hkv]
    entry = torch.where(live[:, None], _entry(state, tags), s)  # dead tokens: the scratch row
    order = torch.arange(n, device=key.device)[:, None].expand(n, hkv)
    heads = torch.arange(hkv, device=key.device)[None].expand(n, hkv)
    last = torch.full((s + 1, hkv), -1, dtype=torch.long, device=key.device)
    last = last.scatter_reduce(0, entry, order, reduce="amax", include_self=True)
    win = last[entry, heads] == order  # one token per (entry, head): the last
    entry = torch.where(win, entry, s)
    m, inv = ((state.smoothing[0, :, KEY_CENTER], state.smoothing[0, :, KEY_INV_SCALE]) if smooth
              else (None, None))
    kv = torch.stack([transform_keys(key, m, inv, signs),
                      rotate(value.float(), signs) if signs is not None else value.float()], dim=2)
    state.sink_kv.index_put_((entry, heads), kv.to(torch.bfloat16))
    state.sink_tags.index_put_((entry, heads), torch.where(win, tags, 0))
    state.sink_tags[s] = 0


def records(state: SharedState, cache: tuple, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            scale_group: Optional[int], smooth: bool = True,
            ids_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The per-sequence records the kernels read, one per sequence of a call: float32
    [num_seqs, Hkv, 5, D] (``turboquant.smoothing``'s rows), the layer's m and lam, and the sink
    from the table where its fingerprint matches the sequence's block 0, slot 0, else that
    position's FP4 bytes decoded. A sequence without keys, or whose block 0 is no block of the
    cache, gets NaN sink rows (a reader that sees position 0 of such a sequence gives NaN).
    Without smoothing (``smooth`` False) the records hold m = 0, lam = 1. ``ids_out`` (int32
    [num_seqs]) is filled with each sequence's record index 0 .. num_seqs - 1, the state_ids of
    the call (the cuda kernel writes both in one launch)."""
    key_cache, value_cache, key_scales, value_scales = cache
    nb, hkv, bs, _ = value_cache.shape
    d = state.smoothing.shape[-1]
    ns = block_tables.shape[0]
    smoothing = layer_record(state, smooth)
    op = _cuda_op(value_cache, "shared_records_cuda")
    if op is not None:
        rec = torch.empty(ns, hkv, STATE_ROWS, d, device=value_cache.device)
        ids = ids_out if ids_out is not None else torch.empty(ns, dtype=torch.int32,
                                                             device=value_cache.device)
        op(rec, ids, *cache, block_tables, seq_lens, smoothing, state.sink_kv, state.sink_tags)
        return rec
    if ids_out is not None:
        ids_out.copy_(torch.arange(ns, dtype=torch.int32, device=ids_out.device))
    if ns == 0:
        return torch.empty(0, hkv, STATE_ROWS, d, device=value_cache.device)
    first = block_tables[:, 0].long() if block_tables.shape[1] else \
        torch.full((ns,), -1, dtype=torch.long, device=block_tables.device)
    ok = (first >= 0) & (first < nb) & (seq_lens > 0)
    slots = torch.where(ok, first, 0) * bs
    tags = fingerprints(*cache, slots)
    entry = _entry(state, tags)
    heads = torch.arange(hkv, device=tags.device)[None].expand(ns, hkv)
    hit = (state.sink_tags[entry, heads] == tags)[..., None]
    blk = slots // bs
    kc = key_cache[blk, :, 0]
    if kc.dtype == torch.float8_e4m3fn:
        k0 = dequantize_e4m3(kc.view(torch.uint8), key_scales[blk, 0].reshape(ns, hkv))
    else:
        k0 = dequantize_fp4(kc, key_scales[blk, 0].reshape(ns, hkv, -1), scale_group)
    v0 = dequantize_fp4(value_cache[blk, :, 0], value_scales[blk, 0].reshape(ns, hkv, -1),
                        scale_group)
    table = state.sink_kv[entry, heads].float()  # [ns, Hkv, 2, D]
    rec = torch.empty(ns, hkv, STATE_ROWS, d, device=tags.device)
    rec[:] = smoothing  # m, lam, 1 / lam (the sink rows below)
    nan = float("nan")  # (a scalar: nothing copied from the host inside a captured graph)
    rec[:, :, SINK_KEY] = torch.where(ok[:, None, None], torch.where(hit, table[:, :, 0], k0), nan)
    rec[:, :, SINK_VALUE] = torch.where(ok[:, None, None], torch.where(hit, table[:, :, 1], v0), nan)
    return rec


def call_with_records(call):
    """``call`` (an AttentionCall) with the per-sequence records in place of the layer's shared
    state it carries (``sink_kv``: its one record and sink table; ``turboquant.ops``), for the
    backends whose kernels read records; ``call`` itself where it carries none."""
    if call.sink_kv is None:
        return call
    state = SharedState(call.seq_state, call.sink_kv, call.sink_tags)
    ids = torch.empty(call.num_seqs, dtype=torch.int32, device=call.query.device)
    rec = records(state, (call.key_cache, call.value_cache, call.key_scales, call.value_scales),
                  call.block_tables, call.seq_lens, call.scale_group, ids_out=ids)
    return dataclasses.replace(call, seq_state=rec, state_ids=ids, sink_kv=None, sink_tags=None)

