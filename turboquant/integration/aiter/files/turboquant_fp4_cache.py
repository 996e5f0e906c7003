# turboquant-fp4: aiter.reshape_and_cache_fp4, the FP4 KV-cache writer with turboquant's API
# (the cache aiter.paged_attention_fp4 reads). Injected into aiter/ops/ by
# `python -m turboquant.integration.aiter.patch`; removed by its --revert.
from typing import Optional

import torch

from csrc.cpp_itfs.pa.cache_fp4 import reshape_and_cache_fp4_launch
from csrc.cpp_itfs.torch_utils import direct_register_custom_op


def reshape_and_cache_fp4_out(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scales: torch.Tensor,
    value_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    rotation_signs: Optional[torch.Tensor] = None,
    seq_state: Optional[torch.Tensor] = None,
    state_ids: Optional[torch.Tensor] = None,
) -> None:
    reshape_and_cache_fp4_launch(key, value, key_cache, value_cache, key_scales, value_scales,
                                 slot_mapping, rotation_signs, seq_state, state_ids)


direct_register_custom_op(
    "reshape_and_cache_fp4_out",
    reshape_and_cache_fp4_out,
    ["key_cache", "value_cache", "key_scales", "value_scales"],
)


def reshape_and_cache_fp4(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scales: torch.Tensor,
    value_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    rotation_signs: Optional[torch.Tensor] = None,
    seq_state: Optional[torch.Tensor] = None,
    state_ids: Optional[torch.Tensor] = None,
) -> None:
    """turboquant.reshape_and_cache_fp4's kernel on AITER: key, value [num_tokens,
    num_kv_heads, D] bf16/fp16/fp32 quantized into the paged cache in place.

    key_cache, value_cache uint8 [num_blocks, num_kv_heads, block_size, D/2] (K8V4:
    key_cache float8_e4m3fn [num_blocks, num_kv_heads, block_size, D], E4M3 key bytes);
    key_scales, value_scales uint8 [num_blocks, block_size, num_kv_heads] (or [..., D/32]: one
    scale per 32 elements, FP4 keys only); slot_mapping int64/int32 [num_tokens] (slot = block
    * block_size + offset; -1 skips a token). turboquant's accuracy transforms, each off when
    None: rotation_signs float32 [D] of +-1 (K and V rotated), seq_state float32 [num_slots,
    num_kv_heads, 5, D] with state_ids int32 [num_tokens] (key smoothing: (k - m) * (1 / lam)
    of each token's record; turboquant.reshape_and_cache_fp4 fills the records). The bytes
    are turboquant's reference writer's, bit for bit; no host synchronization.
    """
    torch.ops.aiter.reshape_and_cache_fp4_out(key, value, key_cache, value_cache, key_scales,
                                              value_scales, slot_mapping, rotation_signs,
                                              seq_state, state_ids)
