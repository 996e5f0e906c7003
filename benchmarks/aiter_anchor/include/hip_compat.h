// Stand-in for AITER's hip_compat.h and the part of ROCm's <hip/hip_runtime.h> that
// attention_common.cuh's partition body uses, for benchmarks/aiter_anchor.py: clang-22
// -nogpulib -nogpuinc, no ROCm here. Each definition has HIP's documented meaning on clang
// builtins (ROCm's own definitions lower to the same instructions); a ROCm build never reads it.
#pragma once

// -nogpuinc drops clang's HIP wrapper, which hipcc includes first: __device__, __global__,
// __expf and __fdividef (clang's, as in a ROCm build).
#include <__clang_hip_runtime_wrapper.h>

#include <assert.h>
#include <stdint.h>
#include <type_traits>

// A failed assert in device code ends the kernel (HIP: a trap); every assert of the counted body
// holds at compile time, so none is emitted.
extern "C" __device__ inline void __assert_fail(const char*, const char*, unsigned, const char*) {
  __builtin_trap();
}

#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(max_threads) __attribute__((amdgpu_flat_work_group_size(1, max_threads)))

// AITER builds with USE_ROCM: WARP_SIZE = ck_tile::get_warp_size(), 64 on gfx9.
constexpr int WARP_SIZE = 64;

struct aa_uint3 { unsigned x, y, z; };
#define threadIdx                                                                     \
  (aa_uint3{__builtin_amdgcn_workitem_id_x(), __builtin_amdgcn_workitem_id_y(),       \
            __builtin_amdgcn_workitem_id_z()})
#define blockIdx                                                                      \
  (aa_uint3{__builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(),     \
            __builtin_amdgcn_workgroup_id_z()})
// gridDim in workgroups: the grid's work-items over the workgroup's (clang folds the quotient to
// the kernel's hidden block count, as ROCm's gridDim does under code object v5).
#define gridDim                                                                        \
  (aa_uint3{__builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(),      \
            __builtin_amdgcn_grid_size_y() / __builtin_amdgcn_workgroup_size_y(),      \
            __builtin_amdgcn_grid_size_z() / __builtin_amdgcn_workgroup_size_z()})

struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
__device__ inline float2 make_float2(float x, float y) { return float2{x, y}; }
__device__ inline float4 make_float4(float x, float y, float z, float w) {
  return float4{x, y, z, w};
}

// __syncthreads: LDS writes before the barrier are visible to every wave of the workgroup after it.
__device__ inline void __syncthreads() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

// __shfl_xor(var, lane_mask, width): var of lane (lane ^ lane_mask) in segments of `width`
// lanes; a partner outside the caller's segment gives the caller's own value (ds_bpermute).
__device__ inline float __shfl_xor(float var, int lane_mask, int width = WARP_SIZE) {
  const int self = __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
  int index = self ^ lane_mask;
  index = index >= ((self + width) & ~(width - 1)) ? self : index;
  const int moved = __builtin_amdgcn_ds_bpermute(index << 2, __builtin_bit_cast(int, var));
  return __builtin_bit_cast(float, moved);
}
