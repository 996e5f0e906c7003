"""The reference backend: plain PyTorch, fp32 math, memory bounded by a chunk of tokens.

It defines what every other backend must compute:

- Query token j of a sequence with q query tokens and seq_len keys sits at position
  p = seq_len - q + j and sees key k iff k <= p and (sliding_window == 0 or k > p - W).
- logits = scale * q.k; with logits_soft_cap c > 0, logits = c * tanh(logits / c).
- softmax over the visible keys, out = sum over visible keys of p * v.
- Tokens past seq_len never reach the output, whatever their bytes: they are removed by
  selection (their logits replaced by -inf, their values by 0), never by multiplying by zero.
- NaN in gives NaN out: a visible key whose scale byte is 255 (NaN) makes the logits NaN and
  so the whole output row; a visible value that is not finite makes the output NaN.
- A query row that sees no key (seq_len 0) gives zeros. A sequence whose used block-table
  entries hold an id outside the cache, or whose seq_len exceeds the table, gives NaN (with
  value checks off; with them on, the API raises first).
- Transforms (CONTRACT.md section 2), all in fp32: with a state record (slot r of the
  sequence), q becomes q * lam_r; with rotation q is rotated and the output un-rotated
  (``turboquant.rotation``); with ``sink``, position 0's key and value come from the record
  (rows SINK_KEY, SINK_VALUE) instead of the FP4 cache; with a soft cap and a record, q.m_r is
  added to every q.k before the scale (without a soft cap softmax does not depend on it).
  A slot outside the state tensor gives NaN for that sequence.

Work is done one sequence at a time, ``chunk_tokens`` keys at a time, with an online softmax,
so memory stays bounded on long contexts.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .calls import attention_op_args, cache_write_op_args, make_attention_call, make_cache_write
from .format import dequantize_e4m3, dequantize_fp4, quantize_e4m3, quantize_fp4
from .rotation import rotate, unrotate
from .smoothing import KEY_CENTER, KEY_INV_SCALE, KEY_SCALE, SINK_KEY, SINK_VALUE, transform_keys
from .ops import ATTENTION_SCHEMA, CACHE_WRITE_SCHEMA, define
from .registry import AttentionCall, Backend, CacheWrite, register
from .shared_state import call_with_records

DEFAULT_CHUNK_TOKENS = 4096


def _gather_tokens(cache, scales, blocks, group, start, stop, block_size):
    """Dequantize tokens [start, stop) of one sequence: -> float32 [num_kv_heads, n, D]
    (FP4 codes, or the E4M3 key bytes of a K8V4 cache)."""
    first, last = start // block_size, (stop - 1) // block_size + 1
    ids = blocks[first:last].long()
    codes = cache[ids]  # [nb, Hkv, bs, D/2] FP4, [nb, Hkv, bs, D] E4M3
    sc = scales[ids].transpose(1, 2)  # [nb, Hkv, bs(, G)]
    if cache.dtype == torch.float8_e4m3fn:
        values = dequantize_e4m3(codes.view(torch.uint8), sc)
    else:
        if group is None:
            sc = sc.unsqueeze(-1)
        values = dequantize_fp4(codes, sc, group)  # [nb, Hkv, bs, D]
    values = values.transpose(0, 1).flatten(1, 2)  # [Hkv, nb*bs, D]
    offset = start - first * block_size
    return values[:, offset:offset + (stop - start)]


def attention_reference(call: AttentionCall, out: torch.Tensor, lse: Optional[torch.Tensor] = None,
                        chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
    """Write the attention output of ``call`` into ``out`` [num_tokens, num_heads, D] and,
    when given, each row's natural-log log-sum-exp into ``lse`` [num_tokens, num_heads]
    (learned sinks included; key smoothing's shift q.m added back: the true logits')."""
    hkv, d = call.num_kv_heads, call.head_dim
    g = call.num_heads // hkv
    group = None if call.scale_group == d else call.scale_group
    seq_lens = call.seq_lens.tolist()
    if call.cu_query_lens is None:
        starts = list(range(call.num_seqs + 1))
    else:
        starts = call.cu_query_lens.tolist()
    sinks = call.sinks.float().view(hkv, g) if call.sinks is not None else None

    def write_rows(q0, q1, o, row_lse):
        """o [Hkv, g*nq, D], row_lse [Hkv, g*nq] (row gi * nq + qi: head kvh * g + gi)."""
        nq = q1 - q0
        out[q0:q1] = o.view(hkv, g, nq, d).permute(2, 0, 1, 3).reshape(nq, hkv * g, d).to(out.dtype)
        if lse is not None:
            lse[q0:q1] = row_lse.view(hkv, g, nq).permute(2, 0, 1).reshape(nq, hkv * g)

    for s in range(call.num_seqs):
        q0, q1 = starts[s], starts[s + 1]
        nq, n = q1 - q0, seq_lens[s]
        if nq == 0:
            continue
        # learned sink logit of each row [Hkv, g*nq]
        sink_rows = sinks.repeat_interleave(nq, dim=1) if sinks is not None else None
        if n == 0:  # no key: O = 0; the lse is the sink's, if any
            empty = torch.full((hkv, g * nq), float("-inf"), device=out.device)
            write_rows(q0, q1, torch.zeros(hkv, g * nq, d, device=out.device),
                       sink_rows if sink_rows is not None else empty)
            continue
        q = call.query[q0:q1].float().view(nq, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, nq, D]
        q = q.reshape(hkv, g * nq, d)
        record = _state_record(call, s)  # [Hkv, 5, D] or None
        q_dot_m = None  # scale * q.m [Hkv, g*nq, 1]: the logits' shift under key smoothing
        if record is not None:
            q_dot_m = (q * record[:, KEY_CENTER, None]).sum(-1)[..., None] * call.scale
            q = q * record[:, KEY_SCALE, None]
        if call.rotation_signs is not None:
            q = rotate(q, call.rotation_signs)
        pos = torch.arange(n - nq, n, device=q.device).repeat(g)  # [g*nq], row r -> query r % nq
        m = torch.full((hkv, g * nq), float("-inf"), device=q.device)
        l = torch.zeros((hkv, g * nq), device=q.device)
        acc = torch.zeros((hkv, g * nq, d), device=q.device)
        bad = torch.zeros((hkv, g * nq), dtype=torch.bool, device=q.device)
        blocks = call.block_tables[s]
        used = -(-n // call.block_size)
        if used > blocks.shape[0] or not bool(((blocks[:used] >= 0) &
                                               (blocks[:used] < call.num_blocks)).all()):
            # a block id out of range (value checks off): never read, the rows are NaN
            write_rows(q0, q1, torch.full((hkv, g * nq, d), float("nan"), device=out.device),
                       torch.full((hkv, g * nq), float("nan"), device=out.device))
            continue
        for c0 in range(0, n, chunk_tokens):
            c1 = min(n, c0 + chunk_tokens)
            k = _gather_tokens(call.key_cache, call.key_scales, blocks, group, c0, c1,
                               call.block_size)
            v = _gather_tokens(call.value_cache, call.value_scales, blocks, group, c0, c1,
                               call.block_size)
            if call.sink and c0 == 0:
                k[:, 0], v[:, 0] = record[:, SINK_KEY], record[:, SINK_VALUE]
            logits = torch.matmul(q, k.transpose(1, 2)) * call.scale  # [Hkv, g*nq, T]
            if q_dot_m is not None and call.logits_soft_cap > 0:
                logits = logits + q_dot_m  # the cap needs the true logit
            if call.logits_soft_cap > 0:
                logits = call.logits_soft_cap * torch.tanh(logits / call.logits_soft_cap)
            key_pos = torch.arange(c0, c1, device=q.device)
            visible = key_pos[None, :] <= pos[:, None]
            if call.sliding_window > 0:
                visible &= key_pos[None, :] > pos[:, None] - call.sliding_window
            logits = torch.where(visible, logits, float("-inf"))
            v_finite = torch.isfinite(v).all(dim=-1)  # [Hkv, T]
            bad |= (visible[None] & ~v_finite[:, None, :]).any(dim=-1)
            v = torch.where(v_finite[..., None], v, 0.0)
            m_new = torch.maximum(m, logits.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = torch.exp(logits - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.matmul(p, v)
            m = m_new
        if q_dot_m is not None and call.logits_soft_cap <= 0:
            m = m + q_dot_m[..., 0]  # from the smoothed logits back to the true ones
        if sink_rows is not None:  # one more logit, no value
            m_new = torch.maximum(m, sink_rows)
            alpha = torch.where(torch.isinf(m) & (m < 0), 0.0, torch.exp(m - m_new))
            l = l * alpha + torch.exp(sink_rows - m_new)
            acc = acc * alpha[..., None]
            m = m_new
        o = torch.where(l[..., None] > 0, acc / l[..., None].clamp_min(1e-30), 0.0)
        row_lse = m + torch.log(l)  # -inf for a row that sees nothing
        nan_rows = bad | torch.isnan(m)  # a NaN logit leaves m NaN: the whole row is NaN
        o = torch.where(nan_rows[..., None], float("nan"), o)
        row_lse = torch.where(nan_rows, float("nan"), row_lse)
        if call.rotation_signs is not None:
            o = unrotate(o, call.rotation_signs)
        write_rows(q0, q1, o, row_lse)


def _state_record(call: AttentionCall, s: int):
    """Sequence s's state record [Hkv, 5, D] (NaN if its slot is outside the tensor), or None."""
    if call.seq_state is None:
        return None
    slot = int(call.state_ids[s])
    if not 0 <= slot < call.seq_state.shape[0]:
        return torch.full(call.seq_state.shape[1:], float("nan"), device=call.query.device)
    return call.seq_state[slot]


def _smoothing_of_tokens(write: CacheWrite, keep: torch.Tensor):
    """(m, 1 / lam) [n, Hkv, D] of the kept tokens' slots (NaN for a slot outside the tensor)."""
    state = write.seq_state
    ids = write.state_ids[keep].long()
    valid = (ids >= 0) & (ids < state.shape[0])
    rec = state[ids.clamp(0, state.shape[0] - 1)]  # [n, Hkv, 5, D]
    rec = torch.where(valid[:, None, None, None], rec, float("nan"))
    return rec[:, :, KEY_CENTER], rec[:, :, KEY_INV_SCALE]


def cache_write_reference(write: CacheWrite) -> None:
    """Transform and quantize key/value and scatter them into the paged cache at
    ``slot_mapping``: key -> rotate((k - m) * r) (m, r = 1 / lam from each token's state slot, with
    key smoothing), value -> rotate(v), each step only where configured, in fp32."""
    d, bs = write.head_dim, write.block_size
    group = None if write.scale_group == d else write.scale_group
    # -1 skips a token; a slot past the cache (value checks off) is skipped too, never written
    keep = (write.slot_mapping >= 0) & (write.slot_mapping < write.num_blocks * bs)
    slots = write.slot_mapping[keep].long()
    blocks, offsets = slots // bs, slots % bs
    center = inv_scale = None
    if write.seq_state is not None:
        center, inv_scale = _smoothing_of_tokens(write, keep)
    key = transform_keys(write.key[keep], center, inv_scale, write.rotation_signs)
    value = transform_keys(write.value[keep], None, None, write.rotation_signs)
    for src, cache, scales in ((key, write.key_cache, write.key_scales),
                               (value, write.value_cache, write.value_scales)):
        if cache.dtype == torch.float8_e4m3fn:  # K8V4 keys: E4M3 bytes [n, Hkv, D], [n, Hkv]
            codes, sc = quantize_e4m3(src)
            codes = codes.view(torch.float8_e4m3fn)
        else:
            codes, sc = quantize_fp4(src, group, write.scale_rule)  # [n, Hkv, D/2], [n, Hkv, G]
            if group is None:
                sc = sc.squeeze(-1)
        cache[blocks, :, offsets] = codes
        scales[blocks, offsets] = sc


# The reference as torch.library ops with the shared schema, so the public API traces under
# torch.compile and captures in CUDA graphs whichever backend runs.
define("turboquant::paged_attention_fp4_reference", ATTENTION_SCHEMA)
# One cache-writer op per scale rule, both with the shared schema.
CACHE_WRITE_OPS = {"smallest": "reshape_and_cache_fp4_reference",
                   "mse": "reshape_and_cache_fp4_mse_reference"}


@torch.library.impl("turboquant::paged_attention_fp4_reference", "CompositeExplicitAutograd")
def _attention_op(out, query, key_cache, value_cache, key_scales, value_scales, block_tables,
                  seq_lens, cu_query_lens, scale, sliding_window, logits_soft_cap, max_seq_len,
                  rotation_signs, seq_state, state_ids, sink, sinks=None, lse=None,
                  workspace=None, sink_kv=None, sink_tags=None):  # (workspace: not needed here)
    call = make_attention_call(query, key_cache, value_cache, key_scales, value_scales,
                               block_tables, seq_lens, scale, cu_query_lens, sliding_window,
                               logits_soft_cap, max_seq_len, check_values=False)
    call = dataclasses.replace(call, rotation_signs=rotation_signs, seq_state=seq_state,
                               state_ids=state_ids, sink=sink, sinks=sinks,
                               return_lse=lse is not None, sink_kv=sink_kv, sink_tags=sink_tags)
    attention_reference(call_with_records(call), out, lse)


def _register_cache_write_op(rule: str, op_name: str) -> None:
    qualname = f"turboquant::{op_name}"
    define(qualname, CACHE_WRITE_SCHEMA)

    def impl(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping,
             rotation_signs, seq_state, state_ids):
        cache_write_reference(make_cache_write(key, value, key_cache, value_cache, key_scales,
                                               value_scales, slot_mapping, check_values=False,
                                               scale_rule=rule, rotation_signs=rotation_signs,
                                               seq_state=seq_state, state_ids=state_ids))

    torch.library.impl(qualname, "CompositeExplicitAutograd")(impl)


for _rule, _op in CACHE_WRITE_OPS.items():
    _register_cache_write_op(_rule, _op)


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0
    description = "PyTorch, fp32 math, chunked (runs anywhere; the definition of the output)"

    def check_attention(self, call):
        return None

    def check_cache_write(self, write):
        return None

    def paged_attention(self, call, out, lse=None):
        torch.ops.turboquant.paged_attention_fp4_reference(*attention_op_args(call, out, lse))

    def reshape_and_cache(self, write):
        op = getattr(torch.ops.turboquant, CACHE_WRITE_OPS[write.scale_rule])
        op(*cache_write_op_args(write))

    def check_merge(self, merge):
        return None

    def merge_states(self, merge):  # the op is defined beside the formula, in turboquant.states
        torch.ops.turboquant.merge_attention_states_reference(merge.out, merge.lse,
                                                              list(merge.outs), list(merge.lses))


register(ReferenceBackend())
