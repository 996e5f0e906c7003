# turboquant-fp4: aiter.paged_attention_fp4, the FP4 KV-cache paged attention with turboquant's
# API. Injected into aiter/ops/ by `python -m turboquant.integration.aiter.patch`; removed by
# its --revert.
from typing import Optional

import torch

from csrc.cpp_itfs.pa.pa_fp4 import (  # noqa: F401 - workspace_size: for callers sizing their own
    new_workspace, paged_attention_fp4_launch, workspace_size)
from csrc.cpp_itfs.torch_utils import direct_register_custom_op


def paged_attention_fp4_out(
    out: torch.Tensor,
    workspace_buffer: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scales: torch.Tensor,
    value_scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    logits_soft_cap: float = 0.0,
    use_native: int = -1,
    rotation_signs: Optional[torch.Tensor] = None,
    seq_state: Optional[torch.Tensor] = None,
    state_ids: Optional[torch.Tensor] = None,
    sink: bool = False,
    cu_query_lens: Optional[torch.Tensor] = None,
    sliding_window: int = 0,
    sinks: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> None:
    """use_native: 1 native FP4 MFMA, 0 LUT, -1 the default (native unless AITER_FP4_KV_LUT=1)."""
    paged_attention_fp4_launch(out, workspace_buffer, query, key_cache, value_cache, key_scales,
                               value_scales, block_tables, seq_lens, max_seq_len, scale,
                               logits_soft_cap, None if use_native < 0 else bool(use_native),
                               rotation_signs, seq_state, state_ids, sink,
                               cu_query_lens=cu_query_lens, sliding_window=sliding_window,
                               sinks=sinks, lse=lse)


direct_register_custom_op(
    "paged_attention_fp4_out",
    paged_attention_fp4_out,
    ["out", "workspace_buffer", "lse"],
)


def paged_attention_fp4(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scales: torch.Tensor,
    value_scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    cu_query_lens: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    max_seq_len: Optional[int] = None,
    use_native: Optional[bool] = None,
    workspace_buffer: Optional[torch.Tensor] = None,
    rotation_signs: Optional[torch.Tensor] = None,
    seq_state: Optional[torch.Tensor] = None,
    state_ids: Optional[torch.Tensor] = None,
    sink: bool = False,
    sinks: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """turboquant.paged_attention_fp4 on AITER.

    query [num_tokens, num_heads, D] bf16/fp16; key_cache, value_cache uint8
    [num_blocks, num_kv_heads, block_size, D/2] (K8V4: key_cache float8_e4m3fn
    [num_blocks, num_kv_heads, block_size, D], E4M3 key bytes); key_scales, value_scales uint8
    [num_blocks, block_size, num_kv_heads]; block_tables int32 [num_seqs, max_blocks];
    seq_lens int32 [num_seqs]. cu_query_lens: None (decode: one query token per sequence,
    num_tokens = num_seqs) or int32 [num_seqs + 1], the query tokens of sequence s being
    cu_query_lens[s] .. cu_query_lens[s + 1] - 1; query token j of a sequence with q of them
    and seq_len keys is at position seq_len - q + j and sees keys up to it (causal).
    sliding_window W > 0: a query at position p sees keys p - W + 1 .. p (0: off).
    max_seq_len: host-side bound on seq_lens (default: the block table's capacity).
    workspace_buffer: None (a new one per call), or the caller's: uint8, contiguous, 16-byte
    aligned, at least workspace_size(...) bytes (csrc.cpp_itfs.pa.pa_fp4), contents unused;
    paged_attention_fp4_workspace makes one, reusable=True for one kept across calls.
    turboquant's accuracy transforms, each off when None / False: rotation_signs float32 [D]
    of +-1 (Q rotated, output rotated back); seq_state float32 [num_slots, num_kv_heads, 5, D]
    with state_ids int32 [num_seqs] (q scaled by the key scale of its slot; q.m added back
    under a soft cap); sink: position 0 from seq_state (a key like any other for the causal
    and window ranges). sinks: learned sink logits float32 [num_heads] (one more logit per
    head, no value); lse: float32 [num_tokens, num_heads], filled with each row's natural-log
    log-sum-exp of its true logits (None: not computed).
    """
    if max_seq_len is None:
        max_seq_len = block_tables.size(1) * key_cache.size(2)
    if out is None:
        out = torch.empty_like(query)
    if workspace_buffer is None:
        workspace_buffer = new_workspace(query, value_cache.size(1), max_seq_len,
                                         num_seqs=seq_lens.size(0), cu_query_lens=cu_query_lens)
    torch.ops.aiter.paged_attention_fp4_out(
        out, workspace_buffer, query, key_cache, value_cache, key_scales, value_scales,
        block_tables, seq_lens, max_seq_len, scale, logits_soft_cap,
        -1 if use_native is None else int(use_native), rotation_signs, seq_state, state_ids,
        bool(sink), cu_query_lens, sliding_window, sinks, lse)
    return out


def paged_attention_fp4_workspace(
    query: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    cu_query_lens: Optional[torch.Tensor] = None,
    reusable: bool = False,
) -> torch.Tensor:
    """A workspace_buffer for paged_attention_fp4 calls like this one (uint8 on query's device).
    reusable: enough for every call with at most as many query tokens and sequences, the same
    heads and at most this max_seq_len (sized for the shortest partitions), to keep across
    calls."""
    return new_workspace(query, value_cache.size(1), max_seq_len, num_seqs=seq_lens.size(0),
                         cu_query_lens=cu_query_lens, reusable=reusable)
