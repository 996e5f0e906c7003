// turboquant cuda backend: PTX wrappers and FP4/E8M0 register helpers (torch-free).
//
// One small named wrapper per PTX instruction, each with its lane layout. The PTX-free helpers
// (element loads and conversions, the state record's rows, the rotation's FWHT, lane shuffles)
// live in fp4_portable.cuh, which the cache writer includes alone so that hipify-torch can
// translate it for AMD (turboquant/hip_writer.py).
#pragma once

#include <cstdint>

#include "fp4_portable.cuh"

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

// ---- wgmma (SM90a only: warpgroup MMA, fp16 inputs, fp32 accumulators) -----------------------
// A warpgroup (4 consecutive warps, the first a multiple of 4) computes D[64xN] += A[64x16] B[16xN]
// asynchronously. A comes from registers (warp w of the group holds rows 16w .. 16w+15 in
// exactly the a[0..3] layout of mma.m16n8k16 above; those registers must not change until the
// MMA is waited for) or from shared memory (_ss). D: warp w, lane 4g + t holds, for each
// 8-column block j, d[4j] = D[16w+g][8j+2t], d[4j+1] = D[16w+g][8j+2t+1], d[4j+2] = D[16w+g+8][8j+2t],
// d[4j+3] = D[16w+g+8][8j+2t+1] (mma.m16n8k16's C layout, repeated N/8 times). B comes from shared
// memory through a descriptor (wgmma_desc_sw128). kTransB = 0: B is stored K-major ([n][k] rows,
// k contiguous); 1: N-major ([k][n] rows, n contiguous). Ordering: wgmma_fence() before the first
// MMA whose accumulators or A registers were written since the last; the MMAs of one
// wgmma_commit() group run in order; wgmma_wait<N>() returns when at most N groups are pending.
// Shared memory written by ordinary stores must be published to the MMAs' (async) proxy by
// fence_proxy_async() in the writing threads before the barrier that precedes the MMA.
#define TQ_ACC8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
// accumulate = false: D = A B, the previous contents of d ignored (no zeroing before a chain).
template <int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_f16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                    bool accumulate = true) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : TQ_ACC8(d, 0), TQ_ACC8(d, 8), TQ_ACC8(d, 16), TQ_ACC8(d, 24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate), "n"(kTransB)
      : "memory");
#else
  __trap();  // SM90a only
#endif
}
template <int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_f16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
      : TQ_ACC8(d, 0), TQ_ACC8(d, 8), TQ_ACC8(d, 16), TQ_ACC8(d, 24),
        TQ_ACC8(d, 32), TQ_ACC8(d, 40), TQ_ACC8(d, 48), TQ_ACC8(d, 56)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(kTransB)
      : "memory");
#else
  __trap();  // SM90a only
#endif
}
// The same MMA with A from shared memory too (desc_a: A [64 x 16] K-major, wgmma_desc_sw128).
// (The prefill kernel's S takes Q from registers; this form is the one of the variants waiting
// in benchmarks/variants, and tests/gpu/wgmma_layout_check.cu checks it.)
// accumulate = false: D = A B, the previous contents of d ignored (no zeroing before a chain).
__device__ __forceinline__ void wgmma_m64n64k16_f16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                       bool accumulate = true) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : TQ_ACC8(d, 0), TQ_ACC8(d, 8), TQ_ACC8(d, 16), TQ_ACC8(d, 24)
      : "l"(desc_a), "l"(desc_b), "r"((int)accumulate)
      : "memory");
#else
  __trap();  // SM90a only
#endif
}
// FP8 S of the prefill kernel (tuning::PREFILL_FP8_S): D[64x64] +=
// A[64x32] B[32x64] with A E4M3 from registers and B E5M2 from shared memory, K-major (the only
// layout FP8 wgmma reads). A fragment (8-bit, k32): warp w of the group, lane 4g + t holds
// a[0] = A[16w+g][4t .. 4t+3], a[1] = A[16w+g+8][4t .. 4t+3], a[2] = A[16w+g][16+4t .. 16+4t+3],
// a[3] = A[16w+g+8][16+4t .. 16+4t+3], byte i of a word = column +i; D as the fp16 MMAs'.
// E2M1 codes times 2^-14 are E5M2 bytes as fp4x8_to_f16hi8 makes them (the fp16 high bytes).
// tests/gpu/wgmma_layout_check.cu checks the layout with codes decoded that way.
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_e5m2(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                          bool accumulate = true) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e5m2 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : TQ_ACC8(d, 0), TQ_ACC8(d, 8), TQ_ACC8(d, 16), TQ_ACC8(d, 24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate)
      : "memory");
#else
  __trap();  // SM90a only
#endif
}
// The same MMA with B E4M3 too (K8V4 keys: their bytes as stored, each 8 reordered as the
// FP4 decode orders its E5M2 bytes, so that Q's fragments are the same); layout as above.
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_e4m3(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                          bool accumulate = true) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : TQ_ACC8(d, 0), TQ_ACC8(d, 8), TQ_ACC8(d, 16), TQ_ACC8(d, 24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate)
      : "memory");
#else
  __trap();  // SM90a only
#endif
}
#undef TQ_ACC8
// A[64x32] E4M3 from registers (the layout above) times B [32 x 8] (m64n8k32) or [32 x 16]
// (m64n16k32) E4M3 from shared memory, K-major: the decode kernel's narrow MMAs (a GQA group's
// query heads as the columns). D: d[4j + 0..3] = rows 16w + g, 16w + g + 8 of columns 8j + 2t,
// 8j + 2t + 1, in the order (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
__device__ __forceinline__ void wgmma_m64n8k32_e4m3(float (&d)[4], const uint32_t (&a)[4], uint64_t desc_b,
                                                    bool accumulate = true) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate)
      : "memory");
#else
  __trap();  // SM90a only
#endif
}
__device__ __forceinline__ void wgmma_m64n16k32_e4m3(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b,
                                                     bool accumulate = true) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate)
      : "memory");
#else
  __trap();  // SM90a only
#endif
}

// Shared-memory matrix descriptor of a 128-byte-swizzled tile: start address / 16 (bits 0-13),
// leading byte offset / 16 (bits 16-29), stride byte offset / 16 (bits 32-45), base offset 0
// (bits 49-51: every 8-row x 128-byte swizzle atom starts 1024-byte aligned), layout type
// 1 = SWIZZLE_128B (bits 62-63). The swizzle: 16-byte chunk c of the 128-byte row r of an atom
// sits at chunk c ^ (r & 7). In 16-bit elements, with rows of 64 elements (one atom column):
//   K-major (kTransB 0): element (n, k) at atom column k / 64, row n; SBO = bytes between 8-row
//     groups along n (1024 when rows are packed); LBO unused; the MMA's k16 slice k0 .. k0+15
//     starts at column k0 / 64's base + (k0 % 64) * 2 bytes.
//   N-major (kTransB 1): element (k, n) at atom column n / 64 (LBO = bytes between columns), row
//     k (SBO = bytes between 8-row groups along k).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((smem_addr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo & 0x3FFFFu) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}
// The descriptor of the tile `bytes` (a multiple of 16) further on: one 32-bit add to the
// start-address field, which holds address / 16 < 2^14 for every shared address (< 256 KB), so
// the sum of two in-window addresses never carries into the fields above it.
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | (uint32_t)((uint32_t)desc + (bytes >> 4));
}
// Byte offset of (row n, byte k) in a tile of 128-byte rows with the 128-byte swizzle (8-row
// atoms packed: SBO 1024), the layout wgmma_desc_sw128 describes; the tile 1024-byte aligned.
__host__ __device__ __forceinline__ uint32_t sw128_offset(int n, int k) {
  return n * 128 + ((((k >> 4) ^ n) & 7) << 4) + (k & 15);
}
__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// ---- fence.proxy.async.shared::cta (SM90) ----------------------------------------------------
// Orders this thread's earlier ordinary shared-memory stores before later async-proxy accesses
// (wgmma's descriptor reads) once a barrier has been crossed.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// ---- bar.sync / bar.arrive id, n (named barriers, SM70+) --------------------------------------
// Barrier `id` (1-15; 0 is __syncthreads') completes once n threads (a multiple of 32, whole
// warps) have reached it: bar.arrive counts this thread's warp and goes on, bar.sync counts it
// and waits for completion (and orders the warp's earlier shared-memory accesses before the
// waiting warps' later ones, as __syncthreads does). A producer / consumer hand-off: producers
// arrive, consumers sync, n = both counts.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
// bar.red.or.pred: bar.sync that also returns the OR of the n threads' predicates.
__device__ __forceinline__ bool named_barrier_or(uint32_t id, uint32_t n, bool pred) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r) : "r"((uint32_t)pred), "r"(id), "r"(n) : "memory");
  return r != 0;
}

// ---- setmaxnreg.{dec,inc}.sync.aligned.u32 N (SM90a) -----------------------------------------
// Gives back (dec) or claims (inc) registers for the rest of the warpgroup's run: every warp of a
// warpgroup executes it; N in [24, 256], a multiple of 8. The kernel's own count comes from its
// launch bounds; the sum over the CTA's warpgroups must stay within 64K registers per SM.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg count");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg count");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// Tells the compiler that the registers r may change here (no instruction): placed after
// wgmma_wait so that no read of an asynchronously written accumulator moves above the wait.
// (reg_fence on an A fragment after the wait keeps its registers from being reused earlier.)
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void reg_fence(uint32_t (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// ---- ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (SM75+) --------------------------------
// Four 8x8 matrices of 16-bit elements from shared memory: lanes 8m .. 8m+7 give the 16-byte
// row addresses (rows 0..7) of matrix m. Out: r[m] of lane 4g + t holds row g, elements 2t, 2t+1
// of matrix m (the B fragment of mma.m16n8k16 when the matrix is B^T, i.e. [n][k] rows); with
// .trans, row g of the transpose: elements (2t, g), (2t+1, g) (B from [k][n] rows).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr));
}

// ---- cp.async.cg.shared.global.L2::128B [smem], [gmem], 16 ----------------------------------
// Per-thread 16-byte asynchronous copy global -> shared (L2 only, bypasses L1). Both addresses
// 16-byte aligned; smem_addr is a shared-window address (__cvta_generic_to_shared). Completion
// is tracked per thread by commit/wait groups below. The L2::128B hint lets L2 fetch the whole
// 128-byte line from DRAM at the first miss (the KV tiles are read whole): measured on H100
// (CUDA graph, 32/8/128, two runs in one call) 64 x 4k 104.7 / 104.9 vs 105.5 / 106.1 us,
// 1 x 32k 22.3 / 22.5 vs 22.8 / 23.0 us; L2::256B measures in between. Those shapes run the decode
// kernel; the general kernel's tiles use the same copy (its GPU tests pass; not timed apart).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem));
}
// ... from gmem + OFF to smem_addr + OFF, the offset an immediate of both addresses (a run of
// copies from two base registers, none held per copy)
template <int OFF>
__device__ __forceinline__ void cp_async_16_at(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0+%2], [%1+%2], 16;\n" ::"r"(smem_addr), "l"(gmem), "n"(OFF));
}

// ---- cp.async.ca.shared.global [smem], [gmem], 4 --------------------------------------------
// Per-thread 4-byte asynchronous copy (used for the aligned word holding an E8M0 scale byte).
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr), "l"(gmem));
}

// ... and 8 bytes (a table word read only after the pipeline's last wait)
__device__ __forceinline__ void cp_async_8(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr), "l"(gmem));
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

// The current device is sm_90 or later (programmatic dependent launch).
inline bool sm90_or_later() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  return major >= 9;
}

// Launches kern(args...) as a programmatic dependent of the previous kernel in the stream
// (sm_90+; a plain launch below): its CTAs may start while that kernel drains and wait in
// pdl_wait() until its writes are visible. Measured on H100 (CUDA graph, decode kernel):
// batch 1 x 4k 8.6 vs 9.2 us, 1 x 32k 21.3 vs 22.1 us, 64 x 4k 105.9 vs 107.0 us.
template <typename Kernel, typename... Args>
cudaError_t launch_programmatic(Kernel kern, dim3 grid, dim3 block, int smem, cudaStream_t stream,
                                Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = sm90_or_later() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kern, args...);
}

// ---- FP4 (E2M1) -> fp16 in registers (any SM80+) -------------------------------------------
// The fp16 whose high byte is (sign << 7) | (magnitude << 1) and whose low byte is 0 equals the
// E2M1 value times 2^-14 exactly: magnitude bits e1 e0 m land on fp16 bits 11..9 (two low
// exponent bits and the top mantissa bit; code 1 = 0.5 becomes the fp16 subnormal 2^-15, which
// tensor cores take as it is). Two steps:
// fp4x8_to_f16hi8: x holds 8 codes (nibble i = bits 4i..4i+3, sign in bit 3); lo gets the high
//   bytes of elements 0,2,4,6 and hi of 1,3,5,7 (byte k = element 2k / 2k+1). 7 integer ops.
__device__ __forceinline__ void fp4x8_to_f16hi8(uint32_t x, uint32_t& lo, uint32_t& hi) {
  lo = ((x << 1) & 0x0E0E0E0Eu) | ((x << 4) & 0x80808080u);
  hi = ((x >> 3) & 0x0E0E0E0Eu) | (x & 0x80808080u);
}
// f16hi4_to_f16x2x2: 4 high bytes -> 2 fp16x2 words, d0 = (byte 0, byte 1), d1 = (byte 2,
//   byte 3), each byte moved to bits 15..8 of its half and zeros below: one prmt each (the
//   integer pipe; measured on H100 no slower than the two cvt.rn.f16x2.e4m3x2 of an e4m3 byte
//   route, and it runs on SM80 too).
__device__ __forceinline__ void f16hi4_to_f16x2x2(uint32_t x, uint32_t& d0, uint32_t& d1) {
  asm("prmt.b32 %0, %1, 0, 0x1404;\n" : "=r"(d0) : "r"(x));
  asm("prmt.b32 %0, %1, 0, 0x3424;\n" : "=r"(d1) : "r"(x));
}

// ---- cvt.rn.f16x2.e4m3x2 (SM89+): two E4M3 bytes (bits 0..7 and 8..15) -> fp16x2, exact ----
// (the other direction, cvt.rn.satfinite.e4m3x2.f32, is fp4_portable.cuh's cvt_e4m3x2)
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(d) : "h"((uint16_t)x));
  return d;
#else
  __trap();  // SM89+ only
  return 0;
#endif
}
// Two floats in two E4M3 terms each: hi = E4M3 of (a, b) (cvt_e4m3x2's byte order), lo = E4M3
// of the remainders a - hi, b - hi (one exact conversion back for the pair). SM89+.
__device__ __forceinline__ void e4m3x2_split(float a, float b, uint32_t& hi, uint32_t& lo) {
  hi = cvt_e4m3x2(a, b);
  const uint32_t r = e4m3x2_to_f16x2(hi);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&r));
  lo = cvt_e4m3x2(a - f.x, b - f.y);
}

// ---- prmt.b32 (byte permute) ----------------------------------------------------------------
// d.byte[i] = {b,a}.byte[sel nibble i] (bytes 0-3 from a, 4-7 from b).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// 8 E2M1 codes (a word, element i in nibble i) -> 8 E4M3 bytes worth E2M1 x 2^-6 (exact: the
// sign bit moves to bit 7, the 3 magnitude bits to bits 2-4): lo = elements 0, 2, 4, 6, hi =
// 1, 3, 5, 7 (byte j of lo / hi: element 2j / 2j + 1). 7 integer ops.
__device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t x, uint32_t& lo, uint32_t& hi) {
  lo = ((x << 2) & 0x1C1C1C1Cu) | ((x << 4) & 0x80808080u);
  hi = ((x >> 2) & 0x1C1C1C1Cu) | (x & 0x80808080u);
}

// The SM90a FP8 decode's V^T A fragments of one 64-token step from a thread's 8 ldmatrix.trans
// units (r[4c + j]: two adjacent tokens' 4 codes each, 32-token chunk c): the byte permutes
// 0x6420 / 0x7531 of a unit pair give 4 tokens x 2 codes, whose E4M3 decode is 4 tokens of one
// D row, 4 consecutive k slots; va[h][c][k], h the row half (attention_decode_wgmma.cuh).
__device__ __forceinline__ void e2m1_units_to_vt_e4m3(const uint32_t (&r)[8], uint32_t (&va)[2][2][4]) {
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t u = r[4 * c + 2 * j], v = r[4 * c + 2 * j + 1];
      e2m1x8_to_e4m3(prmt(u, v, 0x6420u), va[0][c][2 * j], va[0][c][2 * j + 1]);
      e2m1x8_to_e4m3(prmt(u, v, 0x7531u), va[1][c][2 * j], va[1][c][2 * j + 1]);
    }
}

// A per-thread constant kept in a register: ptxas otherwise recomputes address arithmetic
// inside a loop when registers are short (the SM90a decode kernel's constant offsets).
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}
template <class T> __device__ __forceinline__ const T* opaque(const T* p) {
  asm volatile("" : "+l"(p));
  return p;
}

// ---- shared memory by address (ld / st.shared; a = __cvta_generic_to_shared) ---------------
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}
__device__ __forceinline__ void sts32(uint32_t a, uint32_t x) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(x));
}
__device__ __forceinline__ void sts64(uint32_t a, uint32_t x, uint32_t y) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(a), "r"(x), "r"(y));
}
__device__ __forceinline__ void sts16(uint32_t a, uint32_t v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(a), "h"((uint16_t)v));
}

// E8M0 byte -> float 2^(b-127); 255 -> NaN; 0 -> 2^-127 is returned as 0 (a key/value whose
// scale is 2^-127 contributes below 1e-37: treated as 0). Branch-free: 2 integer ops + 1 select.
__device__ __forceinline__ float e8m0_to_float(uint32_t b) {
  return b == 255u ? __int_as_float(0x7fc00000) : __int_as_float(b << 23);
}

}  // namespace cuda_fp4
}  // namespace turboquant
