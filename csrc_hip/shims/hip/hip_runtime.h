// Minimal stand-in for <hip/hip_runtime.h>, for compile tests only (tests/test_aiter_patch.py):
// just what the rendered pa_fp4.cpp.jinja launch code uses (dim3, hipStream_t, <<<...>>>,
// hipLaunchKernelGGL).
// clang-22 with -nogpuinc has no HIP headers and no registry package provides usable ones;
// a real AITER build uses ROCm's header instead.
#pragma once

#include <stddef.h>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef struct ihipStream_t* hipStream_t;
typedef int hipError_t;

extern "C" hipError_t __hipPushCallConfiguration(dim3 grid, dim3 block, size_t shared_mem,
                                                 hipStream_t stream);
extern "C" hipError_t __hipPopCallConfiguration(dim3* grid, dim3* block, size_t* shared_mem,
                                                hipStream_t* stream);
extern "C" hipError_t hipLaunchKernel(const void* function, dim3 grid, dim3 block, void** args,
                                      size_t shared_mem, hipStream_t stream);

// As ROCm's amd_hip_runtime.h defines it: the kernel name parenthesized, so a template's commas
// pass through (the caller writes hipLaunchKernelGGL((kernel<A, B>), grid, block, ...)).
#define hipLaunchKernelGGL(kernel_name, grid, block, shared_mem, stream, ...) \
  do {                                                                         \
    (kernel_name)<<<(grid), (block), (shared_mem), (stream)>>>(__VA_ARGS__);   \
  } while (0)
