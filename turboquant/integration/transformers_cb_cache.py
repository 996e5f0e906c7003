"""The paged cache of transformers' continuous batching holding turboquant's bytes: what
``transformers_batching`` builds in place of transformers' BF16 cache, for the transformers
versions it knows (5.23 and 5.17; others raise on import).

transformers owns its cache: sizing from free memory, blocks, prefix sharing, forks. Kept; what
changes is what a block holds: each layer's part is one uint8 range ``[blocks, Hkv, page, C]``
(C = D + 2 for FP4, 3 D / 2 + 2 for K8V4: ``integration.vllm.layer``'s engine layer reads it
as the cache's four regions), so a block costs the format's bytes and the sizing counts them,
without the BF16 read-back and the masks this path never makes. Forks copy blocks region by
region. Each step's requests are kept in order (the rows of the step's block table); a padding
token's slot is -1 (not written).

- 5.23: one byte tensor cut by an allocator per attention type: ``Allocator`` (a subclass of
  its full-attention allocator) lays the layers out one range each; ``MemoryHandler`` sizes it.
- 5.17: per-layer K and V tensors allocated by the cache itself: they are made empty (head dim 0
  while it is built) and one byte tensor holds the layers' ranges; ``MemoryHandler`` solves
  5.17's sizing equation with the format's bytes per token.
Both are built by swapping, while the cache is made, the module globals it reads.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import transformers

from ..cache import cache_in
from .transformers import EngineLayers
from .vllm.layer import bytes_per_token_head

VERSION = transformers.__version__[:4]
VERSIONS = ("5.17", "5.23")
if VERSION not in VERSIONS:
    raise ImportError(f"turboquant's continuous batching knows the internals of transformers "
                      f"{' and '.join(VERSIONS)}, found {transformers.__version__}; model.generate "
                      f"works on any version through turboquant.integration.transformers."
                      f"PagedKVCache")

from transformers.generation.continuous_batching import cache as cb_cache  # noqa: E402

FULL = "full_attention"


@contextlib.contextmanager
def swapped(module, **names):
    """transformers' cache reads these module globals while it is built: ours, for that time."""
    old = {k: getattr(module, k) for k in names}
    for k, v in names.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def copy_blocks(buffers: dict, head_dim: int, key_format: str, source: list, dest: list) -> None:
    """Forks: blocks ``source`` copied onto ``dest`` in every layer, region by region."""
    dev = next(iter(buffers.values())).device
    src, dst = (torch.tensor(x, dtype=torch.long, device=dev) for x in (source, dest))
    for buf in buffers.values():
        for region in cache_in(buf.view(-1), *buf.shape[:3], head_dim, key_format=key_format):
            region.index_copy_(0, dst, region.index_select(0, src))


class _StepRows:
    """What both versions' caches add: the engine layers, and each step's requests in order."""

    def _start(self, head_dim: int, num_kv_heads: int, key_format: str, calibration,
               sink_entries: Optional[int]) -> None:
        self.engine = EngineLayers(head_dim, num_kv_heads, key_format, calibration, sink_entries)
        self._step_lists, self._rows, self.meta = None, [], None

    def _keep(self, request_id, write_index) -> None:
        if write_index is not self._step_lists:  # a new step: transformers made fresh lists
            self._step_lists, self._rows = write_index, []
        self._rows.append(request_id)

    def step_block_table(self, device, num_seqs: int) -> torch.Tensor:
        """int32 [num_seqs, the longest table]: the step's requests, then zero rows for the
        empty sequences transformers pads a step with (static shapes for CUDA graphs)."""
        rows = [self.block_ids(r) for r in self._rows]
        table = torch.zeros(num_seqs, max(map(len, rows)), dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(device, non_blocking=True)

    def update(self, *args, **kwargs):
        raise NotImplementedError("the turboquant cache is written by its attention function")


if VERSION == "5.23":
    from transformers.generation.continuous_batching.cache_allocators import (
        FullAttentionCacheAllocator)

    class Allocator(FullAttentionCacheAllocator):
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
            self.buffers = {layer: self.layer_view(
                cache_tensor[i * per_layer:(i + 1) * per_layer], blocks)
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

        def copy_blocks(self, source_block_ids, dest_block_ids):
            copy_blocks(self.buffers, self.head_dim, self.key_format, source_block_ids,
                        dest_block_ids)

    class MemoryHandler(cb_cache.PagedAttentionMemoryHandler):
        """5.23's sizing without the BF16 read-back and the 4D masks this path never makes."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.num_attention_masks = 0
            self.kv_heads_at_peak = 2 * cb_cache.find_num_key_value_heads(self.config)  # K, V

        @property
        def bytes_per_cache_token(self):
            return self.io_multiplier * self.num_groups * 8  # read-index storage only

    class Cache(_StepRows, cb_cache.PagedAttentionCache):
        """5.23's paged cache built with ``Allocator`` and ``MemoryHandler``."""

        allocator_class = Allocator

        def __init__(self, *args, key_format: str = "fp4", calibration=None,
                     sink_entries=None, **kwargs):
            alloc = type(f"Allocator_{key_format}", (self.allocator_class,),
                         {"key_format": key_format})
            with swapped(cb_cache, FullAttentionCacheAllocator=alloc,
                         PagedAttentionMemoryHandler=MemoryHandler,
                         group_layers_by_attn_type=lambda cfg: {FULL: list(range(
                             cfg.num_hidden_layers))},
                         ATTN_TYPE_TO_ALLOCATOR={FULL: alloc}):
                super().__init__(*args, **kwargs)
            self.allocator = self.cache_allocators[FULL]
            self.buffers = self.allocator.buffers
            self.page_size = self.allocator.tokens_per_page
            self._start(self.allocator.head_dim, self.allocator.num_key_value_heads, key_format,
                        calibration, sink_entries)

        @property
        def decode_path_length(self) -> int:
            return self.max_decode_fast_path_length

        def block_ids(self, request_id) -> list:
            return self.allocator.block_table[request_id]

        def extend_read_and_write_indices(self, request_id, past_length, query_length,
                                          read_index, write_index):
            self._keep(request_id, write_index)
            write_index[0].extend(self.allocator.get_write_indices(request_id, past_length,
                                                                   query_length))

else:  # 5.17
    _find_head_dim = cb_cache.find_head_dim

    class MemoryHandler(cb_cache.PagedAttentionMemoryHandler):
        """5.17's sizing with the real head dim, the format's bytes per cache token, no
        read-back and no mask."""

        token_bytes = 0  # one token's K and V bytes in one layer, set per cache

        def __init__(self, *args, **kwargs):
            with swapped(cb_cache, find_head_dim=_find_head_dim):
                super().__init__(*args, **kwargs)
            self.num_attention_masks = 0

        def infer_max_batch_tokens_and_num_blocks(self):
            with swapped(cb_cache, find_head_dim=_find_head_dim):
                return super().infer_max_batch_tokens_and_num_blocks()

        @property
        def activation_peak(self):
            peaks = super().activation_peak
            peaks["attention"] = (peaks["attention"][0], 0, 0, 0)  # pages are read in place
            return peaks

        def _equation_coefficients(self, peak_deltas):
            cm, cn, cmn, cmm = super()._equation_coefficients(peak_deltas)
            cn += self.group_size * (self.token_bytes -
                                     2 * self.page_size * self.cache_dtype.itemsize)
            return cm, cn, cmn, cmm

    class Cache(_StepRows, cb_cache.PagedAttentionCache):
        """5.17's paged cache with empty K/V tensors and the format's bytes beside them."""

        def __init__(self, *args, key_format: str = "fp4", calibration=None,
                     sink_entries=None, **kwargs):
            config = kwargs.get("config", args[0] if args else None)
            d, hkv = _find_head_dim(config), cb_cache.find_num_kv_heads(config)
            c = bytes_per_token_head(d, key_format)
            handler = type("MemoryHandler_fmt", (MemoryHandler,), {"token_bytes": hkv * c})
            n = config.num_hidden_layers
            with swapped(cb_cache, find_head_dim=lambda cfg: 0,
                         PagedAttentionMemoryHandler=handler,
                         group_layers_by_attn_type=lambda cfg: ([list(range(n))], [FULL])):
                super().__init__(*args, **kwargs)
            self.head_dim, self.key_format = d, key_format  # (the offload sizing reads head_dim)
            self.write_trash_index = -1  # a padding token's slot: not written
            per_layer = self.num_blocks * hkv * self.block_size * c
            self.cache_bytes = torch.empty(n * per_layer, dtype=torch.uint8, device=self.device)
            self.buffers = {i: self.cache_bytes[i * per_layer:(i + 1) * per_layer].view(
                self.num_blocks, hkv, self.block_size, c) for i in range(n)}
            self.page_size = self.block_size
            self._start(d, hkv, key_format, calibration, sink_entries)

        @property
        def decode_path_length(self) -> int:
            return self.max_blocks_per_request * self.block_size

        def block_ids(self, request_id) -> list:
            return self.group_cache_managers[0].block_table[request_id]

        def extend_read_and_write_indices(self, request_id, past_length, query_length,
                                          read_index, write_index):
            self._keep(request_id, write_index)
            super().extend_read_and_write_indices(  # 5.17's write indices are the slots
                request_id, past_length, query_length, None, write_index)

        def copy_cache(self, list_source_blocks, list_forked_blocks):
            copy_blocks(self.buffers, self.head_dim, self.key_format, list_source_blocks,
                        list_forked_blocks)
