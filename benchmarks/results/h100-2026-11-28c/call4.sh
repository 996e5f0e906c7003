#!/usr/bin/env bash
# Call 4 (issue 18): find_row_tile's search over cu_query_lens as a 32-way warp search (ballot,
# ceil(log32 num_seqs) rounds of one load) instead of a binary search (log2 num_seqs dependent
# loads), variant -DTQ_ROW_TILE_WARP_SEARCH: the multi-token GPU tests (general kernel, both
# multi-token forms of the decode kernel) under the variant, then the multi-token rows of both
# builds, two rounds, rotated. Carry .prebuilt.
set -uo pipefail
TESTS="spec" VARIANT_TESTS="multi_token or spec or more_query or states or sanitizer" VARIANTS="ws:-DTQ_ROW_TILE_WARP_SEARCH" ROUNDS=2 \
DEC="--shapes 32/8/128 --no-decode --no-writer --no-sdpa --bw-repeats 5 --multi-token 64x2@4k,128x2@4k,16x2@16k,64x2@16k,64x4@4k,128x4@4k,16x16@4k" \
  bash benchmarks/decode_ab.sh
