"""vLLM's attention-backend classes for turboquant's cache: the backends ``TQ_FP4`` (cache dtype
``tq_fp4``: FP4 keys and values, the default transforms) and ``TQ_K8V4`` (``tq_k8v4``: E4M3
keys, FP4 values), their metadata builder and the layer implementation. The work is
``layer.PagedLayer``'s; these classes translate vLLM's interfaces to it and state what is
declined, through vLLM's own validation (``validate_configuration`` lists the reason).

Choices (vLLM 0.33):
- The page: ``customize_spec`` sets ``state_content_bytes`` to the format's bytes per token and
  kv head, so vLLM's block count is memory / (num_kv_heads x block_size x those bytes).
- Layouts: layer-outermost (LBNHC, LBHNC), so a layer's bytes are one range
  (``layer.layer_bytes``); KV connectors (offload, disaggregated transfer) are declined: they
  move a block as a byte range, and ours spans four regions.
- Writes happen in ``forward`` (``forward_includes_kv_cache_update``): the writer needs the
  step's positions, which ``do_kv_cache_update`` is not given.
- CUDA graphs: uniform batches (decode, and speculative verification of 1 + k tokens); their
  metadata is captured with ``max_seq_len`` at the block table's capacity, so the kernels' grid
  covers any sequence a replay brings. Mixed and prefill batches run eagerly, decode-first
  (``reorder_batch_threshold = 1``): a step's decodes as one call and its other sequences as
  another, each with its own kernel (``paged_attention_fp4``'s ``num_decodes``).
- The prefill workspace (``paged_attention_fp4``'s ``workspace``): the builder allocates one
  when it starts, for one sequence of ``max_model_len`` keys (a chunked-prefill step usually
  holds one long prompt; ``turboquant.prefill_workspace_bytes``, at most 1 GiB), and every
  step's calls share it; a step that needs more decodes in the kernel. vLLM starts the builder
  after its profile run has sized the cache, so these bytes come out of the memory
  ``--gpu-memory-utilization`` leaves free.
- Declined: ALiBi, encoder and cross attention, KV sharing between layers, MLA, sparse attention,
  per-head quant scales, batch invariance, decode context parallelism, non-causal attention.
- Calibration: ``TURBOQUANT_CALIBRATION=FILE`` (``turboquant.save_calibration``'s format, one
  entry per decoder layer, indexed by the layer number in vLLM's layer name) gives each layer its
  smoothing; without it the smoothing is taken by the first prompt the server writes.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import replace
from typing import ClassVar, Optional

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionMetadata, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata)
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from ...api import prefill_workspace_bytes
from ...calls import leading_decodes
from ...shared_state import positions_from_metadata
from ...smoothing import load_calibration
from ...sources import cuda_limits
from .layer import KEY_FORMATS, PagedLayer, StepMetadata, bytes_per_token_head

# the NVIDIA kernels' shapes (csrc_cuda/limits.cuh); the aiter backend's own list
# (turboquant._backends.aiter.HEAD_DIMS) names the same head dims
_DIMS, _MIN_BLOCK, _MAX_BLOCK = cuda_limits()
HEAD_SIZES = list(_DIMS)
BLOCK_SIZES = [1 << n for n in range(_MIN_BLOCK.bit_length() - 1, _MAX_BLOCK.bit_length())]
CALIBRATION_ENV = "TURBOQUANT_CALIBRATION"


@dataclasses.dataclass
class TurboQuantMetadata(StepMetadata, AttentionMetadata):
    """The step's metadata every layer reads (``layer.StepMetadata``)."""


def declined_setup(vllm_config) -> Optional[str]:
    """Why vLLM would move this cache's blocks as byte ranges (``layer_bytes``: a block spans
    four regions of the layer's memory, so such a copy or zeroing corrupts other blocks), or
    None. vLLM's own validation does not see these, so the builder raises with the reason."""
    if vllm_config is None:
        return None
    model, cache = vllm_config.model_config, vllm_config.cache_config
    spec = vllm_config.speculative_config
    if model is not None and model.is_hybrid:
        return ("hybrid models: their Mamba or linear-attention state shares the KV memory and "
                "vLLM zeroes new blocks as byte ranges")
    if cache.kv_cache_dtype_skip_layers:
        return ("--kv-cache-dtype-skip-layers: a mixed-precision cache, whose reused blocks vLLM "
                "zeroes as byte ranges")
    if cache.prefix_match_unit not in (None, cache.block_size):
        return ("--prefix-match-unit below the block size: vLLM copies a partly matched block as "
                "a byte range")
    if spec is not None and spec.kv_cache_dtype not in (None, cache.cache_dtype):
        return ("a draft model with another KV-cache dtype: a mixed-precision cache, whose reused "
                "blocks vLLM zeroes as byte ranges")
    return None


def prefill_workspace(vllm_config, spec: AttentionSpec, device) -> Optional[torch.Tensor]:
    """The builder's prefill workspace: uint8 [bytes] for one sequence of max_model_len keys,
    or None where no kernel on this device takes one (or without a config)."""
    if vllm_config is None or getattr(vllm_config, "model_config", None) is None:
        return None
    key_format = KEY_FORMATS.get(vllm_config.cache_config.cache_dtype, "fp4")
    nbytes = prefill_workspace_bytes(1, vllm_config.model_config.max_model_len,
                                     spec.num_kv_heads, spec.head_size, key_format=key_format,
                                     device=device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None


class TurboQuantMetadataBuilder(AttentionMetadataBuilder[TurboQuantMetadata]):
    """vLLM's per-step metadata -> ``TurboQuantMetadata``, once per step for all layers. Token
    positions are vLLM's (a view of its persistent buffer); where it passes none they are
    derived into the builder's own buffer, so a captured graph reads the current ones."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # vLLM puts the requests of one query token first; build() counts them (num_decodes)
    reorder_batch_threshold: int = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        reason = declined_setup(vllm_config)
        if reason is not None:
            raise NotImplementedError(f"turboquant's KV cache does not support {reason}")
        tokens = (vllm_config.scheduler_config.max_num_batched_tokens
                  if vllm_config is not None else 0)
        self._positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.workspace = prefill_workspace(vllm_config, kv_cache_spec, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TurboQuantMetadata:
        m = common_attn_metadata
        positions = m.positions
        if positions is None:
            n = m.num_actual_tokens
            if self._positions.numel() < n:
                self._positions = torch.zeros(n, dtype=torch.long,
                                              device=m.query_start_loc.device)
            positions = self._positions[:n]
            positions.copy_(positions_from_metadata(m.query_start_loc, m.seq_lens, n))
        # views of vLLM's tensors, never copies: a captured graph reads vLLM's persistent buffers
        return TurboQuantMetadata.build(m.query_start_loc, m.seq_lens, m.block_table_tensor,
                                        m.slot_mapping, m.num_actual_tokens, m.max_seq_len,
                                        positions=positions,
                                        num_decodes=leading_decodes(m.query_start_loc_cpu,
                                                                    m.num_reqs),
                                        workspace=self.workspace)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> TurboQuantMetadata:
        meta = self.build(0, common_attn_metadata)
        meta.max_seq_len = meta.block_table.shape[1] * self.kv_cache_spec.block_size
        return meta


class TurboQuantFP4Backend(AttentionBackend):
    """``--attention-backend TQ_FP4 --kv-cache-dtype tq_fp4``."""

    CACHE_DTYPE: ClassVar[str] = "tq_fp4"
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["tq_fp4"]

    @staticmethod
    def get_name() -> str:
        return "TQ_FP4"

    @staticmethod
    def get_impl_cls() -> type["TurboQuantImpl"]:
        return TurboQuantImpl

    @staticmethod
    def get_builder_cls() -> type[TurboQuantMetadataBuilder]:
        return TurboQuantMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_SIZES)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        if spec.state_content_bytes is not None:
            return spec
        return replace(spec, state_content_bytes=bytes_per_token_head(
            spec.head_size, KEY_FORMATS[cls.CACHE_DTYPE]))

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major >= 8


class TurboQuantK8V4Backend(TurboQuantFP4Backend):
    """``--attention-backend TQ_K8V4 --kv-cache-dtype tq_k8v4``."""

    CACHE_DTYPE: ClassVar[str] = "tq_k8v4"
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["tq_k8v4"]

    @staticmethod
    def get_name() -> str:
        return "TQ_K8V4"


@functools.lru_cache(maxsize=2)
def _calibration_file(path: str) -> list:
    return load_calibration(path)


def layer_calibration(layer_name: str, draft: bool = False) -> Optional[tuple]:
    """This layer's (m, lam) from the file ``TURBOQUANT_CALIBRATION`` names, or None (no file, or
    a speculative draft model's layer: the file is the target model's). The entry is the one
    number in vLLM's layer name ("model.layers.7.self_attn.attn": 7)."""
    path = os.environ.get(CALIBRATION_ENV)
    if not path or draft:
        return None
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"{CALIBRATION_ENV}: layer {layer_name!r} has no single layer number "
                         f"to pick its entry by")
    layers = _calibration_file(path)
    if not numbers[0] < len(layers):
        raise ValueError(f"{CALIBRATION_ENV}: {path} holds {len(layers)} layers, the model's "
                         f"layer {layer_name!r} is number {numbers[0]}")
    return layers[numbers[0]]


class TurboQuantImpl(AttentionImpl[TurboQuantMetadata]):
    """One attention layer: ``layer.PagedLayer`` behind vLLM's AttentionImpl."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: Optional[int] = None, alibi_slopes=None,
                 sliding_window: Optional[int] = None, kv_cache_dtype: str = "tq_fp4",
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, **kwargs):
        if kv_cache_dtype not in KEY_FORMATS:
            raise ValueError(f"kv_cache_dtype: expected one of {sorted(KEY_FORMATS)}, got "
                             f"{kv_cache_dtype!r}")
        if alibi_slopes is not None:
            raise NotImplementedError("alibi_slopes: ALiBi is not supported by turboquant")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"attn_type: only decoder attention, got {attn_type}")
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("kv_sharing_target_layer_name: layers sharing another "
                                      "layer's cache are not supported (the shared state is "
                                      "per layer)")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = sliding_window
        self.layer = PagedLayer(num_heads, head_size, self.num_kv_heads, scale,
                                key_format=KEY_FORMATS[kv_cache_dtype],
                                sliding_window=sliding_window or 0,
                                logits_soft_cap=logits_soft_cap or 0.0,
                                sinks=kwargs.get("sinks"))
        self._calibrated = False

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[TurboQuantMetadata],
                output: torch.Tensor, output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query [num_tokens, num_heads, D]; key, value [num_tokens, num_kv_heads, D];
        kv_cache: the layer's bytes (``layer.layer_bytes``); output [num_tokens, num_heads, D]."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("output_scale: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's profiling run: no cache yet
            return output.fill_(0)
        if not self._calibrated:
            self.layer.calibration = layer_calibration(getattr(layer, "layer_name", ""),
                                                       getattr(layer, "is_draft_layer", False))
            self._calibrated = True
        return self.layer.forward(query, key, value, kv_cache, attn_metadata, output)
