#!/usr/bin/env bash
# Call 3 (issue 18): the decode kernel's 8-column multi-token form (tuning::spec_columns: one
# draft token per sequence, or any short multi-token step of at most 8 (query token, head)
# pairs per sequence on average). Every cuda GPU test of this tree, then the multi-token rows of
# this tree against the same tree built with -DTQ_SPEC8=0 (always 16 columns, HEAD's dispatch),
# two rounds, rotated; a few decode rows as the control (same SASS in both builds).
# Carry .prebuilt.
set -uo pipefail
TESTS="not zzzz" VARIANTS="s16:-DTQ_SPEC8=0" ROUNDS=2 \
DEC="--shapes 32/8/128 --no-writer --no-sdpa --bw-repeats 5 --batches 64,128 --contexts 4k --multi-token 16x2@16k,64x2@4k,64x2@16k,128x2@4k,128x2@16k,32x1@8k,64x4@4k" \
  bash benchmarks/decode_ab.sh
