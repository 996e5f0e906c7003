// Stand-in for ROCm's <hip/hip_runtime.h> in the device build of the hipified cache writer
// (turboquant/hip_writer.py: clang-22 -x hip --offload-arch=gfx950|gfx942 -nogpulib -nogpuinc,
// no ROCm installed). It declares exactly the HIP API the writer uses, each with HIP's
// documented meaning, on clang builtins; a ROCm build uses ROCm's header instead and needs
// nothing from here. -nogpuinc also drops clang's own HIP wrapper header, which a HIP compile
// includes first (the __device__ / __global__ attributes, device math such as fabsf and
// __fmaf_rn, min/max): it is included here, as hipcc would.
#pragma once

#include <__clang_hip_runtime_wrapper.h>

#include <stddef.h>
#include <stdint.h>

#ifndef __HIP_PLATFORM_AMD__
#define __HIP_PLATFORM_AMD__ 1
#endif

#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(max_threads) __attribute__((amdgpu_flat_work_group_size(1, max_threads)))

// Work-item and work-group coordinates (HIP reads the sizes from the dispatch packet too).
struct __tq_uint3 { unsigned x, y, z; };
#define threadIdx                                                                      \
  (__tq_uint3{__builtin_amdgcn_workitem_id_x(), __builtin_amdgcn_workitem_id_y(),      \
              __builtin_amdgcn_workitem_id_z()})
#define blockIdx                                                                       \
  (__tq_uint3{__builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(),    \
              __builtin_amdgcn_workgroup_id_z()})
#define blockDim                                                                       \
  (__tq_uint3{__builtin_amdgcn_workgroup_size_x(), __builtin_amdgcn_workgroup_size_y(), \
              __builtin_amdgcn_workgroup_size_z()})

// Vector types (HIP's have the same members, sizes and alignments).
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
__host__ __device__ inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
__host__ __device__ inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return uint4{x, y, z, w};
}

// Bit reinterpretation and integer intrinsics.
__device__ inline unsigned __float_as_uint(float x) { return __builtin_bit_cast(unsigned, x); }
__device__ inline int __float_as_int(float x) { return __builtin_bit_cast(int, x); }
__device__ inline float __uint_as_float(unsigned x) { return __builtin_bit_cast(float, x); }
__device__ inline float __int_as_float(int x) { return __builtin_bit_cast(float, x); }
__device__ inline unsigned __umulhi(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a * b) >> 32);
}

// Device memcpy (HIP provides one; the writer copies 4-byte floats to integers with it).
extern "C" __device__ inline void* memcpy(void* dst, const void* src, size_t n) {
  return __builtin_memcpy(dst, src, n);
}

// Read-only load (HIP: an ordinary load; the compiler picks the cache policy).
template <typename T>
__device__ inline T __ldg(const T* p) { return *p; }

// __shfl_xor(var, lane_mask, width): the value of var in lane (lane ^ lane_mask) of the same
// wavefront; the wavefront acts as independent segments of `width` lanes, and a partner past
// the caller's segment gives the caller's own value. 32-bit types (ds_bpermute moves a dword).
template <typename T>
__device__ inline T __shfl_xor(T var, int lane_mask, int width = 64) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  const int self = (int)__builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
  int index = self ^ lane_mask;
  index = index >= ((self + width) & ~(width - 1)) ? self : index;
  return __builtin_bit_cast(T, __builtin_amdgcn_ds_bpermute(index << 2, __builtin_bit_cast(int, var)));
}

// Host side of a launch: the error codes and calls the launcher uses, and what clang lowers
// kernel<<<grid, block, shared, stream>>>(args) to.
// (dim3, hipStream_t, hipError_t and the launch entry points: the compile-test shim's)
#include "../../hip/hip_runtime.h"
constexpr hipError_t hipSuccess = 0;
constexpr hipError_t hipErrorInvalidValue = 1;
hipError_t hipGetLastError();
#define hipLaunchKernelGGL(kernel, grid, block, shared_mem, stream, ...) \
  do {                                                                   \
    kernel<<<(grid), (block), (shared_mem), (stream)>>>(__VA_ARGS__);    \
  } while (0)
