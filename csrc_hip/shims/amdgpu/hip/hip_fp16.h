// Stand-in for ROCm's <hip/hip_fp16.h> in the device build of the hipified cache writer (see
// hip_runtime.h here): the __half type and its two conversions the writer's header declares.
#pragma once

#include "hip_runtime.h"

struct __half { unsigned short __x; };
__host__ __device__ inline float __half2float(__half h) {
  return (float)__builtin_bit_cast(_Float16, h.__x);
}
__host__ __device__ inline __half __float2half_rn(float f) {
  return __half{__builtin_bit_cast(unsigned short, (_Float16)f)};
}
