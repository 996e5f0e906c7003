"""Allocating an FP4 paged cache, and building random paged problems (main job, tests, bench)."""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch

from .config import QuantConfig
from .format import MX_GROUP


class FP4Cache(NamedTuple):
    # uint8 [num_blocks, num_kv_heads, block_size, D/2]; K8V4: float8_e4m3fn [..., D]
    key_cache: torch.Tensor
    value_cache: torch.Tensor  # uint8 [num_blocks, num_kv_heads, block_size, D/2]
    key_scales: torch.Tensor  # uint8 [num_blocks, block_size, num_kv_heads(, D/32)]
    value_scales: torch.Tensor  # same shape as key_scales


def _layout(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
            scale_group: Optional[int], key_format: str) -> tuple:
    """The byte shapes of the cache's four tensors (key codes, value codes, key scales, value
    scales), the arguments checked."""
    if key_format not in ("fp4", "fp8_e4m3"):
        raise ValueError(f"key_format: expected 'fp4' or 'fp8_e4m3', got {key_format!r}")
    if key_format == "fp8_e4m3" and scale_group not in (None, head_dim):
        raise ValueError(f"scale_group: a K8V4 cache (key_format='fp8_e4m3') has one scale per "
                         f"(token, head), got {scale_group}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim: expected an even head dim (two FP4 codes per byte), "
                         f"got {head_dim}")
    if scale_group == MX_GROUP and head_dim % MX_GROUP:
        raise ValueError(f"scale_group: per-{MX_GROUP} scales need a head dim divisible by "
                         f"{MX_GROUP}, got {head_dim}")
    shape = (num_blocks, num_kv_heads, block_size, head_dim // 2)
    sshape = (num_blocks, block_size, num_kv_heads)
    if scale_group not in (None, head_dim):
        if scale_group != MX_GROUP:
            raise ValueError(f"scale_group: expected None, {head_dim} or {MX_GROUP}, "
                             f"got {scale_group}")
        sshape += (head_dim // MX_GROUP,)
    kshape = shape[:3] + (head_dim,) if key_format == "fp8_e4m3" else shape
    return kshape, shape, sshape, sshape


def _as_cache(tensors: list, key_format: str) -> FP4Cache:
    """The four uint8 tensors of ``_layout`` as the cache (K8V4 keys viewed as E4M3)."""
    if key_format == "fp8_e4m3":
        tensors[0] = tensors[0].view(torch.float8_e4m3fn)
    return FP4Cache(*tensors)


def allocate_cache(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, *,
                   scale_group: Optional[int] = None, device="cpu", fill: int = 0,
                   key_format: str = "fp4") -> FP4Cache:
    """An FP4 paged cache. ``scale_group`` None (or head_dim): one scale per (token, head);
    32: one per 32 elements. ``fill`` sets every byte (0xFF poisons unwritten slots).
    ``key_format="fp8_e4m3"``: a K8V4 cache, E4M3 key bytes (torch.float8_e4m3fn
    [num_blocks, num_kv_heads, block_size, D]) with one scale per (token, head), FP4 values."""
    shapes = _layout(num_blocks, num_kv_heads, block_size, head_dim, scale_group, key_format)
    return _as_cache([torch.full(s, fill, dtype=torch.uint8, device=device) for s in shapes],
                     key_format)


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, scale_group: Optional[int] = None,
                       key_format: str = "fp4") -> int:
    """Bytes of K plus V (codes and scales) one token occupies in the cache."""
    groups = 1 if scale_group in (None, head_dim) else head_dim // scale_group
    key_bytes = head_dim if key_format == "fp8_e4m3" else head_dim // 2
    return num_kv_heads * (key_bytes + head_dim // 2 + 2 * groups)


def cache_in(buffer: torch.Tensor, num_blocks: int, num_kv_heads: int, block_size: int,
             head_dim: int, *, key_format: str = "fp4") -> FP4Cache:
    """The cache (one scale per (token, head)) as four views of one engine-allocated layer
    buffer, region after region: key codes, value codes, key scales, value scales, each a
    contiguous tensor of ``allocate_cache``'s shape. ``buffer``: contiguous uint8 holding
    exactly num_blocks * block_size * ``kv_bytes_per_token`` bytes, any shape (vLLM's
    [num_blocks, page_bytes]). A block's bytes are not contiguous in the buffer: an engine that
    copies blocks as byte ranges (KV offload, transfer connectors) cannot use this layout."""
    shapes = _layout(num_blocks, num_kv_heads, block_size, head_dim, None, key_format)
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or \
            not buffer.is_contiguous():
        raise ValueError("buffer: expected a contiguous uint8 tensor")
    want = num_blocks * block_size * kv_bytes_per_token(num_kv_heads, head_dim,
                                                        key_format=key_format)
    if buffer.numel() != want:
        raise ValueError(f"buffer: expected {want} bytes ({num_blocks} blocks of {block_size} "
                         f"tokens, {num_kv_heads} kv heads, D {head_dim}, {key_format}), got "
                         f"{buffer.numel()}")
    if (block_size * num_kv_heads) % 16:
        raise ValueError(f"block_size: block_size x num_kv_heads must be a multiple of 16 (each "
                         f"region starts 16-byte aligned), got {block_size} x {num_kv_heads}")
    flat, views, at = buffer.view(-1), [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[at:at + n].view(shape))
        at += n
    return _as_cache(views, key_format)


class PagedProblem(NamedTuple):
    """A filled paged cache with its dense (unquantized) K/V, ready for attention."""

    cache: FP4Cache
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    keys: list  # per sequence: [seq_len, num_kv_heads, D] in the source dtype
    values: list  # per sequence: [seq_len, num_kv_heads, D]
    kwargs: dict  # what paged_attention_fp4 needs besides the tensors: config, and shared_state
    #               or seq_state and state_ids

    def state_records(self) -> Optional[torch.Tensor]:
        return state_records(self.kwargs, self.cache, self.block_tables, self.seq_lens)


def state_records(kwargs: dict, cache: tuple, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor) -> Optional[torch.Tensor]:
    """The record each sequence of a call is read with, float32 [num_seqs, Hkv, 5, D] (None: the
    config keeps no state), from the call's ``kwargs`` (config, and shared_state or seq_state
    and state_ids): built from the shared state, or the sequence's own record."""
    if "shared_state" in kwargs:
        from .shared_state import records

        cfg = kwargs["config"]
        return records(kwargs["shared_state"], tuple(cache), block_tables, seq_lens,
                       cfg.scale_group, smooth=cfg.key_smoothing is not None)
    if "seq_state" in kwargs:
        return kwargs["seq_state"][kwargs["state_ids"].long()]
    return None


def build_paged_problem(seq_lens, num_kv_heads: int, head_dim: int, block_size: int, *,
                        dtype=torch.bfloat16, device="cpu", scale_group=None, spare_blocks=0,
                        poison: bool = True, generator=None, write_backend: str = "auto",
                        kv_factory=None, config: Optional[QuantConfig] = None,
                        key_format: str = "fp4") -> PagedProblem:
    """Random K/V for each sequence, written through ``reshape_and_cache_fp4`` with ``config``
    (default ``QuantConfig()``; ``scale_group``, when given, replaces its scale group) into blocks in
    shuffled order; the state (if the config keeps one) is a shared state, or with "sequence"
    smoothing the per-sequence records, sequence s's in slot ``num_seqs - 1 - s``. With
    ``poison``, every byte not written (unused slots of the last blocks, spare blocks, block
    table padding is -1) is 0xFF, i.e. NaN scales. ``key_format``: as for ``allocate_cache``."""
    from .api import reshape_and_cache_fp4
    from .shared_state import allocate_shared_state
    from .smoothing import allocate_state

    config = config or QuantConfig()
    if scale_group is None:
        scale_group = config.scale_group
    config = dataclasses.replace(config, scale_group=None if scale_group in (None, head_dim) else
                                 scale_group)

    seq_lens = [int(n) for n in seq_lens]
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    cache = allocate_cache(max(num_blocks, 1), num_kv_heads, block_size, head_dim,
                           scale_group=scale_group, device=device, fill=0xFF if poison else 0,
                           key_format=key_format)
    perm = torch.randperm(max(num_blocks, 1), generator=generator).tolist()
    width = max(blocks_per_seq + [1])
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    keys, values, slots, positions = [], [], [], []
    used = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = perm[used:used + nb]
        used += nb
        table[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        shape = (n, num_kv_heads, head_dim)
        if kv_factory is None:
            k = torch.randn(shape, generator=generator).to(dtype)
            v = torch.randn(shape, generator=generator).to(dtype)
        else:
            k, v = kv_factory(s, shape)
        keys.append(k.to(device))
        values.append(v.to(device))
        pos = torch.arange(n)
        slots.append(table[s, pos // block_size].long() * block_size + pos % block_size)
        positions.append(pos)
    kwargs = {"config": config}
    write_kwargs = {}
    if config.shares_state:
        kwargs["shared_state"] = allocate_shared_state(num_kv_heads, head_dim, max(num_blocks, 1),
                                                       device=device)
        write_kwargs = {"shared_state": kwargs["shared_state"],
                        "positions": torch.cat(positions).to(device)}
    elif config.uses_state:
        num_seqs = len(seq_lens)
        slot_of = torch.arange(num_seqs - 1, -1, -1, dtype=torch.int32)
        kwargs["seq_state"] = allocate_state(max(num_seqs, 1), num_kv_heads, head_dim, device)
        kwargs["state_ids"] = slot_of.to(device)
        write_kwargs = {"seq_state": kwargs["seq_state"], "positions": torch.cat(positions).to(device),
                        "state_ids": torch.repeat_interleave(slot_of, torch.tensor(seq_lens)
                                                             ).to(device)}
    if sum(seq_lens):
        reshape_and_cache_fp4(torch.cat(keys), torch.cat(values), *cache,
                              torch.cat(slots).to(device), config=config,
                              backend=write_backend, **write_kwargs)
    return PagedProblem(cache, table.to(device), torch.tensor(seq_lens, dtype=torch.int32,
                                                                 device=device), keys, values,
                        kwargs)
