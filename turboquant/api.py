"""The public API: the ops' policy above the checked calls of ``turboquant.calls`` (the
config a cache is bound to, the writer's state, the shared state's records), and backend
dispatch. Argument validation and its two kinds (metadata and value checks): ``calls``."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import registry
from .calls import (INDEX_DTYPES, check_device, check_num_decodes, check_output, check_shape,
                    check_tensor, make_attention_call, make_cache_write, values_checkable)
from .config import QuantConfig
from .registry import AttentionCall, CacheWrite
from .rotation import rotation_signs
from .shared_state import (SharedState, check_shared_state, enter_sinks, layer_record,
                           take_smoothing, writer_records)
from .smoothing import KEY_SCALE, STATE_ROWS, check_smoothing, init_state
from .tensor_facts import TensorFacts


def _check_config(config, group: int, head_dim: int) -> QuantConfig:
    """The config to use (None: the default); its scale group must match the scale tensors'
    layout (the default config takes its scale group from them)."""
    if config is None:
        return QuantConfig(scale_group=None if group == head_dim else group)
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config: expected a turboquant.QuantConfig, got {type(config).__name__}")
    want = head_dim if config.scale_group is None else config.scale_group
    if want != group:
        layout = "[num_blocks, block_size, num_kv_heads]" if want == head_dim else \
            f"[num_blocks, block_size, num_kv_heads, {head_dim // 32}]"
        raise ValueError(f"config: scale_group {config.scale_group} needs key_scales shaped "
                         f"{layout}; the scales given hold one scale per {group} elements")
    if config.rotation and head_dim & (head_dim - 1):
        raise ValueError(f"config: rotation needs a power-of-two head dim, got {head_dim}; "
                         f"use config=QuantConfig(rotation=False, ...)")
    return config


# The config each written cache holds, keyed by its key_cache's (device, address): set by the
# first write through the API, checked by every later write and read (CONTRACT.md section 2).
# An entry lives as long as the tensor (a view's base) it was made for.
_CACHE_CONFIGS = TensorFacts()


def cache_config(key_cache: torch.Tensor) -> Optional[QuantConfig]:
    """The QuantConfig a cache was written with through this API (None: not written yet)."""
    return _CACHE_CONFIGS.get(key_cache)


def _bind_config(key_cache: torch.Tensor, config: QuantConfig) -> None:
    _CACHE_CONFIGS.set(key_cache, config)


def _resolve_config(config, key_cache, group: int, head_dim: int, read: bool = False
                    ) -> QuantConfig:
    """The call's config: the one the cache was written with when none is given; a different
    one raises (reading a cache with other transforms than it holds gives wrong numbers). A
    read without config of a cache never written through this API here (a copy: ``.clone()``,
    loaded, another process) raises too: its config is unknown, and the API does not guess.
    Not checked while torch.compile traces (the binding is host state)."""
    if torch.compiler.is_compiling():
        return _check_config(config, group, head_dim)
    bound = cache_config(key_cache)
    if read and config is None and bound is None:
        raise ValueError("config: this cache was not written through turboquant in this process "
                         "(a copy, a loaded cache, or never written), so the config its bytes "
                         "hold is unknown: pass config= the QuantConfig it was written with")
    if config is None and bound is not None:
        config = bound
    config = _check_config(config, group, head_dim)
    if bound is not None and config != bound:
        differ = ", ".join(f"{f.name} {getattr(bound, f.name)!r} (written) vs "
                           f"{getattr(config, f.name)!r}" for f in dataclasses.fields(config)
                           if getattr(bound, f.name) != getattr(config, f.name))
        raise ValueError(f"config: this cache was written with config {bound.name!r}; the call "
                         f"passes {config.name!r}, which differs in {differ}. Read (and write) "
                         f"a cache with the config it holds")
    return config


def _check_state(config: QuantConfig, seq_state, state_ids, num_ids: int, hkv: int, d: int,
                 device, ids_name: str = "state_ids") -> None:
    """seq_state/state_ids are required exactly when the config uses the state record."""
    if not config.uses_state:
        for name, t in (("seq_state", seq_state), (ids_name, state_ids)):
            if t is not None:
                raise ValueError(f"{name}: config {config.name!r} keeps no per-sequence state; "
                                 f"expected None")
        return
    if seq_state is None and state_ids is None and not config.needs_slots:
        raise ValueError(f"shared_state: config {config.name!r} (key smoothing "
                         f"{config.key_smoothing}, sink {config.sink}) keeps state: pass "
                         f"shared_state=turboquant.allocate_shared_state({hkv}, {d}, num_blocks) "
                         f"(one per layer, the same to its writes and reads), or a config "
                         f"without it (e.g. QuantConfig(key_smoothing=None, sink=False))")
    if seq_state is None or state_ids is None:
        raise ValueError(f"seq_state: config {config.name!r} (key smoothing "
                         f"{config.key_smoothing}, sink {config.sink}) keeps one state record "
                         f"per sequence: pass seq_state=turboquant.allocate_state(num_slots, "
                         f"{hkv}, {d}) and {ids_name}= each sequence's slot, or a config "
                         f"without them (e.g. QuantConfig(key_smoothing=None, sink=False))")
    check_tensor("seq_state", seq_state, (torch.float32,), (4,))
    if tuple(seq_state.shape[1:]) != (hkv, STATE_ROWS, d):
        raise ValueError(f"seq_state: expected shape [num_slots, {hkv}, {STATE_ROWS}, {d}], "
                         f"got {tuple(seq_state.shape)}")
    if not seq_state.is_contiguous():
        raise ValueError("seq_state: expected a contiguous tensor")
    check_tensor(ids_name, state_ids, INDEX_DTYPES, (1,))
    check_shape(ids_name, state_ids, (num_ids,))
    check_device(device, seq_state=seq_state, **{ids_name: state_ids})
    if num_ids and values_checkable(state_ids):
        lo, hi = int(state_ids.min()), int(state_ids.max())
        if lo < 0 or hi >= seq_state.shape[0]:
            raise ValueError(f"{ids_name}: expected slots in [0, {seq_state.shape[0]}) "
                             f"(seq_state's dim 0), got min {lo}, max {hi}")


# The shared state each written cache was written with (its smoothing tensor's device and
# address), keyed like _CACHE_CONFIGS: a read or write with another layer's state raises.
_CACHE_STATES = TensorFacts()


def _bind_shared(key_cache: torch.Tensor, shared_state) -> None:
    """The first accepted write with a shared state binds it to the cache; a later call with
    another one raises (its smoothing and sinks are not the ones the bytes were written with)."""
    if torch.compiler.is_compiling():
        return
    mine = TensorFacts.key(shared_state.smoothing)
    bound = _CACHE_STATES.get(key_cache)
    if bound is None:
        _CACHE_STATES.set(key_cache, mine)
    elif bound != mine:
        raise ValueError("shared_state: this cache was written with another shared state; pass "
                         "the one its writes used (one per layer: the layer's own)")


def _check_shared(config: QuantConfig, shared_state, seq_state, state_ids, hkv: int, d: int,
                  device) -> None:
    """shared_state replaces seq_state/state_ids; its config keeps nothing per sequence."""
    if seq_state is not None or state_ids is not None:
        raise ValueError("shared_state: given with seq_state/state_ids; expected one of them "
                         "(the shared state keeps nothing per sequence)")
    if config.needs_slots:
        raise ValueError(f"shared_state: config {config.name!r} smooths keys per sequence; the "
                         "shared state's smoothing is the layer's: key_smoothing='calibrated' "
                         "(the default config)")
    check_shared_state(shared_state, hkv, d, device)


def reshape_and_cache_fp4(key, value, key_cache, value_cache, key_scales, value_scales,
                          slot_mapping, *, config: Optional[QuantConfig] = None,
                          seq_state: Optional[torch.Tensor] = None,
                          state_ids: Optional[torch.Tensor] = None,
                          positions: Optional[torch.Tensor] = None,
                          calibration: Optional[tuple] = None,
                          shared_state: Optional[SharedState] = None,
                          backend: str = "auto") -> None:
    """Quantize ``key``/``value`` [num_tokens, num_kv_heads, D] to FP4 and write them into the
    paged cache (in place) at ``slot_mapping`` (slot = block * block_size + offset; -1 skips
    the token; other slots are untouched; two tokens with the same slot: undefined which wins).

    ``config`` (default ``QuantConfig()``, scale group taken from the scales' shape) picks the
    scale rule and the transforms (CONTRACT.md section 2); read the cache with the same config.
    With key smoothing or the sink (the default config) the writer keeps state. By default it
    is the layer's ``shared_state`` (``turboquant.allocate_shared_state``, one per layer, the
    same to its writes and reads; ``turboquant.shared_state``): nothing per sequence, so prefix
    caching, forks and engines without request slots work unchanged. The layer's key smoothing
    (m, lam) is the calibration given to ``allocate_shared_state``, else taken from the first
    write; with the sink, every token at position 0 (``positions`` [num_tokens], int32/int64,
    each token's position in its sequence, which
    ``turboquant.shared_state.positions_from_metadata`` derives from what a vLLM-style engine
    passes) enters the layer's sink table; without ``positions`` position 0 is read from its
    FP4 bytes.

    The option: one record per sequence, ``seq_state`` float32 [num_slots, num_kv_heads, 5, D]
    (``turboquant.allocate_state``) and ``state_ids`` int32 [num_tokens] (each token's slot);
    "sequence" key smoothing needs it. Every call that may write a sequence's position 0 passes
    ``positions``: those sequences' records are filled first, from this call's tokens of the
    sequence (``turboquant.smoothing.init_state``; a host synchronization). ``calibration``
    (m, lam), float32 [num_kv_heads, D] each, is this layer's entry of a calibration file,
    needed with ``key_smoothing="calibrated"`` and a per-sequence record.
    """
    write = make_cache_write(key, value, key_cache, value_cache, key_scales, value_scales,
                             slot_mapping)
    num_tokens, hkv, d = key.shape
    config = _resolve_config(config, key_cache, write.scale_group, d)
    if shared_state is not None:
        _check_shared(config, shared_state, seq_state, state_ids, hkv, d, key.device)
        if calibration is not None:
            raise ValueError("calibration: with shared_state the calibration is given to "
                             "allocate_shared_state; expected None")
    else:
        _check_state(config, seq_state, state_ids, num_tokens, hkv, d, key.device)
    if shared_state is None and config.key_smoothing == "calibrated":
        if not isinstance(calibration, (tuple, list)) or len(calibration) != 2:
            raise ValueError("calibration: key_smoothing='calibrated' with seq_state needs this "
                             "layer's (key_center, key_scale) from turboquant.smoothing"
                             ".load_calibration (with shared_state= the layer takes them itself)")
        check_smoothing("calibration", *calibration, num_kv_heads=hkv, head_dim=d)
    elif calibration is not None:
        raise ValueError(f"calibration: config {config.name!r} does not use a calibration "
                         f"file; expected None")
    if positions is not None:
        check_tensor("positions", positions, (torch.int32, torch.int64), (1,))
        check_shape("positions", positions, (num_tokens,))
        check_device(key.device, positions=positions)
        if not config.uses_state:
            raise ValueError(f"positions: config {config.name!r} keeps no per-sequence state; "
                             f"expected None")
    if num_tokens == 0:
        return
    signs = rotation_signs(d, config.rotation_seed, key.device) if config.rotation else None
    if shared_state is not None:
        _bind_shared(key_cache, shared_state)
    if cache_config(key_cache) is None and not torch.compiler.is_compiling():
        _bind_config(key_cache, config)  # the first accepted write binds the cache's config
    if shared_state is not None:
        if config.key_smoothing is not None:
            take_smoothing(shared_state, key, slot_mapping, positions)
            seq_state, state_ids = writer_records(shared_state, num_tokens)
        _write(write, config, seq_state, state_ids, signs, backend)
        if config.sink and positions is not None:
            enter_sinks(shared_state, key, value, (key_cache, value_cache, key_scales,
                                                   value_scales),
                        slot_mapping, positions, signs, smooth=config.key_smoothing is not None)
        return
    if positions is not None:
        init_state(key, value, seq_state, state_ids, positions, config, calibration, signs)
    elif config.uses_state and values_checkable(state_ids):
        ids = state_ids.long()
        unset = torch.isnan(seq_state[ids.clamp(0, seq_state.shape[0] - 1), 0, KEY_SCALE, 0])
        if bool(unset.any()):
            slot = int(ids[unset][0])
            raise ValueError(f"positions: slot {slot} has no record yet (its sequence's "
                             f"position 0 was never written with positions=): pass positions= "
                             f"on the write that holds a sequence's position 0")
    _write(write, config, seq_state, state_ids, signs, backend)


def _write(write: CacheWrite, config: QuantConfig, seq_state, state_ids, signs, backend) -> None:
    """The write itself, on the selected backend."""
    smoothing = config.key_smoothing is not None
    write = dataclasses.replace(write, scale_rule=config.scale_rule, rotation_signs=signs,
                                seq_state=seq_state if smoothing else None,
                                state_ids=state_ids if smoothing else None)
    registry.select(backend, "cache_write", write).reshape_and_cache(write)


def prepare_attention(query, key_cache, value_cache, key_scales, value_scales, block_tables,
                      seq_lens, scale, *, cu_query_lens=None, sliding_window=0,
                      logits_soft_cap=0.0, max_seq_len: Optional[int] = None,
                      config: Optional[QuantConfig] = None,
                      seq_state: Optional[torch.Tensor] = None,
                      state_ids: Optional[torch.Tensor] = None,
                      sinks: Optional[torch.Tensor] = None,
                      return_lse: bool = False,
                      holds_first_token: bool = True,
                      shared_state: Optional[SharedState] = None,
                      workspace: Optional[torch.Tensor] = None) -> AttentionCall:
    """Validate the arguments of ``paged_attention_fp4`` (all but ``out`` and ``backend``) and
    return the call a backend runs, transforms included (``registry.select`` takes it)."""
    call = make_attention_call(query, key_cache, value_cache, key_scales, value_scales,
                               block_tables, seq_lens, scale, cu_query_lens, sliding_window,
                               logits_soft_cap, max_seq_len)
    config = _resolve_config(config, key_cache, call.scale_group, call.head_dim, read=True)
    sink_table = (None, None)
    if shared_state is not None:
        _check_shared(config, shared_state, seq_state, state_ids, call.num_kv_heads,
                      call.head_dim, query.device)
        if _CACHE_STATES.get(key_cache) is not None:  # (an unbound copy: its config was given)
            _bind_shared(key_cache, shared_state)
        if config.uses_state:  # the layer's record and sink table (turboquant.ops)
            seq_state = layer_record(shared_state, config.key_smoothing is not None)
            sink_table = (shared_state.sink_kv, shared_state.sink_tags)
    else:
        _check_state(config, seq_state, state_ids, call.num_seqs, call.num_kv_heads,
                     call.head_dim, query.device)
    signs = (rotation_signs(call.head_dim, config.rotation_seed, query.device)
             if config.rotation else None)
    if sinks is not None:
        check_tensor("sinks", sinks, (torch.float32,), (1,))
        check_shape("sinks", sinks, (call.num_heads,))
        check_device(query.device, sinks=sinks)
        if not sinks.is_contiguous():
            raise ValueError("sinks: expected a contiguous tensor")
    if workspace is not None:
        _check_workspace(workspace, query.device)
    return dataclasses.replace(call, rotation_signs=signs, seq_state=seq_state,
                               state_ids=state_ids, sink=config.sink and bool(holds_first_token),
                               sinks=sinks, return_lse=bool(return_lse), workspace=workspace,
                               sink_kv=sink_table[0], sink_tags=sink_table[1])


def _check_workspace(workspace, device: torch.device) -> None:
    check_tensor("workspace", workspace, (torch.uint8,), (1,))
    check_device(device, workspace=workspace)
    if not workspace.is_contiguous() or workspace.data_ptr() % 16:
        raise ValueError("workspace: expected a contiguous tensor starting at a 16-byte "
                         "aligned address")


def prefill_workspace_bytes(num_seqs: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                            *, key_format: str = "fp4", device=None) -> int:
    """The bytes of a ``workspace`` for ``paged_attention_fp4`` that serves every call on
    ``device`` (default: the current CUDA device) with at most ``num_seqs`` sequences of at most
    ``max_seq_len`` keys, ``num_kv_heads`` and ``head_dim``: what an engine allocates once at
    start-up. The most any backend takes (``Backend.workspace_bytes``); 0 where none takes one
    (only the cuda backend's SM90 prefill kernel does: its decode-once pass,
    csrc_cuda/prefill_workspace.cuh, about 388 bytes per key and kv head at D 128, at most 1 GiB;
    a call that needs more decodes in the kernel instead)."""
    if key_format not in ("fp4", "fp8_e4m3"):
        raise ValueError(f"key_format: expected 'fp4' or 'fp8_e4m3', got {key_format!r}")
    for name, v, lo in (("num_seqs", num_seqs, 0), ("max_seq_len", max_seq_len, 0),
                        ("num_kv_heads", num_kv_heads, 1), ("head_dim", head_dim, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    return max(b.workspace_bytes(num_seqs, max_seq_len, num_kv_heads, head_dim, key_format,
                                 device) for b in registry.ordered())


def paged_attention_fp4(query, key_cache, value_cache, key_scales, value_scales, block_tables,
                        seq_lens, scale, *, cu_query_lens=None, out=None, sliding_window=0,
                        logits_soft_cap=0.0, backend: str = "auto",
                        max_seq_len: Optional[int] = None,
                        config: Optional[QuantConfig] = None,
                        seq_state: Optional[torch.Tensor] = None,
                        state_ids: Optional[torch.Tensor] = None,
                        sinks: Optional[torch.Tensor] = None,
                        return_lse: bool = False, holds_first_token: bool = True,
                        lse_out: Optional[torch.Tensor] = None,
                        shared_state: Optional[SharedState] = None, num_decodes: int = 0,
                        workspace: Optional[torch.Tensor] = None):
    """Attention of ``query`` [num_tokens, num_heads, D] over the FP4 paged cache.

    ``max_seq_len`` (an extension to the contract's signature) is an optional host-side upper
    bound of ``seq_lens``; kernels size their split-KV grid with it (default: the block
    table's capacity), so passing it avoids launching work for empty table columns.
    ``config``: the QuantConfig the cache was written with (default ``QuantConfig()``).
    ``shared_state``: the layer's shared state its writes used (``turboquant.shared_state``),
    needed when the config keeps state (the default does); or, the option, ``seq_state``/
    ``state_ids`` (int32 [num_seqs], each sequence's slot): the per-sequence records the writer
    filled.
    ``sinks`` (float32 [num_heads], gpt-oss's learned attention sinks): one more logit per
    head in the softmax's denominator, with no value; compared with the scaled logits
    (``scale * q.k``, after the soft cap if any; the sink itself is not capped) and present
    whatever the sliding window (gpt-oss applies it in its windowed and its full layers).
    Returns ``out`` (allocated like ``query`` when not given), or with ``return_lse`` the pair
    ``(out, lse)``: ``lse`` float32 [num_tokens, num_heads], the natural-log log-sum-exp of
    each row's logits (the scaled, capped logits the softmax normalizes, learned sink
    included): the convention of FlashAttention and vLLM's ``merge_attn_states``; an API
    that wants base 2 takes ``lse * log2(e)``. A row that sees no key has lse -inf (or its
    sink), a row that saw NaN has NaN. Key smoothing does not show in it: the lse is that of
    the true logits ``scale * q.k``, so states from other kernels merge with ours
    (``turboquant.merge_attention_states``). ``holds_first_token=False``: the call's blocks are
    a later part of every sequence (sequences split over calls), so their first key is an
    ordinary one and the sink token (the config's ``sink``) is not read from the record; the
    call that holds the sequences' position 0 keeps the default. ``lse_out`` (with
    ``return_lse``): a contiguous float32 [num_tokens, num_heads] tensor the lse is written
    into, as ``out`` is for the output (e.g. views of a collective's send buffer).
    ``num_decodes`` (a host int, with ``cu_query_lens``): the first ``num_decodes`` sequences
    have one query token each (an engine's decode-first order, as vLLM's
    ``reorder_batch_threshold = 1`` makes it): they run as a decode batch and the other
    sequences as a multi-token batch, two calls, each choosing its own kernel. Without it a
    chunked-prefill step's decode rows ride the prefill kernel's 128-row tiles.
    ``workspace`` (contiguous uint8 [bytes], 16-byte aligned, on the query's device): scratch
    memory for the call, allocated once by the caller (``prefill_workspace_bytes`` sizes it)
    and reused by every call and layer on one stream; its contents are not kept. A long
    chunked prefill on SM90 decodes its context once into it (csrc_cuda/prefill_workspace.cuh);
    a call that needs more than it holds decodes in the kernel, and with a workspace given no
    call allocates one of its own (without it, a call that takes the pass allocates its bytes
    from torch's caching allocator). Other backends ignore it.
    """
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else 0
    check_num_decodes(num_decodes, cu_query_lens, num_seqs)
    if cu_query_lens is not None and 0 < num_decodes < num_seqs:
        return _decodes_then_rest(
            num_decodes, query, (key_cache, value_cache, key_scales, value_scales), block_tables,
            seq_lens, scale, cu_query_lens, out, lse_out, return_lse, state_ids,
            dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                 backend=backend, max_seq_len=max_seq_len, config=config, seq_state=seq_state,
                 sinks=sinks, holds_first_token=holds_first_token,
                 shared_state=shared_state, workspace=workspace))
    call = prepare_attention(query, key_cache, value_cache, key_scales, value_scales,
                             block_tables, seq_lens, scale, cu_query_lens=cu_query_lens,
                             sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                             max_seq_len=max_seq_len, config=config, seq_state=seq_state,
                             state_ids=state_ids, sinks=sinks, return_lse=return_lse,
                             holds_first_token=holds_first_token, shared_state=shared_state,
                             workspace=workspace)
    if out is None:
        out = torch.empty_like(query)
    else:
        check_output("out", out, query.dtype, query.shape, query.device)
    if lse_out is not None:
        if not return_lse:
            raise ValueError("lse_out: given without return_lse=True")
        check_output("lse_out", lse_out, torch.float32, query.shape[:2], query.device)
    lse = lse_out if lse_out is not None else (
        torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        if return_lse else None)
    if query.shape[0]:
        registry.select(backend, "attention", call).paged_attention(call, out, lse)
    return (out, lse) if return_lse else out


def _decodes_then_rest(nd, query, cache, block_tables, seq_lens, scale, cu_query_lens, out,
                       lse_out, return_lse, state_ids, common):
    """paged_attention_fp4 with num_decodes = nd: the first nd sequences (one query token
    each) as a decode call, the others as a multi-token call, into slices of one output."""
    if out is None:
        out = torch.empty_like(query)
    if return_lse and lse_out is None:
        lse_out = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    for seqs, cu in ((slice(0, nd), None), (slice(nd, None), cu_query_lens[nd:] - nd)):
        paged_attention_fp4(query[seqs], *cache, block_tables[seqs], seq_lens[seqs], scale,
                            cu_query_lens=cu, out=out[seqs],
                            state_ids=None if state_ids is None else state_ids[seqs],
                            return_lse=return_lse,
                            lse_out=None if lse_out is None else lse_out[seqs], **common)
    return (out, lse_out) if return_lse else out


def explain(query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens,
            scale, **kwargs) -> list[dict]:
    """Which backend ``paged_attention_fp4`` with these arguments would run, and why each other
    one declines: every backend in priority order as ``{"name", "reason", "chosen"}``."""
    call = prepare_attention(query, key_cache, value_cache, key_scales, value_scales,
                             block_tables, seq_lens, scale, **kwargs)
    return registry.explain("attention", call)


def backends() -> list[dict]:
    """Every backend with its priority, whether it can run here and, if not, why."""
    return registry.status()


