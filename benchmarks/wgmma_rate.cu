// The tensor rate of the warpgroup MMA forms the prefill kernel issues, alone (issue 18): is a
// 64-token step's S (8 x m64n64k16, A from registers, B K-major from a 128-byte-swizzled tile)
// slower per FLOP than a 128-token step's (8 x m64n128k16)? And P V (m64n128k16, B N-major)?
// One CTA per SM, 1 or 2 warpgroups issuing chains of 8 MMAs (one commit group, as the kernel
// issues S or P V), either waited for after each group (wait 0: the kernel's pattern) or kept
// two groups in flight (wait 1: the pipe's throughput). Prints FLOP per SM clock and its share
// of 4096 (the dense fp16 rate: 989.4 TFLOP/s over 132 SMs at 1830 MHz).
//   nvcc -std=c++17 -O3 -arch=sm_90a -I csrc_cuda benchmarks/wgmma_rate.cu -o wgmma_rate
// grid (num SMs), block 128 x WGS; dynamic smem 32 KB + 1 KB alignment.
#include <cstdio>
#include <cstdint>

#include "fp4_common.cuh"

using namespace turboquant::cuda_fp4;

template <int N, int kTransB>
__device__ __forceinline__ void mma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (N == 64) wgmma_m64n64k16_f16<kTransB>(d, a, desc);
  else wgmma_m64n128k16_f16<kTransB>(d, a, desc);
}

template <int N, int kTransB, int kInFlight>
__global__ void __launch_bounds__(256, 1) rate_kernel(int iters, long long* cycles, float* sink) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - ((uint32_t)__cvta_generic_to_shared(smem_raw) & 1023u)) & 1023u);
  // a tile of small fp16 values (0.25 .. 2): the MMAs' inputs are not all zero
  for (int i = threadIdx.x; i < 16384; i += blockDim.x)
    reinterpret_cast<uint16_t*>(smem)[i] = (uint16_t)(0x3400 + ((i * 37) & 0x7ff));
  fence_proxy_async();
  __syncthreads();
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  // K-major (S): rows = N tokens of 128 bytes, 8-row groups 1024 apart; the k16 slice ks at + 32 ks.
  // N-major (P V): 16 k-rows per slice, panels of 64 columns (LBO) 64 x 128 bytes apart.
  const uint64_t desc = kTransB ? wgmma_desc_sw128(base, 64 * 128, 1024) : wgmma_desc_sw128(base, 16, 1024);
  const uint32_t lane = threadIdx.x & 31;
  uint32_t a[4] = {0x3c003c00u ^ lane, 0x38003800u, 0x3c003800u, 0x38003c00u};
  // two accumulators, alternating groups: with wait<1> one group runs while the next is issued
  float d[2][N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[0][i] = d[1][i] = 0.f;
  __syncthreads();
  const long long t0 = clock64();
#pragma unroll 1
  for (int it = 0; it < iters; it += 2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 8; ++ks)
        mma<N, kTransB>(d[h], a, wgmma_desc_advance(desc, kTransB ? (ks & 3) * 2048 : (ks & 3) * 32));
      wgmma_commit();
      wgmma_wait<kInFlight>();
    }
  }
  wgmma_wait<0>();
  __syncthreads();
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += d[0][i] + d[1][i];
  if (s == 12345.f) sink[threadIdx.x] = s;  // keeps the MMAs
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int N, int kTransB, int kInFlight>
void run(const char* name, int wgs, int sms, long long* dcyc, float* dsink) {
  auto k = rate_kernel<N, kTransB, kInFlight>;
  const int smem = 32768 + 1024;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int iters = 4096;
  k<<<sms, 128 * wgs, smem>>>(16, dcyc, dsink);  // warm-up
  k<<<sms, 128 * wgs, smem>>>(iters, dcyc, dsink);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(e)); return; }
  long long cyc[1024];
  cudaMemcpy(cyc, dcyc, sizeof(long long) * sms, cudaMemcpyDeviceToHost);
  long long mx = 0;
  for (int i = 0; i < sms; ++i) mx = cyc[i] > mx ? cyc[i] : mx;
  const double flop = (double)wgs * iters * 8 * 64.0 * N * 16 * 2;
  const double per_clk = flop / (double)mx;
  printf("%-34s warpgroups %d  wait<%d>  %7.1f clocks per 8-MMA group per warpgroup  %6.0f FLOP/clk/SM  %5.1f %% of 4096\n",
         name, wgs, kInFlight, (double)mx / iters / wgs, per_clk, 100.0 * per_clk / 4096.0);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long* dcyc;
  float* dsink;
  cudaMalloc(&dcyc, sizeof(long long) * 1024);
  cudaMalloc(&dsink, sizeof(float) * 256);
  for (int wgs = 1; wgs <= 2; ++wgs) {
    run<64, 0, 0>("S, 64 tokens (m64n64k16, K-major)", wgs, sms, dcyc, dsink);
    run<64, 0, 1>("S, 64 tokens (m64n64k16, K-major)", wgs, sms, dcyc, dsink);
    run<128, 0, 0>("S, 128 tokens (m64n128k16, K-major)", wgs, sms, dcyc, dsink);
    run<128, 0, 1>("S, 128 tokens (m64n128k16, K-major)", wgs, sms, dcyc, dsink);
    run<128, 1, 0>("P V, D 128 (m64n128k16, N-major)", wgs, sms, dcyc, dsink);
    run<128, 1, 1>("P V, D 128 (m64n128k16, N-major)", wgs, sms, dcyc, dsink);
  }
  return 0;
}
