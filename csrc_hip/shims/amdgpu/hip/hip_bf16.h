// Stand-in for ROCm's <hip/hip_bf16.h> in the device build of the hipified cache writer (see
// hip_runtime.h here): the __hip_bfloat16 type and its two conversions.
#pragma once

#include "hip_runtime.h"

struct __hip_bfloat16 { unsigned short data; };
__host__ __device__ inline float __bfloat162float(__hip_bfloat16 b) {
  return __builtin_bit_cast(float, (unsigned)b.data << 16);
}
// Round to nearest, ties to even; NaN stays a (quiet) NaN.
__host__ __device__ inline __hip_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned u = __builtin_bit_cast(unsigned, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __hip_bfloat16{(unsigned short)((u >> 16) | 0x40u)};
  return __hip_bfloat16{(unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
