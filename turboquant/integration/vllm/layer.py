"""One attention layer of a serving engine over turboquant's cache: what the vLLM backend's
forward runs, kept free of vLLM so that it runs, and captures into CUDA graphs, where vLLM is not
installed (the GPU machines here).

The engine allocates each layer's KV memory and hands it over as one byte tensor; vLLM's is a
uint8 ``[num_blocks, num_kv_heads, block_size, C]`` view (C = ``bytes_per_token_head``: D + 2
for FP4, 3 D / 2 + 2 for K8V4) whose strides follow its KV layout. With a layer-outermost layout
(vLLM's LBNHC or LBHNC) a layer's bytes are one dense range, which ``turboquant.cache_in`` reads
as the cache's four regions (key codes, value codes, key scales, value scales). So a page holds
exactly the FP4 bytes and the capacity gain is real, but a block's bytes are spread over the four
regions: engines that copy blocks as byte ranges (KV offload, transfer connectors) are declined.

Per layer the state is one ``turboquant.allocate_shared_state`` (nothing per request), created
at the layer's first forward, with the layer's calibration if one is given; otherwise the
smoothing is taken by the first write that holds keys past position 0 with a slot, not all
equal (vLLM's warm-ups, every slot -1 or the prompt [0, 1] repeated, take nothing). Each step's
metadata is built once and read by every layer (``StepMetadata``); the writer's positions come
from it, so no host synchronization and no request slot. Value checks are off inside
``forward``: the engine's metadata is trusted, and the checks would read it back to the host in
every layer.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ...api import paged_attention_fp4, reshape_and_cache_fp4
from ...calls import value_checks
from ...cache import FP4Cache, cache_in, kv_bytes_per_token
from ...config import QuantConfig
from ...shared_state import SharedState, allocate_shared_state, positions_from_metadata

KEY_FORMATS = {"tq_fp4": "fp4", "tq_k8v4": "fp8_e4m3"}  # the engine's cache dtype -> key format


def bytes_per_token_head(head_dim: int, key_format: str) -> int:
    """Bytes one token occupies per kv head: K and V codes and their two scale bytes."""
    return kv_bytes_per_token(1, head_dim, key_format=key_format)


def layer_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """The dense byte range under a layer's view (any dim order, no gaps): uint8 [numel]."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.element_size() != 1:
        raise ValueError(f"kv_cache: expected a tensor of 1-byte elements, got "
                         f"{getattr(kv_cache, 'dtype', type(kv_cache).__name__)}")
    dims = sorted((st, n) for st, n in zip(kv_cache.stride(), kv_cache.shape) if n > 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            raise ValueError(f"kv_cache: the layer's bytes are not one dense range (shape "
                             f"{tuple(kv_cache.shape)}, strides {kv_cache.stride()}): use a "
                             f"layer-outermost KV layout (vLLM: LBNHC or LBHNC)")
        expected *= n
    flat = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
    return flat.as_strided((kv_cache.numel(),), (1,))


@dataclasses.dataclass
class StepMetadata:
    """What one engine step tells every attention layer (built once per step)."""

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs], each sequence's length after this step
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [>= num_tokens], -1: a token not to write
    positions: torch.Tensor  # int64 [num_tokens], each query token's position
    num_tokens: int  # query tokens of the step (padding included)
    max_seq_len: int  # host-side upper bound of seq_lens
    # the leading sequences with one query token each (decode-first order): the layer runs
    # them as a decode call and the rest as a multi-token call (paged_attention_fp4's
    # num_decodes); 0 = one call for the step
    num_decodes: int = 0
    # uint8 [bytes]: the engine's prefill workspace (turboquant.prefill_workspace_bytes),
    # allocated once and passed to every layer's call; None: a call allocates its own
    workspace: Optional[torch.Tensor] = None

    @classmethod
    def build(cls, query_start_loc, seq_lens, block_table, slot_mapping, num_tokens: int,
              max_seq_len: int, positions: Optional[torch.Tensor] = None,
              num_decodes: int = 0, workspace: Optional[torch.Tensor] = None
              ) -> "StepMetadata":
        """From an engine's metadata; ``positions`` derived from it when not given."""
        if positions is None:
            positions = positions_from_metadata(query_start_loc, seq_lens, num_tokens)
        return cls(query_start_loc, seq_lens, block_table, slot_mapping, positions[:num_tokens],
                   int(num_tokens), int(max_seq_len), int(num_decodes), workspace)


class PagedLayer:
    """One layer's attention over its cache: write the step's keys and values, then attend."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, *,
                 key_format: str = "fp4", sliding_window: int = 0, logits_soft_cap: float = 0.0,
                 sinks: Optional[torch.Tensor] = None, calibration: Optional[tuple] = None,
                 config: Optional[QuantConfig] = None, backend: str = "auto",
                 sink_entries: Optional[int] = None):
        if key_format not in KEY_FORMATS.values():
            raise ValueError(f"key_format: expected one of {sorted(KEY_FORMATS.values())}, got "
                             f"{key_format!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads ({num_kv_heads}), "
                             f"got {num_heads}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.key_format = float(scale), key_format
        self.sliding_window, self.logits_soft_cap = int(sliding_window), float(logits_soft_cap)
        self.sinks = sinks  # [num_heads] (the model's parameter; float32 copy at first use)
        self.calibration = calibration  # (m, lam) float32 [num_kv_heads, D], or None
        self.sink_entries = sink_entries  # the shared state's sink table (None: its default)
        self.config = config if config is not None else QuantConfig()
        if self.config.needs_slots:
            raise ValueError(f"config: {self.config.name!r} keeps a record per request; an engine "
                             f"layer uses the shared state (the default)")
        self.backend = backend
        self.state: Optional[SharedState] = None
        self._state_for: Optional[tuple] = None  # (device, num_blocks) the state was made for
        self._cache: Optional[tuple] = None  # (key of the layer buffer, FP4Cache)
        self._sinks32: Optional[torch.Tensor] = None

    @property
    def bytes_per_token_head(self) -> int:
        return bytes_per_token_head(self.head_dim, self.key_format)

    def cache(self, kv_cache: torch.Tensor) -> FP4Cache:
        """The cache over the layer's buffer kv_cache [num_blocks, ...] (views made once)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride())
        if self._cache is None or self._cache[0] != key:
            flat = layer_bytes(kv_cache)
            per_block = self.bytes_per_token_head * self.num_kv_heads
            num_blocks = kv_cache.shape[0]
            if flat.numel() % (num_blocks * per_block):
                raise ValueError(f"kv_cache: {flat.numel()} bytes is not {num_blocks} blocks of "
                                 f"{per_block} bytes per token ({self.key_format}, D "
                                 f"{self.head_dim}, {self.num_kv_heads} kv heads)")
            block_size = flat.numel() // (num_blocks * per_block)
            self._cache = (key, cache_in(flat, num_blocks, self.num_kv_heads, block_size,
                                         self.head_dim, key_format=self.key_format))
        return self._cache[1]

    def _state(self, cache: FP4Cache) -> SharedState:
        """The layer's shared state, made for this buffer's device and block count."""
        where = (cache.key_cache.device, cache.key_cache.shape[0])
        if self.state is None or self._state_for != where:
            cal = self.calibration
            if cal is not None:
                cal = tuple(t.to(where[0], torch.float32) for t in cal)
            self.state = allocate_shared_state(self.num_kv_heads, self.head_dim, where[1],
                                               calibration=cal, entries=self.sink_entries,
                                               device=where[0])
            self._state_for = where
        return self.state

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor],
                value: Optional[torch.Tensor], kv_cache: torch.Tensor, meta: StepMetadata,
                output: torch.Tensor) -> torch.Tensor:
        """query [num_tokens, num_heads, D] (rows past meta.num_tokens: padding, left as they
        are in output); key, value [num_tokens, num_kv_heads, D] (None: already written);
        output [num_tokens, num_heads, D], written in place and returned."""
        n = meta.num_tokens
        cache = self.cache(kv_cache)
        state = self._state(cache)
        with value_checks(False):
            if key is not None and value is not None:
                reshape_and_cache_fp4(key[:n], value[:n], *cache, meta.slot_mapping[:n],
                                      config=self.config, positions=meta.positions,
                                      shared_state=state, backend=self.backend)
            paged_attention_fp4(query[:n], *cache, meta.block_table, meta.seq_lens, self.scale,
                                cu_query_lens=meta.query_start_loc, out=output[:n],
                                sliding_window=self.sliding_window,
                                logits_soft_cap=self.logits_soft_cap,
                                max_seq_len=min(meta.max_seq_len,
                                                meta.block_table.shape[1] *
                                                cache.key_cache.shape[2]),
                                config=self.config, sinks=self._sinks(query.device),
                                shared_state=state, backend=self.backend,
                                num_decodes=meta.num_decodes, workspace=meta.workspace)
        return output

    def _sinks(self, device) -> Optional[torch.Tensor]:
        if self.sinks is None:
            return None
        if self._sinks32 is None or self._sinks32.device != device:
            self._sinks32 = self.sinks.detach().to(device, torch.float32).contiguous()
        return self._sinks32
