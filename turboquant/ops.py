"""One op schema shared by every vendor backend.

Each backend registers its kernels under ``turboquant::<op>_<backend>`` with exactly these
schemas (the C++ extensions use the same text), so the Python layer calls every backend the
same way, and ``torch.compile`` / CUDA graphs see an opaque op that writes into
caller-allocated outputs and never synchronizes with the host.
"""

ATTENTION_SCHEMA = (
    "(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
    "Tensor key_scales, Tensor value_scales, Tensor block_tables, Tensor seq_lens, "
    "Tensor? cu_query_lens, float scale, int sliding_window, float logits_soft_cap, "
    "int max_seq_len) -> ()"
)

CACHE_WRITE_SCHEMA = (
    "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor(c!) key_scales, Tensor(d!) value_scales, Tensor slot_mapping) -> ()"
)


def define(qualname: str, schema: str) -> None:
    """Define ``qualname`` (``turboquant::<op>_<backend>``) with ``schema`` once, with a fake
    (meta) implementation: the ops only write into their mutable arguments and return
    nothing, so tracing needs no shape logic."""
    import torch

    ns, name = qualname.split("::")
    if hasattr(getattr(torch.ops, ns), name):
        return
    torch.library.define(qualname, schema)
    torch.library.register_fake(qualname)(lambda *args, **kwargs: None)
