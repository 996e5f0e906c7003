// Stand-in for ROCm's <hip/hip_bf16.h> (see ../hip_compat.h): the bf16 type, and the fp16 pair
// type that attention_common.cuh's fp16 branches name. The bf16 partition body converts with
// bit operations of its own; these are declared for the compiler's parse of the other
// branches and never called in the kernel counted.
#pragma once

#include "../hip_compat.h"

struct __hip_bfloat16 { unsigned short data; };
__device__ float __bfloat162float(__hip_bfloat16);
__device__ __hip_bfloat16 __float2bfloat16(float);

struct __half2 { _Float16 x, y; };
__device__ __half2 operator+(__half2, __half2);
__device__ __half2 __float22half2_rn(float2);
