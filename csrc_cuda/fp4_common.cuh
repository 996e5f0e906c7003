// turboquant cuda backend: PTX wrappers and FP4/E8M0 register helpers (torch-free).
//
// One small named wrapper per PTX instruction, each with its lane layout.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace turboquant {
namespace cuda_fp4 {

// ---- mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 -------------------------------------
// D[16x8] (fp32) += A[16x16] (fp16, row) * B[16x8] (fp16, col). Lane = 4*g + t (g = lane/4,
// t = lane%4):
//   a[0] = {A[g][2t],   A[g][2t+1]}      a[1] = {A[g+8][2t],   A[g+8][2t+1]}
//   a[2] = {A[g][2t+8], A[g][2t+9]}      a[3] = {A[g+8][2t+8], A[g+8][2t+9]}
//   b[0] = {B[2t][g],   B[2t+1][g]}      b[1] = {B[2t+8][g],   B[2t+9][g]}
//   c[0] = C[g][2t]  c[1] = C[g][2t+1]  c[2] = C[g+8][2t]  c[3] = C[g+8][2t+1]
// (low 16 bits of each 32-bit register hold the element with the smaller index).
__device__ __forceinline__ void mma_m16n8k16_f16(float (&c)[4], const uint32_t (&a)[4],
                                                 uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- cp.async.cg.shared.global [smem], [gmem], 16 -------------------------------------------
// Per-thread 16-byte asynchronous copy global -> shared (L2 only, bypasses L1). Both addresses
// 16-byte aligned; smem_addr is a shared-window address (__cvta_generic_to_shared). Completion is tracked per thread by commit/wait groups below.
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem));
}

// ---- cp.async.ca.shared.global [smem], [gmem], 4 --------------------------------------------
// Per-thread 4-byte asynchronous copy (used for the aligned word holding an E8M0 scale byte).
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr), "l"(gmem));
}

// ---- cp.async.commit_group / cp.async.wait_group N ------------------------------------------
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- griddepcontrol.launch_dependents / griddepcontrol.wait (programmatic dependent launch) ---
// sm_90+: a grid launched with programmatic stream serialization may start once every CTA of
// the grid before it has called launch_dependents (or exited); its wait blocks until that
// grid has completed and its memory is visible. Per CTA, any thread; no-ops below sm_90.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---- FP4 (E2M1) -> fp16 in registers --------------------------------------------------------
// x holds 8 packed codes (nibble i = bits 4i..4i+3; sign in the nibble's bit 3, magnitude
// e1 e0 m in bits 2..0). Output h[i] (i = 0..3) is an fp16x2 word: low half = nibble i, high
// half = nibble i+4. The magnitude bits go to fp16 bits 11..9 (two low exponent bits and the
// top mantissa bit) and the sign to bit 15, so each fp16 equals the E2M1 value times 2^-14
// exactly (code 1 = 0.5 becomes the fp16 subnormal 2^-15; tensor cores take fp16 subnormals
// as they are). Pairing nibble i with i+4 makes both halves need the same shift: 2 shifts,
// 1 and, 1 lop3 per word pair (~2 integer ops per element).
__device__ __forceinline__ void fp4x8_to_f16x2x4(uint32_t x, uint32_t (&h)[4]) {
  const uint32_t M = 0x0E000E00u, S = 0x80008000u;
  h[0] = ((x << 9) & M) | ((x << 12) & S);
  h[1] = ((x << 5) & M) | ((x << 8) & S);
  h[2] = ((x << 1) & M) | ((x << 4) & S);
  h[3] = ((x >> 3) & M) | (x & S);
}

// ---- FP4 (E2M1) -> e4m3 bytes -> fp16 (sm_89+: cvt.rn.f16x2.e4m3x2) ------------------------
// Alternative decode: each nibble becomes an e4m3 byte (sign -> bit 7, e1 e0 -> exponent bits
// 1..0 = bits 4..3, m -> top mantissa bit 2), i.e. E2M1 value * 2^-6 exactly (em=1 -> the e4m3
// subnormal 2^-7). lo holds elements 0,2,4,6 of x, hi elements 1,3,5,7 (byte k = element 2k /
// 2k+1). 7 integer ops per 8 elements; then one cvt per 2 elements gives normal fp16 values.
__device__ __forceinline__ void fp4x8_to_e4m3x8(uint32_t x, uint32_t& lo, uint32_t& hi) {
  lo = ((x << 2) & 0x1C1C1C1Cu) | ((x << 4) & 0x80808080u);
  hi = ((x >> 2) & 0x1C1C1C1Cu) | (x & 0x80808080u);
}
// cvt.rn.f16x2.e4m3x2 on both 16-bit halves of x: d0 <- bytes 0,1 ; d1 <- bytes 2,3.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(uint32_t x, uint32_t& d0, uint32_t& d1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(d0), "=r"(d1) : "r"(x));
#else
  d0 = d1 = 0u;  // not used below sm_89 (the kernel keeps the fp16 bit decode there)
#endif
}

// ---- prmt.b32 (byte permute) ----------------------------------------------------------------
// d.byte[i] = {b,a}.byte[sel nibble i] (bytes 0-3 from a, 4-7 from b).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// E8M0 byte -> float 2^(b-127); 255 -> NaN; 0 -> 2^-127 is returned as 0 (a key/value whose
// scale is 2^-127 contributes below 1e-37: treated as 0). Branch-free: 2 integer ops + 1 select.
__device__ __forceinline__ float e8m0_to_float(uint32_t b) {
  return b == 255u ? __int_as_float(0x7fc00000) : __int_as_float(b << 23);
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
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&f)[8]) {
  if constexpr (sizeof(T) == 2) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_float(e[i]);
  } else {
    float4 a = reinterpret_cast<const float4*>(p)[0];
    float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
}

}  // namespace cuda_fp4
}  // namespace turboquant
