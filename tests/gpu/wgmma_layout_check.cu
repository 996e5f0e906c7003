// The prefill kernel's warpgroup MMAs on structured inputs, exactly as the kernel issues them:
// B from a decoded tile in shared memory (attention_prefill.cuh's dec_off panels, 128-byte
// swizzle) through wgmma_desc_sw128; A from registers (Q and P, fp4_common.cuh's layout) or from
// shared memory (Q rows, the second warpgroup's of a 128-row CTA, the first 64 rows poisoned).
//   S = Q K^T: Q [64 x 128], K [64 tokens x 128] K-major, 8 x m64n64k16 with Q in registers
//              (the kernel's S) and 8 x m64n64k16 _ss (the form of benchmarks/variants)
//   O = P V:   P [64 x 64], V [64 tokens x N] N-major, 4 x m64nNk16 with tnspB, N = 128 and 64
//   FP8 S:     Q [64 x 128] E4M3 in registers, K [64 tokens x 128] from FP4 codes decoded by
//              fp4x8_to_f16hi8 (E5M2 bytes E2M1 * 2^-14) into 128-byte K-major rows, each 8
//              codes' bytes in the decode's order (0 2 4 6 1 3 5 7) and Q's columns permuted
//              alike: 4 x m64n64k32 (wgmma_m64n64k32_e4m3_e5m2)
//   K8V4 FP8 S: the same Q, K [64 tokens x 128] as E4M3 bytes in the same rows, each 8 bytes
//              in that order (the producers' reorder_e4m3_chunk): 4 x m64n64k32
//              (wgmma_m64n64k32_e4m3_e4m3)
// Entries are small integers, so every product is exact in fp32 and the check is equality; a
// mismatch prints its first positions (a wrong descriptor or fragment map moves whole rows,
// columns or 8 x 8 blocks). Built and run by tests/gpu/test_wgmma_layout.py (SM90a only).
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_fp8.h>

#include "attention_prefill.cuh"

using namespace turboquant::cuda_fp4;

constexpr int TK = 64;

__device__ uint32_t pack2(const __half* row, int c) {
  return (uint32_t)__half_as_ushort(row[c]) | ((uint32_t)__half_as_ushort(row[c + 1]) << 16);
}
// a[0..3] of the rows 16 w + g, + 8 and the k16 slice at column k0 of a [64][ld] matrix
__device__ void a_frag(uint32_t (&a)[4], const __half* m, int ld, int k0) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const __half* r0 = m + (16 * warp + g) * ld + k0;
  const __half* r1 = r0 + 8 * ld;
  a[0] = pack2(r0, 2 * t);
  a[1] = pack2(r1, 2 * t);
  a[2] = pack2(r0, 2 * t + 8);
  a[3] = pack2(r1, 2 * t + 8);
}
template <int N>
__device__ void store_d(const float (&d)[N / 2], float* out) {  // out [64][N]
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int j = 0; j < N / 8; ++j)
    for (int i = 0; i < 4; ++i) out[(16 * warp + g + 8 * (i >> 1)) * N + 8 * j + 2 * t + (i & 1)] = d[4 * j + i];
}
// rows [TK][cols] (ld apart in src) into shared memory as the prefill kernel decodes a tile
// (rows0 = TK) or stores its Q rows (rows0 = 128: panels of 128 rows, these at rows 64..127)
template <int ROWS0 = TK>
__device__ void fill_tile(uint8_t* tile, const __half* src, int ld, int cols) {
  for (int e = threadIdx.x; e < TK * cols; e += blockDim.x) {
    const int r = e / cols + ROWS0 - TK, col = e % cols;
    reinterpret_cast<__half*>(tile + dec_off<ROWS0>(r, col / 8))[col % 8] = src[(r - ROWS0 + TK) * ld + col];
  }
  fence_proxy_async();
  __syncthreads();
}
template <int N>
__device__ void zero(float (&d)[N]) {
  for (int i = 0; i < N; ++i) d[i] = 0.f;
}

// O = P V through wgmma_n (m64nNk16, tnspB) from the tile of v's first N columns
template <int N>
__device__ void pv_product(uint8_t* smem, uint32_t base, const __half* p, const __half* v, float* out) {
  fill_tile(smem, v, 128, N);
  float o[N / 2];
  zero(o);
  wgmma_fence();
  for (int u = 0; u < TK / 16; ++u) {
    uint32_t a[4];
    a_frag(a, p, 64, 16 * u);
    wgmma_fence();
    wgmma_n<N, 1>(o, a, wgmma_desc_advance(wgmma_desc_sw128(base, TK * 128, 1024), u * 16 * 128));  // the kernel's P V call
  }
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(o);
  store_d<N>(o, out);
}

// The decode's byte order within 8 codes: position b of the 8 E5M2 bytes holds element PERM8[b].
__host__ __device__ inline int perm8(int b) { return b < 4 ? 2 * b : 2 * (b - 4) + 1; }

// FP8 S = Q K^T: kE4m3K false: codes [64 tokens][64 bytes] (two E2M1 codes a byte, element 2i
// in the low nibble); true: [64 tokens][128] E4M3 key bytes; q8 [64][128] E4M3 bytes with the
// columns of each 8 already in perm8 order
template <bool kE4m3K>
__device__ void fp8_s_product(uint8_t* smem, uint32_t base, const uint32_t* codes, const uint8_t* q8, float* out) {
  for (int e = threadIdx.x; e < 64 * 16; e += blockDim.x) {  // elements 8j .. 8j+7 of token r
    const int r = e / 16, j = e % 16;
    uint32_t lo, hi;
    if constexpr (kE4m3K) {
      const uint32_t w0 = codes[r * 32 + 2 * j], w1 = codes[r * 32 + 2 * j + 1];
      lo = prmt(w0, w1, 0x6420u);
      hi = prmt(w0, w1, 0x7531u);
    } else {
      fp4x8_to_f16hi8(codes[r * 16 + j], lo, hi);
    }
    *reinterpret_cast<uint2*>(smem + dec_off<TK>(r, j / 2) + (j & 1) * 8) = make_uint2(lo, hi);
  }
  fence_proxy_async();
  __syncthreads();
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float s[32];
  for (float& x : s) x = __int_as_float(0x7fc00000);
  const uint64_t kdesc = wgmma_desc_sw128(base, 16, 1024);
  for (int ks = 0; ks < 4; ++ks) {  // k32 slices: 32 bytes each of the 128-byte rows
    const uint8_t* r0 = q8 + (16 * warp + g) * 128 + 32 * ks + 4 * t;
    const uint8_t* r1 = r0 + 8 * 128;
    const uint32_t a[4] = {*reinterpret_cast<const uint32_t*>(r0), *reinterpret_cast<const uint32_t*>(r1),
                           *reinterpret_cast<const uint32_t*>(r0 + 16), *reinterpret_cast<const uint32_t*>(r1 + 16)};
    wgmma_fence();
    if constexpr (kE4m3K) wgmma_m64n64k32_e4m3_e4m3(s, a, wgmma_desc_advance(kdesc, 32 * ks), ks > 0);
    else wgmma_m64n64k32_e4m3_e5m2(s, a, wgmma_desc_advance(kdesc, 32 * ks), ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(s);
  store_d<64>(s, out);
}

// grid 1, block 128 (one warpgroup); q [64][128], k [64][128], p [64][64], v [64][128]
__global__ void __launch_bounds__(128) wgmma_check_kernel(const __half* q, const __half* k, const __half* p,
                                                          const __half* v, const uint32_t* codes, const uint8_t* q8,
                                                          const uint32_t* k8, float* s_out, float* s_ss_out,
                                                          float* o128_out, float* o64_out, float* s8_out, float* sk8_out) {
  extern __shared__ __align__(16) uint8_t smem_raw[];  // 1024-aligned below, as the kernel's
  uint8_t* const smem = smem_raw + ((1024u - ((uint32_t)__cvta_generic_to_shared(smem_raw) & 1023u)) & 1023u);
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  {  // S = Q K^T as the kernel issues it: Q fragments in registers, the first MMA not
     // accumulating (s holds NaN before it: a scale-d error makes every S NaN)
    fill_tile(smem, k, 128, 128);
    float s[32];
    for (float& x : s) x = __int_as_float(0x7fc00000);
    const uint64_t kdesc = wgmma_desc_sw128(base, 16, 1024);
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t a[4];
      a_frag(a, q, 128, 16 * ks);
      wgmma_fence();
      wgmma_m64n64k16_f16<0>(s, a, wgmma_desc_advance(kdesc, (ks >> 2) * TK * 128 + (ks & 3) * 32), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(s);
    store_d<64>(s, s_out);
    __syncthreads();
  }
  {  // S = Q K^T with Q rows in shared memory (_ss)
    uint8_t* qs = smem + TK * 256;  // 128 Q rows, 2 panels of 128 x 128 bytes
    for (int e = threadIdx.x; e < 128 * 128; e += blockDim.x) reinterpret_cast<__half*>(qs)[e] = __float2half(99.f);
    __syncthreads();
    fill_tile<128>(qs, q, 128, 128);
    fill_tile(smem, k, 128, 128);
    const uint32_t qrows = base + TK * 256 + 64 * 128;
    // descriptors of the tile starts advanced by the k16 slice's bytes, the first MMA not
    // accumulating (s holds NaN before it)
    float s[32];
    for (float& x : s) x = __int_as_float(0x7fc00000);
    const uint64_t qdesc = wgmma_desc_sw128(qrows, 16, 1024), kdesc = wgmma_desc_sw128(base, 16, 1024);
    wgmma_fence();
    for (int ks = 0; ks < 8; ++ks)
      wgmma_m64n64k16_f16_ss(s, wgmma_desc_advance(qdesc, (ks >> 2) * 128 * 128 + (ks & 3) * 32),
                             wgmma_desc_advance(kdesc, (ks >> 2) * TK * 128 + (ks & 3) * 32), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(s);
    store_d<64>(s, s_ss_out);
    __syncthreads();
  }
  pv_product<128>(smem, base, p, v, o128_out);
  __syncthreads();
  pv_product<64>(smem, base, p, v, o64_out);  // the first 64 columns of v
  __syncthreads();
  fp8_s_product<false>(smem, base, codes, q8, s8_out);
  __syncthreads();
  fp8_s_product<true>(smem, base, k8, q8, sk8_out);
}

static int check(const char* what, const std::vector<float>& got, const std::vector<float>& want, int cols) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] == want[i]) continue;
    if (bad < 8) printf("%s: [%zu][%zu] got %g want %g\n", what, i / cols, i % cols, got[i], want[i]);
    ++bad;
  }
  printf("%s: %d of %zu wrong\n", what, bad, want.size());
  return bad;
}

int main() {
  // structured integers: row- and column-dependent so that a moved row, column or block shows
  auto val = [](int i, int j, int a, int b) { return (float)(((i * a + j * b + (i ^ j)) % 9) - 4); };
  std::vector<__half> hq(64 * 128), hk(64 * 128), hp(64 * 64), hv(64 * 128);
  std::vector<float> fq(64 * 128), fk(64 * 128), fp(64 * 64), fv(64 * 128);
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 128; ++j) {
      fq[i * 128 + j] = val(i, j, 3, 5);
      fk[i * 128 + j] = val(i, j, 7, 2);
      fv[i * 128 + j] = val(i, j, 5, 3);
      if (j < 64) fp[i * 64 + j] = val(i, j, 2, 7);
    }
  for (size_t i = 0; i < fq.size(); ++i) hq[i] = __float2half(fq[i]), hk[i] = __float2half(fk[i]), hv[i] = __float2half(fv[i]);
  for (size_t i = 0; i < fp.size(); ++i) hp[i] = __float2half(fp[i]);
  // FP8 S: E2M1 codes of every value and sign (code = (i * 5 + j * 3 + (i ^ j)) % 16 at token i,
  // element j), Q small integers in E4M3 with each 8 columns in perm8 order
  static const float e2m1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  std::vector<uint32_t> codes(64 * 16, 0u);
  std::vector<uint8_t> q8(64 * 128), k8(64 * 128);  // k8: E4M3 bytes of K (small integers, exact)
  std::vector<float> s8(64 * 64, 0.f);
  auto code_at = [](int i, int j) { return (unsigned)((i * 5 + j * 3 + (i ^ j)) % 16); };
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 128; ++j) {
      codes[i * 16 + j / 8] |= code_at(i, j) << (4 * (j % 8));
      const int src = (j & ~7) + perm8(j & 7);  // the Q column this byte holds
      q8[i * 128 + j] = __nv_fp8_e4m3(fq[i * 128 + src]).__x;
      k8[i * 128 + j] = __nv_fp8_e4m3(fk[i * 128 + j]).__x;
    }
  for (int i = 0; i < 64; ++i)
    for (int t = 0; t < 64; ++t)
      for (int d = 0; d < 128; ++d) {
        const unsigned c = code_at(t, d);
        s8[i * 64 + t] += fq[i * 128 + d] * ((c & 8) ? -1.f : 1.f) * e2m1[c & 7] * 0x1p-14f;
      }
  std::vector<float> s(64 * 64, 0.f), o128(64 * 128, 0.f), o64(64 * 64, 0.f);
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 64; ++j)
      for (int d = 0; d < 128; ++d) s[i * 64 + j] += fq[i * 128 + d] * fk[j * 128 + d];
    for (int n = 0; n < 128; ++n)
      for (int t = 0; t < 64; ++t) o128[i * 128 + n] += fp[i * 64 + t] * fv[t * 128 + n];
    for (int n = 0; n < 64; ++n) o64[i * 64 + n] = o128[i * 128 + n];
  }
  __half *dq, *dk, *dp, *dv;
  float *ds, *dss, *do128, *do64, *ds8;
  uint32_t* dcodes;
  uint8_t *dq8, *dk8;
  float* dsk8;
  cudaMalloc(&dcodes, codes.size() * 4); cudaMalloc(&dq8, q8.size()); cudaMalloc(&ds8, s8.size() * 4);
  cudaMalloc(&dk8, k8.size()); cudaMalloc(&dsk8, s.size() * 4);
  cudaMemcpy(dk8, k8.data(), k8.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(dcodes, codes.data(), codes.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dq8, q8.data(), q8.size(), cudaMemcpyHostToDevice);
  cudaMalloc(&dq, hq.size() * 2); cudaMalloc(&dk, hk.size() * 2); cudaMalloc(&dp, hp.size() * 2);
  cudaMalloc(&dv, hv.size() * 2);
  cudaMalloc(&ds, s.size() * 4); cudaMalloc(&dss, s.size() * 4); cudaMalloc(&do128, o128.size() * 4); cudaMalloc(&do64, o64.size() * 4);
  cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dp, hp.data(), hp.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice);
  const int smem = TK * 256 + 128 * 256 + 1024;
  cudaFuncSetAttribute(wgmma_check_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  wgmma_check_kernel<<<1, 128, smem>>>(dq, dk, dp, dv, dcodes, dq8, reinterpret_cast<const uint32_t*>(dk8), ds, dss,
                                       do128, do64, ds8, dsk8);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("launch: %s\n", cudaGetErrorString(e));
    return 2;
  }
  std::vector<float> gs(s.size()), gss(s.size()), g128(o128.size()), g64(o64.size()), gs8(s8.size()), gsk8(s.size());
  cudaMemcpy(gsk8.data(), dsk8, gsk8.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(gs8.data(), ds8, gs8.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(gs.data(), ds, gs.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(gss.data(), dss, gss.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(g128.data(), do128, g128.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(g64.data(), do64, g64.size() * 4, cudaMemcpyDeviceToHost);
  const int bad = check("S = Q K^T (m64n64k16, Q in registers, K-major)", gs, s, 64) +
                  check("S = Q K^T (m64n64k16 ss, K-major)", gss, s, 64) +
                  check("O = P V (m64n128k16, N-major)", g128, o128, 128) +
                  check("O = P V (m64n64k16, N-major)", g64, o64, 64) +
                  check("FP8 S = Q K^T (m64n64k32 e4m3 x e5m2, K from FP4 codes)", gs8, s8, 64) +
                  check("K8V4 FP8 S = Q K^T (m64n64k32 e4m3 x e4m3, E4M3 key bytes)", gsk8, s, 64);
  return bad ? 1 : 0;
}
