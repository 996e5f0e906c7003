// Stand-in for ck_tile's block_masking.hpp (see ../../../../hip_compat.h): pa_v1 builds a mask
// without masking and never queries it, so only its shape is needed.
#pragma once

namespace ck_tile {
template <bool IsMasking>
struct SimplifiedGenericAttentionMask {
  int seqlen_q, seqlen_k;
};
}  // namespace ck_tile
