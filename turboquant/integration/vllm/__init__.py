"""turboquant in vLLM: a general plugin (entry point ``vllm.general_plugins``, installed with
the package) that registers the KV-cache dtypes ``tq_fp4`` and ``tq_k8v4`` and the attention
backends ``TQ_FP4`` and ``TQ_K8V4`` (``backend``):

    vllm serve MODEL --kv-cache-dtype tq_fp4 --attention-backend TQ_FP4

vLLM loads the plugin in every process it starts (engine, workers) and calls ``register``.
Importing this module imports nothing of vLLM; ``register`` does.
"""
from __future__ import annotations

BACKENDS = {"TQ_FP4": "TurboQuantFP4Backend", "TQ_K8V4": "TurboQuantK8V4Backend"}


def _dtype_handler(name: str):
    """vLLM's KVCacheDTypeHandler for one of our cache dtypes: bytes, a self-managed format."""
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode

    class Handler:
        def torch_dtype(self):
            return torch.uint8

        def quant_mode(self):
            return KVQuantMode.CUSTOM

    Handler.name = name
    Handler.__qualname__ = Handler.__name__ = f"TurboQuantHandler_{name}"
    return Handler


def register() -> None:
    """Register the cache dtypes and backends with vLLM (idempotent)."""
    from vllm.config.cache import get_kv_cache_dtype_handler, register_kv_cache_dtype
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .layer import KEY_FORMATS

    for name in KEY_FORMATS:
        if get_kv_cache_dtype_handler(name) is None:
            register_kv_cache_dtype(name)(_dtype_handler(name))
    for name, cls in BACKENDS.items():
        known = AttentionBackendEnum.__members__.get(name)  # a second call: the same path again
        register_backend(known if known is not None else name, f"{__name__}.backend.{cls}")
