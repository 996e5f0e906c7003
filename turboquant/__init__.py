"""turboquant: FP4 KV-cache paged attention with one cache format and one API across vendors.

    turboquant.reshape_and_cache_fp4(key, value, key_cache, value_cache,
                                     key_scales, value_scales, slot_mapping, *, config=None,
                                     seq_state=None, state_ids=None, positions=None,
                                     calibration=None, shared_state=None, backend="auto")
    turboquant.paged_attention_fp4(query, key_cache, value_cache, key_scales, value_scales,
                                   block_tables, seq_lens, scale, *, cu_query_lens=None,
                                   out=None, sliding_window=0, logits_soft_cap=0.0,
                                   backend="auto", max_seq_len=None, config=None,
                                   seq_state=None, state_ids=None, sinks=None,
                                   return_lse=False, shared_state=None)   # -> out, or (out, lse)
    turboquant.allocate_shared_state(num_kv_heads, head_dim, num_blocks)  # one per layer
    turboquant.merge_attention_states(out_a, lse_a, out_b, lse_b)   # -> (out, lse)
    turboquant.merge_attention_states_n(outs, lses)   # R states -> (out, lse)
    turboquant.backends()  # every backend, whether it can run here, and why not
"""
from . import _backends  # registers the vendor backends  # noqa: F401
from . import reference as _reference  # registers the reference backend  # noqa: F401
from .api import (backends, explain, paged_attention_fp4, prefill_workspace_bytes,
                  reshape_and_cache_fp4)
from .calls import value_checks
from .cache import FP4Cache, allocate_cache, cache_in
from .config import QuantConfig
from .format import dequantize_fp4, quantize_fp4
from .shared_state import SharedState, allocate_shared_state
from .smoothing import allocate_state, load_calibration, save_calibration
from .states import merge_attention_states, merge_attention_states_n

__all__ = ["FP4Cache", "QuantConfig", "SharedState", "allocate_cache", "allocate_shared_state",
           "cache_in",
           "allocate_state", "backends", "explain",
           "dequantize_fp4", "load_calibration", "merge_attention_states",
           "merge_attention_states_n", "paged_attention_fp4", "prefill_workspace_bytes",
           "quantize_fp4",
           "reshape_and_cache_fp4", "save_calibration", "value_checks"]
__version__ = "0.1.0"
