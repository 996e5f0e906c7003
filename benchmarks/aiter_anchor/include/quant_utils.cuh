// Stand-in for AITER's quant_utils.cuh (see hip_compat.h): the FP8 output type that the reduce
// kernel's FP8-output branch names; the partition body counted here does not use it.
#pragma once

#include <stdint.h>

struct hip_fp8 {
  __device__ explicit hip_fp8(float);
  uint8_t data;
};
