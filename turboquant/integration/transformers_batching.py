"""turboquant in transformers' continuous batching (``generate_batch``; transformers 5.23 and
5.17): the paged KV cache transformers allocates holds the format's bytes instead of BF16.

    from turboquant.integration.transformers_batching import generate_batch
    outputs = generate_batch(model, [ids_1, ids_2, ...], max_new_tokens=128)  # kv_cache_dtype=

transformers keeps its scheduler, its cache's sizing, blocks, prefix sharing and forks; the cache
holds the format's bytes (``transformers_cb_cache``). The attention function "turboquant_cb"
writes each step's tokens and runs ``paged_attention_fp4`` with the step's block table: on the
varlen path the block table of the step's requests, built on the host; on transformers' decode
path (``decode_fast_path_blocks``) its own block table, from which the slots are derived on the
device, so decode steps build no host indices and are replayed from CUDA graphs on a GPU
(varlen steps are not captured). Forks (``num_return_sequences``) copy blocks region by region;
CPU offload of blocks (byte ranges) is refused. One group: sliding windows are applied by the
kernels over full-length caches.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from transformers import AttentionInterface, ContinuousBatchingConfig
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.utils import WorkloadHints
from transformers.masking_utils import AttentionMaskInterface

from .transformers_cb_cache import FULL, Cache, swapped
from .vllm.layer import KEY_FORMATS, StepMetadata

NAME = "turboquant_cb"


def step_metadata(cache: Cache, num_tokens: int, cu_seq_lens_q, cu_seq_lens_k, max_length_k,
                  write_index, position_ids, block_table) -> StepMetadata:
    """The step's metadata from what transformers passes layer 0's attention function
    (``cu_seq_lens_k`` and ``max_length_k`` per attention type in 5.23, plain in 5.17): in
    decode steps on the fast path its block table (rows = requests, padding rows -1) and the
    slots derived from it on the device; otherwise the write indices (the slots) and the block
    table of the step's requests, built on the host."""
    cu_k = cu_seq_lens_k[FULL] if isinstance(cu_seq_lens_k, dict) else cu_seq_lens_k
    seq_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    pos = position_ids[0].long()
    if block_table is not None:  # transformers' decode fast path: no host indices
        table, page = block_table[0], cache.page_size
        blk = table.gather(1, (pos // page)[:, None])[:, 0].long()
        slots = torch.where(blk >= 0, blk * page + pos % page, -1)
        return StepMetadata(cu_seq_lens_q.to(torch.int32), seq_lens, table, slots, pos,
                            num_tokens, cache.decode_path_length)
    max_k = max_length_k[FULL] if isinstance(max_length_k, dict) else max_length_k
    return StepMetadata(cu_seq_lens_q.to(torch.int32), seq_lens,
                        cache.step_block_table(pos.device, seq_lens.shape[0]), write_index[0],
                        pos, num_tokens, int(max_k))


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              sliding_window=None, softcap=None, s_aux=None, *, cache=None, cu_seq_lens_q=None,
              cu_seq_lens_k=None, max_length_k=None, max_seqlen_k=None, write_index=None,
              position_ids=None, block_table=None, **kwargs):
    """transformers' attention function "turboquant_cb": query [1, Hq, T, D], key and value
    [1, Hkv, T, D] (the step's T packed tokens) -> [1, T, Hq, D]. (``max_seqlen_k``: 5.17's
    name of ``max_length_k``.)"""
    if not isinstance(cache, Cache):
        raise ValueError("cache: the 'turboquant_cb' attention runs in generate_batch of "
                         "turboquant.integration.transformers_batching")
    layer_idx = module.layer_idx
    if layer_idx == 0:  # the step's metadata, for every layer
        cache.meta = step_metadata(cache, query.shape[2], cu_seq_lens_q, cu_seq_lens_k,
                                   max_length_k if max_length_k is not None else max_seqlen_k,
                                   write_index, position_ids, block_table)
    return cache.engine.run(layer_idx, query, key, value, cache.buffers[layer_idx],
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

    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if model.config._attn_implementation != self.attention:
            self._original_attn_impl = model.config._attn_implementation
            model.set_attn_implementation(self.attention)

    def _create_batch_processor(self):
        if self.continuous_batching_config.cpu_offload_space != 0:  # (None: sized by transformers)
            raise ValueError("continuous_batching_config: cpu_offload_space moves blocks as byte "
                             "ranges, which the turboquant cache does not support; expected 0")
        with swapped(continuous_api, PagedAttentionCache=self.cache_factory):
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
    cache = functools.partial(Cache, key_format=KEY_FORMATS[kv_cache_dtype],
                              calibration=calibration, sink_entries=sink_entries)
    return run_batch(model, inputs, NAME, attention, cache, **kwargs)


def run_batch(model, inputs: Sequence[Sequence[int]], name: str, attention_fn, cache_factory, *,
              generation_config=None,
              continuous_batching_config: Optional[ContinuousBatchingConfig] = None,
              max_new_tokens: Optional[int] = None, decode_fast_path_blocks: int = 0,
              **kwargs) -> dict:
    """``model.generate_batch`` with the attention function ``attention_fn`` registered as
    ``name`` (no masks) over the cache ``cache_factory(...)`` makes in place of transformers'
    (a ``transformers_cb_cache.Cache``): ``generate_batch`` is this with turboquant's; benchmarks
    run other pages through the same hook."""
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
