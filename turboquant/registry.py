"""The backend registry: one list of backends, each able to say why it cannot run.

The dispatcher (``backend="auto"``), explicit backend selection, ``turboquant.backends()``
and the test skips all ask the same two questions of a backend:

- ``unavailable()``: a reason the backend cannot run on this machine at all (no GPU of its
  kind, extension failed to build), or ``None``.
- ``check_attention(call)`` / ``check_cache_write(write)`` / ``check_merge(merge)``: a reason
  it cannot run *these* tensors (wrong device, unsupported head dim, scale group, ...), or
  ``None``.

Backends are tried in priority order (higher first); ``reference`` has the lowest priority
and accepts everything, so ``auto`` always finds one.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .smoothing import STATE_ROWS


@dataclass(frozen=True)
class AttentionCall:
    """The validated arguments of one ``paged_attention_fp4`` call (shapes already checked)."""

    query: torch.Tensor  # [num_tokens, num_heads, D] bf16/fp16
    key_cache: torch.Tensor  # uint8 [num_blocks, num_kv_heads, block_size, D/2]
    value_cache: torch.Tensor  # uint8 [num_blocks, num_kv_heads, block_size, D/2]
    key_scales: torch.Tensor  # uint8 [num_blocks, block_size, num_kv_heads(, D/32)]
    value_scales: torch.Tensor  # same shape as key_scales
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    cu_query_lens: Optional[torch.Tensor]  # int32 [num_seqs + 1], or None (decode)
    scale: float  # softmax scale applied to q.k
    sliding_window: int  # 0: off; W > 0: a query at position p sees keys p-W+1 .. p
    logits_soft_cap: float  # 0: off; c > 0: logits = c * tanh(logits / c)
    max_seq_len: int  # host-side upper bound on seq_lens (sizes grids, never read past)
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    scale_group: int  # elements per E8M0 scale: head_dim (default) or 32
    rotation_signs: Optional[torch.Tensor] = None  # float32 [D] of +-1; None: no rotation
    seq_state: Optional[torch.Tensor] = None  # float32 [num_slots, num_kv_heads, 5, D]
    state_ids: Optional[torch.Tensor] = None  # int32 [num_seqs]: each sequence's state slot
    sink: bool = False  # position 0 read from the state record, not from the FP4 cache
    sinks: Optional[torch.Tensor] = None  # float32 [num_heads]: learned sink logits (gpt-oss)
    return_lse: bool = False  # the caller wants each row's log-sum-exp (float32 [T, num_heads])
    key_format: str = "fp4"  # or "fp8_e4m3": a K8V4 cache (E4M3 keys, FP4 values)
    workspace: Optional[torch.Tensor] = None  # uint8 [bytes]: the caller's prefill workspace
    # the layer's sink table (turboquant.shared_state), with seq_state its one record and no
    # state_ids; None: the records are per sequence
    sink_kv: Optional[torch.Tensor] = None  # bfloat16 [S + 1, num_kv_heads, 2, D]
    sink_tags: Optional[torch.Tensor] = None  # int64 [S + 1, num_kv_heads]


@dataclass(frozen=True)
class CacheWrite:
    """The validated arguments of one ``reshape_and_cache_fp4`` call."""

    key: torch.Tensor  # [num_tokens, num_kv_heads, D] bf16/fp16/fp32
    value: torch.Tensor  # [num_tokens, num_kv_heads, D] same dtype as key
    key_cache: torch.Tensor  # uint8 [num_blocks, num_kv_heads, block_size, D/2]
    value_cache: torch.Tensor  # uint8 [num_blocks, num_kv_heads, block_size, D/2]
    key_scales: torch.Tensor  # uint8 [num_blocks, block_size, num_kv_heads(, D/32)]
    value_scales: torch.Tensor  # same shape as key_scales
    slot_mapping: torch.Tensor  # int64/int32 [num_tokens]; -1 skips the token
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    scale_group: int
    scale_rule: str = "smallest"  # "smallest" (CONTRACT.md) or "mse" (QuantConfig.scale_rule)
    rotation_signs: Optional[torch.Tensor] = None  # float32 [D] of +-1; None: no rotation
    seq_state: Optional[torch.Tensor] = None  # float32 [num_slots, num_kv_heads, 5, D]; with
    # key smoothing only: each token's key becomes (k - m) * (1 / lam) of its slot
    state_ids: Optional[torch.Tensor] = None  # int32 [num_tokens]: each token's state slot
    key_format: str = "fp4"  # or "fp8_e4m3": a K8V4 cache (E4M3 keys, FP4 values)


@dataclass(frozen=True)
class MergeCall:
    """The validated arguments of one ``merge_attention_states_n`` call."""

    outs: tuple  # R x [num_tokens, num_heads, D], one dtype and device
    lses: tuple  # R x float32 [num_tokens, num_heads]
    out: torch.Tensor  # [num_tokens, num_heads, D]: the merged output, written
    lse: torch.Tensor  # float32 [num_tokens, num_heads]: the merged lse, written


_CHECKS = {"attention": "check_attention", "cache_write": "check_cache_write",
           "merge": "check_merge"}


_DEVICE_TENSOR = {"attention": "query", "cache_write": "key", "merge": "out"}


def _device(kind: str, arg) -> torch.device:
    return getattr(arg, _DEVICE_TENSOR[kind]).device


def transform_tensors_reason(call: AttentionCall) -> Optional[str]:
    """Why a kernel cannot take this call's transform tensors (rotation signs, state records and
    their slots; the API builds them right, this guards direct callers of a backend), or None."""
    signs, state, ids = call.rotation_signs, call.seq_state, call.state_ids
    if signs is not None and (signs.dtype != torch.float32 or tuple(signs.shape) != (call.head_dim,)
                              or not signs.is_contiguous() or signs.device != call.query.device):
        return (f"rotation_signs: expected a contiguous float32 [{call.head_dim}] tensor on "
                f"{call.query.device}")
    if (call.sink_kv is None) != (call.sink_tags is None):
        return "sink_kv and sink_tags: expected both or neither"
    if call.sink_kv is not None:
        if state is None or ids is not None or state.dim() != 4 or state.shape[0] != 1:
            return ("seq_state/state_ids: with sink_kv, expected the layer's one record "
                    "[1, num_kv_heads, 5, D] and no state_ids")
        kv, tags = call.sink_kv, call.sink_tags
        if (tags.dtype != torch.int64 or tags.dim() != 2 or tags.shape[0] < 2
                or tags.shape[1] != call.num_kv_heads or not tags.is_contiguous()
                or tags.device != call.query.device):
            return (f"sink_tags: expected a contiguous int64 [S + 1 >= 2, {call.num_kv_heads}] "
                    f"tensor on {call.query.device}")
        if (kv.dtype != torch.bfloat16
                or tuple(kv.shape) != (tags.shape[0], call.num_kv_heads, 2, call.head_dim)
                or not kv.is_contiguous() or kv.device != call.query.device):
            return (f"sink_kv: expected a contiguous bfloat16 [{tags.shape[0]}, "
                    f"{call.num_kv_heads}, 2, {call.head_dim}] tensor on {call.query.device}")
    elif (state is None) != (ids is None):
        return "seq_state and state_ids: expected both or neither"
    if call.sink and state is None:
        return "sink: needs seq_state and state_ids (the sink rows live in the state record)"
    if state is not None:
        want = (call.num_kv_heads, STATE_ROWS, call.head_dim)
        if (state.dtype != torch.float32 or state.dim() != 4 or tuple(state.shape[1:]) != want
                or not state.is_contiguous() or state.device != call.query.device):
            return (f"seq_state: expected a contiguous float32 [num_slots, {want[0]}, {want[1]}, "
                    f"{want[2]}] tensor on {call.query.device}")
        if ids is not None and (ids.dtype != torch.int32 or tuple(ids.shape) != (call.num_seqs,)
                                or not ids.is_contiguous() or ids.device != call.query.device):
            return (f"state_ids: expected a contiguous int32 [{call.num_seqs}] tensor on "
                    f"{call.query.device}")
    return None


def key_format_reason(call, backend: str) -> Optional[str]:
    """Why a backend with FP4 keys only declines a K8V4 cache (attention or write), or None."""
    if call.key_format != "fp4":
        return (f"{call.key_format} keys (a K8V4 cache): not in the {backend} kernels yet (the "
                f"reference has them)")
    return None


def state_outputs_reason(call: AttentionCall, backend: str) -> Optional[str]:
    """Why a backend whose kernel has neither the log-sum-exp output nor learned sinks declines
    a call that asks for them, or None."""
    wants = [w for w, on in (("the log-sum-exp output (return_lse)", call.return_lse),
                             ("learned sinks (sinks)", call.sinks is not None)) if on]
    if wants:
        return f"{' and '.join(wants)}: not in the {backend} kernel yet (the reference has them)"
    return None


class Backend:
    """Base class. Subclasses set ``name``/``priority``/``description``, override the checks
    and the two entry points. A check returns ``None`` when the backend can run, else a
    human-readable reason."""

    name: str = ""
    priority: int = 0
    description: str = ""

    def unavailable(self) -> Optional[str]:
        return None

    def check_attention(self, call: AttentionCall) -> Optional[str]:
        return "paged attention is not implemented by this backend"

    def check_cache_write(self, write: CacheWrite) -> Optional[str]:
        return "the cache writer is not implemented by this backend"

    def check_merge(self, merge: MergeCall) -> Optional[str]:
        return "merging attention states is not implemented by this backend"

    def paged_attention(self, call: AttentionCall, out: torch.Tensor,
                        lse: Optional[torch.Tensor] = None) -> None:
        raise NotImplementedError

    def reshape_and_cache(self, write: CacheWrite) -> None:
        raise NotImplementedError

    def merge_states(self, merge: MergeCall) -> None:
        raise NotImplementedError

    def workspace_bytes(self, num_seqs: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                        key_format: str, device: torch.device) -> int:
        """The bytes of ``paged_attention``'s ``workspace`` this backend takes at most for
        calls of up to ``num_seqs`` sequences of up to ``max_seq_len`` keys on ``device``
        (``turboquant.prefill_workspace_bytes``); 0: it takes none."""
        return 0


_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.name in _BACKENDS:
        raise ValueError(f"backend {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    return backend


def get(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"backend: expected one of {sorted(_BACKENDS) + ['auto']}, got {name!r}"
        ) from None


def ordered() -> list[Backend]:
    return sorted(_BACKENDS.values(), key=lambda b: -b.priority)


def explain(kind: str, arg) -> list[dict]:
    """For ``arg`` (an AttentionCall for kind 'attention', a CacheWrite for 'cache_write', a
    MergeCall for 'merge'): every backend in priority order with ``name``, ``reason`` (why it
    cannot run this call, or "") and ``chosen`` (the one ``backend='auto'`` takes)."""
    method = _CHECKS[kind]
    rows, chosen = [], False
    for backend in ordered():
        reason = backend.unavailable() or getattr(backend, method)(arg)
        rows.append({"name": backend.name, "reason": reason or "",
                     "chosen": reason is None and not chosen})
        chosen = chosen or reason is None
    return rows


_warned: set = set()


def _warn_reference_on_device(kind: str, arg, rows: list) -> None:
    """One warning per distinct set of reasons when 'auto' runs the reference on tensors off
    the CPU: the reference is orders of magnitude slower than a kernel, and a serving engine
    should hear why none of them took the call."""
    device = _device(kind, arg)
    if device.type == "cpu" or torch.compiler.is_compiling():
        return
    why = "; ".join(f"{r['name']}: {r['reason']}" for r in rows if r["reason"])
    if (kind, why) in _warned:
        return
    _warned.add((kind, why))
    warnings.warn(f"turboquant: backend='auto' runs the {kind} on the reference backend "
                  f"(PyTorch, slow) for tensors on {device}, because {why}", RuntimeWarning,
                  stacklevel=4)


def select(name: str, kind: str, arg) -> Backend:
    """Pick the backend for ``arg`` (an AttentionCall for kind 'attention', a CacheWrite for
    kind 'cache_write', a MergeCall for 'merge'). ``name='auto'`` takes the highest-priority
    backend that can run (and warns once per reason when that is the reference on tensors off
    the CPU); a named backend that cannot run raises a ValueError that says why."""
    method = _CHECKS[kind]
    if name != "auto":
        backend = get(name)
        reason = backend.unavailable() or getattr(backend, method)(arg)
        if reason is not None:
            raise ValueError(f"backend={name!r} cannot run this call: {reason}")
        return backend
    rows = explain(kind, arg)
    for row in rows:
        if row["chosen"]:
            if row["name"] == "reference":
                _warn_reference_on_device(kind, arg, rows)
            return get(row["name"])
    raise ValueError("no backend can run this call: " +
                     "; ".join(f"{r['name']}: {r['reason']}" for r in rows))


def status() -> list[dict]:
    """Every registered backend with whether it is usable here and, if not, why."""
    rows = []
    for backend in ordered():
        reason = backend.unavailable()
        rows.append(
            {
                "name": backend.name,
                "priority": backend.priority,
                "available": reason is None,
                "reason": reason or "",
                "description": backend.description,
            }
        )
    return rows
