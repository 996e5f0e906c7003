"""Key smoothing and the sink token: the per-sequence state record, its initialization, and
calibration files (CONTRACT.md section 2).

The state of one layer is ``seq_state``: float32 ``[num_slots, num_kv_heads, 5, D]``, one slot
per live sequence (the engine's request slot: SGLang's ``req_pool_indices``, a vLLM persistent
batch row), rows:

- ``KEY_CENTER`` m: subtracted from every key before quantization. Softmax is unchanged by it
  (q.m is the same for every key of a query); with a logit soft cap the reader adds q.m back.
- ``KEY_SCALE`` lam (> 0): queries are multiplied by it, keys by its reciprocal (below).
- ``SINK_KEY``, ``SINK_VALUE``: the sequence's position 0 after the writer's transform
  (``rotate((k0 - m) * r)`` and ``rotate(v0)``), in fp32: with ``sink`` on, attention reads
  position 0 from here instead of from its FP4 bytes.
- ``KEY_INV_SCALE`` r = 1 / lam (fp32 division, once per record): the writer multiplies keys by
  it, one instruction per element where a division is a dozen.

The writer fills a slot when it writes a sequence's position 0 (``init_state``), from the tokens
of that sequence in the same call (its first chunk), or from a calibration file's per-layer m
and lam. Later chunks and decode steps read the slot. A slot that was never initialized holds
NaN (``allocate_state``), so reading it gives NaN, never a silently wrong number.

The rule for m and lam from a set of keys (positions >= 1: the first token's key lies far from
the others, and the sink keeps it exactly anyway), per kv head and channel c:

    m_c   = mean_t k_tc
    a_c   = max_t |k_tc - m_c|, floored at 2^-20 * max_c a_c
    lam_c = a_c ^ SMOOTHING_EXPONENT, divided by the RMS over channels (so lam is about 1)

An exponent of 1/2 splits each channel's range evenly between the keys (divided) and the
queries (multiplied), as SmoothQuant does for activations and weights. Measured
(``python benchmarks/probe.py smoothing-exponent``, the default config, KLD / top-1 against the unquantized
model, 2026-11-24), exponents 0.25 / 0.5 / 0.75 / 1: SmolLM2-135M 0.0401 / 0.0324 / 0.0333 /
0.0422 (top-1 87.1 / 88.9 / 88.7 / 88.3 %); chosen there, then checked on the held-back Gemma 3
270M: 0.0359 / 0.0309 / 0.0350 / 0.0502 (86.8 / 89.2 / 88.4 / 86.6 %).
A chunk with fewer than two tokens (no key past position 0) gives m = 0 and lam = 1.

A layer's smoothing, shared by every sequence (calibration files; ``turboquant.shared_state``
takes it from the layer's first write), is taken from other tokens than most it encodes, and
one outlier of those tokens would set a channel's range for all of them: there a_c is the
``LAYER_RANGE_QUANTILE`` (99.9th percentile) of |k_tc - m_c| instead of the maximum. Measured
(``python -m turboquant accuracy``, the default through the shared state, KLD against the
unquantized model; per-sequence records with the maximum beside it): SmolLM2-135M 0.0339
(0.0360), Gemma 3 270M 0.0303 (0.0284); with the maximum 0.0346 / 0.0321. The quantile was
picked on these two models with the usual texts, then checked with the texts' roles swapped
(``--swap-texts``: evaluate the calibration text, calibrate on the evaluation text): 0.0298
(0.0329) / 0.0340 (0.0329); the maximum there 0.0281 / 0.0363.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from .rotation import rotate

KEY_CENTER, KEY_SCALE, SINK_KEY, SINK_VALUE, KEY_INV_SCALE = range(5)
STATE_ROWS = 5
SMOOTHING_EXPONENT = 0.5
# A layer's smoothing (calibration files, the shared state's first write) is taken from other
# tokens than the ones it will encode: its a_c is this quantile of |k_tc - m_c| (see above).
LAYER_RANGE_QUANTILE = 0.999
_FLOOR = 2.0 ** -20


def allocate_state(num_slots: int, num_kv_heads: int, head_dim: int, device="cpu"
                   ) -> torch.Tensor:
    """One layer's per-sequence state, float32 [num_slots, num_kv_heads, 5, D], NaN until a
    sequence's position 0 is written into its slot."""
    return torch.full((num_slots, num_kv_heads, STATE_ROWS, head_dim), float("nan"),
                      dtype=torch.float32, device=device)


def smoothing_from_keys(keys: torch.Tensor,
                        quantile: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [T, Hkv, D] (positions >= 1 of one sequence, or a calibration text's) ->
    (m, lam), each float32 [Hkv, D], by the rule in the module docstring. quantile: a_c as this
    quantile of |k_tc - m_c| over t instead of the maximum."""
    k = keys.float()
    n = k.shape[0]
    if n == 0:
        shape = k.shape[1:]
        return torch.zeros(shape, device=k.device), torch.ones(shape, device=k.device)
    m = k.sum(0) / n
    dev = (k - m).abs()
    if quantile is None:
        a = dev.amax(dim=0)
    else:  # the deviations in descending order, read from the top, interpolated
        desc = dev.sort(dim=0, descending=True).values
        at = torch.tensor(n - 1, device=k.device) * (1.0 - quantile)
        lo = at.floor().long()
        hi = torch.clamp(lo + 1, max=n - 1)
        a = torch.lerp(desc[lo], desc[hi], at - lo).clamp_min(0.0)
    a = torch.maximum(a, _FLOOR * a.amax(dim=-1, keepdim=True))
    lam = a.pow(SMOOTHING_EXPONENT)
    lam = lam / lam.pow(2).mean(dim=-1, keepdim=True).sqrt()
    # a head whose keys are all equal: no scale to take from them
    flat = ~(a.amax(dim=-1, keepdim=True) > 0)
    lam = torch.where(flat, torch.ones_like(lam), lam)
    return m, lam


def transform_keys(key: torch.Tensor, center: Optional[torch.Tensor],
                   inv_scale: Optional[torch.Tensor], signs: Optional[torch.Tensor]) -> torch.Tensor:
    """The writer's key transform in fp32: rotate((k - m) * r) with r = 1 / lam (each step only
    if given); key [..., D], center/inv_scale broadcastable to it."""
    k = key.float()
    if center is not None:
        k = (k - center) * inv_scale
    return rotate(k, signs) if signs is not None else k


def init_state(key: torch.Tensor, value: torch.Tensor, seq_state: torch.Tensor,
               state_ids: torch.Tensor, positions: torch.Tensor, config,
               calibration: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               signs: Optional[torch.Tensor] = None) -> None:
    """Fill the slot of every sequence whose position 0 is in this write (in place).

    key/value [num_tokens, Hkv, D]; state_ids int32 [num_tokens] (each token's slot);
    positions [num_tokens] (each token's position in its sequence). The tokens of a starting
    sequence in this call are its first chunk: m and lam come from its positions >= 1
    (``key_smoothing="sequence"``) or from ``calibration`` (m, lam) ("calibrated"); without key
    smoothing m = 0, lam = 1. The sink rows get position 0 after the writer's transform.
    """
    starts = torch.nonzero(positions == 0).flatten()
    if starts.numel() == 0:
        return
    hkv, d = key.shape[1], key.shape[2]
    for t0 in starts.tolist():  # one slot per starting sequence: a handful per call
        slot = int(state_ids[t0])
        if config.key_smoothing == "sequence":
            chunk = (state_ids == slot) & (positions > 0)
            m, lam = smoothing_from_keys(key[chunk])
        elif config.key_smoothing == "calibrated":
            m, lam = (c.to(device=key.device, dtype=torch.float32) for c in calibration)
        else:
            m = torch.zeros(hkv, d, device=key.device)
            lam = torch.ones(hkv, d, device=key.device)
        inv = 1.0 / lam
        seq_state[slot, :, KEY_CENTER] = m
        seq_state[slot, :, KEY_SCALE] = lam
        seq_state[slot, :, KEY_INV_SCALE] = inv
        seq_state[slot, :, SINK_KEY] = transform_keys(key[t0], m, inv, signs)
        seq_state[slot, :, SINK_VALUE] = transform_keys(value[t0], None, None, signs)


# --------------------------------------------------------------------------- calibration files

FILE_FORMAT = "turboquant.key_smoothing.v1"


def calibrate(layer_keys: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, keys [T, Hkv, D] of a calibration text (all positions; position 0 is left
    out) -> (m, lam) per layer by the module's rule."""
    return [smoothing_from_keys(k[1:], quantile=LAYER_RANGE_QUANTILE) for k in layer_keys]


def save_calibration(path: Union[str, Path], layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     metadata: Optional[dict] = None) -> None:
    """Write per-layer (m, lam) as one safetensors file: tensors ``layers.{i}.key_center`` and
    ``layers.{i}.key_scale``, float32 [num_kv_heads, D]; metadata ``format`` =
    ``turboquant.key_smoothing.v1``, ``num_layers`` and whatever ``metadata`` adds (str -> str)."""
    from safetensors.torch import save_file

    tensors = {}
    for i, (m, lam) in enumerate(layers):
        tensors[f"layers.{i}.key_center"] = m.float().contiguous().cpu()
        tensors[f"layers.{i}.key_scale"] = lam.float().contiguous().cpu()
    meta = {"format": FILE_FORMAT, "num_layers": str(len(layers))}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    save_file(tensors, str(path), metadata=meta)


def load_calibration(path: Union[str, Path], device="cpu"
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Read a file written by ``save_calibration``: -> per layer (m, lam), checked."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FILE_FORMAT:
            raise ValueError(f"path: {path} is not a {FILE_FORMAT} file "
                             f"(format {meta.get('format')!r})")
        layers = []
        for i in range(int(meta["num_layers"])):
            m, lam = f.get_tensor(f"layers.{i}.key_center"), f.get_tensor(f"layers.{i}.key_scale")
            check_smoothing(f"layers.{i}", m, lam)
            layers.append((m.to(device), lam.to(device)))
    return layers


def check_smoothing(name: str, center: torch.Tensor, scale: torch.Tensor,
                    num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                    device=None) -> None:
    """ValueError/TypeError naming the argument unless (m, lam) are float32 [Hkv, D], finite,
    lam > 0 (and of the given shape and device)."""
    for what, t in (("key_center", center), ("key_scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {what}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: {what}: expected dtype torch.float32, got {t.dtype}")
        want = (num_kv_heads or t.shape[0], head_dim or t.shape[-1])
        if t.dim() != 2 or tuple(t.shape) != want:
            raise ValueError(f"{name}: {what}: expected shape [num_kv_heads, D] = {want}, "
                             f"got {tuple(t.shape)}")
        if device is not None and t.device != device:
            raise ValueError(f"{name}: {what}: expected a tensor on {device}, got {t.device}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: {what}: expected finite values")
    if not bool((scale > 0).all()):
        raise ValueError(f"{name}: key_scale: expected values > 0, got min {float(scale.min())}")
