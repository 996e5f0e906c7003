"""The exponent of the key-smoothing rule (turboquant/smoothing.py: lam = a^exponent), measured:
KLD and top-1 of the default config on one model, one row per exponent, in one process.

    python benchmarks/smoothing_exponent.py --model smollm2 --exponents 0.25,0.5,0.75,1
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turboquant import smoothing  # noqa: E402
from turboquant.accuracy import run_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--exponents", default="0.25,0.5,0.75,1")
    ap.add_argument("--options", default="default")
    args = ap.parse_args()
    print(f"model {args.model}; options {args.options}")
    for e in (float(x) for x in args.exponents.split(",")):
        smoothing.SMOOTHING_EXPONENT = e
        run = run_model(args.options.split(","), model=args.model, layers=[0])
        for r in run["rows"]:
            print(f"exponent {e:4.2f}  {r['option']:<24} KLD {r['kld']:.4f}  top-1 "
                  f"{100 * r['top1']:.1f} %  ppl {r['ppl_delta_pct']:+.2f} %", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
