"""The cuda backend's split-KV partition choice (csrc_cuda/tuning.cuh), compiled for the host
with g++: the worked examples written next to both choosers hold (H100: 132 SMs)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (chooser, max_seq_len, base CTAs = row tiles x kv heads, SMs) -> partition size in tokens
CASES = [
    ("decode", 32768, 8, 132, 1024),    # batch 1 x 32k: 32 partitions, one wave
    ("decode", 4096, 8, 132, 256),      # batch 1 x 4k: the minimum partition
    ("decode", 16384, 128, 132, 8192),  # batch 16 x 16k: 2 partitions, one wave
    ("decode", 4096, 512, 132, 4096),   # batch 64 x 4k: no split
    ("decode", 16384, 1024, 132, 16384),  # batch 128 x 16k: no split, no 4096 cap
    ("general", 4096, 512, 132, 4096),  # batch 64 x 4k
    ("general", 32768, 8, 132, 1024),   # batch 1 x 32k
    ("general", 4096, 8, 132, 256),     # batch 1 x 4k: clamped to the minimum
    ("general", 1024, 1024, 132, 1024),  # batch 128 x 1k
]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_partition_sizes_match_the_worked_examples(tmp_path):
    calls = "\n".join(
        f'  std::printf("%d\\n", {"choose_decode_partition_size" if kind == "decode" else "choose_partition_size"}'
        f"({L}, {base}, {sms}));" for kind, L, base, sms, _ in CASES)
    src = tmp_path / "partitions.cpp"
    src.write_text('#include <cstdio>\n#include "tuning.cuh"\n'
                   "using namespace turboquant::tuning;\nint main() {\n" + calls + "\n}\n")
    exe = tmp_path / "partitions"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", f"-I{ROOT / 'csrc_cuda'}", str(src),
                    "-o", str(exe)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True,
                                          check=True).stdout.split()]
    assert got == [c[-1] for c in CASES]
