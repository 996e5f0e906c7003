"""turboquant in transformers' continuous batching (``generate_batch``, transformers 5.23): the
paged KV cache transformers allocates holds the format's bytes instead of BF16.

    from turboquant.integration.transformers_batching import generate_batch
    outputs = generate_batch(model, [ids_1, ids_2, ...], max_new_tokens=128)  # kv_cache_dtype=

transformers' continuous batching owns its cache: one byte tensor, cut into blocks by an
allocator per attention type, sized from free memory by a memory handler, with a block manager
that shares prefixes and forks requests. This module keeps all of that and changes what a block
holds: ``_Allocator`` makes each layer's part of the tensor a uint8 ``[blocks, Hkv, page, C]``
range (C = D + 2 for FP4: the engine layer of ``integration.vllm.layer``, four regions per
layer), so a block costs the format's bytes; ``_MemoryHandler`` sizes the cache without the BF16
read-back and masks this path never makes. The attention function "turboquant_cb" writes each
step's tokens and runs ``paged_attention_fp4`` with the step's block table; decode steps can use
transformers' block-table fast path (``decode_fast_path_blocks``), which builds no host indices.

It depends on transformers' internals of 5.23 (the module globals its cache reads when built,
``ContinuousBatchingManager``'s attention switch and batch processor): other versions raise.
Forks (``num_return_sequences``) copy blocks region by region; CPU offload of blocks (byte ranges)
is refused. One group: sliding windows are applied by the kernels over full-length caches.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional, Sequence

import torch
import transformers
from transformers import AttentionInterface, ContinuousBatchingConfig

from ..cache import cache_in
from .transformers import EngineLayers
from .vllm.layer import KEY_FORMATS, StepMetadata, bytes_per_token_head

TRANSFORMERS = "5.23"
if not transformers.__version__.startswith(TRANSFORMERS):
    raise ImportError(f"turboquant.integration.transformers_batching needs transformers "
                      f"{TRANSFORMERS}.x (its continuous-batching internals), found "
                      f"{transformers.__version__}; model.generate works on any version through "
                      f"turboquant.integration.transformers.PagedKVCache")

from transformers.generation.continuous_batching import cache as cb_cache  # noqa: E402
from transformers.generation.continuous_batching import continuous_api  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    FullAttentionCacheAllocator)
from transformers.generation.continuous_batching.utils import WorkloadHints  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

NAME = "turboquant_cb"
FULL = "full_attention"


@contextlib.contextmanager
def _swapped(module, **names):
    """transformers' cache reads these module globals while it is built: ours, for that time."""
    old = {k: getattr(module, k) for k in names}
    for k, v in names.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


class _Allocator(FullAttentionCacheAllocator):
    """transformers' full-attention allocator (blocks, prefix sharing, forks) over per-layer
    uint8 ranges [blocks, Hkv, page, C]; a request's block ids index every layer's range."""

    key_format = "fp4"

    @classmethod
    def bytes_per_token_head(cls, head_dim: int) -> int:
        return bytes_per_token_head(head_dim, cls.key_format)

    @classmethod
    def get_bytes_per_page(cls, num_key_value_heads, head_dim, cache_dtype, page_size):
        return num_key_value_heads * cls.bytes_per_token_head(head_dim) * page_size

    def layer_view(self, layer_bytes: torch.Tensor, blocks: int) -> torch.Tensor:
        """A layer's uint8 range [blocks x bytes per block] as the layer's cache."""
        return layer_bytes.view(blocks, self.num_key_value_heads, self.tokens_per_page,
                                self.bytes_per_token_head(self.head_dim))

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool):
        self.bytes_per_sector = bytes_per_sector
        blocks = (non_trash_bytes + 2 * bytes_per_sector) // self.bytes_per_block
        per_layer = blocks * self.bytes_per_page  # layer-outermost: a layer is one range
        self.buffers = {layer: self.layer_view(cache_tensor[i * per_layer:(i + 1) * per_layer],
                                               blocks)
                        for i, layer in enumerate(self.layer_indices)}
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)
        self.write_trash_index = -1  # a padding token's slot: not written

    def get_write_indices(self, request_id, past_length, query_length):  # the slots
        table, page = self.block_table[request_id], self.tokens_per_page
        return [table[t // page] * page + t % page
                for t in range(past_length, past_length + query_length)]

    def get_read_indices(self, request_id, past_length, query_length):
        return []  # the kernel reads through the block table

    def fill_block_table(self, request_id, past_length, query_length, block_table):
        ids = self.block_table[request_id]
        block_table[:len(ids)].copy_(torch.tensor(ids, dtype=block_table.dtype))

    def copy_blocks(self, source_block_ids, dest_block_ids):  # forks
        dev = next(iter(self.buffers.values())).device
        src, dst = (torch.tensor(x, dtype=torch.long, device=dev)
                    for x in (source_block_ids, dest_block_ids))
        for buf in self.buffers.values():
            for region in cache_in(buf.view(-1), *buf.shape[:3], self.head_dim,
                                   key_format=self.key_format):
                region.index_copy_(0, dst, region.index_select(0, src))

    def update(self, *args, **kwargs):
        raise NotImplementedError("the turboquant cache is written by its attention function")


class _MemoryHandler(cb_cache.PagedAttentionMemoryHandler):
    """transformers' sizing without the BF16 read-back and the 4D masks this path never makes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_attention_masks = 0
        self.kv_heads_at_peak = 2 * cb_cache.find_num_key_value_heads(self.config)  # K and V

    @property
    def bytes_per_cache_token(self):
        return self.io_multiplier * self.num_groups * 8  # read-index storage only


class _Cache(cb_cache.PagedAttentionCache):
    """transformers' paged cache built with ``_Allocator`` and ``_MemoryHandler``; it also keeps
    which requests a step holds, in order (the rows of the step's block table)."""

    allocator_class = _Allocator

    def __init__(self, *args, key_format: str = "fp4", calibration=None, sink_entries=None,
                 **kwargs):
        alloc = type(f"_Allocator_{key_format}", (self.allocator_class,),
                     {"key_format": key_format})
        with _swapped(cb_cache, FullAttentionCacheAllocator=alloc,
                      PagedAttentionMemoryHandler=_MemoryHandler,
                      group_layers_by_attn_type=lambda cfg: {FULL: list(range(
                          cfg.num_hidden_layers))},
                      ATTN_TYPE_TO_ALLOCATOR={FULL: alloc}):
            super().__init__(*args, **kwargs)
        self.allocator = self.cache_allocators[FULL]
        self.engine = EngineLayers(self.allocator.head_dim, self.allocator.num_key_value_heads,
                                   key_format, calibration, sink_entries)
        self._step_lists, self._rows, self.meta = None, [], None

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index,
                                      write_index):
        if write_index is not self._step_lists:  # a new step: transformers made fresh lists
            self._step_lists, self._rows = write_index, []
        self._rows.append(request_id)
        write_index[0].extend(self.allocator.get_write_indices(request_id, past_length,
                                                               query_length))

    def step_block_table(self, device, num_seqs: int) -> torch.Tensor:
        """int32 [num_seqs, the longest table]: the step's requests, then zero rows for the
        empty sequences transformers pads a step with (static shapes for CUDA graphs)."""
        rows = [self.allocator.block_table[r] for r in self._rows]
        table = torch.zeros(num_seqs, max(map(len, rows)), dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(device, non_blocking=True)


def step_metadata(cache: _Cache, num_tokens: int, cu_seq_lens_q, cu_seq_lens_k, max_length_k,
                  write_index, position_ids, block_table) -> StepMetadata:
    """The step's metadata from what transformers passes layer 0's attention function: in decode
    steps on the fast path its block table (rows = requests, padding rows -1) and the slots
    derived from it on the device; otherwise the write indices (the slots) and the block table
    of the step's requests, built on the host."""
    cu_k = cu_seq_lens_k[FULL]
    seq_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    pos = position_ids[0].long()
    if block_table is not None:  # transformers' decode fast path: no host indices
        table, page = block_table[0], cache.allocator.tokens_per_page
        blk = table.gather(1, (pos // page)[:, None])[:, 0].long()
        slots = torch.where(blk >= 0, blk * page + pos % page, -1)
        return StepMetadata(cu_seq_lens_q.to(torch.int32), seq_lens, table, slots, pos,
                            num_tokens, cache.max_decode_fast_path_length)
    return StepMetadata(cu_seq_lens_q.to(torch.int32), seq_lens,
                        cache.step_block_table(pos.device, seq_lens.shape[0]), write_index[0],
                        pos, num_tokens, int(max_length_k[FULL]))


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              sliding_window=None, softcap=None, s_aux=None, *, cache=None, cu_seq_lens_q=None,
              cu_seq_lens_k=None, max_length_k=None, write_index=None, position_ids=None,
              block_table=None, **kwargs):
    """transformers' attention function "turboquant_cb": query [1, Hq, T, D], key and value
    [1, Hkv, T, D] (the step's T packed tokens) -> [1, T, Hq, D]."""
    if not isinstance(cache, _Cache):
        raise ValueError("cache: the 'turboquant_cb' attention runs in generate_batch of "
                         "turboquant.integration.transformers_batching")
    layer_idx = module.layer_idx
    if layer_idx == 0:  # the step's metadata, for every layer
        cache.meta = step_metadata(cache, query.shape[2], cu_seq_lens_q, cu_seq_lens_k,
                                   max_length_k, write_index, position_ids, block_table)
    return cache.engine.run(layer_idx, query, key, value, cache.allocator.buffers[layer_idx],
                            cache.meta, None, scaling, sliding_window, softcap, s_aux), None


class _Manager(continuous_api.ContinuousBatchingManager):
    """transformers' manager with our attention and cache."""

    def __init__(self, model, generation_config, cb_config: ContinuousBatchingConfig, hints, *,
                 attention: str, cache_factory, decode_fast_path_blocks: int = 0):
        self.attention, self.cache_factory = attention, cache_factory
        if cb_config.use_cuda_graph is not None:
            self._decode_graphs_only(cb_config)
        super().__init__(model, generation_config, cb_config, hints)
        cfg = self.continuous_batching_config
        self._decode_graphs_only(cfg)  # (padding intervals turn graphs on for both)
        if decode_fast_path_blocks:  # (transformers turns it off for attention not flash's)
            cfg.max_blocks_per_request = decode_fast_path_blocks
            if cb_config.use_cuda_graph is None and self.model.device.type == "cuda":
                cfg.use_cuda_graph = (False, True)  # decode steps: nothing on the host

    @staticmethod
    def _decode_graphs_only(cfg: ContinuousBatchingConfig) -> None:
        if cfg.cuda_graph_booleans[0]:
            raise ValueError("continuous_batching_config: use_cuda_graph captures the varlen "
                             "steps, whose block table is built on the host each step; capture "
                             "decode steps only: use_cuda_graph=(False, True)")

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash=True):
        if model.config._attn_implementation != self.attention:
            self._original_attn_impl = model.config._attn_implementation
            model.set_attn_implementation(self.attention)

    def _create_batch_processor(self):
        if self.continuous_batching_config.cpu_offload_space:
            raise ValueError("continuous_batching_config: cpu_offload_space moves blocks as byte "
                             "ranges, which the turboquant cache does not support")
        with _swapped(continuous_api, PagedAttentionCache=self.cache_factory):
            return super()._create_batch_processor()


def generate_batch(model, inputs: Sequence[Sequence[int]], *, kv_cache_dtype: str = "tq_fp4",
                   calibration: Optional[Sequence[tuple]] = None,
                   sink_entries: Optional[int] = None, **kwargs) -> dict:
    """``model.generate_batch(inputs, ...)`` with the KV cache in the format: ``inputs`` token id
    lists; ``calibration`` per layer (m, lam) or None (taken by the first write);
    ``decode_fast_path_blocks``: the most blocks a request holds, > 0 turns transformers' block-
    table decode path on; ``generation_config``, ``continuous_batching_config``,
    ``max_new_tokens`` and the rest as generate_batch's. Returns generate_batch's outputs
    (request id -> output)."""
    if kv_cache_dtype not in KEY_FORMATS:
        raise ValueError(f"kv_cache_dtype: expected one of {sorted(KEY_FORMATS)}, got "
                         f"{kv_cache_dtype!r}")
    cache = functools.partial(_Cache, key_format=KEY_FORMATS[kv_cache_dtype],
                              calibration=calibration, sink_entries=sink_entries)
    return run_batch(model, inputs, NAME, attention, cache, **kwargs)


def run_batch(model, inputs: Sequence[Sequence[int]], name: str, attention_fn, cache_factory, *,
              generation_config=None,
              continuous_batching_config: Optional[ContinuousBatchingConfig] = None,
              max_new_tokens: Optional[int] = None, decode_fast_path_blocks: int = 0,
              **kwargs) -> dict:
    """``model.generate_batch`` with the attention function ``attention_fn`` registered as
    ``name`` (no masks) over the cache ``cache_factory(...)`` makes in place of transformers'
    (a ``_Cache``): ``generate_batch`` is this with turboquant's; benchmarks run other pages
    through the same hook."""
    AttentionInterface.register(name, attention_fn)
    AttentionMaskInterface.register(name, lambda *args, **kw: None)
    gen = generation_config if generation_config is not None else model.generation_config
    new = max_new_tokens if max_new_tokens is not None else gen.max_new_tokens
    hints = WorkloadHints(max(map(len, inputs)), new or 0, len(inputs))
    manager = _Manager(model, gen, continuous_batching_config or ContinuousBatchingConfig(),
                       hints, attention=name, cache_factory=cache_factory,
                       decode_fast_path_blocks=decode_fast_path_blocks)
    model._cached_continuous_batching_manager = manager  # generate_batch takes it from here
    try:
        return model.generate_batch(inputs, generation_config=gen, max_new_tokens=new, **kwargs)
    finally:
        if getattr(model, "_cached_continuous_batching_manager", None) is manager:
            del model._cached_continuous_batching_manager
