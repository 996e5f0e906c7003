"""Summarize ncu's SASS source counters of the prefill kernel by warp role (issue 18).

Input: `ncu -i REP --page source --csv --print-source sass > FILE.csv` of one launch of
paged_attention_fp4_prefill_kernel (benchmarks/probe.py ncu-prefill). The SM90a kernel's code is
split at its two USETMAXREG instructions: the row warps run from the .TRY_ALLOC (setmaxnreg.inc)
to the .DEALLOC (setmaxnreg.dec), the producers from the .DEALLOC on; what precedes both is the
shared prologue. Per region: executed warp instructions (and per warp and 64-token step when
--warp-steps gives the launch's count: CTAs x 8 warps x steps), stall samples by reason, the
opcodes, and the instructions with the most samples with their leading reasons. --listing
REGION: instead, every executed instruction of that region in address order (offset from the
region's first, stall samples, executions, the two leading reasons), where a dependency chain
or a wait shows (a barrier's wait is sampled on the instruction after it); --range LO:HI (hex
addresses) keeps a part of it, e.g. one loop.

    python benchmarks/ncu_source_summary.py src_head.csv [src_nosm.csv ...] --warp-steps 983040
    python benchmarks/ncu_source_summary.py src.csv --listing "row warps" \
        --range 0x...3680:0x...e680
"""
import argparse
import collections
import csv
import re


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"])
    cols = rows[head]
    out = []
    for r in rows[head + 1:]:
        if len(r) != len(cols) or not r[0].startswith("0x"):
            continue
        out.append(dict(zip(cols, r)))
    return cols, out


def num(s):
    try:
        return float(s.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def regions(rows):
    """Split at the USETMAXREG instructions: (prologue, row warps, producers)."""
    inc = next((i for i, r in enumerate(rows) if "USETMAXREG.TRY_ALLOC" in r["Source"]), None)
    dec = next((i for i, r in enumerate(rows) if "USETMAXREG.DEALLOC" in r["Source"]), None)
    if inc is None or dec is None:
        return [("whole kernel", rows)]
    return [("prologue", rows[:inc]), ("row warps", rows[inc:dec]), ("producers", rows[dec:])]


def opcode(src):
    s = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    return s.split(" ")[0].split(".")[0] if s else "?"


def summary(path, top=12):
    """Per region: name, executed warp instructions, stall samples, samples by reason,
    instructions by opcode, and the `top` rows with the most samples."""
    cols, rows = load(path)
    reasons = [c for c in cols if c.startswith("stall_") and "(Not Issued)" not in c]
    out = []
    for name, part in regions(rows):
        ins = sum(num(r["Instructions Executed"]) for r in part)
        samples = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in part)
        if ins == 0 and samples == 0:
            continue
        by_reason, ops = collections.Counter(), collections.Counter()
        for r in part:
            for c in reasons:
                by_reason[c[len("stall_"):]] += num(r[c])
            ops[opcode(r["Source"])] += num(r["Instructions Executed"])
        hot = []
        for r in sorted(part, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[:top]:
            lead = sorted(((num(r[c]), c[len("stall_"):]) for c in reasons), reverse=True)[:2]
            hot.append((r["Address"], num(r["Warp Stall Sampling (All Samples)"]), r["Source"].strip(),
                        [(k, v) for v, k in lead if v]))
        out.append(dict(name=name, instructions=ins, samples=samples, reasons=by_reason, opcodes=ops, hot=hot))
    return out


def listing(path, region, lo=None, hi=None):
    """The executed instructions of `region` (in [lo, hi] when given): (offset from the region's
    first executed instruction, samples, executions, source, the two leading stall reasons)."""
    cols, rows = load(path)
    reasons = [c for c in cols if c.startswith("stall_") and "(Not Issued)" not in c]
    part = dict(regions(rows)).get(region)
    if part is None:
        raise SystemExit(f"ncu_source_summary: no region {region!r} "
                         f"(one of {[n for n, _ in regions(rows)]})")
    out, base = [], None
    for r in part:
        a = int(r["Address"], 16)
        if num(r["Instructions Executed"]) == 0 or (lo is not None and not lo <= a <= hi):
            continue
        base = a if base is None else base
        lead = sorted(((num(r[c]), c[len("stall_"):]) for c in reasons), reverse=True)[:2]
        out.append((a - base, num(r["Warp Stall Sampling (All Samples)"]),
                    num(r["Instructions Executed"]), r["Source"].strip(),
                    [(k, v) for v, k in lead if v]))
    return out


def print_listing(path, region, span):
    lo, hi = (int(x, 16) for x in span.split(":")) if span else (None, None)
    rows = listing(path, region, lo, hi)
    total = sum(s for _, s, _, _, _ in rows) or 1.0
    print(f"== {path}: {region}, {len(rows)} executed instructions, {total:,.0f} stall samples")
    for off, s, ins, src, lead in rows:
        why = ", ".join(f"{k} {v:.0f}" for k, v in lead)
        print(f"{off:6x} {s:6.0f} {100 * s / total:5.1f}% {ins:10,.0f}  {src[:60]:60s} [{why}]")


def print_summary(path, warp_steps, top):
    print(f"== {path}")
    for g in summary(path, top):
        ins, samples = g["instructions"], g["samples"]
        per = f" ({ins / warp_steps:.1f} per warp-step)" if warp_steps else ""
        print(f"{g['name']}: {ins:,.0f} warp instructions{per}, {samples:,.0f} stall samples")
        tot = sum(g["reasons"].values()) or 1.0
        print("  stall reasons: " + ", ".join(f"{k} {100 * v / tot:.1f}%" for k, v in g["reasons"].most_common(10) if v))
        unit = warp_steps or 1.0
        print("  opcodes: " + ", ".join(f"{k} {v / unit:.1f}" for k, v in g["opcodes"].most_common(16) if v))
        for addr, s, src, lead in g["hot"]:
            why = ", ".join(f"{k} {v:.0f}" for k, v in lead)
            print(f"    {addr} {s:7.0f} ({100 * s / (samples or 1):4.1f}%)  {src[:60]:60s} [{why}]")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--warp-steps", type=float, default=0.0,
                    help="warps x 64-token steps of the launch (per-step figures)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--listing", metavar="REGION",
                    help="every executed instruction of a region (prologue, row warps, producers)")
    ap.add_argument("--range", metavar="LO:HI", help="with --listing: hex addresses to keep")
    a = ap.parse_args()
    for p in a.csv:
        if a.listing:
            print_listing(p, a.listing, a.range)
        else:
            print_summary(p, a.warp_steps, a.top)


if __name__ == "__main__":
    main()
