// Host build of the hipified cache writer: the translation unit hipify-torch made from
// csrc_cuda (turboquant/hip_writer.py passes its name as TQ_HIP_WRITER_TU), compiled with the
// host stand-ins of hip/*.h here, and one C entry point per call for ctypes.
#include TQ_HIP_WRITER_TU

namespace tw = turboquant::cuda_fp4;

extern "C" int tq_hip_writer_params_size() { return (int)sizeof(tw::CacheWriteParams); }

// dtype: 0 fp16, 1 bf16, 2 fp32. Returns the launcher's hipError_t (hipErrorLaunchFailure when
// a wavefront deadlocked on a shuffle), or hipErrorInvalidValue for a head dim not built.
template <typename T>
static int run(const tw::CacheWriteParams& p) {
  switch (p.head_dim) {
    case 64: return tw::launch_reshape_and_cache<T, 64>(p, nullptr);
    case 128: return tw::launch_reshape_and_cache<T, 128>(p, nullptr);
    case 256: return tw::launch_reshape_and_cache<T, 256>(p, nullptr);
    default: return hipErrorInvalidValue;
  }
}

extern "C" int tq_hip_writer_run(const tw::CacheWriteParams* p, int dtype) {
  switch (dtype) {
    case 0: return run<__half>(*p);
    case 1: return run<__hip_bfloat16>(*p);
    case 2: return run<float>(*p);
    default: return hipErrorInvalidValue;
  }
}

// A check of the host runtime's shuffle: one workgroup of `threads` work-items, each storing
// __shfl_xor(its index, lane_mask, width). Returns hipGetLastError() after the launch.
static __global__ void shuffle_probe_kernel(int* out, int width, int lane_mask) {
  out[threadIdx.x] = __shfl_xor((int)threadIdx.x, lane_mask, width);
}

extern "C" int tq_host_shuffle_probe(int* out, int threads, int width, int lane_mask) {
  hipLaunchKernelGGL(shuffle_probe_kernel, dim3(1), dim3(threads), 0, nullptr, out, width, lane_mask);
  return hipGetLastError();
}
