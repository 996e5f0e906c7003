"""The problems ``python -m turboquant bench`` times: the bytes each call must move (pure
functions, unit-tested against hand computation), a row's device memory and input sets, and the
builders of the inputs (the FP4 cache written from dense K/V, the decode problem of a row and its
FP4 and SDPA calls, the writer's steady state).

The byte-counting formulas are written out in ``turboquant.bench.run``'s docstring and in
``BYTE_COUNTING`` (which the bench's JSON carries).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import parse_cache_format
from ..shared_state import SharedState
from .timing import Step, sync

BYTE_COUNTING = {
    "fp4": "2*B*L*Hkv*D/2 codes + 2*B*L*Hkv*(D/group) scales + 2*B*Hq*D*elem (Q, O)",
    "sdpa": "2*B*L*Hkv*D*elem (dense K, V) + 2*B*Hq*D*elem (Q, O)",
    "writer": "2*T*Hkv*D*elem input + 2*T*Hkv*D/2 codes + 2*T*Hkv*(D/group) scales",
}


def parse_int(text: str) -> int:
    """``"4k"`` -> 4096 (k, m: binary multiples); a positive integer."""
    t = str(text).strip().lower()
    mult = 1
    if t.endswith("k"):
        mult, t = 1024, t[:-1]
    elif t.endswith("m"):
        mult, t = 1024 * 1024, t[:-1]
    try:
        value = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer like 4096 or 4k, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_int_list(text: str) -> list:
    """``"1,16,1k"`` -> ``[1, 16, 1024]``."""
    return [parse_int(p) for p in text.split(",") if p.strip()]


# --------------------------------------------------------------------------------------------
# byte counting


def _groups(head_dim: int, scale_group: int) -> int:
    group = scale_group or head_dim
    if head_dim % group:
        raise ValueError(f"scale_group: expected a divisor of head_dim {head_dim}, got {group}")
    return head_dim // group


def _key_row_bytes(head_dim: int, key_format: str) -> int:
    return head_dim if key_format == "fp8_e4m3" else head_dim // 2


def fp4_attention_bytes(batch: int, context: int, num_heads: int, num_kv_heads: int,
                        head_dim: int, scale_group: int = 0, q_elem_bytes: int = 2,
                        query_len: int = 1, key_format: str = "fp4") -> int:
    """Bytes a decode call must move: K and V codes + K and V scales + Q read + O written
    (K8V4, ``key_format="fp8_e4m3"``: D key bytes per token and head instead of D/2)."""
    tokens = batch * context
    codes = tokens * num_kv_heads * (_key_row_bytes(head_dim, key_format) + head_dim // 2)
    scales = 2 * tokens * num_kv_heads * _groups(head_dim, scale_group)
    q = batch * query_len * num_heads * head_dim * q_elem_bytes
    return codes + scales + 2 * q


def dense_attention_bytes(batch: int, context: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, elem_bytes: int = 2, query_len: int = 1) -> int:
    """Bytes SDPA on a dense cache must move: K + V + Q read + O written."""
    kv = 2 * batch * context * num_kv_heads * head_dim * elem_bytes
    q = batch * query_len * num_heads * head_dim * elem_bytes
    return kv + 2 * q


def writer_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, scale_group: int = 0,
                 in_elem_bytes: int = 2, key_format: str = "fp4") -> int:
    """Bytes the cache writer must move: K + V input read + codes + scales written."""
    read = 2 * num_tokens * num_kv_heads * head_dim * in_elem_bytes
    codes = num_tokens * num_kv_heads * (_key_row_bytes(head_dim, key_format) + head_dim // 2)
    scales = 2 * num_tokens * num_kv_heads * _groups(head_dim, scale_group)
    return read + codes + scales


def fp4_cache_bytes(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                    scale_group: int = 0, key_format: str = "fp4") -> int:
    """Bytes allocated for the K+V codes and K+V scales of ``num_blocks`` blocks."""
    per_token = num_kv_heads * (_key_row_bytes(head_dim, key_format) + head_dim // 2
                                + 2 * _groups(head_dim, scale_group))
    return num_blocks * block_size * per_token


def state_bytes(batch: int, num_kv_heads: int, head_dim: int, config) -> int:
    """What the reader takes from the state records: lam (and the sink's key and value), fp32."""
    if not config.uses_state:
        return 0
    return batch * num_kv_heads * head_dim * 4 * (1 + 2 * config.sink)


# --------------------------------------------------------------------------------------------
# a row: its shape, format, memory and input sets


@dataclass
class Row:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    context: int


def torch_dtype(name: str) -> torch.dtype:
    """``--dtype`` name -> torch dtype."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def cache_config(name: str, args) -> tuple:
    """The cache format ``name`` (a QuantConfig name, or ``k8v4[/NAME]``) with the bench's
    scale group -> (QuantConfig, key_format)."""
    config, key_format = parse_cache_format(name)
    if key_format == "fp8_e4m3" and args.scale_group:
        raise ValueError(f"--configs {name}: K8V4 has one scale per (token, head); drop "
                         f"--scale-group {args.scale_group}")
    return dataclasses.replace(config, scale_group=args.scale_group or None), key_format


def row_memory(row: Row, n_sets: int, block_size: int, scale_group: int, elem: int,
               sdpa: bool, gqa: bool, chunk_bytes: int, key_format: str = "fp4") -> int:
    """Device bytes a row needs: FP4 cache, dense cache, Q/O, block tables, work space."""
    nblk = math.ceil(row.context / block_size)
    fp4 = fp4_cache_bytes(n_sets * row.batch * nblk, row.num_kv_heads, block_size,
                          row.head_dim, scale_group, key_format)
    dense = 2 * n_sets * row.batch * row.num_kv_heads * row.context * row.head_dim * elem
    if sdpa and not gqa:  # the repeated copy exists next to the kv-head cache for a moment
        dense += dense * row.num_heads // row.num_kv_heads
    qo = 4 * n_sets * row.batch * row.num_heads * row.head_dim * elem
    tables = n_sets * row.batch * nblk * 4
    work = 3 * chunk_bytes + 256 * 2**20  # writer chunk copies + slots, kernel workspaces
    return fp4 + dense + qo + tables + work


def sets_for(row: Row, args, l2_bytes: int, key_format: str = "fp4") -> int:
    """How many independent input sets the row rotates among: enough that one pass over them
    holds at least ``args.l2_multiple`` L2 sizes of FP4 bytes (1 without an L2 figure)."""
    nblk = math.ceil(row.context / args.block_size)
    set_fp4 = fp4_cache_bytes(row.batch * nblk, row.num_kv_heads, args.block_size,
                              row.head_dim, args.scale_group, key_format)
    if not l2_bytes:
        return 1
    return max(1, math.ceil(args.l2_multiple * l2_bytes / set_fp4))


# --------------------------------------------------------------------------------------------
# building the inputs


def checks_off(tq):
    """``turboquant.value_checks(False)`` for the duration, restoring the previous setting."""
    return tq.value_checks(False)


def fill_cache(tq, cache, config, dense_k: torch.Tensor, dense_v: torch.Tensor,
               tables: torch.Tensor, block_size: int, chunk_bytes: int):
    """Write the dense K/V [num_seqs, Hkv, L, D] into ``cache`` through ``tables``
    [num_seqs, L / block_size] with the "auto" writer, a chunk of sequences at a time. -> the
    state (``state_kwargs`` turns it into arguments): None (the config keeps none), the layer's
    shared state, or with "sequence" smoothing the per-sequence records, sequence i's in slot i."""
    nseq, hkv, length, d = dense_k.shape
    device = dense_k.device
    per_seq = 2 * length * hkv * d * dense_k.element_size()
    spc = max(1, chunk_bytes // per_seq)
    pos = torch.arange(length, device=device)
    state = None
    if config.shares_state:
        state = tq.allocate_shared_state(hkv, d, cache[0].shape[0], device=device)
    elif config.uses_state:
        state = tq.allocate_state(nseq, hkv, d, device)
    with checks_off(tq):
        for i0 in range(0, nseq, spc):
            i1 = min(nseq, i0 + spc)
            k = dense_k[i0:i1].permute(0, 2, 1, 3).reshape(-1, hkv, d)
            v = dense_v[i0:i1].permute(0, 2, 1, 3).reshape(-1, hkv, d)
            slots = (tables[i0:i1][:, pos // block_size].long() * block_size
                     + pos % block_size).reshape(-1)
            extra = {}
            if state is not None:
                ids = torch.arange(i0, i1, device=device, dtype=torch.int32)
                extra = dict(state_kwargs(state, ids.repeat_interleave(length)),
                             positions=pos.repeat(i1 - i0))
            tq.reshape_and_cache_fp4(k, v, *cache, slots, config=config, **extra)
            del k, v, slots, extra
    sync(device)
    return state


def state_kwargs(state, ids: torch.Tensor) -> dict:
    """The state arguments of a call (``fill_cache``'s state; ``ids`` int32: each sequence's
    or token's slot, used only by per-sequence records)."""
    if state is None:
        return {}
    if isinstance(state, SharedState):
        return {"shared_state": state}
    return {"seq_state": state, "state_ids": ids}


@dataclass
class DecodeProblem:
    """``n_sets`` independent input sets of one decode row (batch B, context L): set s is
    sequences s*B .. s*B + B - 1 of the dense K/V and of the FP4 cache written from them."""
    dense_k: Optional[torch.Tensor]  # [n_sets * B, Hkv, L, D]; None once SDPA has its copy
    dense_v: Optional[torch.Tensor]
    query: torch.Tensor  # [n_sets, B, Hq, D]
    out: torch.Tensor  # FP4 outputs, like query
    cache: tuple  # codes and scales of every set's blocks (tq.allocate_cache)
    block_tables: torch.Tensor  # [n_sets, B, ceil(L / block)] int32, a random permutation
    seq_lens: torch.Tensor  # [B] int32, all L
    scale: float
    config: object  # QuantConfig
    set_kwargs: list  # per set: paged_attention_fp4's config (and state) arguments

    @property
    def n_sets(self) -> int:
        return self.query.shape[0]


def build_decode_problem(tq, row: Row, n_sets: int, config, key_format: str,
                         dtype: torch.dtype, block_size: int, scale_group: int, seed: int,
                         device: torch.device, chunk_bytes: int) -> DecodeProblem:
    """Random normal dense K/V and queries for ``n_sets`` sets, the FP4 cache written from the
    dense K/V (``fill_cache``) through a random permutation of the physical blocks."""
    hq, hkv, d = row.num_heads, row.num_kv_heads, row.head_dim
    B, L = row.batch, row.context
    nblk = math.ceil(L / block_size)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1000003 + hq * 7919 + B * 131 + L)
    nseq = n_sets * B
    total_blocks = nseq * nblk
    dense_k = torch.randn(nseq, hkv, L, d, device=device, dtype=dtype, generator=gen)
    dense_v = torch.randn(nseq, hkv, L, d, device=device, dtype=dtype, generator=gen)
    query = torch.randn(n_sets, B, hq, d, device=device, dtype=dtype, generator=gen)
    cache = tq.allocate_cache(total_blocks, hkv, block_size, d, scale_group=scale_group or None,
                              device=device, key_format=key_format)
    perm = torch.randperm(total_blocks, device=device, generator=gen).to(torch.int32)
    block_tables = perm.view(n_sets, B, nblk)
    state = fill_cache(tq, cache, config, dense_k, dense_v, block_tables.view(nseq, nblk),
                       block_size, chunk_bytes)

    def attn_kwargs(s):
        ids = torch.arange(s * B, (s + 1) * B, device=device, dtype=torch.int32)
        return {"config": config, **state_kwargs(state, ids)}

    return DecodeProblem(
        dense_k=dense_k, dense_v=dense_v, query=query, out=torch.empty_like(query),
        cache=cache, block_tables=block_tables,
        seq_lens=torch.full((B,), L, device=device, dtype=torch.int32),
        scale=1.0 / math.sqrt(d), config=config,
        set_kwargs=[attn_kwargs(s) for s in range(n_sets)])


def fp4_steps(tq, p: DecodeProblem, backend: str, max_seq_len: int) -> list:
    """One ``Step`` per set: ``paged_attention_fp4`` of a query [B, Hq, D] over set s's blocks,
    written into the given ``out`` (returned)."""
    def step(s: int) -> Step:
        bt, kw = p.block_tables[s], p.set_kwargs[s]

        def f(q: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
            return tq.paged_attention_fp4(q, *p.cache, bt, p.seq_lens, p.scale, out=out,
                                          backend=backend, max_seq_len=max_seq_len, **kw)
        return f

    return [step(s) for s in range(p.n_sets)]


def sdpa_steps(p: DecodeProblem, gqa: bool) -> list:
    """One ``Step`` per set: ``scaled_dot_product_attention`` of a query [B, Hq, 1, D] over set
    s's dense K/V, ``enable_gqa=True`` (``gqa`` False: over K/V repeated to the query heads,
    materialised here, outside any timing). SDPA has no ``out=``: a step ignores the buffer it
    is given and returns the tensor SDPA allocates."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    B = p.query.shape[1]
    if gqa:
        ks, vs = p.dense_k, p.dense_v
        kw = {"enable_gqa": True}
    else:  # older torch: materialise the GQA repeat
        g = p.query.shape[2] // p.dense_k.shape[1]
        ks = p.dense_k.repeat_interleave(g, dim=1)
        vs = p.dense_v.repeat_interleave(g, dim=1)
        kw = {}

    def step(s: int) -> Step:
        k4, v4 = ks[s * B:(s + 1) * B], vs[s * B:(s + 1) * B]

        def f(q: torch.Tensor, _out: Optional[torch.Tensor] = None) -> torch.Tensor:
            return sdpa(q, k4, v4, scale=p.scale, **kw)
        return f

    return [step(s) for s in range(p.n_sets)]


def writer_state(tq, key, value, cache, slots, config, sequences: int = 64) -> dict:
    """For a writer timed in its steady state: the tokens of ``key``/``value`` [T, Hkv, D]
    belong to ``sequences`` equal runs whose state records (if ``config`` keeps them) are filled
    by one first write, untimed; -> the state arguments of the timed writes (no positions: no
    record is filled again, no sink entered), or {}."""
    if not config.uses_state:
        return {}
    T, hkv, d = key.shape
    if config.needs_slots:
        state = tq.allocate_state(sequences, hkv, d, key.device)
    else:
        state = tq.allocate_shared_state(hkv, d, cache[0].shape[0], device=key.device)
    pos = torch.arange(T, device=key.device)
    ids = (pos * sequences // T).to(torch.int32)
    first = (ids.long() * T + sequences - 1) // sequences  # each run's first token
    with checks_off(tq):
        tq.reshape_and_cache_fp4(key, value, *cache, slots, config=config,
                                 positions=pos - first, **state_kwargs(state, ids))
    return state_kwargs(state, ids)
