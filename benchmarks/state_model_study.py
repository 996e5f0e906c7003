"""Issue 39: what a state that engines can share costs in accuracy (CPU, reference backend).

The shared state the issue weighs keeps nothing per sequence: key smoothing per layer (m, lam
taken once, from the first keys a layer's cache sees, or from a calibration file) and the sink
(position 0's fp32 K and V) in a per-layer table addressed by the content of position 0's FP4
bytes. When the table holds the entry, a read gets exactly the values today's per-sequence
record holds; when it does not (evicted by another first token), position 0 is read from its
FP4 bytes. This script measures each piece with the accuracy harness (`python -m turboquant
accuracy`'s model runs: KLD and top-1 against the unquantized model, FP8 beside it):

- ``calib@N``: key smoothing per layer from the first N tokens of the calibration text (a
  different text from the one evaluated: the first request an engine serves), N = 1 (no key
  past position 0: m = 0, lam = 1), 16, 256 or the whole text, with the sink;
- ``sink=DTYPE``: the sink's K and V stored as bf16 or E4M3 (one fp32 scale per row) instead
  of fp32, calibrated smoothing (whole text);
- ``sink miss``: the table never holds the entry (position 0 from its FP4 bytes):
  ``rotation+calibrated``.

    python benchmarks/state_model_study.py [--models smollm2,gemma3] [--calib-tokens 1,16,256,0]
                                           [--sink-dtypes bf16,e4m3] [--tokens N] [--json FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import turboquant.api as api  # noqa: E402
from turboquant.accuracy import models as M  # noqa: E402
from turboquant.accuracy.formats import parse_format  # noqa: E402
from turboquant.smoothing import SINK_KEY, SINK_VALUE  # noqa: E402

E4M3_MAX = 448.0


def round_rows(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """x [..., D] fp32 stored as ``dtype`` and read back: bf16, or E4M3 with one fp32 scale per
    row (amax / 448)."""
    if dtype == "bf16":
        return x.to(torch.bfloat16).float()
    if dtype == "e4m3":
        s = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(2.0 ** -126)
        return (x / s).to(torch.float8_e4m3fn).float() * s
    raise ValueError(f"--sink-dtypes: expected bf16 or e4m3, got {dtype!r}")


@contextlib.contextmanager
def sink_stored_as(dtype):
    """The writer's sink rows rounded to ``dtype`` (None: fp32, unchanged) as they are filled."""
    if dtype is None:
        yield
        return
    original = api.init_state

    def init_state(key, value, seq_state, state_ids, positions, *args, **kwargs):
        original(key, value, seq_state, state_ids, positions, *args, **kwargs)
        for row in (SINK_KEY, SINK_VALUE):
            seq_state[:, :, row] = round_rows(seq_state[:, :, row], dtype)

    api.init_state = init_state
    try:
        yield
    finally:
        api.init_state = original


def first_tokens(tok, text: str, n: int) -> str:
    """The text of the first n tokens of ``text`` (n = 0: all of it)."""
    ids = tok(text).input_ids
    return text if n == 0 or n >= len(ids) else tok.decode(ids[:n])


def run(model: str, calib_tokens, sink_dtypes, tokens, progress) -> list[dict]:
    net, tok = M.load_model(M.find_model_path(model), "cpu")
    ids = tok(M.load_text(), return_tensors="pt").input_ids
    if tokens:
        ids = ids[:, :tokens]
    ref = M.log_probs(net, ids)
    calib_text = M.load_text(M.CALIBRATION_TEXT_PATH)
    full = M.calibrate_model(net, tok, calib_text)
    runs = [("fp8", "fp8", None, None), ("default (per-sequence record)", "default", None, None),
            ("sink miss: rotation+calibrated", "rotation+calibrated", full, None)]
    for n in calib_tokens:
        cal = full if n == 0 else M.calibrate_model(net, tok, first_tokens(tok, calib_text, n))
        runs.append((f"calib@{n or 'all'} + sink fp32", "rotation+calibrated+sink", cal, None))
    for dt in sink_dtypes:
        runs.append((f"calib@all + sink {dt}", "rotation+calibrated+sink", full, dt))
    rows = []
    for label, option, cal, dt in runs:
        t0 = time.perf_counter()
        with sink_stored_as(dt), M.hooked(fmt=parse_format(option), calibration=cal):
            r = M.compare(ref, M.log_probs(net, ids), ids)  # the format in every layer
        row = {"model": model, "run": label, "option": option, "kld": r["kld"],
               "top1": r["top1"], "ppl_delta_pct": r["ppl_delta_pct"],
               "tokens": int(ids.shape[1]), "s": time.perf_counter() - t0}
        progress(f"[{model}] {label}: KLD {row['kld']:.4f}, top-1 {100 * row['top1']:.1f} %")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2")
    p.add_argument("--calib-tokens", default="1,16,256,0",
                   help="calibration text prefixes in tokens (0: all of it)")
    p.add_argument("--sink-dtypes", default="bf16,e4m3")
    p.add_argument("--tokens", type=int, default=0, help="evaluate the first N tokens (0: all)")
    p.add_argument("--json", help="write the rows to FILE")
    a = p.parse_args(argv)
    calib = [int(x) for x in a.calib_tokens.split(",") if x != ""]
    sinks = [x for x in a.sink_dtypes.split(",") if x]
    rows = []
    for model in a.models.split(","):
        rows += run(model, calib, sinks, a.tokens, lambda m: print(m, file=sys.stderr, flush=True))
    print("| model | run | KLD | top-1 | ppl delta |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['run']} | {r['kld']:.4f} | {100 * r['top1']:.1f} % | "
              f"{r['ppl_delta_pct']:+.2f} % |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
