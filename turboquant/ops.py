"""One op schema shared by every vendor backend.

Each backend registers its kernels under ``turboquant::<op>_<backend>`` with exactly these
schemas (the C++ extensions use the same text), so the Python layer calls every backend the
same way, and ``torch.compile`` / CUDA graphs see an opaque op that writes into
caller-allocated outputs and never synchronizes with the host.

The transforms of CONTRACT.md section 2 travel with every call: ``rotation_signs`` (float32
[D] of +-1, or None: no rotation), ``seq_state`` (float32 [num_slots, num_kv_heads, 5, D],
``turboquant.smoothing``) and ``state_ids`` (int32: the slot of each sequence for attention,
of each token for the writer), ``sink`` (attention reads position 0 from the state record).
Attention may instead take a layer's shared state (``turboquant.shared_state``) as it is:
``seq_state`` its one record [1, num_kv_heads, 5, D] (every sequence's m and lam), no
``state_ids``, and ``sink_kv`` (bfloat16 [S + 1, num_kv_heads, 2, D]) / ``sink_tags`` (int64
[S + 1, num_kv_heads]), the sink table each sequence's sink rows are looked up in (the cuda
backend's kernels look them up themselves; the other backends build the per-sequence records
first, ``shared_state.call_with_records``).
Attention also takes ``sinks`` (float32 [num_heads]: learned sink logits, or None), ``lse``
(float32 [num_tokens, num_heads], written when given: the natural-log log-sum-exp of each
row's logits, ``turboquant.api.paged_attention_fp4``) and ``workspace`` (uint8 [bytes], or
None: scratch memory a backend may use instead of allocating its own; its contents are not
kept between calls).
The writer gets ``seq_state`` only with key smoothing; the reader whenever the config uses it.
"""

ATTENTION_SCHEMA = (
    "(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
    "Tensor key_scales, Tensor value_scales, Tensor block_tables, Tensor seq_lens, "
    "Tensor? cu_query_lens, float scale, int sliding_window, float logits_soft_cap, "
    "int max_seq_len, Tensor? rotation_signs, Tensor? seq_state, Tensor? state_ids, "
    "bool sink, Tensor? sinks=None, Tensor(b!)? lse=None, Tensor(c!)? workspace=None, "
    "Tensor? sink_kv=None, Tensor? sink_tags=None) -> ()"
)

# The bytes of a prefill workspace (``workspace`` above) that serves every attention call of
# ``query``'s device, head dim and key format with at most ``num_seqs`` sequences of at most
# ``max_seq_len`` keys (``turboquant.prefill_workspace_bytes``); cuda backend only.
WORKSPACE_BYTES_SCHEMA = (
    "(Tensor query, int num_seqs, int max_seq_len, int num_kv_heads, bool key_e4m3) -> int"
)

CACHE_WRITE_SCHEMA = (
    "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor(c!) key_scales, Tensor(d!) value_scales, Tensor slot_mapping, "
    "Tensor? rotation_signs, Tensor? seq_state, Tensor? state_ids) -> ()"
)

# Merging R attention states of the same rows over disjoint keys (turboquant.states): out and
# lse are written; outs / lses are the parts, [num_tokens, num_heads, D] and float32
# [num_tokens, num_heads] each.
MERGE_STATES_SCHEMA = (
    "(Tensor(a!) out, Tensor(b!) lse, Tensor[] outs, Tensor[] lses) -> ()"
)


# The shared state (turboquant.shared_state): the per-sequence records of an attention call, built
# from a layer's state (and their ids 0 .. num_seqs - 1); and a write's position-0 tokens entered
# in the layer's sink table.
SHARED_RECORDS_SCHEMA = (
    "(Tensor(a!) records, Tensor(b!) state_ids, Tensor key_cache, Tensor value_cache, Tensor key_scales, "
    "Tensor value_scales, Tensor block_tables, Tensor seq_lens, Tensor smoothing, "
    "Tensor sink_kv, Tensor sink_tags) -> ()"
)
SHARED_ENTER_SINKS_SCHEMA = (
    "(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, Tensor key_scales, "
    "Tensor value_scales, Tensor slot_mapping, Tensor positions, Tensor? smoothing, "
    "Tensor(a!) sink_kv, Tensor(b!) sink_tags, Tensor? rotation_signs) -> ()"
)


def define(qualname: str, schema: str) -> None:
    """Define ``qualname`` (``turboquant::<op>_<backend>``) with ``schema`` once, with a fake
    (meta) implementation where it returns nothing (those ops only write into their mutable
    arguments, so tracing needs no shape logic; the others are host-side queries)."""
    import torch

    ns, name = qualname.split("::")
    if hasattr(getattr(torch.ops, ns), name):
        return
    torch.library.define(qualname, schema)
    if schema.endswith("-> ()"):
        torch.library.register_fake(qualname)(lambda *args, **kwargs: None)
