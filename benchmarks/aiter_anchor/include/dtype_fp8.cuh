// Stand-in for AITER's dtype_fp8.cuh (see hip_compat.h): the KV cache dtype tag, AITER's values.
#pragma once

namespace vllm {
enum class Fp8KVCacheDataType { kAuto = 0, kFp8E4M3 = 1, kFp8E5M2 = 2 };
}
