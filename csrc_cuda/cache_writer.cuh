// turboquant cuda backend: the FP4 cache writer (reshape_and_cache_fp4), torch-free.
//
// Bit-exact with turboquant/format.py (quantize_fp4) and the reference writer:
// - scale rule: amax == 0 -> b = 0; a group holding NaN/Inf -> b = 255 and all-zero codes;
//   else the smallest e with amax <= 6 * 2^e, b = clamp(127 + e, 0, 254). With
//   amax = m * 2^E (m in [0.5, 1), frexp): e = E - 3 if m <= 0.75 else E - 2 (exact, no log).
// - codes: x * 2^(127 - b) (exact: multiplying by a power of two), round to nearest with ties to
//   the even code, saturate at 6, sign from the sign bit (so -0.0 and small negatives give 8).
// - packing: even element in the low nibble.
// - transforms (turboquant/reference.py cache_write_reference), in fp32 before the scale rule:
//   key -> rotate((k - m) / lam) with m, lam from the token's state record (key smoothing),
//   value -> rotate(v); rotate(x) = fwht(x * s) * D^-0.5 in the stage order of
//   turboquant.rotation.fwht, so the codes are the reference's bit for bit.
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
  const float* rot_signs;  // [D] +-1, or nullptr: no rotation
  float rot_norm;          // D^-0.5 (fp32)
  const float* seq_state;  // [num_slots, Hkv, 4, D] fp32 (rows 0, 1: m, lam), or nullptr
  const int* state_ids;    // [num_tokens] slot of each token (outside [0, num_slots): NaN codes)
  int num_slots;
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
// ties to the even code, sign from the sign bit. Branch-free, mostly on the FP32 pipe (the
// writer is bound by the integer pipe): in each binade of y = |q| the codes are evenly spaced,
// so one magic-number add per binade rounds to nearest-even and leaves the code in the low
// mantissa bits: codes 0..4 = rint(2y) for y < 2, 4..6 = rint(y) + 2 for 2 <= y < 4, 6..7 =
// rint(y / 2) + 4 above (8 and up saturate to 7). Ties: 0.75 -> rint(1.5) = 2 (1.0), 2.5 ->
// rint(2.5) + 2 = 4 (2.0), 5 -> rint(2.5) + 4 = 6 (4.0); the even code wins as rint's even
// integer does, since each binade's first code is even.
__device__ __forceinline__ uint32_t encode_e2m1(float q) {
  const float y = fabsf(q);
  const float t0 = __fmaf_rn(y, 2.f, 8388608.f);    // 2^23 + rint(2y)
  const float t1 = __fadd_rn(y, 8388610.f);         // 2^23 + rint(y) + 2
  const float t2 = __fmaf_rn(y, 0.5f, 8388612.f);   // 2^23 + rint(y / 2) + 4
  const float t = y < 2.f ? t0 : (y < 4.f ? t1 : t2);
  const uint32_t c = min(__float_as_uint(t) - 0x4B000000u, 7u);
  return c | ((__float_as_uint(q) >> 28) & 8u);
}

// Quantize the E (8 or 16) elements f of one thread (a group spans tpg consecutive lanes) and
// store E/2 bytes of codes (one 4- or 8-byte store) and, from the group's first lane, the scale.
template <int E>
__device__ __forceinline__ void quantize_store(const float (&f)[E], int tpg, bool active, uint8_t* code_dst,
                                               uint8_t* scale_dst) {
  // group max of |f| as integer bits: for non-negative floats the integer order is the float
  // order, and any NaN or Inf (bits >= 0x7f800000) wins the max, so one reduction gives both
  // the max and the "group is finite" test
  uint32_t umax = 0;
#pragma unroll
  for (int i = 0; i < E; ++i) umax = max(umax, __float_as_uint(f[i]) & 0x7fffffffu);
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    if (o < tpg) umax = max(umax, __shfl_xor_sync(0xffffffffu, umax, o));
  }
  if (!active) return;
  const uint32_t b = e8m0_for_amax(__uint_as_float(umax), umax < 0x7f800000u);
  uint32_t word[E / 8];
#pragma unroll
  for (int w = 0; w < E / 8; ++w) word[w] = 0;
  if (b != 255u) {
    // 2^(127 - b): b = 254 -> 2^-127 (subnormal), else normal
    const float inv = (b == 254u) ? __int_as_float(0x00400000) : __int_as_float((254u - b) << 23);
#pragma unroll
    for (int i = 0; i < E; ++i) word[i / 8] |= encode_e2m1(f[i] * inv) << (4 * (i % 8));
  }
  if constexpr (E == 8) {
    *reinterpret_cast<uint32_t*>(code_dst) = word[0];
  } else {
    *reinterpret_cast<uint2*>(code_dst) = make_uint2(word[0], word[1]);
  }
  if (scale_dst) *scale_dst = (uint8_t)b;
}

// grid (ceil(num_tokens * Hkv * D/E / WRITER_THREADS)), block WRITER_THREADS, E = WRITER_EPT.
// Item = (token, kv head); D/E consecutive lanes per item, each quantizing E elements of K and
// E of V (2E/8 16-byte loads issued together with the slot load: one memory latency per item)
// and writing E/2 bytes of codes to each cache. The group max is a shuffle reduction over the
// group's group/E lanes (an item never spans more than one warp).
template <typename T, int D>
__global__ void __launch_bounds__(tuning::WRITER_THREADS) reshape_and_cache_fp4_kernel(const CacheWriteParams p) {
  constexpr int E = tuning::WRITER_EPT;
  constexpr int TPI = D / E;  // threads per item (4 .. 32: divides 32)
  // 32-bit index math (the launcher checks num_tokens * Hkv * D/E < 2^31)
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
  float fk[E], fv[E];
#pragma unroll
  for (int i = 0; i < E; ++i) fk[i] = fv[i] = 0.f;
  if (live) {
    slot = p.slot_is_64 ? __ldg(reinterpret_cast<const long long*>(p.slot_mapping) + tok)
                        : (long long)__ldg(reinterpret_cast<const int*>(p.slot_mapping) + tok);
    const T* kp = reinterpret_cast<const T*>(p.key) + tok * p.k_stride_tok + head * p.k_stride_head + sub * E;
    const T* vp = reinterpret_cast<const T*>(p.value) + tok * p.v_stride_tok + head * p.v_stride_head + sub * E;
#pragma unroll
    for (int h = 0; h < E / 8; ++h) {
      float a[8], c[8];
      load8<T>(kp + 8 * h, a);
      load8<T>(vp + 8 * h, c);
#pragma unroll
      for (int i = 0; i < 8; ++i) { fk[8 * h + i] = a[i]; fv[8 * h + i] = c[i]; }
    }
    if (p.seq_state != nullptr) {  // key smoothing: (k - m) / lam of the token's slot
      const int slot = __ldg(p.state_ids + tok);
      const bool bad = slot < 0 || slot >= p.num_slots;
      const float* rec = p.seq_state + ((size_t)(bad ? 0 : slot) * p.num_kv_heads + head) * 4 * D + sub * E;
#pragma unroll
      for (int c = 0; c < E; c += 4) {  // four elements at a time: few registers live
        float m[4], lam[4];
        load_floats(rec + c, m);
        load_floats(rec + D + c, lam);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          fk[c + i] = bad ? __int_as_float(0x7fc00000) : (fk[c + i] - m[i]) / lam[i];
      }
    }
  }
  if (p.rot_signs != nullptr) {  // uniform: every lane of the warp shuffles
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < E; c += 4) {
      float sg[4];
      load_floats(p.rot_signs + sub * E + c, sg);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        fk[c + i] *= sg[i];
        fv[c + i] *= sg[i];
      }
    }
    fwht_row<E, TPI>(fk, lane);
    fwht_row<E, TPI>(fv, lane);
#pragma unroll
    for (int i = 0; i < E; ++i) {
      fk[i] *= p.rot_norm;
      fv[i] *= p.rot_norm;
    }
  }
  const long long blk = slot >= 0 ? (slot >> p.log2_block_size) : -1;
  const bool active = live && slot >= 0 && blk < p.num_blocks;
  const int off = active ? (int)(slot & (p.block_size - 1)) : 0;
  const long long b0 = active ? blk : 0;
  const int tpg = p.group / E;
  const bool first = (sub * E) % p.group == 0;
  const long long sidx = ((b0 * p.block_size + off) * p.num_kv_heads + head) * (D / p.group) + (sub * E) / p.group;
  const long long row = (long long)off * (D / 2) + sub * (E / 2);  // code bytes inside the block
  quantize_store<E>(fk, tpg, active, p.key_cache + b0 * p.kc_stride_blk + head * p.kc_stride_head + row,
                    first ? p.key_scales + sidx : nullptr);
  quantize_store<E>(fv, tpg, active, p.value_cache + b0 * p.vc_stride_blk + head * p.vc_stride_head + row,
                    first ? p.value_scales + sidx : nullptr);
}

template <typename T, int D>
cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream) {
  const long long threads = (long long)p.num_tokens * p.num_kv_heads * (D / tuning::WRITER_EPT);
  if (threads == 0) return cudaSuccess;
  if (threads >= (1LL << 31)) return cudaErrorInvalidValue;  // split the call
  const int blocks = (int)((threads + tuning::WRITER_THREADS - 1) / tuning::WRITER_THREADS);
  reshape_and_cache_fp4_kernel<T, D><<<blocks, tuning::WRITER_THREADS, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda_fp4
}  // namespace turboquant
