"""Does the FP8 warpgroup decode's arithmetic cost model quality (issue 43)? KLD and top-1 of a
real model against its unquantized self, with the default FP4 cache read (a) as the library's
kernels read it (fp32 arithmetic on the stored values: the reference backend) and (b) with the
arithmetic of benchmarks/wgmma_decode_probe.cu emulated in torch, next to the FP8 anchor, in
one run. CPU; the models and text of ``python -m turboquant accuracy``.

The probe's arithmetic, emulated per (query row, kv head) on the cache as written (codes and
E8M0 scales, the transforms' stored domain):
- Q after the reader's transforms (smoothing scale, rotation) times 2^qe, qe such that the row's
  largest |q| lies in [128, 256), rounded to E4M3 in one term, or two (hi, lo = q - hi).
- S = Q . K exactly (E2M1 codes are exact in E4M3; fp32 accumulation), times the key scale.
- Logits in the exp2 domain with the value's scale exponent e_v added; keys in 64-token steps
  from position 0 (the decode kernel's order), each step's P' = 2^(x - m_s + 8) against the
  running maximum m_s after that step, rounded to E4M3 in one or two terms; O accumulates
  P' x codes, rescaled exactly when m grows; l sums the unrounded P' 2^-e_v.
- The sink token (position 0 under the default config) in fp32, unrounded, as the kernels
  keep it apart.
Each emulated row is first checked with rounding off against the library's output. The same
rows on the unquantized K and V (no transforms; V's exponent that of a per-token E8M0 scale,
checked against fp32 attention) give the arithmetic's cost alone, apart from FP4's noise.

    python benchmarks/fp8_arithmetic_accuracy.py [--model smollm2|gemma3] [--tokens N]
        [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turboquant.accuracy import models  # noqa: E402
from turboquant.accuracy.formats import (BLOCK_SIZE, format_attention, parse_format,  # noqa: E402
                                         reference_attention, sequence_rows, write_cache)
from turboquant.api import prepare_attention  # noqa: E402
from turboquant.cache import state_records  # noqa: E402
from turboquant.format import dequantize_fp4  # noqa: E402
from turboquant.reference import attention_reference  # noqa: E402
from turboquant.rotation import rotate, rotation_signs, unrotate  # noqa: E402
from turboquant.smoothing import KEY_SCALE, SINK_KEY, SINK_VALUE  # noqa: E402

STEP = 64  # keys per step of the probe's kernel
LOG2E = 1.0 / math.log(2.0)
# (label, Q terms, P terms); 0 terms: no rounding (the check against the library)
ARITHMETIC = (("E4M3 Q and P, one term", 1, 1), ("E4M3 Q two terms, P one", 2, 1),
              ("E4M3 Q one term, P two", 1, 2), ("E4M3 Q and P, two terms", 2, 2))


def e4m3(x: torch.Tensor, terms: int) -> torch.Tensor:
    """x rounded to E4M3 (nearest, ties to even) in ``terms`` terms: hi, then hi + e4m3(x - hi)."""
    if terms == 0:
        return x
    hi = x.to(torch.float8_e4m3fn).float()
    if terms == 1:
        return hi
    return hi + (x - hi).to(torch.float8_e4m3fn).float()


def stored(written, tokens: int):
    """Values in the stored domain [T, Hkv, D] and scale exponents [T, Hkv] of K and V."""
    out = []
    for codes, scales in ((written.cache.key_cache, written.cache.key_scales),
                          (written.cache.value_cache, written.cache.value_scales)):
        c, s = sequence_rows(codes, scales, tokens)
        out.append((dequantize_fp4(c, s, written.fmt.config.scale_group),
                    s[..., 0].float() - 127.0))
    return out


def emulated_attention(layer, fmt, q_terms: int, p_terms: int, calibration=None) -> torch.Tensor:
    """The layer's causal attention [T, Hq, D] float32 with the probe's arithmetic; fmt None:
    on the unquantized K and V (no transforms; V's exponent that of a per-token FP4 scale), the
    arithmetic's own error alone."""
    t, hkv, d = layer.k.shape
    hq = layer.q.shape[1]
    g = hq // hkv
    q = layer.q.float().view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d)
    signs, sink = None, False
    if fmt is None:
        k, v = layer.k.float(), layer.v.float()
        amax = v.abs().amax(-1).clamp_min(1e-30)
        ev = torch.ceil(torch.log2(amax / 6.0))  # the exponent an E8M0 scale of V would have
    else:
        config = fmt.config
        if config.scale_group is not None:
            raise ValueError("the probe reads one scale per (token, kv head)")
        written = write_cache(layer.k, layer.v, fmt, calibration)
        (k, _), (v, ev) = stored(written, t)
        record = state_records(written.kwargs, written.cache, written.block_tables,
                               written.seq_lens)
        if record is not None:  # as the reference: the smoothing scale (ones without smoothing)
            q = q * record[0, :, KEY_SCALE, None]
        signs = rotation_signs(d, config.rotation_seed, q.device) if config.rotation else None
        if signs is not None:
            q = rotate(q, signs)
        sink = bool(config.sink)
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, T, D]
    ev = ev.transpose(0, 1)  # [Hkv, T]
    if sink:
        k[:, 0], v[:, 0] = record[0, :, SINK_KEY], record[0, :, SINK_VALUE]
        ev[:, 0] = 0.0  # exact, apart
    # Q in E4M3 terms, per row, against its largest element
    amax = q.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    qs = torch.exp2(7.0 - torch.floor(torch.log2(amax)))
    qr = e4m3(q * qs, q_terms) / qs
    logits = torch.matmul(qr, k.transpose(1, 2)) * layer.scale  # [Hkv, g*T, T]
    if sink:
        logits[..., 0] = torch.matmul(q, k[:, 0, :, None])[..., 0] * layer.scale
    pos = torch.arange(t, device=q.device).repeat(g)  # row r -> query r % T
    visible = torch.arange(t, device=q.device)[None, :] <= pos[:, None]
    x = torch.where(visible, logits * LOG2E + ev[:, None, :], float("-inf"))
    # running maximum after each 64-key step; each key's P' against its step's
    steps = -(-t // STEP)
    pad = steps * STEP - t
    xs = torch.nn.functional.pad(x, (0, pad), value=float("-inf")).view(hkv, g * t, steps, STEP)
    m_step = torch.cummax(xs.amax(-1), dim=-1).values  # [Hkv, rows, steps]
    m_key = m_step.repeat_interleave(STEP, dim=-1)[..., :t]
    m_fin = m_step[..., -1:]
    p = torch.exp2(x - m_key)  # <= 1; 0 where not visible
    pr = e4m3(p * 256.0, p_terms) / 256.0
    if sink:
        pr[..., 0] = p[..., 0]
    scale_to_fin = torch.exp2(m_key - m_fin)  # the exact rescales of O and l
    w = pr * scale_to_fin * torch.exp2(-ev)[:, None, :]  # times V's stored values
    l_sum = (p * scale_to_fin * torch.exp2(-ev)[:, None, :]).sum(-1, keepdim=True)
    o = torch.matmul(w, v) / l_sum
    if signs is not None:
        o = unrotate(o, signs)
    return o.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)


def library_fp32(layer, fmt, calibration=None) -> torch.Tensor:
    """The reference backend's output of the harness's call, kept in float32 (the API returns
    the query's bf16): the check of the emulation without rounding."""
    written = write_cache(layer.k, layer.v, fmt, calibration)
    t = layer.k.shape[0]
    cu = torch.tensor([0, layer.q.shape[0]], dtype=torch.int32)
    call = prepare_attention(layer.q, *written.cache, written.block_tables, written.seq_lens,
                             float(layer.scale), cu_query_lens=cu, max_seq_len=t,
                             **written.kwargs)
    out = torch.empty(layer.q.shape, dtype=torch.float32)
    attention_reference(call, out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(models.MODELS))
    ap.add_argument("--tokens", type=int, default=None, help="first N tokens of the text")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    path = models.find_model_path(args.model)
    net, tok = models.load_model(path)
    eval_path, _ = models.text_paths()
    ids = tok(models.load_text(eval_path), return_tensors="pt").input_ids
    if args.tokens is not None:
        ids = ids[:, :args.tokens]
    with models.hooked():
        ref = models.log_probs(net, ids)
    fmt = parse_format("default")
    rows = []

    def run(label, attention):
        saved = models.format_attention
        models.format_attention = attention
        try:
            with models.hooked(fmt=fmt):
                row = models.compare(ref, models.log_probs(net, ids), ids)
        finally:
            models.format_attention = saved
        row["option"] = label
        rows.append(row)
        print(f"{label:52s} KLD {row['kld']:.4f}  top-1 {100 * row['top1']:.1f} %  "
              f"perplexity {row['ppl_delta_pct']:+.2f} %", flush=True)

    worst = 0.0

    def checked(q_terms, p_terms, quantized=True):
        """The emulation as the harness's attention, checked without rounding first: against
        the library's output (bf16, as the query), or fp32 attention on the unquantized K, V."""
        def attention(layer, f, calibration=None, written=None):
            nonlocal worst
            f = f if quantized else None
            if quantized:
                want = library_fp32(layer, f, calibration)
            else:
                want = reference_attention(layer.q, layer.k, layer.v, layer.scale)
            exact = emulated_attention(layer, f, 0, 0, calibration)
            err = float((exact - want).norm() / want.norm())
            worst = max(worst, err)
            if err > 1e-5:
                against = ("the library's output: it does not read the cache as the kernels "
                           "do" if quantized else "fp32 attention on the unquantized K, V")
                raise AssertionError(f"the emulation without rounding is {err:.2e} off {against}")
            return emulated_attention(layer, f, q_terms, p_terms, calibration).to(
                layer.q.dtype).float()
        return attention

    run("library (fp32 arithmetic)", format_attention)
    for label, qt, pt in ARITHMETIC:
        run(label, checked(qt, pt))
    for label, qt, pt in ARITHMETIC:  # the arithmetic alone, on the unquantized cache
        run(f"{label}, unquantized K V", checked(qt, pt, quantized=False))
    with models.hooked(bf16=True):
        row = models.compare(ref, models.log_probs(net, ids), ids)
    row["option"] = "bf16 Q K V and output (control)"
    rows.append(row)
    fp8 = parse_format("fp8")
    with models.hooked(fmt=fp8):
        row = models.compare(ref, models.log_probs(net, ids), ids)
    row["option"] = "FP8 E4M3 cache (anchor)"
    rows.append(row)
    for row in rows[-2:]:
        print(f"{row['option']:52s} KLD {row['kld']:.4f}  top-1 {100 * row['top1']:.1f} %  "
              f"perplexity {row['ppl_delta_pct']:+.2f} %")
    print(f"{args.model}, {ids.shape[1]} tokens, block {BLOCK_SIZE}; the emulation without "
          f"rounding against its references: worst rel error {worst:.1e}; "
          f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "tokens": int(ids.shape[1]),
                                         "check_worst_rel": worst, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
