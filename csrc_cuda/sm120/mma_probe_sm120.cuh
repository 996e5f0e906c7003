// Layout probes: run one MMA instruction on operand registers given per lane, so a test can
// check every lane-layout assumption (fragments, scale lanes and bytes, element encodings)
// against a plain matrix product. Real instruction on sm_120a/sm_121a, software model in the
// emulation build. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mma_sm120.cuh"

namespace tq {
namespace sm120 {

enum ProbeKind : int { kProbeMxf8f6f4E4m3E2m1 = 0, kProbeMxf4E2m1E2m1 = 1, kProbeMxf8f6f4E4m3E4m3 = 2 };

// grid 1 block 32
template <int kKind, int kBidA, int kTidA, int kBidB, int kTidB>
__global__ void mma_probe_sm120_kernel(const uint32_t* a,    // [32 lanes][4] A registers
                                       const uint32_t* b,    // [32 lanes][2] B registers
                                       const uint32_t* sfa,  // [32 lanes] scale-A register
                                       const uint32_t* sfb,  // [32 lanes] scale-B register
                                       const float* c,       // [32 lanes][4] accumulator in
                                       float* d) {           // [32 lanes][4] accumulator out
  const int lane = threadIdx.x;
  uint32_t ar[4], br[2];
  float cr[4], dr[4];
  for (int i = 0; i < 4; ++i) {
    ar[i] = a[4 * lane + i];
    cr[i] = c[4 * lane + i];
  }
  for (int i = 0; i < 2; ++i) br[i] = b[2 * lane + i];
  if constexpr (kKind == kProbeMxf8f6f4E4m3E2m1) {
    mma_mxf8f6f4_e4m3_e2m1_m16n8k32<kBidA, kTidA, kBidB, kTidB>(dr, ar, br, cr, sfa[lane], sfb[lane]);
  } else if constexpr (kKind == kProbeMxf8f6f4E4m3E4m3) {
    mma_mxf8f6f4_e4m3_e4m3_m16n8k32<kBidA, kTidA, kBidB, kTidB>(dr, ar, br, cr, sfa[lane], sfb[lane]);
  } else {
    mma_mxf4_e2m1_e2m1_m16n8k64<kBidA, kTidA, kBidB, kTidB>(dr, ar, br, cr, sfa[lane], sfb[lane]);
  }
  for (int i = 0; i < 4; ++i) d[4 * lane + i] = dr[i];
}

// Selector sets a probe can use: 0 = {byte-id-a, thread-id-a, byte-id-b, thread-id-b}
// {0,0,0,0}; 1 = {3,1,2,3} for the k32 kinds (1X) and {2,1,2,3} for k64 (2X).
inline cudaError_t launch_mma_probe_sm120(int kind, int selectors, const uint32_t* a, const uint32_t* b,
                                          const uint32_t* sfa, const uint32_t* sfb, const float* c, float* d,
                                          cudaStream_t stream) {
  switch (kind * 2 + selectors) {
    case 0: mma_probe_sm120_kernel<kProbeMxf8f6f4E4m3E2m1, 0, 0, 0, 0><<<1, 32, 0, stream>>>(a, b, sfa, sfb, c, d); break;
    case 1: mma_probe_sm120_kernel<kProbeMxf8f6f4E4m3E2m1, 3, 1, 2, 3><<<1, 32, 0, stream>>>(a, b, sfa, sfb, c, d); break;
    case 2: mma_probe_sm120_kernel<kProbeMxf4E2m1E2m1, 0, 0, 0, 0><<<1, 32, 0, stream>>>(a, b, sfa, sfb, c, d); break;
    case 3: mma_probe_sm120_kernel<kProbeMxf4E2m1E2m1, 2, 1, 2, 3><<<1, 32, 0, stream>>>(a, b, sfa, sfb, c, d); break;
    case 4: mma_probe_sm120_kernel<kProbeMxf8f6f4E4m3E4m3, 0, 0, 0, 0><<<1, 32, 0, stream>>>(a, b, sfa, sfb, c, d); break;
    case 5: mma_probe_sm120_kernel<kProbeMxf8f6f4E4m3E4m3, 3, 1, 2, 3><<<1, 32, 0, stream>>>(a, b, sfa, sfb, c, d); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace sm120
}  // namespace tq
