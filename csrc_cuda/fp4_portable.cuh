// turboquant cuda backend: the register helpers (torch-free) shared by the cache writer and the
// attention kernels, PTX-free but for cvt_e4m3x2's SM89+ instruction (arch-guarded, with a
// software path); fp4_common.cuh includes this file and adds the PTX wrappers the attention
// kernels need.
//
// Two compilers see this file: nvcc for NVIDIA, and clang for AMD after hipify-torch has
// translated the writer (turboquant/hip_writer.py). Everything here is CUDA that hipify maps
// name for name onto HIP, with one exception, the cross-lane shuffle (lane_xor below), whose
// AMD form is written out because CUDA's full-warp mask has no 64-lane meaning.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace turboquant {
namespace cuda_fp4 {

// ---- cross-lane exchange: the value of v held by lane (lane ^ o) -----------------------------
// Callers exchange within aligned runs of at most 32 lanes (o < 32, every lane of the warp
// present), so a partner never lies in another 32-lane half.
// - NVIDIA (32-lane warps): shfl.sync.bfly over the full warp.
// - AMD (hipified; gfx9 runs 64-lane wavefronts): HIP's __shfl_xor with width 32, which keeps
//   CUDA's warp semantics inside each half of the wavefront (a partner index outside the
//   caller's 32-lane segment returns the caller's own value, as CUDA's width rule does; with
//   o < 32 that never happens). A literal hipify of __shfl_xor_sync(0xffffffff, ...) would be
//   wrong there: HIP's _sync shuffles take a 64-bit mask (the 32-bit literal names only the
//   lower half of the wavefront, and ROCm's header rejects a 32-bit mask type at compile time).
template <typename V>
__device__ __forceinline__ V lane_xor(V v, int o) {
#if defined(__HIP_PLATFORM_AMD__)
  return __shfl_xor(v, o, 32);
#else
  return __shfl_xor_sync(0xffffffffu, v, o);
#endif
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Load 8 consecutive elements (16-byte aligned for 2-byte types, 32-byte for float) as float.
// The 16-byte word is split into elements by memcpy, not by reading it through a T pointer:
// the compilers may assume a uint4 and a T never alias (g++ -O2 drops the load in the host
// build of the hipified writer); the machine code is the same.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&f)[8]) {
  if constexpr (sizeof(T) == 2) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    T e[8];
    memcpy(e, &v, sizeof(v));
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_float(e[i]);
  } else {
    float4 a = reinterpret_cast<const float4*>(p)[0];
    float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
}

// N consecutive floats from a 16-byte aligned address (N a multiple of 4).
template <int N>
__device__ __forceinline__ void load_floats(const float* src, float (&v)[N]) {
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(src + i));
    v[i] = a.x; v[i + 1] = a.y; v[i + 2] = a.z; v[i + 3] = a.w;
  }
}

// Rows of a per-sequence state record, seq_state [num_slots, Hkv, STATE_ROWS, D] fp32
// (turboquant/smoothing.py): key center m, key scale lam (attention: q * lam), the sink's key
// and value, and 1 / lam (the writer: (k - m) * (1 / lam), a multiply where a division is a
// dozen instructions).
constexpr int STATE_CENTER = 0, STATE_SCALE = 1, STATE_SINK_K = 2, STATE_SINK_V = 3, STATE_INV_SCALE = 4;
constexpr int STATE_ROWS = 5;

// ---- fp32 rounding helpers and the E4M3 encode (writer and prefill kernel) ----
// fp32 arithmetic with round to nearest, for the device and for the host check of the encode.
// Device passes: NVIDIA's (__CUDA_ARCH__) and, after hipify, AMD's (__HIP_DEVICE_COMPILE__).
__host__ __device__ __forceinline__ float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
__host__ __device__ __forceinline__ float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
__host__ __device__ __forceinline__ uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
// E4M3 byte of q, |q| <= 448 (the scale rule guarantees it; NaN never comes here): the sign bit
// and the magnitude rounded to nearest, ties to even, as torch's float8_e4m3fn conversion.
// Normal range (|q| >= 2^-6): the fp32 mantissa rounded to 3 bits by adding 2^19 - 1 plus the
// kept lsb, the exponent rebiased from 127 to 7 by one subtraction (a carry out of the mantissa
// moves the exponent, as it should; 448 stays 448). Below (subnormal steps of 2^-9): |q| + 2^14
// rounds |q| to a multiple of ulp(2^14) = 2^-9, leaving the code in the low bits (2^-6 gives
// code 8, the smallest normal: the two ranges meet). The software path for SM80; SM89+ has the
// conversion instruction (cvt_e4m3x2). tests/test_cuda_compile.py checks this host build
// against a nearest-even search for every float32 magnitude up to 448.
__host__ __device__ __forceinline__ uint32_t e4m3_byte(float q) {
  const uint32_t u = float_bits(q);
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - ((127u - 7u) << 3);
  const uint32_t subnormal = float_bits(add_rn(fabsf(q), 16384.f)) - 0x46800000u;
  return ((u >> 24) & 0x80u) | (a < 0x3c800000u ? subnormal : normal);
}

// Two E4M3 bytes, lo in bits 0..7 and hi in 8..15.
// cvt.rn.satfinite.e4m3x2.f32 (SM89+): the first source goes to the upper byte; |x| above 448
// saturates to 448, NaN stays NaN (the software path takes neither).
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return e4m3_byte(lo) | (e4m3_byte(hi) << 8);
#endif
}

// ---- the rotation of turboquant/rotation.py (writer and attention kernels) ----
// Unnormalized Walsh-Hadamard transform of one row of N * LANES elements, held as N consecutive
// elements per lane by LANES consecutive, aligned lanes: stages h = 1, 2, .., N * LANES / 2 in
// the order of turboquant.rotation.fwht (in-lane stages first, then one shuffle per element and
// stage), so the fp32 results equal the reference's bit for bit. Every lane of the warp calls it.
template <int N, int LANES>
__device__ __forceinline__ void fwht_row(float (&x)[N], int lane) {
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (!(i & h)) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < LANES; m <<= 1) {
    // lower lane: x + y; upper lane: y - x, as one FFMA with x * (+-1) exact (no select)
    const float sg = (lane & m) ? -1.f : 1.f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float y = lane_xor(x[i], m);
      x[i] = __fmaf_rn(x[i], sg, y);
    }
  }
}

// Sum of v over the LANES consecutive, aligned lanes of a row (every lane of the warp calls it).
template <int LANES>
__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int m = 1; m < LANES; m <<= 1) v += lane_xor(v, m);
  return v;
}

}  // namespace cuda_fp4
}  // namespace turboquant
