// Instantiates every kernel template of the cuda backend, with no torch, so that
// tests/test_cuda_compile.py can compile the headers standalone for sm_80 and sm_90a:
//   nvcc -std=c++17 -arch=sm_90a -c csrc_cuda/compile_check.cu -Xptxas -v
#include "attention_plan.cuh"
#include "cache_writer.cuh"
#include "merge_states.cuh"
#include "shared_state.cuh"

namespace turboquant {
namespace cuda_fp4 {

// Every head dim of limits.cuh: the attention launcher for 16-bit queries, the writer for 16-
// and 32-bit keys (taking their addresses instantiates them).
template <typename T, int... Ds> int instantiate_head_dims(IntList<Ds...>) {
  int n = 0;
  ((n += (&launch_reshape_and_cache<T, Ds> != nullptr)), ...);
  if constexpr (!std::is_same_v<T, float>) ((n += (&launch_paged_attention<Ds, T> != nullptr)), ...);
  return n;
}
template int instantiate_head_dims<__half>(HeadDims);
template int instantiate_head_dims<__nv_bfloat16>(HeadDims);
template int instantiate_head_dims<float>(HeadDims);

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
