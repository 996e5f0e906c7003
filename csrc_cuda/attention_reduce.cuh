// The split-KV reduce pass (torch-free): when a call's KV range is split into partitions, the
// attention kernels write partials (O/l, m, l) and this pass combines them per (query token,
// head), a programmatic dependent of the attention grid.
#pragma once

#include "attention_common.cuh"

namespace turboquant {
namespace cuda_fp4 {

// grid (num_tokens * num_heads), block 32 * REDUCE_WARPS: one CTA per (query token, head)
// combines the num_partitions partials (O/l, m, l) of tmp_out / tmp_ml. Warp w takes partitions
// w, w + REDUCE_WARPS, ...; it loads its first REDUCE_BATCH partial rows together with the
// (m, l) words (no dependency between them), so one round of loads covers up to
// REDUCE_WARPS * REDUCE_BATCH partitions; the warps' sums meet in shared memory.
template <int D, typename T, bool kStates>
__global__ void __launch_bounds__(32 * tuning::REDUCE_WARPS) paged_attention_reduce_kernel(const AttnParams p) {
  constexpr int NWR = tuning::REDUCE_WARPS, NB = tuning::REDUCE_BATCH;
  constexpr int EPL = D / 32;  // elements per lane
  __shared__ float part_sum[NWR][D];
  pdl_wait();  // the attention grid's partials are complete and visible
  // the next kernel, if launched as a programmatic dependent (the next attention call), may
  // start now: its CTAs become resident while this pass runs and wait in their own pdl_wait (a
  // kernel launched without that waits for this grid's end). Measured (CUDA graph, chained
  // calls, default config): H100 1 x 4k 9.7 vs 10.0 us, 1 x 16k 14.8 vs 15.1, 1 x 32k 20.4 vs
  // 20.7, 16 x 4k 32.7 vs 32.9; the H200 alike; shapes without a split unchanged.
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long item = blockIdx.x;
  const int tok = (int)(item / p.num_heads), head = (int)(item % p.num_heads);
  const int NP = p.num_partitions;
  const float2* ml = p.tmp_ml + item * NP;
  const float* src = p.tmp_out + item * NP * D + lane * EPL;
  // partial rows warp + NWR * (j0 + j), j < NB; an empty partition's row was never written and
  // is loaded but not used (its weight is 0)
  float ob[NB][EPL];
  auto load_rows = [&](int j0) {
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      const int i = warp + NWR * (j0 + j);
#pragma unroll
      for (int e = 0; e < EPL; e += 2) {
        float2 o = make_float2(0.f, 0.f);
        if (i < NP) o = *reinterpret_cast<const float2*>(src + (size_t)i * D + e);
        ob[j][e] = o.x;
        ob[j][e + 1] = o.y;
      }
    }
  };
  load_rows(0);
  float M = -INFINITY;
  for (int i = lane; i < NP; i += 32) M = fmaxf(M, ml[i].x);
#pragma unroll
  for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  // weight of partition i: 0 for empty ones; a NaN l stays NaN
  auto weight = [&](int i) -> float {
    if (i >= NP) return 0.f;
    const float2 v = ml[i];
    return (v.x == -INFINITY) ? v.y * 0.f : fast_exp2(v.x - M) * v.y;
  };
  float Ls = 0.f;
  for (int i = lane; i < NP; i += 32) Ls += weight(i);
#pragma unroll
  for (int o = 16; o; o >>= 1) Ls += __shfl_xor_sync(0xffffffffu, Ls, o);
  float a[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) a[e] = 0.f;
  for (int j0 = 0; warp + NWR * j0 < NP; j0 += NB) {
    if (j0 > 0) load_rows(j0);
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      const float w = weight(warp + NWR * (j0 + j));  // the same address in every lane: one load
#pragma unroll
      for (int e = 0; e < EPL; ++e) a[e] += (w != 0.f || w != w) ? w * ob[j][e] : 0.f;
    }
  }
#pragma unroll
  for (int e = 0; e < EPL; ++e) part_sum[warp][lane * EPL + e] = a[e];
  __syncthreads();
  if (warp != 0) return;
  float inv = (Ls == 0.f) ? 0.f : 1.f / Ls;  // NaN stays NaN
  if constexpr (kStates) {
    // the partials' maxima are in true-logit units already: the learned sink joins here
    const float L0 = Ls;
    const float k = add_learned_sink(p, head, M, Ls);
    inv = (L0 == 0.f) ? 0.f : k / L0;
  }
  T* o = reinterpret_cast<T*>(p.out) + tok * p.o_stride_tok + head * p.o_stride_head;
  // warp 0 writes the row, D/32 elements per lane, un-rotated when the cache is rotated
  float v[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    v[e] = 0.f;
#pragma unroll
    for (int w = 0; w < NWR; ++w) v[e] += part_sum[w][lane * EPL + e];
    v[e] *= inv;
  }
  if constexpr (kStates) {
    if (p.lse != nullptr && lane == 0) p.lse[item] = row_lse(M, Ls, v[0]);
  }
  if (p.rot_signs != nullptr) unrotate_row<EPL, 32>(p, v, lane * EPL, lane);
#pragma unroll
  for (int e = 0; e < EPL; ++e) o[lane * EPL + e] = from_float<T>(v[e]);
}

// The reduce pass over num_partitions > 1 partials, a programmatic dependent of the attention
// grid: its launch and CTA start overlap the attention grid's last CTAs.
template <int D, typename T, bool kStates>
cudaError_t launch_reduce(const AttnParams& p, cudaStream_t stream) {
  const long long items = (long long)p.num_tokens * p.num_heads;
  return launch_programmatic(paged_attention_reduce_kernel<D, T, kStates>, dim3((unsigned)items), dim3(32 * tuning::REDUCE_WARPS), 0,
                             stream, p);
}

}  // namespace cuda_fp4
}  // namespace turboquant
