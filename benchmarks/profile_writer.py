"""The cuda cache writer under one config, for a profiler: 65536 tokens x 8 kv heads x D 128
bf16 in 64 sequences whose state records are filled first (one untimed write with positions),
then ``--calls`` steady-state writes (no positions), as ``turboquant bench`` times them.

    ncu --section SpeedOfLight -k regex:reshape --launch-skip 1 \\
        python benchmarks/profile_writer.py --config default
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import turboquant as tq  # noqa: E402
from turboquant.bench.problems import writer_state  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="default")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    config = tq.QuantConfig.parse(args.config)
    T, hkv, d, bs = 65536, 8, 128, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    value = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = tq.allocate_cache(T // bs, hkv, bs, d, device="cuda")
    slots = torch.randperm(T, device="cuda", generator=g)
    extra = writer_state(tq, key, value, cache, slots, config)
    with tq.value_checks(False):
        for _ in range(args.calls):
            tq.reshape_and_cache_fp4(key, value, *cache, slots, config=config, backend="cuda",
                                     **extra)
    torch.cuda.synchronize()
    print("ok", args.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
