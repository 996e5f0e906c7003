// Stand-in for <hip/hip_bf16.h> in the host build of the hipified cache writer (see
// hip_runtime.h here): __hip_bfloat16 and its conversions.
#pragma once

#include "hip_runtime.h"

struct __hip_bfloat16 { unsigned short data; };
inline float __bfloat162float(__hip_bfloat16 b) { return tq_host_bit_cast<float>((unsigned)b.data << 16); }
// Round to nearest, ties to even; NaN stays a (quiet) NaN.
inline __hip_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned u = tq_host_bit_cast<unsigned>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __hip_bfloat16{(unsigned short)((u >> 16) | 0x40u)};
  return __hip_bfloat16{(unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
