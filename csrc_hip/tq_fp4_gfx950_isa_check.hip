// Compile-only translation unit for the ISA test (tests/test_aiter_isa.py): instantiates the
// partition kernel in both specializations (native FP4 MFMA, LUT), each for decode and for
// multi-token queries, with FP4 keys and with E4M3 keys (K8V4), and both reduce kernels, for
// one Llama-like shape (bf16, head 128, block 16, GQA 8), so clang-22 emits their gfx950 code:
//   clang-22 -x hip --offload-arch=gfx950 --offload-device-only -nogpulib -nogpuinc -O3 -std=c++20 -S
#include "tq_fp4_paged_attention.cuh"

#define TQ_PARTITION_ARGS                                                                      \
  const uint16_t*, const uint8_t*, const uint8_t*, const uint8_t*, const uint8_t*, const int*,    \
      const int*, const int*, float*, float*, uint16_t*, float, float, int, int, int, int, int,   \
      int, int, int64_t, int, int, const float*, const float*, const int*, int, int, int
#define TQ_REDUCE_ARGS                                                                        \
  uint16_t*, float*, const float*, const float*, const uint16_t*, const int*, const int*,       \
      const float*, int, int, int, int

template __attribute__((global)) void tq::tq_fp4_pa_partition_kernel<tq::Bf16, 128, 16, 8, true, false, false>(TQ_PARTITION_ARGS);
template __attribute__((global)) void tq::tq_fp4_pa_partition_kernel<tq::Bf16, 128, 16, 8, false, false, false>(TQ_PARTITION_ARGS);
template __attribute__((global)) void tq::tq_fp4_pa_partition_kernel<tq::Bf16, 128, 16, 8, true, true, false>(TQ_PARTITION_ARGS);
template __attribute__((global)) void tq::tq_fp4_pa_partition_kernel<tq::Bf16, 128, 16, 8, false, true, false>(TQ_PARTITION_ARGS);
template __attribute__((global)) void tq::tq_fp4_pa_partition_kernel<tq::Bf16, 128, 16, 8, true, false, true>(TQ_PARTITION_ARGS);
template __attribute__((global)) void tq::tq_fp4_pa_partition_kernel<tq::Bf16, 128, 16, 8, false, false, true>(TQ_PARTITION_ARGS);
template __attribute__((global)) void tq::tq_fp4_pa_partition_kernel<tq::Bf16, 128, 16, 8, true, true, true>(TQ_PARTITION_ARGS);
template __attribute__((global)) void tq::tq_fp4_pa_partition_kernel<tq::Bf16, 128, 16, 8, false, true, true>(TQ_PARTITION_ARGS);
template __attribute__((global)) void tq::tq_fp4_pa_reduce_kernel<tq::Bf16, 128, false>(TQ_REDUCE_ARGS);
template __attribute__((global)) void tq::tq_fp4_pa_reduce_kernel<tq::Bf16, 128, true>(TQ_REDUCE_ARGS);
