#!/usr/bin/env bash
# Call 5 (issue 18): the final tree (find_row_tile's warp search in the general kernel, both
# multi-token forms of the decode kernel and, replacing its own binary search, the prefill
# kernel): every cuda GPU test, then its multi-token rows against the tree of 6837983 (.H: binary
# searches), two rounds, rotated. Carry .prebuilt .H.
set -uo pipefail
TESTS="not zzzz" AB_TREES=".H:c1" ROUNDS=2 \
DEC="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --bw-repeats 5 --multi-token 1x512@4k,1x2048@16k,4x2048@16k,128x2@4k,64x2@4k,64x4@4k,16x16@4k" \
  bash benchmarks/decode_ab.sh
