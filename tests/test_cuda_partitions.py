"""The cuda backend's split-KV partition choice and prefill-kernel rule (csrc_cuda/tuning.cuh),
compiled for the host with g++: the worked examples written next to them hold (H100: 132 SMs)."""
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


def _run_on_host(tmp_path, name: str, calls: str) -> list:
    """Compile a host program whose main() runs ``calls`` (printf lines) over tuning.cuh with
    g++ (warnings are errors), run it and return its output's words."""
    src = tmp_path / f"{name}.cpp"
    src.write_text('#include <cstdio>\n#include "tuning.cuh"\n'
                   "using namespace turboquant::tuning;\nint main() {\n" + calls + "\n}\n")
    exe = tmp_path / name
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", f"-I{ROOT / 'csrc_cuda'}", str(src),
                    "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_partition_sizes_match_the_worked_examples(tmp_path):
    calls = "\n".join(
        f'  std::printf("%d\\n", {"choose_decode_partition_size" if kind == "decode" else "choose_partition_size"}'
        f"({L}, {base}, {sms}));" for kind, L, base, sms, _ in CASES)
    got = [int(x) for x in _run_on_host(tmp_path, "partitions", calls)]
    assert got == [c[-1] for c in CASES]


# (multi-token, head dim, query tokens, sequences, GQA group) -> the prefill kernel runs
PREFILL_RULE = [
    (True, 128, 2048, 1, 4, True),      # 1 x 2048 @ 16k: 8192 rows per kv head
    (True, 128, 256, 64, 4, False),     # 64 sequences x 4 tokens (speculative decoding): 16 rows each
    (True, 128, 512 + 15, 16, 4, True),  # a chunk of 512 and 15 decode tokens: 131.75 rows per sequence
    (True, 128, 31, 1, 4, False),       # 124 rows: below one CTA's 128
    (True, 256, 2048, 1, 4, False),     # D 256: the general kernel
    (True, 64, 200, 1, 1, True),        # MHA, 200 rows
    (False, 128, 64, 64, 4, False),     # decode (no cu_query_lens): never
]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_prefill_rule_matches_the_worked_examples(tmp_path):
    """tuning::use_prefill_kernel picks the prefill kernel exactly for the shapes its comment
    gives (long chunks, mixed steps dominated by a chunk) and not for speculative decoding,
    decode, D 256 or fewer rows than one CTA holds."""
    calls = "\n".join(f'  std::printf("%d\\n", (int)use_prefill_kernel({str(m).lower()}, {d}, {t}, {s}, {g}));'
                      for m, d, t, s, g, _ in PREFILL_RULE)
    got = [bool(int(x)) for x in _run_on_host(tmp_path, "prefill_rule", calls)]
    assert got == [c[-1] for c in PREFILL_RULE]


# (multi, head_dim, num_tokens, num_seqs, group_size, the decode kernel's multi-token form?)
SPEC_RULE = [
    (True, 128, 256, 64, 4, True),      # 64 x 4 tokens: 16 columns per sequence
    (True, 128, 512, 64, 4, True),      # 64 x 8: 32 columns, two CTAs per sequence
    (True, 128, 256, 128, 4, True),     # 128 x 2: 8 columns
    (True, 64, 66, 17, 4, True),        # ragged 1-8 tokens, D 64
    (True, 128, 576, 64, 4, False),     # 64 x 9: 36 columns -> general kernel
    (True, 128, 2048, 1, 4, False),     # a 2048-token chunk: the prefill kernel's
    (True, 256, 256, 64, 4, False),     # D 256: general kernel
    (False, 128, 64, 64, 4, False),     # decode: the decode kernel's 8-column form
]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_spec_rule_matches_the_worked_examples(tmp_path):
    """tuning::use_spec_kernel takes short multi-token queries (speculative decoding, up to 32
    (query token, head) pairs per sequence on average, D <= 128) and leaves decode, long chunks
    and D 256 to their kernels."""
    calls = "\n".join(f'  std::printf("%d\\n", (int)use_spec_kernel({str(m).lower()}, {d}, {t}, {s}, {g}));'
                      for m, d, t, s, g, _ in SPEC_RULE)
    got = [bool(int(x)) for x in _run_on_host(tmp_path, "spec_rule", calls)]
    assert got == [c[-1] for c in SPEC_RULE]


# (num_tokens, num_seqs, group_size, columns of the multi-token form)
SPEC_COLUMNS = [
    (256, 128, 4, 8),       # 128 x 2 tokens (one draft token): 8 pairs per sequence
    (256, 64, 4, 16),       # 64 x 4: 16
    (34, 17, 4, 8),         # ragged 1-3 tokens averaging 2: 8 (a 3-token sequence takes two CTAs)
    (35, 17, 4, 16),        # one token more: 8.2 on average -> 16
    (15, 3, 1, 8),          # MHA, 8 + 2 + 5 tokens: 5 on average
    (4, 4, 7, 8),           # GQA 7, one token each: 7
    (3, 2, 16, 16),         # GQA 16: 24
]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_spec_columns_match_the_worked_examples(tmp_path):
    """tuning::spec_columns gives the 8-column form (the decode kernel's own registers and
    instructions per tile) exactly when the (query token, head) pairs average at most 8 per
    sequence, else the 16-column form."""
    calls = "\n".join(f'  std::printf("%d\\n", spec_columns({t}, {s}, {g}));' for t, s, g, _ in SPEC_COLUMNS)
    got = [int(x) for x in _run_on_host(tmp_path, "spec_columns", calls)]
    assert got == [c[-1] for c in SPEC_COLUMNS]
