// turboquant cuda backend: the FP4 cache writer (reshape_and_cache_fp4), torch-free.
//
// Bit-exact with turboquant/format.py (quantize_fp4) and the reference writer:
// - scale rule: amax == 0 -> b = 0; a group holding NaN/Inf -> b = 255 and all-zero codes;
//   else the smallest e with amax <= 6 * 2^e, b = clamp(127 + e, 0, 254). With
//   amax = m * 2^E (m in [0.5, 1), frexp): e = E - 3 if m <= 0.75 else E - 2 (exact, no log).
// - codes: x * 2^(127 - b) (exact: multiplying by a power of two), round to nearest with ties to
//   the even code, saturate at 6, sign from the sign bit (so -0.0 and small negatives give 8).
// - packing: even element in the low nibble.
// - K8V4 keys (format.py quantize_e4m3): the same rule with 448 in place of 6, the key divided by
//   its scale (exact) rounded to the nearest E4M3 value, ties to even, one byte per element.
// - transforms (turboquant/reference.py cache_write_reference), in fp32 before the scale rule:
//   key -> rotate((k - m) * r) with m, r = 1 / lam from the token's state record (key smoothing),
//   value -> rotate(v); rotate(x) = fwht(x * s) * D^-0.5 in the stage order of
//   turboquant.rotation.fwht, so the codes are the reference's bit for bit.
//
// AMD: turboquant/hip_writer.py runs hipify-torch over this file and fp4_portable.cuh (it
// includes nothing with PTX) and compiles the result for gfx950 / gfx942. What hipify cannot
// map is written so it needs no mapping: lane shuffles go through lane_xor (fp4_portable.cuh,
// width 32 inside AMD's 64-lane wavefronts), the round-to-nearest helpers below take the
// intrinsic on HIP's device pass too, and the E4M3 encode has a software path (cvt_e4m3x2's
// PTX is for SM89+ only; gfx942's FP8 is the FNUZ variant, so no AMD conversion is used).
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>

#include "fp4_portable.cuh"
#include "limits.cuh"
#include "tuning.cuh"

namespace turboquant {
namespace cuda_fp4 {

struct CacheWriteParams {
  const void* key;      // [num_tokens, Hkv, D] T (last dim contiguous, 16-byte aligned rows)
  const void* value;    // [num_tokens, Hkv, D] T
  long long k_stride_tok, k_stride_head;  // elements
  long long v_stride_tok, v_stride_head;  // elements
  uint8_t* key_cache;    // [num_blocks, Hkv, block_size, D/2] ([bs, D/2] contiguous); K8V4: [.., D] E4M3
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
  const float* seq_state;  // [num_slots, Hkv, STATE_ROWS, D] fp32 (rows m, 1 / lam read), or nullptr
  const int* state_ids;    // [num_tokens] slot of each token (outside [0, num_slots): NaN codes)
  int num_slots;
  int key_e4m3;  // K8V4: key_cache holds E4M3 bytes, D per row (one scale per row)
};

__host__ __device__ __forceinline__ uint32_t umin(uint32_t a, uint32_t b) { return a < b ? a : b; }

// The largest magnitude of a code format as c * 2^kMaxExp with c in [0.5, 1), and c's
// mantissa bits: E2M1's 6 = 0.75 * 2^3, E4M3's 448 = 0.875 * 2^9.
struct E2m1Max { static constexpr int kMaxExp = 3; static constexpr uint32_t kMantissa = 0x400000u; };
struct E4m3Max { static constexpr int kMaxExp = 9; static constexpr uint32_t kMantissa = 0x600000u; };

// E8M0 byte for a group max magnitude (format.py e8m0_for_amax), given as float bits: the
// smallest e with amax <= c 2^(kMaxExp + e). With amax = m * 2^E (m in [0.5, 1), frexp):
// e = E - kMaxExp if m <= c, else E - kMaxExp + 1 (exact, no log).
template <typename Fmt>
__device__ __forceinline__ uint32_t e8m0_for_amax(float amax, bool finite) {
  if (!finite) return 255u;
  if (amax == 0.f) return 0u;
  uint32_t u = __float_as_uint(amax);
  int E;
  if (u >= 0x00800000u) {  // normal: amax = (1 + f) * 2^(x-127) = m * 2^E, m = (1+f)/2
    E = (int)(u >> 23) - 126;
    // m <= c  <=>  the mantissa bits of amax <= those of c
    const int e = ((u & 0x7fffffu) <= Fmt::kMantissa) ? E - Fmt::kMaxExp : E - Fmt::kMaxExp + 1;
    return (uint32_t)min(max(127 + e, 0), 254);
  }
  // subnormal amax (< 2^-126): 127 + e < 0 always -> b = 0
  return 0u;
}

// E2M1 magnitude code of y = |q|, q already divided by its scale (format.py encode_e2m1):
// round to nearest, ties to the even code; |q| <= 6 (the scale rule guarantees it, so nothing
// saturates). Returned as the bits of the float 2^23 + code. Compare-free and mostly on the
// FP32 pipe (the writer is bound by the integer/ALU pipe): in each binade of y the codes are
// evenly spaced, so one magic-number add per binade rounds to nearest-even and leaves that
// binade's code in the low mantissa bits,
//   c0 = rint(2y) (right for y < 2), c1 = rint(y) + 2 (2 <= y < 4), c2 = rint(y / 2) + 4 (above),
// and the right one is always the smallest: 2y <= y + 2 <= y/2 + 4 below 2, the first two in
// the reverse order at and above 2, the last two at and above 4 (rint is monotone, and
// rint(x + 2k) = rint(x) + 2k keeps ties on the even code). All three are floats 2^23 + c of
// one exponent, so their bits order as the codes do: one 3-way integer min. Ties: 0.75 -> 2
// (1.0), 2.5 -> 4 (2.0), 5 -> 6 (4.0), as rint's even integer. Checked against a
// nearest-even search of the grid for every float32 magnitude up to 6
// (tests/test_cuda_compile.py runs this function's host build).
constexpr uint32_t E2M1_MAGIC = 0x4B000000u;  // the bits of 2^23
__host__ __device__ __forceinline__ uint32_t e2m1_magnitude_magic(float q) {
  const float y = fabsf(q);
  const uint32_t t0 = float_bits(fma_rn(y, 2.f, 8388608.f));   // 2^23 + rint(2y)
  const uint32_t t1 = float_bits(add_rn(y, 8388610.f));        // 2^23 + rint(y) + 2
  const uint32_t t2 = float_bits(fma_rn(y, 0.5f, 8388612.f));  // 2^23 + rint(y / 2) + 4
  return umin(umin(t0, t1), t2);
}

// Eight E2M1 codes, element i in nibble i: the magnitudes (above) summed as t * 16^i (one
// multiply-add each, on the FMA pipe, with the eight 2^23 offsets removed once: the sum is
// exact modulo 2^32), the signs moved from bit 31 to bit 4i + 3 (sign from the sign bit, so
// -0.0 and small negatives give code 8) by a high multiply and merged under a mask.
__device__ __forceinline__ uint32_t encode_e2m1x8(const float* f, float inv) {
  uint32_t mag = 0, sgn = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float q = f[i] * inv;
    mag += e2m1_magnitude_magic(q) << (4 * i);
    const uint32_t u = __float_as_uint(q);
    sgn |= (i == 7 ? u : __umulhi(u, 1u << (4 * i + 4))) & (8u << (4 * i));
  }
  return (mag - E2M1_MAGIC * 0x11111111u) | sgn;
}

// 2^(127 - b) for a finite group's scale byte b: b = 254 -> 2^-127 (subnormal), else normal.
__device__ __forceinline__ float inv_scale(uint32_t b) {
  return (b == 254u) ? __int_as_float(0x00400000) : __int_as_float((254u - b) << 23);
}

// Max |f| over N elements as integer bits, with no abs per element: as signed ints the bits
// order the non-negative floats by magnitude (negatives below them), as unsigned ints the
// negative floats by magnitude (above every non-negative one); so the larger of the two maxima
// with the sign masked off is max |f|. Any NaN or Inf (magnitude bits >= 0x7f800000) wins, so
// one reduction gives both the max and the "group is finite" test.
template <int N>
__device__ __forceinline__ uint32_t abs_max_bits(const float* f) {
  int smax = INT_MIN;
  uint32_t umax = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    smax = max(smax, __float_as_int(f[i]));
    umax = max(umax, __float_as_uint(f[i]));
  }
  return max((uint32_t)smax & 0x7fffffffu, umax & 0x7fffffffu);
}

// The writer's two code formats: elements per 32-bit word of codes and the word's encode
// (x * inv for each element; inv = 2^(127 - b)).
struct E2m1Codes : E2m1Max {
  static constexpr int PER_WORD = 8;
  static __device__ __forceinline__ uint32_t encode(const float* f, float inv) { return encode_e2m1x8(f, inv); }
};
struct E4m3Codes : E4m3Max {  // K8V4 keys
  static constexpr int PER_WORD = 4;
  static __device__ __forceinline__ uint32_t encode(const float* f, float inv) {
    return cvt_e4m3x2(f[0] * inv, f[1] * inv) | (cvt_e4m3x2(f[2] * inv, f[3] * inv) << 16);
  }
};

// Quantize the E (8 or 16) elements f of one thread (a scale group spans GROUP / E consecutive
// lanes) and store their codes (one 4-, 8- or 16-byte store: E/2 bytes of E2M1, E of E4M3)
// and, from the group's first lane, the scale.
template <typename Codes, int E, int GROUP>
__device__ __forceinline__ void quantize_store(const float (&f)[E], bool active, uint8_t* code_dst,
                                               uint8_t* scale_dst) {
  constexpr int W = E / Codes::PER_WORD;
  uint32_t amax = abs_max_bits<E>(f);
#pragma unroll
  for (int o = 1; o < GROUP / E; o <<= 1) amax = max(amax, lane_xor(amax, o));
  if (!active) return;
  const uint32_t b = e8m0_for_amax<Codes>(__uint_as_float(amax), amax < 0x7f800000u);
  uint32_t word[W];
#pragma unroll
  for (int w = 0; w < W; ++w) word[w] = 0;
  if (b != 255u) {
    const float inv = inv_scale(b);
#pragma unroll
    for (int w = 0; w < W; ++w) word[w] = Codes::encode(f + Codes::PER_WORD * w, inv);
  }
  if constexpr (W == 1) {
    *reinterpret_cast<uint32_t*>(code_dst) = word[0];
  } else if constexpr (W == 2) {
    *reinterpret_cast<uint2*>(code_dst) = make_uint2(word[0], word[1]);
  } else {
    *reinterpret_cast<uint4*>(code_dst) = make_uint4(word[0], word[1], word[2], word[3]);
  }
  if (scale_dst) *scale_dst = (uint8_t)b;
}

// grid (ceil(num_tokens * Hkv * D/E / WRITER_THREADS)), block WRITER_THREADS, E = WRITER_EPT.
// Item = (token, kv head); D/E consecutive lanes per item, each quantizing E elements of K and
// E of V (2E/8 16-byte loads issued together with the slot load: one memory latency per item)
// and writing E/2 bytes of codes to each cache. The group max is a shuffle reduction over the
// group's GROUP/E lanes (an item never spans more than one warp). One instantiation per scale
// group (D or 32) and set of transforms (kSmooth: (k - m) * (1 / lam) from the token's state
// record; kRotate: both tensors rotated; kKeyE4m3: K8V4 keys, E bytes of E4M3 per lane), so a
// config pays for exactly its own instructions.
template <typename T, int D, int GROUP, bool kSmooth, bool kRotate, bool kKeyE4m3>
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
    if constexpr (kSmooth) {  // key smoothing: (k - m) * (1 / lam) of the token's slot
      const int slot = __ldg(p.state_ids + tok);
      const bool bad = slot < 0 || slot >= p.num_slots;
      const float* rec = p.seq_state + ((size_t)(bad ? 0 : slot) * p.num_kv_heads + head) * STATE_ROWS * D + sub * E;
#pragma unroll
      for (int c = 0; c < E; c += 4) {  // four elements at a time: few registers live
        float m[4], r[4];
        load_floats(rec + STATE_CENTER * D + c, m);
        load_floats(rec + STATE_INV_SCALE * D + c, r);
#pragma unroll
        for (int i = 0; i < 4; ++i) fk[c + i] = bad ? __int_as_float(0x7fc00000) : (fk[c + i] - m[i]) * r[i];
      }
    }
  }
  const long long blk = slot >= 0 ? (slot >> p.log2_block_size) : -1;
  const bool active = live && slot >= 0 && blk < p.num_blocks;
  const int off = active ? (int)(slot & (p.block_size - 1)) : 0;
  const long long b0 = active ? blk : 0;
  const long long srow = ((b0 * p.block_size + off) * p.num_kv_heads + head) * (D / GROUP);  // the row's scales
  constexpr int KROW = kKeyE4m3 ? D : D / 2;  // bytes of a key row
  uint8_t* const kcodes = p.key_cache + b0 * p.kc_stride_blk + head * p.kc_stride_head + (long long)off * KROW;
  uint8_t* const vcodes = p.value_cache + b0 * p.vc_stride_blk + head * p.vc_stride_head + (long long)off * (D / 2);
  if constexpr (kRotate) {  // every lane of the warp shuffles
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
  const bool first = (sub * E) % GROUP == 0;
  const int sg = (sub * E) / GROUP;
  if constexpr (kKeyE4m3) {
    quantize_store<E4m3Codes, E, D>(fk, active, kcodes + sub * E, first ? p.key_scales + srow : nullptr);
  } else {
    quantize_store<E2m1Codes, E, GROUP>(fk, active, kcodes + sub * (E / 2), first ? p.key_scales + srow + sg : nullptr);
  }
  quantize_store<E2m1Codes, E, GROUP>(fv, active, vcodes + sub * (E / 2), first ? p.value_scales + srow + sg : nullptr);
}

// One launch statement with the variant picked beforehand: hipify-torch rewrites each
// kernel<<<...>>> into hipLaunchKernelGGL and eats the blank before it ("else kernel<<<" becomes
// "elsehipLaunchKernelGGL"), so no launch follows a keyword.
template <typename T, int D, int GROUP, bool kKeyE4m3>
void launch_writer_variant(const CacheWriteParams& p, int blocks, bool smooth, bool rotate, cudaStream_t stream) {
  constexpr int threads = tuning::WRITER_THREADS;
  void (*const kernel)(const CacheWriteParams) =
      smooth ? (rotate ? reshape_and_cache_fp4_kernel<T, D, GROUP, true, true, kKeyE4m3>
                       : reshape_and_cache_fp4_kernel<T, D, GROUP, true, false, kKeyE4m3>)
             : (rotate ? reshape_and_cache_fp4_kernel<T, D, GROUP, false, true, kKeyE4m3>
                       : reshape_and_cache_fp4_kernel<T, D, GROUP, false, false, kKeyE4m3>);
  kernel<<<blocks, threads, 0, stream>>>(p);
}

template <typename T, int D>
cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream) {
  static_assert(supported_head_dim<D>(), "D: not in limits.cuh's HeadDims");
  const long long threads = (long long)p.num_tokens * p.num_kv_heads * (D / tuning::WRITER_EPT);
  if (threads == 0) return cudaSuccess;
  if (threads >= (1LL << 31)) return cudaErrorInvalidValue;  // split the call
  const int blocks = (int)((threads + tuning::WRITER_THREADS - 1) / tuning::WRITER_THREADS);
  const bool smooth = p.seq_state != nullptr, rotate = p.rot_signs != nullptr;
  if (p.key_e4m3) {
    if (p.group != D) return cudaErrorInvalidValue;  // K8V4: one scale per row
    launch_writer_variant<T, D, D, true>(p, blocks, smooth, rotate, stream);
  } else if (p.group == D) {
    launch_writer_variant<T, D, D, false>(p, blocks, smooth, rotate, stream);
  } else {
    launch_writer_variant<T, D, 32, false>(p, blocks, smooth, rotate, stream);
  }
  return cudaGetLastError();
}

}  // namespace cuda_fp4
}  // namespace turboquant
