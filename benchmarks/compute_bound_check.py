"""Does the cuda decode kernel's instruction count set its time when memory is not the limit?
A direct check of benchmarks/isa_model.py's instruction -> time part, apart from its overlap
term (issue 20). One device call, no arguments needed:

    python benchmarks/compute_bound_check.py [--out DIR]     # default ./cb_out; < 90 s once
                                                             # the cuda extension is built

turboquant.paged_attention_fp4 (backend cuda, public API, plain config, value checks off) on
32 q / 8 kv heads, D 128, bf16, block 16, FP4 and K8V4 caches, batch x context 64 x 8k,
64 x 16k and 128 x 4k, timed as a CUDA graph of 8 calls (benchmarks/tune_cuda.py bench_graph:
the median of 20 replays), in two variants of the same problem:

  hbm  the block table is a permutation of distinct blocks (the bench's problem, HBM-bound);
  l2   every block-table entry is one of 64 blocks (1.1 MB of FP4 cache, 1.6 MB of K8V4: L2
       resident), so the bytes come from L2 and the kernel is bound by its instruction issue.

From l2: measured SM clocks per 16-token tile per SM = time x SM clock x 132 SMs / tiles
(tiles = batch x 8 kv heads x context / 16), per shape and as the slope between 64 x 8k and
64 x 16k (the same partitioning, so the per-call costs cancel), next to isa_model.py's
issue-bound clocks per tile (binding pipe, and issue slots alone) counted in the SASS of the
library that ran (cuobjdump of the loaded extension). The SM clock is nvidia-smi's clocks.sm
sampled while l2 calls run (else torch.cuda.clock_rate, else isa_model's 1.98 GHz); the output
says which. From hbm: % of the measured read bandwidth next to isa_model's call model.
Before timing, a 2 x 1k case of each variant and format is compared with the reference backend.
On SM 9.x the FP4 rows run the SM90a FP8 decode kernel (attention_decode_wgmma.cuh), and its
SASS step is the one counted: its l2 rows' measured / predicted is that kernel's own dependency
factor, which isa_model.py reads from benchmarks/results/2026-11-29-h200-isa-model-dependency-fp8.json
(docs/performance.md).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
import isa_model as im  # noqa: E402
import turboquant as tq  # noqa: E402
from benchmarks.tune_cuda import bench_graph, hbm_bandwidth  # noqa: E402
from turboquant._backends import cuda as tq_cuda  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
SHAPES = [(64, 8192), (64, 16384), (128, 4096)]
SLOPE = ((64, 8192), (64, 16384))
POOL = 64  # blocks of the l2 variant
FORMATS = {"FP4": ("fp4", im.CUDA_DECODE, im.FP4_TILE_BYTES),
           "K8V4": ("fp8_e4m3", im.CUDA_DECODE_K8V4, im.K8V4_TILE_BYTES)}
PLAIN = tq.QuantConfig.parse("plain")


def problem(batch: int, context: int, key_format: str, variant: str, gen: torch.Generator):
    """(call, bytes the call must read and write) for one variant; codes random (E4M3 keys
    without the NaN encodings), scale bytes 118..123 as in tune_cuda.py."""
    dev = torch.device("cuda")
    nbps = -(-context // BS)
    nblocks = batch * nbps if variant == "hbm" else POOL
    cache = tq.allocate_cache(nblocks, HKV, BS, D, key_format=key_format, device=dev)
    for t in cache[:2]:
        u8 = t.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, device=dev, generator=gen))
    if key_format == "fp8_e4m3":
        cache[0].view(torch.uint8).bitwise_and_(0xF7)  # exponent never 1111: no NaN
    for t in cache[2:]:
        t.copy_(torch.randint(118, 124, t.shape, dtype=torch.uint8, device=dev, generator=gen))
    if variant == "hbm":
        table = torch.randperm(nblocks, device=dev, generator=gen).to(torch.int32).view(batch, nbps)
    else:
        table = torch.randint(0, POOL, (batch, nbps), device=dev, generator=gen, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
    out = torch.empty_like(q)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)

    def call(backend: str = "cuda", o=out):
        return tq.paged_attention_fp4(q, *cache, table, lens, D ** -0.5, out=o, backend=backend,
                                      max_seq_len=context, config=PLAIN)
    key_bytes = D if key_format == "fp8_e4m3" else D // 2
    nbytes = batch * context * HKV * (key_bytes + D // 2 + 2) + 2 * batch * HQ * D * 2
    return call, nbytes


def check_small(gen) -> list:
    """Each format and variant at 2 x 1k against the reference backend (relative L2 error)."""
    rows = []
    for name, (fmt, _, _) in FORMATS.items():
        for variant in ("hbm", "l2"):
            call, _ = problem(2, 1024, fmt, variant, gen)
            got = call("cuda").float()
            ref = call("reference", None).float()
            err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
            rows.append({"format": name, "variant": variant, "rel_err": err,
                         "ok": math.isfinite(err) and err < 1e-2})
    return rows


def loaded_library() -> str | None:
    """Path of the loaded turboquant cuda extension (from /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    libs = sorted({m.group(1) for m in re.finditer(r"(/\S*turboquant_cuda\S*\.so)\s*$", maps, re.M)})
    return libs[0] if libs else None


def decode_kernel(name: str, major: int) -> tuple[str, str]:
    """(mangled name, MMA opcode of its step) of the decode kernel a format's calls run on a
    device of compute capability `major`: FP4 keys at D 128 on SM 9.x run the SM90a FP8
    warpgroup kernel (attention_launch.cuh use_decode_wgmma; G = 4 here), the rest the
    warp-MMA decode kernel."""
    if name == "FP4" and major == 9:
        return im.CUDA_DECODE_WGMMA, "QGMMA"
    return FORMATS[name][1], "HMMA"


def predicted_clocks(lib: str | None, major: int) -> dict:
    """isa_model's issue-bound SM clocks per tile of each format, from the library's SASS (one
    warp's 16-token tile: a 64-token step of the FP8 kernel's warpgroup, each warp's 16 tokens),
    for the kernel the format runs on this device."""
    from _tools import find_tool
    cuobjdump = find_tool("cuobjdump")
    if lib is None or cuobjdump is None:
        return {"source": f"unavailable (library {lib}, cuobjdump {cuobjdump})"}
    sass = subprocess.run([cuobjdump, "-sass", lib], capture_output=True, text=True).stdout
    funcs = im.parse_sass(sass)
    out = {"source": f"cuobjdump -sass {lib}"}
    for name in FORMATS:
        mangled, mma = decode_kernel(name, major)
        code = funcs.get(mangled)
        if not code:
            out[name] = None
            continue
        head, back = im.find_key_loop(code, mma=mma)
        counts = im.count_classes(im.hot_path(code, head, back))
        cyc = (im.nvidia_tile_cycles(counts, im.nvidia_gpus()["h100"]) if mma == "QGMMA"
               else im.cuda_tile_cycles(counts))
        out[name] = {"kernel": "SM90a FP8 decode" if mma == "QGMMA" else "decode",
                     "sm_clk": cyc["sm_clk"], "bound": cyc["bound"],
                     "issue_slots_sm_clk": counts["total"] / im.H100().schedulers,
                     "instructions": counts["total"]}
    return out


def sm_clock_during(call, seconds: float = 0.4) -> tuple[float, str]:
    """The SM clock (GHz) while `call` runs: queue ~`seconds` of calls, sample nvidia-smi
    twice, then wait. Falls back to torch.cuda.clock_rate, then to isa_model's clock."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-5)
    for _ in range(max(1, int(seconds / one))):
        call()
    samples = []
    for _ in range(2):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True,
                               timeout=10)
            cur, mx = (float(x) for x in r.stdout.splitlines()[0].split(","))
            samples.append(cur)
        except Exception:  # noqa: BLE001 - no nvidia-smi: the next source
            break
    torch.cuda.synchronize()
    if samples:
        return sum(samples) / len(samples) / 1e3, (f"nvidia-smi clocks.sm during the l2 calls "
                                                   f"({', '.join(f'{s:.0f}' for s in samples)} MHz; "
                                                   f"max {mx:.0f} MHz)")
    try:
        return torch.cuda.clock_rate() / 1e3, "torch.cuda.clock_rate() after the l2 calls"
    except Exception:  # noqa: BLE001
        return im.H100().clock_ghz, "no clock readable: isa_model's H100 clock"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("cb_out"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    why = tq_cuda.ensure_loaded()
    if why is not None:
        print(f"cuda backend unavailable: {why}")
        return 1
    build_s = time.perf_counter() - t_start
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    lines = [f"{props.name}, {sms} SMs, torch {torch.__version__}; extension ready in {build_s:.0f} s"]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(20)
    res = {"device": props.name, "sms": sms}
    with tq.value_checks(False):
        checks = check_small(gen)
        res["checks"] = checks
        lines.append("reference check (2 x 1k, relative L2 error vs backend reference): " + ", ".join(
            f"{c['format']} {c['variant']} {c['rel_err']:.1e} {'ok' if c['ok'] else 'FAILED'}"
            for c in checks))
        bw, _ = hbm_bandwidth()
        lines.append(f"HBM read bandwidth (tune_cuda.py: torch.sum over 2 GiB fp32): {bw:.0f} GB/s")
        pred = predicted_clocks(loaded_library(), props.major)
        res["predicted"] = pred
        lines.append(f"predicted clocks per tile from: {pred['source']}")
        meas = []
        clock = None
        for name, (fmt, _, tile_bytes) in FORMATS.items():
            for batch, context in SHAPES:
                for variant in ("hbm", "l2"):
                    call, nbytes = problem(batch, context, fmt, variant, gen)
                    us = bench_graph([call] * 8)
                    if variant == "l2" and clock is None:
                        clock, clock_src = sm_clock_during(call)
                        lines.append(f"SM clock {clock * 1e3:.0f} MHz: {clock_src}")
                    meas.append({"format": name, "batch": batch, "context": context,
                                 "variant": variant, "us": us, "bytes": nbytes,
                                 "tiles": batch * HKV * context // BS, "tile_bytes": tile_bytes})
                    del call
                    torch.cuda.empty_cache()
    res.update(clock_ghz=clock, clock_source=clock_src, bandwidth_gbs=bw, rows=meas)

    # isa_model's call model for the hbm rows: k fitted on its training row (a warp-MMA decode
    # kernel's row), with this SASS; none where FP4 runs the FP8 kernel (its l2 rows are the
    # point there: measured / predicted is its own dependency factor)
    k = None
    if pred.get("FP4") and pred["FP4"]["kernel"] == "decode":
        kern = {n: {"cycles": {"sm_clk": pred[n]["sm_clk"]}, "tile_bytes": FORMATS[n][2]}
                for n in FORMATS if pred.get(n)}
        train = next(r for r in im.all_measured_rows()
                     if (r["run"], r["config"], r["batch"], r["context"]) == im.OVERLAP_TRAIN_ROW)
        k = im.fit_overlap_k(train, kern["FP4"]["cycles"]["sm_clk"], kern["FP4"]["tile_bytes"])
    res["k"] = k
    lines += ["", f"| format | batch x context | variant | us | GB/s | SM clocks / tile / SM "
              f"(measured) | isa_model issue-bound (binding pipe; issue slots) | measured / "
              f"predicted | % of {bw:.0f} GB/s (isa_model call model, k = "
              f"{'-' if k is None else f'{k:.2f}'}) |", "|---" * 9 + "|"]
    for m in meas:
        p = pred.get(m["format"])
        gbs = m["bytes"] / (m["us"] * 1e-6) / 1e9
        m["sm_clk_per_tile"] = m["us"] * 1e-6 * clock * 1e9 * sms / m["tiles"]
        pc = f"{p['sm_clk']:.1f} ({p['bound']}); {p['issue_slots_sm_clk']:.1f}" if p else "-"
        ratio = f"{m['sm_clk_per_tile'] / p['sm_clk']:.2f}" if p and m["variant"] == "l2" else ""
        model = ""
        if m["variant"] == "hbm" and k is not None and p:
            c = im.cuda_call(m["batch"], m["context"], p["sm_clk"], m["tile_bytes"], bw, k,
                             cta_order=im.CTA_ORDER)
            m["model_pct"] = im.call_pct(m["bytes"], c["total_us"], bw)
            model = f"{100 * gbs / bw:.1f} ({m['model_pct']:.1f})"
        lines.append(f"| {m['format']} | {m['batch']} x {m['context'] // 1024}k | {m['variant']} | "
                     f"{m['us']:.1f} | {gbs:.0f} | {m['sm_clk_per_tile']:.1f} | {pc} | {ratio} | {model} |")
    lines.append("")
    for name in FORMATS:
        a, b = (next(m for m in meas if m["format"] == name and m["variant"] == "l2"
                     and (m["batch"], m["context"]) == s) for s in SLOPE)
        slope = (b["us"] - a["us"]) * 1e-6 * clock * 1e9 * sms / (b["tiles"] - a["tiles"])
        p = pred.get(name)
        res[f"slope_{name}"] = slope
        lines.append(f"{name} l2 slope {SLOPE[0][0]} x {SLOPE[0][1] // 1024}k -> {SLOPE[1][0]} x "
                     f"{SLOPE[1][1] // 1024}k: {slope:.1f} SM clocks per tile per SM"
                     + (f" vs {p['sm_clk']:.1f} predicted ({p['bound']}-bound; issue slots alone "
                        f"{p['issue_slots_sm_clk']:.1f}): measured / predicted {slope / p['sm_clk']:.2f}"
                        if p else ""))
    lines.append(f"total {time.perf_counter() - t_start:.0f} s (extension build/load {build_s:.0f} s)")
    text = "\n".join(lines)
    print(text)
    (args.out / "compute_bound.txt").write_text(text + "\n")
    (args.out / "compute_bound.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
