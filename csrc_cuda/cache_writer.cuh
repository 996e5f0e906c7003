// turboquant cuda backend: the FP4 cache writer (reshape_and_cache_fp4), torch-free.
//
// Bit-exact with turboquant/format.py (quantize_fp4) and the reference writer:
// - scale rule: amax == 0 -> b = 0; a group holding NaN/Inf -> b = 255 and all-zero codes;
//   else the smallest e with amax <= 6 * 2^e, b = clamp(127 + e, 0, 254). With
//   amax = m * 2^E (m in [0.5, 1), frexp): e = E - 3 if m <= 0.75 else E - 2 (exact, no log).
// - codes: x * 2^(127 - b) (exact: multiplying by a power of two), round to nearest with ties to
//   the even code, saturate at 6, sign from the sign bit (so -0.0 and small negatives give 8).
// - packing: even element in the low nibble.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "fp4_common.cuh"
#include "tuning.cuh"

namespace turboquant {
namespace cuda_fp4 {

struct CacheWriteParams {
  const void* key;      // [num_tokens, Hkv, D] T (last dim contiguous, 16-byte aligned rows)
  const void* value;    // [num_tokens, Hkv, D] T
  long long k_stride_tok, k_stride_head;  // elements
  long long v_stride_tok, v_stride_head;  // elements
  uint8_t* key_cache;    // [num_blocks, Hkv, block_size, D/2] ([bs, D/2] contiguous)
  uint8_t* value_cache;  // [num_blocks, Hkv, block_size, D/2]
  long long kc_stride_blk, kc_stride_head;  // bytes
  long long vc_stride_blk, vc_stride_head;  // bytes
  uint8_t* key_scales;    // [num_blocks, block_size, Hkv(, D/32)] contiguous
  uint8_t* value_scales;  // same
  const void* slot_mapping;  // [num_tokens] int32 or int64; -1 skips the token
  int slot_is_64;
  int num_tokens, num_kv_heads, head_dim, group, block_size, num_blocks;
  int log2_block_size;  // block_size is a power of two
};

// E8M0 byte for a group max magnitude (format.py e8m0_for_amax), given as float bits.
__device__ __forceinline__ uint32_t e8m0_for_amax(float amax, bool finite) {
  if (!finite) return 255u;
  if (amax == 0.f) return 0u;
  uint32_t u = __float_as_uint(amax);
  int E;
  if (u >= 0x00800000u) {  // normal: amax = (1 + f) * 2^(x-127) = m * 2^E, m = (1+f)/2
    E = (int)(u >> 23) - 126;
    // m <= 0.75  <=>  1 + f <= 1.5  <=>  mantissa bits <= 0x400000
    const int e = ((u & 0x7fffffu) <= 0x400000u) ? E - 3 : E - 2;
    return (uint32_t)min(max(127 + e, 0), 254);
  }
  // subnormal amax (< 2^-126): 127 + e < 0 always -> b = 0
  return 0u;
}

// E2M1 code of a value already divided by its scale (format.py encode_e2m1): round to nearest,
// ties to the even code, saturate at 6, sign from the sign bit.
//   |q| < 1 : code = rint(2|q|)              (0, 0.5, 1 -> codes 0, 1, 2; ties to even)
//   |q| >= 1: round |q| to 1 mantissa bit (ties to even) and read code = 2 + 2*exp + mbit,
//             clamped to 7 (the odd code 7 = 6 is reached only from [5, 6] and above).
__device__ __forceinline__ uint32_t encode_e2m1(float q) {
  const float a = fabsf(q);
  uint32_t c;
  if (a < 1.f) {
    c = (uint32_t)rintf(2.f * a);
  } else {
    uint32_t u = __float_as_uint(a);
    u += 0x1fffffu + ((u >> 22) & 1u);  // RNE to one mantissa bit
    const uint32_t e = (u >> 23) - 127u, m = (u >> 22) & 1u;
    c = min(2u + 2u * e + m, 7u);  // a = inf/huge: e large -> 7 (NaN never gets here: b = 255)
  }
  return c | ((__float_as_uint(q) >> 28) & 8u);
}

// Quantize the 8 elements f of one thread (a group spans tpg consecutive lanes) and store.
template <int D>
__device__ __forceinline__ void quantize_store8(const float (&f)[8], int tpg, bool active, uint8_t* code_dst,
                                                uint8_t* scale_dst) {
  float amax = 0.f;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    finite = finite && isfinite(f[i]);
    amax = fmaxf(amax, fabsf(f[i]));
  }
  unsigned fin = finite ? 1u : 0u;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    if (o < tpg) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      fin &= __shfl_xor_sync(0xffffffffu, fin, o);
    }
  }
  if (!active) return;
  const uint32_t b = e8m0_for_amax(amax, fin != 0);
  uint32_t word = 0;
  if (b != 255u) {
    // 2^(127 - b): b = 254 -> 2^-127 (subnormal), else normal
    const float inv = (b == 254u) ? __int_as_float(0x00400000) : __int_as_float((254u - b) << 23);
#pragma unroll
    for (int i = 0; i < 8; ++i) word |= encode_e2m1(f[i] * inv) << (4 * i);
  }
  *reinterpret_cast<uint32_t*>(code_dst) = word;
  if (scale_dst) *scale_dst = (uint8_t)b;
}

// grid (ceil(num_tokens * Hkv * D/8 / WRITER_THREADS)), block WRITER_THREADS.
// Item = (token, kv head); D/8 consecutive lanes per item, each quantizing 8 elements of K and
// 8 of V (two 16-byte loads issued together with the slot load: one memory latency per item)
// and writing one 4-byte word of codes to each cache. The group max is a shuffle reduction
// over the group's group/8 lanes (an item never spans more than one warp).
template <typename T, int D>
__global__ void __launch_bounds__(tuning::WRITER_THREADS) reshape_and_cache_fp4_kernel(const CacheWriteParams p) {
  constexpr int TPI = D / 8;  // threads per item (8, 16 or 32: divides 32)
  // 32-bit index math (the launcher checks num_tokens * Hkv * D/8 < 2^31)
  const uint32_t gtid = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t item = gtid / TPI;
  const int sub = (int)(gtid % TPI);
  const uint32_t nitems = (uint32_t)p.num_tokens * (uint32_t)p.num_kv_heads;
  // every thread stays alive through the shuffles
  const bool live = item < nitems;
  const uint32_t it = live ? item : 0;
  const int tok = (int)(it / (uint32_t)p.num_kv_heads);
  const int head = (int)(it - (uint32_t)tok * (uint32_t)p.num_kv_heads);
  long long slot = -1;
  float fk[8], fv[8];
  if (live) {
    slot = p.slot_is_64 ? __ldg(reinterpret_cast<const long long*>(p.slot_mapping) + tok)
                        : (long long)__ldg(reinterpret_cast<const int*>(p.slot_mapping) + tok);
    load8<T>(reinterpret_cast<const T*>(p.key) + tok * p.k_stride_tok + head * p.k_stride_head + sub * 8, fk);
    load8<T>(reinterpret_cast<const T*>(p.value) + tok * p.v_stride_tok + head * p.v_stride_head + sub * 8, fv);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) fk[i] = fv[i] = 0.f;
  }
  const long long blk = slot >= 0 ? (slot >> p.log2_block_size) : -1;
  const bool active = live && slot >= 0 && blk < p.num_blocks;
  const int off = active ? (int)(slot & (p.block_size - 1)) : 0;
  const long long b0 = active ? blk : 0;
  const int tpg = p.group / 8;
  const bool first = (sub * 8) % p.group == 0;
  const long long sidx = ((b0 * p.block_size + off) * p.num_kv_heads + head) * (D / p.group) + (sub * 8) / p.group;
  quantize_store8<D>(fk, tpg, active,
                     p.key_cache + b0 * p.kc_stride_blk + head * p.kc_stride_head + (long long)off * (D / 2) + sub * 4,
                     first ? p.key_scales + sidx : nullptr);
  quantize_store8<D>(fv, tpg, active,
                     p.value_cache + b0 * p.vc_stride_blk + head * p.vc_stride_head + (long long)off * (D / 2) + sub * 4,
                     first ? p.value_scales + sidx : nullptr);
}

template <typename T, int D>
cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream) {
  const long long threads = (long long)p.num_tokens * p.num_kv_heads * (D / 8);
  if (threads == 0) return cudaSuccess;
  if (threads >= (1LL << 31)) return cudaErrorInvalidValue;  // split the call
  const int blocks = (int)((threads + tuning::WRITER_THREADS - 1) / tuning::WRITER_THREADS);
  reshape_and_cache_fp4_kernel<T, D><<<blocks, tuning::WRITER_THREADS, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda_fp4
}  // namespace turboquant
