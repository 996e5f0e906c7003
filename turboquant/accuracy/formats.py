"""The KV formats the accuracy report compares, and what one layer costs in each.

A format is a name (``parse_format``):

- ``fp8``: FP8 E4M3 keys and values with scale 1.0 per tensor (what vLLM's ``kv_cache_dtype=fp8``
  does without calibrated scales); ``fp8/token``: one fp32 scale per (token, kv head), amax/448.
  Both are emulated (values rounded to E4M3 and back, attention in fp32): the anchors.
- ``k8v4``: the second key format (K8V4): E4M3 keys with one E8M0 scale per (token, kv head),
  FP4 values, written and read through the real API like the FP4 configs below, with the
  default config's transforms (rotation, key smoothing, the sink token); ``k8v4/NAME`` with
  the QuantConfig ``NAME`` instead (``k8v4/plain``: the format alone).
- Any ``QuantConfig.parse`` name (``default``, ``plain``, ``rotation+per32``, ...), optionally
  with ``@N``: the sequence's first write is its first N tokens, the rest is written in a
  second call. A config that keeps state keeps the state the API gives it: the shared state
  (``turboquant.shared_state``: nothing per sequence), whose layer smoothing is the calibration
  file's, or with ``@N`` the one the layer's first write (N tokens) takes; with "sequence"
  smoothing (``rotation+smooth+sink``, the per-sequence option) a record taken from the
  sequence's first chunk. These go through the real API (``reshape_and_cache_fp4`` and
  ``paged_attention_fp4``, the reference backend on the CPU, ``backend="auto"`` elsewhere), so
  the report measures the bytes a serving engine would store.

Per layer: K and V SQNR (the cache read back and every transform undone) and the attention
output of all the layer's query tokens as one causal multi-token sequence, against fp32
attention on the unquantized Q/K/V (cosine and relative error).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from ..api import paged_attention_fp4, reshape_and_cache_fp4
from ..cache import allocate_cache, state_records
from ..config import QuantConfig, parse_cache_format
from ..format import dequantize_e4m3, dequantize_fp4, sqnr_db
from ..rotation import rotation_signs, unrotate
from ..shared_state import allocate_shared_state
from ..smoothing import KEY_CENTER, KEY_SCALE, SINK_KEY, SINK_VALUE, allocate_state

BLOCK_SIZE = 16
FP8_FORMATS = ("fp8", "fp8/token")  # the emulated anchors
E4M3_MAX = 448.0


@dataclasses.dataclass
class Layer:
    """One attention layer's inputs: q [T, Hq, D], k and v [T, Hkv, D], all bf16."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float


@dataclasses.dataclass(frozen=True)
class KVFormat:
    name: str
    config: Optional[QuantConfig]  # None: an FP8 anchor
    first_chunk: int = 0  # 0: the whole sequence in one write
    key_format: str = "fp4"  # or "fp8_e4m3" (K8V4)

    @property
    def shared(self) -> bool:
        """Written and read through the shared state (else a per-sequence record, or none)."""
        return self.config is not None and self.config.shares_state

    @property
    def is_fp8(self) -> bool:
        """An emulated FP8 anchor, not a turboquant cache."""
        return self.config is None


def parse_format(name: str) -> KVFormat:
    """'fp8', 'fp8/token', 'k8v4' or 'k8v4/NAME', or a QuantConfig name with an optional '@N'
    first chunk."""
    if name in FP8_FORMATS:
        return KVFormat(name, None)
    base, _, chunk = name.partition("@")
    first = 0
    if chunk:
        if not chunk.isdigit() or int(chunk) < 1:
            raise ValueError(f"format: expected '@N' with N >= 1 tokens, got {name!r}")
        first = int(chunk)
    config, key_format = parse_cache_format(base)
    return KVFormat(name, config, first, key_format)


def fp8_round(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """x [..., D] -> E4M3-rounded float32 (scale 1.0, or amax/448 per row)."""
    x = x.float()
    if not per_token:
        return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    s = x.abs().amax(-1, keepdim=True) / E4M3_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (x / s).to(torch.float8_e4m3fn).float() * s


def emulate_kv(k: torch.Tensor, v: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [T, Hkv, D] as an emulated format (FP8_FORMATS) holds them: float32 each."""
    per_token = name == "fp8/token"
    return fp8_round(k, per_token), fp8_round(v, per_token)


# --------------------------------------------------------------------------- one layer


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                        ) -> torch.Tensor:
    """fp32 causal attention, query token j sees keys 0..T-q+j: q [Tq, Hq, D], k/v [T, Hkv, D]
    -> [Tq, Hq, D] float32."""
    tq, hq, d = q.shape
    t, hkv, _ = k.shape
    g = hq // hkv
    qf = q.float().view(tq, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, Tq, D]
    kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [Hkv, T, D]
    logits = torch.einsum("hgqd,htd->hgqt", qf, kf) * scale
    pos = torch.arange(t - tq, t, device=q.device)
    visible = torch.arange(t, device=q.device)[None, :] <= pos[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hgqt,htd->hgqd", torch.softmax(logits, dim=-1), vf)
    return out.permute(2, 0, 1, 3).reshape(tq, hq, d)


@dataclasses.dataclass
class WrittenCache:
    """One sequence written into a fresh paged cache (block i in physical block i)."""

    fmt: KVFormat
    cache: tuple  # FP4Cache
    block_tables: torch.Tensor  # int32 [1, nb]
    seq_lens: torch.Tensor  # int32 [1]
    kwargs: dict  # config, and shared_state or seq_state and state_ids, for paged_attention_fp4


def write_cache(k: torch.Tensor, v: torch.Tensor, fmt: KVFormat,
                calibration: Optional[tuple] = None, block_size: int = BLOCK_SIZE
                ) -> WrittenCache:
    """Write k/v [T, Hkv, D] into a turboquant cache of ``fmt`` (its first chunk, then the
    rest)."""
    config = fmt.config
    t, hkv, d = k.shape
    dev = k.device
    nb = max(1, -(-t // block_size))
    cache = allocate_cache(nb, hkv, block_size, d, scale_group=config.scale_group, device=dev,
                           key_format=fmt.key_format)
    kwargs: dict = {"config": config}
    extra: dict = {}
    if fmt.shared:  # calibrated: the file's smoothing, unless the first write (@N) takes it
        cal = calibration if config.key_smoothing == "calibrated" and not fmt.first_chunk else None
        kwargs["shared_state"] = allocate_shared_state(hkv, d, nb, calibration=cal, device=dev)
        extra = {"shared_state": kwargs["shared_state"]}
    elif config.uses_state:
        kwargs["seq_state"] = allocate_state(1, hkv, d, dev)
        kwargs["state_ids"] = torch.zeros(1, dtype=torch.int32, device=dev)
        extra = {"seq_state": kwargs["seq_state"]}
    first = t if fmt.first_chunk == 0 else min(fmt.first_chunk, t)
    for lo, hi in ((0, first), (first, t)):
        if hi <= lo:
            continue
        pos = torch.arange(lo, hi, device=dev)
        if fmt.shared:
            extra["positions"] = pos
        elif config.uses_state:
            extra["state_ids"] = torch.zeros(hi - lo, dtype=torch.int32, device=dev)
            extra["positions"] = pos
        reshape_and_cache_fp4(k[lo:hi], v[lo:hi], *cache, pos, config=config, **extra)
    table = torch.arange(nb, dtype=torch.int32, device=dev)[None]
    return WrittenCache(fmt, cache, table, torch.tensor([t], dtype=torch.int32, device=dev),
                        kwargs)


def sequence_rows(codes: torch.Tensor, scales: torch.Tensor, tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``tokens`` rows of the one sequence ``write_cache`` wrote (block i in physical
    block i): codes [T, Hkv, row] and scale bytes [T, Hkv, groups]."""
    nb, hkv, bs, row = codes.shape
    return (codes.transpose(1, 2).reshape(nb * bs, hkv, row)[:tokens],
            scales.reshape(nb * bs, hkv, -1)[:tokens])


def read_back(written: WrittenCache, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V a reader effectively uses, every transform undone: float32 [T, Hkv, D] each
    (position 0 from the sink record when the config keeps one)."""
    config = written.fmt.config
    record = state_records(written.kwargs, written.cache, written.block_tables, written.seq_lens)
    out = []
    for codes, scales, is_key in ((written.cache.key_cache, written.cache.key_scales, True),
                                  (written.cache.value_cache, written.cache.value_scales, False)):
        c, s = sequence_rows(codes, scales, tokens)
        if codes.dtype == torch.float8_e4m3fn:  # K8V4 keys
            x = dequantize_e4m3(c.view(torch.uint8), s[..., 0])
        else:
            x = dequantize_fp4(c, s, config.scale_group)
        if config.sink:
            x[0] = record[0, :, SINK_KEY if is_key else SINK_VALUE]
        if config.rotation:
            x = unrotate(x, rotation_signs(x.shape[-1], config.rotation_seed, x.device))
        if is_key and config.key_smoothing is not None:
            x = x * record[0, :, KEY_SCALE] + record[0, :, KEY_CENTER]
        out.append(x)
    return out[0], out[1]


def format_attention(layer: Layer, fmt: KVFormat, calibration: Optional[tuple] = None,
                     written: Optional[WrittenCache] = None) -> torch.Tensor:
    """Attention of all the layer's query tokens (one causal sequence) over its K/V stored in
    ``fmt``: -> [T, Hq, D] float32."""
    if fmt.is_fp8:
        return reference_attention(layer.q, *emulate_kv(layer.k, layer.v, fmt.name), layer.scale)
    if written is None:
        written = write_cache(layer.k, layer.v, fmt, calibration)
    t = layer.k.shape[0]
    cu = torch.tensor([0, layer.q.shape[0]], dtype=torch.int32, device=layer.q.device)
    return paged_attention_fp4(layer.q, *written.cache, written.block_tables, written.seq_lens,
                               float(layer.scale), cu_query_lens=cu, max_seq_len=t,
                               **written.kwargs).float()


def evaluate_layer(layer: Layer, fmt: KVFormat, reference: torch.Tensor,
                   calibration: Optional[tuple] = None) -> dict:
    """K/V SQNR (dB), attention-output cosine and relative error of one layer."""
    t = layer.k.shape[0]
    if fmt.is_fp8:
        k_hat, v_hat = emulate_kv(layer.k, layer.v, fmt.name)
        out = format_attention(layer, fmt)
    else:
        written = write_cache(layer.k, layer.v, fmt, calibration)
        k_hat, v_hat = read_back(written, t)
        out = format_attention(layer, fmt, calibration, written)
    o, r = out.flatten().double(), reference.flatten().double()
    return {
        "k_sqnr_db": sqnr_db(layer.k.float(), k_hat),
        "v_sqnr_db": sqnr_db(layer.v.float(), v_hat),
        "cosine": float(torch.nn.functional.cosine_similarity(o, r, dim=0)),
        "rel_err": float((o - r).norm() / r.norm()),
    }


def evaluate_layers(layers: Sequence[Layer], formats: Sequence[str], dataset: str,
                    layer_ids: Optional[Sequence[int]] = None,
                    calibration: Optional[dict] = None,
                    progress: Callable[[str], None] = lambda m: None) -> list[dict]:
    """One row per format, aggregated over the layers (``calibration``: layer id -> (m, lam))."""
    layer_ids = list(range(len(layers))) if layer_ids is None else list(layer_ids)
    per = {name: [] for name in formats}
    for i, (lid, layer) in enumerate(zip(layer_ids, layers)):
        progress(f"[{dataset}] layer {lid} ({i + 1}/{len(layers)}): "
                 f"{layer.q.shape[0]} tokens, formats {', '.join(formats)}")
        ref = reference_attention(layer.q, layer.k, layer.v, layer.scale)
        for name in formats:
            cal = None if calibration is None else calibration.get(lid)
            per[name].append(evaluate_layer(layer, parse_format(name), ref, cal))
    rows = []
    for name in formats:
        res = per[name]
        cos = [r["cosine"] for r in res]
        worst = min(range(len(res)), key=lambda j: cos[j])
        rows.append({
            "dataset": dataset, "option": name,
            "k_sqnr_db": _mean(r["k_sqnr_db"] for r in res),
            "v_sqnr_db": _mean(r["v_sqnr_db"] for r in res),
            "k_sqnr_worst_layer_db": min(r["k_sqnr_db"] for r in res),
            "v_sqnr_worst_layer_db": min(r["v_sqnr_db"] for r in res),
            "worst_layer_cosine": cos[worst], "worst_layer": layer_ids[worst],
            "mean_cosine": _mean(cos),
            "worst_layer_rel_err": max(r["rel_err"] for r in res),
            "mean_rel_err": _mean(r["rel_err"] for r in res),
            "kld": None, "top1": None, "ppl": None, "ppl_delta_pct": None,
            "layers": len(res), "tokens": int(layers[0].k.shape[0]) if layers else 0,
        })
    return rows


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


# --------------------------------------------------------------------------- synthetic data

SYN_HEADS, SYN_KV_HEADS, SYN_HEAD_DIM = 32, 8, 128
OUTLIER_CHANNELS, OUTLIER_GAIN = 4, 10.0


def synthetic_layers(kind: str, num_layers: int = 4, tokens: int = 512, *,
                     heads: int = SYN_HEADS, kv_heads: int = SYN_KV_HEADS,
                     head_dim: int = SYN_HEAD_DIM, seed: int = 0) -> list[Layer]:
    """``gaussian`` (Q, K, V ~ N(0, 1)) or ``outlier_keys`` (the same, with 4 fixed channels of K
    per kv head at 10x the standard deviation) layers, independent draws, bf16."""
    if kind not in ("gaussian", "outlier_keys"):
        raise ValueError(f"kind: expected 'gaussian' or 'outlier_keys', got {kind!r}")
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        q = torch.randn(tokens, heads, head_dim, generator=gen)
        k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
        v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
        if kind == "outlier_keys":
            for h in range(kv_heads):
                ch = torch.randperm(head_dim, generator=gen)[:OUTLIER_CHANNELS]
                k[:, h, ch] *= OUTLIER_GAIN
        layers.append(Layer(q.bfloat16(), k.bfloat16(), v.bfloat16(), head_dim ** -0.5))
    return layers
