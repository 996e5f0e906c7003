"""Generation quality through the serving path: a real model generates with its KV cache held in
turboquant's format (``turboquant.integration.transformers.PagedKVCache``: batched prefill of
left-padded prompts, then token-by-token decode), against the same model with its unquantized
cache, FP8 beside it in the same run.

Per format, over P prompts x N generated tokens:
- teacher-forced along the unquantized model's greedy continuation (each step's input is the
  reference token, so every step is compared on the same context): mean KL divergence of the
  next-token distributions (nats) and top-1 agreement;
- free-running greedy generation: the share of prompts whose N tokens equal the reference's, and
  the tokens to the first divergence (mean, median);
- the KV bytes per token and layer the cache holds.
Rows: ``control`` (the unquantized cache through the same loop: the harness's own noise), ``fp8``
(E4M3 keys and values with scale 1.0, vLLM's ``fp8``; emulated in a dynamic cache), ``k8v4``
and ``fp4`` (turboquant's caches; the layer smoothing from the calibration text unless
``--smoothing first``: taken by the first write, the batched prefill, as a server without a
calibration file does).

Prompts: P windows of the evaluation text (turboquant/data/accuracy_text.txt) of 16 to 200
tokens, starting at spread offsets.

    python benchmarks/generation_quality.py --model smollm2 --prompts 32 --new-tokens 128 \
        --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turboquant.accuracy.formats import fp8_round  # noqa: E402
from turboquant.accuracy.models import (CALIBRATION_TEXT_PATH, calibrate_model,  # noqa: E402
                                        find_model_path, load_model, load_text)
from turboquant.integration.transformers import PagedKVCache  # noqa: E402

FORMATS = ("control", "fp8", "k8v4", "fp4")


def prompts(tok, count: int) -> list:
    """``count`` windows of the evaluation text: lengths 16..200 tokens, spread starts."""
    ids = tok(load_text(), return_tensors="pt").input_ids[0]
    out = []
    for i in range(count):
        n = 16 + (i * 61) % 185
        start = (i * 137) % max(1, len(ids) - n)
        out.append(ids[start:start + n])
    return out


def left_padded(seqs: list, pad_id: int) -> tuple:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], mask[i, width - len(s):] = s, 1
    return ids, mask


def make_cache(fmt: str, model, rows: int, length: int, calibration):
    from transformers import DynamicCache

    if fmt in ("control", "fp8"):
        model.set_attn_implementation("sdpa")
        if fmt == "control":
            return DynamicCache(config=model.config)

        class FP8Cache(DynamicCache):  # what an E4M3 cache with scale 1.0 holds
            def update(self, k, v, layer_idx, *args, **kwargs):
                return super().update(fp8_round(k, False).to(k.dtype),
                                      fp8_round(v, False).to(v.dtype), layer_idx, *args, **kwargs)

        return FP8Cache(config=model.config)
    return PagedKVCache(model, rows, length, kv_cache_dtype={"fp4": "tq_fp4",
                                                              "k8v4": "tq_k8v4"}[fmt],
                        calibration=calibration)


def teacher_forced(model, cache, ids, mask, targets, each) -> None:
    """``each(t, log_probs [rows, vocab])`` for each step t, the inputs being the prompt then
    ``targets`` [rows, N] one token per step (the serving path: one prefill, then decode
    steps)."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                       past_key_values=cache, use_cache=True).logits[:, -1]
        for t in range(targets.shape[1]):
            each(t, logits.double().log_softmax(-1))
            if t + 1 == targets.shape[1]:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = mask.sum(-1, keepdim=True) - 1
            logits = model(input_ids=targets[:, t:t + 1], attention_mask=mask, position_ids=pos,
                           past_key_values=cache, use_cache=True).logits[:, -1]


def greedy(model, cache, ids, mask, n: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[:, ids.shape[1]:]


def kv_bytes_per_token_layer(fmt: str, cfg) -> float:
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_head = {"control": 4 * d, "fp8": 2 * d, "k8v4": d + d // 2 + 2,
                "fp4": d + 2}[fmt]  # control as BF16 (this run keeps fp32)
    return per_head * cfg.num_key_value_heads


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--smoothing", choices=("calibration", "first"), default="calibration")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        ap.error(f"--formats: unknown {bad}; expected some of {FORMATS}")
    t0 = time.perf_counter()
    model, tok = load_model(find_model_path(args.model))
    cfg = model.config
    seqs = prompts(tok, args.prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids, mask = left_padded(seqs, pad)
    n = args.new_tokens
    length = ids.shape[1] + n + 1
    calibration = None
    if args.smoothing == "calibration":
        cal = calibrate_model(model, tok, load_text(CALIBRATION_TEXT_PATH))
        calibration = [cal[i] for i in range(cfg.num_hidden_layers)]
    model.set_attn_implementation("sdpa")
    ref_tokens = greedy(model, make_cache("control", model, 0, 0, None), ids, mask, n)
    ref_lp = torch.empty(len(seqs), n, model.config.get_text_config().vocab_size)  # float32

    def keep(t, lp):
        ref_lp[:, t] = lp[:, :ref_lp.shape[2]]

    teacher_forced(model, make_cache("control", model, 0, 0, None), ids, mask, ref_tokens, keep)
    print(f"reference: {len(seqs)} prompts ({min(map(len, seqs))}-{max(map(len, seqs))} "
          f"tokens) x {n} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
    rows = {}
    for fmt in formats:
        t1 = time.perf_counter()
        kld, top1 = torch.zeros(len(seqs), n), torch.zeros(len(seqs), n)

        def compare(t, lp):
            ref = ref_lp[:, t].double()
            lp = lp[:, :ref.shape[1]]
            kld[:, t] = (ref.exp() * (ref - lp)).sum(-1)
            top1[:, t] = (lp.argmax(-1) == ref.argmax(-1)).float()

        teacher_forced(model, make_cache(fmt, model, len(seqs), length, calibration), ids, mask,
                       ref_tokens, compare)
        toks = greedy(model, make_cache(fmt, model, len(seqs), length, calibration), ids, mask, n)
        same = toks == ref_tokens
        first = [int((~row).nonzero()[0]) if not row.all() else n for row in same]
        rows[fmt] = {"kld": float(kld.mean()), "top1": float(top1.mean()),
                     "exact_match": sum(f == n for f in first) / len(first),
                     "first_divergence_mean": statistics.mean(first),
                     "first_divergence_median": statistics.median(first),
                     "kv_bytes_per_token_layer": kv_bytes_per_token_layer(fmt, cfg),
                     "seconds": round(time.perf_counter() - t1, 1)}
        r = rows[fmt]
        print(f"{fmt:8s} KLD {r['kld']:.4f}  top-1 {100 * r['top1']:.1f} %  exact "
              f"{100 * r['exact_match']:.0f} %  first divergence mean "
              f"{r['first_divergence_mean']:.1f} median {r['first_divergence_median']:.0f}  "
              f"({r['seconds']:.0f} s)", flush=True)
    result = {"model": args.model, "prompts": len(seqs), "new_tokens": n,
              "prompt_tokens": [len(s) for s in seqs], "smoothing": args.smoothing,
              "rows": rows, "torch": torch.__version__}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
