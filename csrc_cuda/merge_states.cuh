// turboquant cuda backend: merging attention states in one kernel (torch-free).
//
// R partial states (O_r, lse_r) of the same rows, each over a disjoint set of keys, give the
// state over the union (turboquant/states.py, the normative formula and its reference):
//
//   m = max_r lse_r,  lse = m + log(sum_r exp(lse_r - m)),  O = sum_r exp(lse_r - lse) O_r
//
// with the edge rules of the reference: a part with lse -inf weighs 0 whatever its O (also a
// NaN O), all parts -inf give O = 0 and lse -inf, a NaN (or +inf) lse makes the row NaN, and a
// weight that underflows to 0 drops its part (0 * NaN is not formed). fp32 throughout, expf and
// logf (not the fast approximations): the result equals the reference's to fp32 rounding.
//
// Design: the merge is where context parallelism (and a shared-prefix split) spends its time
// after the attention: it moves R x rows x D elements once, so one warp per (token, head) row
// reads the R lse values (a broadcast load), then streams the R rows of O with coalesced
// 2-element loads and one store; no shared memory, no synchronization. Pointers per part (not
// one stacked tensor) so that the parts can live where the engine received them, e.g. the
// slices of an all-gather's output buffer.
#pragma once

#include <cmath>
#include <cstdint>

#include "fp4_portable.cuh"

namespace turboquant {
namespace cuda_fp4 {

constexpr int kMaxMergeParts = 8;   // parts one launch merges (8 GPUs of context parallelism)
constexpr int kMergeWarps = 4;      // rows per CTA

template <typename T>
struct MergeParams {
  const T* part_out[kMaxMergeParts];       // each [rows, D] contiguous (rows = tokens x heads)
  const float* part_lse[kMaxMergeParts];   // each [rows]
  T* out;                                  // [rows, D]
  float* lse;                              // [rows]
  int parts;                               // 1 .. kMaxMergeParts
  int rows;
  int D;                                   // even
};

template <typename T>
__device__ __forceinline__ void load2(const T* p, float& a, float& b) {
  if constexpr (sizeof(T) == 2) {
    uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    T e[2];
    memcpy(e, &w, sizeof(w));
    a = to_float(e[0]);
    b = to_float(e[1]);
  } else {
    const float2 v = *reinterpret_cast<const float2*>(p);
    a = v.x;
    b = v.y;
  }
}

template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  if constexpr (sizeof(T) == 2) {
    T e[2] = {from_float<T>(a), from_float<T>(b)};
    uint32_t w;
    memcpy(&w, e, sizeof(w));
    *reinterpret_cast<uint32_t*>(p) = w;
  } else {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
  }
}

// grid (ceil(rows / kMergeWarps)), block (32 * kMergeWarps): warp w of CTA b merges row
// b * kMergeWarps + w; lane l handles the element pairs 2l, 2l + 64, ...
template <typename T>
__global__ void __launch_bounds__(32 * kMergeWarps) merge_states_kernel(const MergeParams<T> p) {
  const int row = blockIdx.x * kMergeWarps + (int)(threadIdx.x / 32);
  if (row >= p.rows) return;
  const int lane = threadIdx.x % 32;
  float l[kMaxMergeParts];
  float m = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int r = 0; r < kMaxMergeParts; ++r) {
    l[r] = r < p.parts ? p.part_lse[r][row] : -INFINITY;
    nan |= l[r] != l[r] || l[r] == INFINITY;
    m = fmaxf(m, l[r]);
  }
  float lse, w[kMaxMergeParts];
  if (nan) {
    lse = NAN;
  } else if (m == -INFINITY) {
    lse = -INFINITY;
  } else {
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxMergeParts; ++r) s += l[r] > -INFINITY ? expf(l[r] - m) : 0.f;
    lse = m + logf(s);
  }
#pragma unroll
  for (int r = 0; r < kMaxMergeParts; ++r) w[r] = (!nan && l[r] > -INFINITY) ? expf(l[r] - lse) : 0.f;
  const size_t base = (size_t)row * p.D;
  for (int e = 2 * lane; e < p.D; e += 64) {
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxMergeParts; ++r) {
      if (w[r] != 0.f) {  // r >= parts has w 0
        float x, y;
        load2(p.part_out[r] + base + e, x, y);
        a = fmaf(w[r], x, a);
        b = fmaf(w[r], y, b);
      }
    }
    if (nan) a = b = NAN;
    store2(p.out + base + e, a, b);
  }
  if (lane == 0) p.lse[row] = lse;
}

template <typename T>
cudaError_t launch_merge_states(const MergeParams<T>& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const int grid = (p.rows + kMergeWarps - 1) / kMergeWarps;
  merge_states_kernel<T><<<grid, 32 * kMergeWarps, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda_fp4
}  // namespace turboquant
