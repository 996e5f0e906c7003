// Torch-free translation unit for the SASS test (tests/test_sm120_sass.py): the attention
// kernel for each head dim and key format (FP4 keys; K8V4's E4M3 keys) plus the layout-probe
// kernels, compiled for sm_120a / sm_121a.
#include "mma_probe_sm120.cuh"
#include "paged_attention_sm120.cuh"

namespace tq {
namespace sm120 {
template __global__ void paged_attention_sm120_kernel<__nv_bfloat16, 64, false, false>(AttentionParams);
template __global__ void paged_attention_sm120_kernel<__nv_bfloat16, 128, false, false>(AttentionParams);
template __global__ void paged_attention_sm120_kernel<__nv_bfloat16, 128, true, false>(AttentionParams);
template __global__ void paged_attention_sm120_kernel<__nv_bfloat16, 256, false, false>(AttentionParams);
template __global__ void paged_attention_sm120_kernel<__nv_bfloat16, 64, false, true>(AttentionParams);
template __global__ void paged_attention_sm120_kernel<__nv_bfloat16, 128, false, true>(AttentionParams);
template __global__ void paged_attention_sm120_kernel<__nv_bfloat16, 256, false, true>(AttentionParams);
template __global__ void combine_splits_sm120_kernel<__nv_bfloat16, 128>(AttentionParams);
template __global__ void mma_probe_sm120_kernel<kProbeMxf8f6f4E4m3E2m1, 0, 0, 0, 0>(const uint32_t*, const uint32_t*,
                                                                                  const uint32_t*, const uint32_t*,
                                                                                  const float*, float*);
template __global__ void mma_probe_sm120_kernel<kProbeMxf4E2m1E2m1, 0, 0, 0, 0>(const uint32_t*, const uint32_t*,
                                                                              const uint32_t*, const uint32_t*,
                                                                              const float*, float*);
template __global__ void mma_probe_sm120_kernel<kProbeMxf8f6f4E4m3E4m3, 0, 0, 0, 0>(const uint32_t*, const uint32_t*,
                                                                                  const uint32_t*, const uint32_t*,
                                                                                  const float*, float*);
}  // namespace sm120
}  // namespace tq
