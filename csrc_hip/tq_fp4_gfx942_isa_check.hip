// Compile-only translation unit for the gfx942 ISA tests (tests/test_aiter_isa.py) and the ISA
// model's gfx942 row (benchmarks/isa_model.py): the gfx942 partition kernel (LUT path) for
// decode and multi-token queries and both reduce kernels, for one Llama-like shape (bf16,
// head 128, block 16, GQA 8), so clang-22 emits their gfx942 code:
//   clang-22 -x hip --offload-arch=gfx942 --offload-device-only -nogpulib -nogpuinc -O3 -std=c++20 -S
// The gfx950 kernels are compiled by the tests from their own instantiations.
#include "tq_fp4_paged_attention.cuh"

// Named by their template arguments alone (decltype of the specialization).
#define TQ_INSTANTIATE(...) template __attribute__((global)) decltype(__VA_ARGS__) __VA_ARGS__;
TQ_INSTANTIATE(tq::tq_fp4_pa_partition_kernel<tq::Bf16, 128, 16, 8, false>)
TQ_INSTANTIATE(tq::tq_fp4_pa_partition_kernel<tq::Bf16, 128, 16, 8, true>)
TQ_INSTANTIATE(tq::tq_fp4_pa_reduce_kernel<tq::Bf16, 128, false>)
TQ_INSTANTIATE(tq::tq_fp4_pa_reduce_kernel<tq::Bf16, 128, true>)
