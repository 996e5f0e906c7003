// The shapes the cuda kernels are built for: the one list of head dims and block sizes.
// turboquant/_backends/cuda.py reads the two lines below that name them (its reasons for
// declining a call), the binding dispatches with for_head_dim (which rejects any other head
// dim), compile_check.cu instantiates every one, and the launchers static_assert theirs.
// Adding a head dim: add it here, then give the layouts that switch on D (the swizzles in
// attention_common.cuh and attention_decode.cuh, tuning.cuh's tiles) a case for it.
#pragma once
#include <type_traits>

namespace turboquant {
namespace cuda_fp4 {

template <int... Ns> struct IntList {};
using HeadDims = IntList<64, 128, 256>;
constexpr int kMinBlockSize = 16, kMaxBlockSize = 256;  // powers of two (the GPU tests' range)

template <int D, int... Ds> constexpr bool in_list(IntList<Ds...>) { return ((D == Ds) || ...); }
template <int D> constexpr bool supported_head_dim() { return in_list<D>(HeadDims{}); }
template <int... Ds> constexpr int largest(IntList<Ds...>) {
  int m = 0;
  ((m = Ds > m ? Ds : m), ...);
  return m;
}
constexpr int kMaxHeadDim = largest(HeadDims{});

// f(std::integral_constant<int, D>{}) for the D of HeadDims equal to d; false when none is.
template <typename F, int... Ds> bool for_head_dim(int d, F&& f, IntList<Ds...>) {
  return ((d == Ds && (f(std::integral_constant<int, Ds>{}), true)) || ...);
}
template <typename F> bool for_head_dim(int d, F&& f) { return for_head_dim(d, f, HeadDims{}); }
inline bool is_head_dim(int d) { return for_head_dim(d, [](auto) {}); }

}  // namespace cuda_fp4
}  // namespace turboquant
