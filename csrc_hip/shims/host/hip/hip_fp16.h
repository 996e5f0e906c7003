// Stand-in for <hip/hip_fp16.h> in the host build of the hipified cache writer (see
// hip_runtime.h here): __half and its conversions, exact / round to nearest even.
#pragma once

#include "hip_runtime.h"

struct __half { unsigned short __x; };
inline float __half2float(__half h) { return (float)tq_host_bit_cast<_Float16>(h.__x); }
inline __half __float2half_rn(float f) { return __half{tq_host_bit_cast<unsigned short>((_Float16)f)}; }
