"""What ``python -m turboquant bench`` reports: the fields of its rows, the printed table, the
files (``bench.json``, ``bench.csv``, ``bench_writer.csv``, ``bench.png``), the device's
metadata and the note on the highest read rate any row reached.

Time fields (``timing`` says how each is taken): ``fp4_us`` / ``sdpa_us`` are the chained
figures (call i's query = call i-1's output, what a model's layers see; GB/s, % of bandwidth and
speedups are computed from them), ``fp4_us_single`` / ``sdpa_us_single`` one call alone per
CUDA-graph replay; the peers' pair is ``peer_<fmt>_us`` / ``peer_<fmt>_us_single``.
"""
from __future__ import annotations

import csv
import json
import math
import os
import platform
from typing import Optional, Sequence

import torch

from . import peers

ATTENTION_FIELDS = [
    "shape",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "scale_group",
    "config",
    "batch",
    "context",
    "status",
    "backend",
    "timing",
    "n_sets",
    "calls_per_timing",
    "fp4_bytes",
    "fp4_us",
    "fp4_us_single",
    "fp4_GBps",
    "fp4_pct_bw",
    "floor_us",
    "sdpa_bytes",
    "sdpa_us",
    "sdpa_us_single",
    "sdpa_GBps",
    "sdpa_pct_bw",
    "sdpa_gqa",
    "speedup",
    "rel_err_vs_sdpa",
    "fp4_kernels",
    "fp4_kernel_us",
    "sdpa_kernels",
    "note",
] + peers.peer_fields()

WRITER_FIELDS = [
    "num_tokens",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "scale_group",
    "config",
    "dtype",
    "status",
    "backend",
    "timing",
    "bytes",
    "us",
    "GBps",
    "pct_bw",
    "note",
]


def fmt_value(v, spec: str) -> str:
    """``v`` formatted with ``spec``; '-' for an empty field, ``str(v)`` where spec fails."""
    if v == "" or v is None:
        return "-"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


HEADER = (f"{'shape':>9} {'batch':>5} {'ctx':>6} {'sets':>4} {'fp4_us':>8} {'single_us':>9} "
          f"{'fp4_GB/s':>8} {'%bw':>5} {'floor_us':>8} {'sdpa_us':>8} {'sdpa_single':>11} "
          f"{'sdpa_GB/s':>9} {'%bw':>5} {'speedup':>7} {'rel_err':>7} backend config")


def table_row(r: dict, keys: Sequence[tuple], cells: Sequence[tuple], tail: str) -> str:
    """A row of a printed table: ``keys`` ((field, width), ...) as they are, right-aligned,
    then, when the row ran (status ok), ``cells`` ((field, format spec), ...) through
    ``fmt_value`` in columns as wide as each spec says, ``tail`` and the row's note; else its
    status and note."""
    lead = " ".join(f"{r[k]:>{w}}" for k, w in keys)
    if r.get("status") != "ok":
        return f"{lead}  {r.get('status')}: {r.get('note', '')}"
    body = " ".join(f"{fmt_value(r[k], spec):>{int(spec.split('.')[0])}}" for k, spec in cells)
    line = f"{lead} {body} {tail}"
    if r.get("note"):
        line += "  # " + r["note"]
    return line


ROW_KEYS = (("shape", 9), ("batch", 5), ("context", 6))
ROW_CELLS = (("n_sets", "4"), ("fp4_us", "8.1f"), ("fp4_us_single", "9.1f"),
             ("fp4_GBps", "8.0f"), ("fp4_pct_bw", "5.1f"), ("floor_us", "8.1f"),
             ("sdpa_us", "8.1f"), ("sdpa_us_single", "11.1f"), ("sdpa_GBps", "9.0f"),
             ("sdpa_pct_bw", "5.1f"), ("speedup", "7.2f"), ("rel_err_vs_sdpa", "7.3f"))


def format_row(r: dict) -> str:
    """One attention row of the table (``HEADER``): chained and single times of FP4 and SDPA,
    GB/s and % of bandwidth from the chained times."""
    return table_row(r, ROW_KEYS, ROW_CELLS,
                     f"{r.get('backend', '')}/{r.get('timing', '')} {r.get('config', '')}")


def format_writer(w: dict) -> str:
    if w.get("status") != "ok":
        return f"cache writer: {w.get('status')}: {w.get('note', '')}"
    return (f"cache writer ({w['backend']}/{w['timing']}, {w['config']}): {w['num_tokens']} "
            f"tokens x {w['num_kv_heads']} kv heads x D {w['head_dim']} {w['dtype']}: "
            f"{w['us']:.1f} us, {w['GBps']:.0f} GB/s, {fmt_value(w['pct_bw'], '.1f')}% of "
            f"measured read bandwidth (bytes {w['bytes']} = input read + codes + scales "
            "written)" + (f"  # {w['note']}" if w.get("note") else ""))


def write_csv(path: str, rows: list, fields: list) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def write_plot(path: str, rows: list, bandwidth: dict, title: str) -> Optional[str]:
    """Roofline-style plot (GB/s from the chained times); returns None when written, else why
    not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("matplotlib is not installed: bench.png not written (pip install matplotlib; "
                "bench.json and bench.csv hold every number)")
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return "no completed rows: bench.png not written"
    fig, ax = plt.subplots(figsize=(9, 6))
    shapes = sorted({r["shape"] for r in ok})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, shp in enumerate(shapes):
        rs = [r for r in ok if r["shape"] == shp]
        c = colors[i % len(colors)]
        ax.scatter([r["fp4_bytes"] for r in rs], [r["fp4_GBps"] for r in rs], color=c,
                   marker="o", label=f"FP4 paged {shp}")
        rs2 = [r for r in rs if r.get("sdpa_GBps") not in ("", None)]
        if rs2:
            ax.scatter([r["sdpa_bytes"] for r in rs2], [r["sdpa_GBps"] for r in rs2], color=c,
                       marker="x", label=f"SDPA dense BF16 {shp}")
    bw = bandwidth.get("read_GBps")
    if bw:
        ax.axhline(bw, color="k", linestyle="-", linewidth=1,
                   label=f"measured HBM read {bw:.0f} GB/s")
    cbw = bandwidth.get("copy_GBps")
    if cbw and math.isfinite(cbw):
        ax.axhline(cbw, color="gray", linestyle="--", linewidth=1,
                   label=f"measured copy (read+write) {cbw:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_xlabel("bytes moved per call (K/V + scales + Q + O)")
    ax.set_ylabel("achieved GB/s (1e9 B/s), chained calls")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_files(out_dir: str, doc: dict, rows: list, writers: list,
                plot_title: Optional[str]) -> tuple:
    """``bench.json`` (``doc``), ``bench.csv`` (``rows``), ``bench_writer.csv`` (where there are
    ``writers``) and, unless ``plot_title`` is None, ``bench.png`` in ``out_dir``.
    -> (the names written, why bench.png was not written or None)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as fh:
        json.dump(doc, fh, indent=2, default=str)
    write_csv(os.path.join(out_dir, "bench.csv"), rows, ATTENTION_FIELDS)
    written = ["bench.json", "bench.csv"]
    if writers:
        write_csv(os.path.join(out_dir, "bench_writer.csv"), writers, WRITER_FIELDS)
        written.append("bench_writer.csv")
    plot_msg = None
    if plot_title is not None:
        plot_msg = write_plot(os.path.join(out_dir, "bench.png"), rows, doc["bandwidth"],
                              plot_title)
        if not plot_msg:
            written.append("bench.png")
    return written, plot_msg


def device_meta(device: torch.device) -> dict:
    """The device, torch and python versions (and on a GPU its name, SM, memory and L2)."""
    meta = {"device": str(device), "torch": torch.__version__,
            "python": platform.python_version()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta.update(name=p.name, sm=f"{p.major}.{p.minor}",
                    multiprocessors=p.multi_processor_count, memory_bytes=p.total_memory,
                    l2_bytes=int(getattr(p, "L2_cache_size", 0) or 50 * 2**20),
                    cuda=torch.version.cuda)
    else:
        meta.update(name=platform.processor() or platform.machine(), l2_bytes=0)
    return meta


def note_max_observed(rows: list, bandwidth: dict) -> str:
    """A kernel that reads faster than the read-only kernels (cuDNN SDPA did, by 2-3%, on an
    H100) shows the memory delivers at least that: record the highest rate any row reached
    in ``bandwidth['max_observed_GBps']`` and return a note with the FP4 rows' share of it
    ('' when no row beat the read figure)."""
    bw = bandwidth["reference_GBps"]
    ok = [r for r in rows if r.get("status") == "ok"]
    observed = [(r.get(k), k[:-5], r) for r in ok for k in ("sdpa_GBps", "fp4_GBps")]
    observed = [o for o in observed if isinstance(o[0], float) and math.isfinite(o[0])]
    if not observed:
        return ""
    top, kind, r = max(observed, key=lambda o: o[0])
    bandwidth["max_observed_GBps"] = max(top, bw)
    if top <= bw:
        return ""
    bandwidth["max_observed_by"] = f"{kind} {r['shape']} batch {r['batch']} context {r['context']}"
    shares = ", ".join(f"{100 * x['fp4_GBps'] / top:.0f}" for x in ok)
    return (f"note: {bandwidth['max_observed_by']} read at {top:.0f} GB/s, "
            f"{100 * top / bw:.1f}% of the read-kernel figure, so the memory delivers at least "
            f"that; the FP4 rows reach {shares}% of it")
