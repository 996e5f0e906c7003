// Stand-in for ck_tile's variants.hpp (see ../../../../hip_compat.h): the attention variant of
// pa_v1 without soft cap, ComposedAttention<0>, as ck_tile defines it: QueryTransform scales the
// logit by sm_scale, LogitsTransform returns it unchanged.
#pragma once

namespace ck_tile {
inline constexpr unsigned LOGITS_SOFT_CAP = 4;  // ck_tile's value

template <typename ImplMask>
struct StandardAttentionParams {
  __device__ StandardAttentionParams(const ImplMask& m, float s) : impl_mask(m), sm_scale(s) {}
  const ImplMask& impl_mask;
  float sm_scale;
};

// Named by the soft-cap branch that the kernel counted here discards.
template <typename ImplMask, bool UseExp2 = false>
struct LogitsSoftCapParams;

template <unsigned VariantCode, bool UseExp2 = false>
struct ComposedAttention {
  static constexpr bool use_exp2 = UseExp2;
  static constexpr bool use_logits_soft_cap = (VariantCode & LOGITS_SOFT_CAP) != 0;
  static_assert(!use_logits_soft_cap, "the soft-cap variant is not stood in for");

  template <typename Params, typename T>
  __device__ T QueryTransform(const Params& p, T q) const { return float(q) * p.sm_scale; }

  template <typename Params, typename T>
  __device__ T LogitsTransform(const Params&, T logits, unsigned, unsigned, unsigned) const {
    return logits;
  }
};
}  // namespace ck_tile
