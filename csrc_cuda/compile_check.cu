// Instantiates every kernel template of the cuda backend, with no torch, so that
// tests/test_cuda_compile.py can compile the headers standalone for sm_80 and sm_90a:
//   nvcc -std=c++17 -arch=sm_90a -c csrc_cuda/compile_check.cu -Xptxas -v
#include "paged_attention_decode.cuh"
#include "cache_writer.cuh"
#include "merge_states.cuh"
#include "shared_state.cuh"

namespace turboquant {
namespace cuda_fp4 {

#define TQ_ATTN(D, T) template cudaError_t launch_paged_attention<D, T>(const AttnParams&, int, cudaStream_t);
TQ_ATTN(64, __half)
TQ_ATTN(128, __half)
TQ_ATTN(256, __half)
TQ_ATTN(64, __nv_bfloat16)
TQ_ATTN(128, __nv_bfloat16)
TQ_ATTN(256, __nv_bfloat16)

#define TQ_WRITE(T, D) template cudaError_t launch_reshape_and_cache<T, D>(const CacheWriteParams&, cudaStream_t);
TQ_WRITE(__half, 64)
TQ_WRITE(__half, 128)
TQ_WRITE(__half, 256)
TQ_WRITE(__nv_bfloat16, 64)
TQ_WRITE(__nv_bfloat16, 128)
TQ_WRITE(__nv_bfloat16, 256)
TQ_WRITE(float, 64)
TQ_WRITE(float, 128)
TQ_WRITE(float, 256)

template cudaError_t launch_merge_states<__half>(const MergeParams<__half>&, cudaStream_t);
template cudaError_t launch_merge_states<__nv_bfloat16>(const MergeParams<__nv_bfloat16>&, cudaStream_t);
template cudaError_t launch_merge_states<float>(const MergeParams<float>&, cudaStream_t);

template __global__ void tq_shared_enter_sinks_kernel<__half>(
    const __half*, const __half*, int64_t, int64_t, int, SharedCache, const int64_t*,
    const int64_t*, const float*, const float*, float, uint16_t*, int64_t*, int);
template __global__ void tq_shared_enter_sinks_kernel<uint16_t>(
    const uint16_t*, const uint16_t*, int64_t, int64_t, int, SharedCache, const int64_t*,
    const int64_t*, const float*, const float*, float, uint16_t*, int64_t*, int);
template __global__ void tq_shared_enter_sinks_kernel<float>(
    const float*, const float*, int64_t, int64_t, int, SharedCache, const int64_t*,
    const int64_t*, const float*, const float*, float, uint16_t*, int64_t*, int);

}  // namespace cuda_fp4
}  // namespace turboquant
