// The gfx950 partition kernel (csrc_hip/tq_fp4_gfx950_attention.cuh) for benchmarks/isa_model.py:
// bf16, head 128, block 16, GQA 8, decode, in its three specializations (native FP4 MFMA, LUT,
// K8V4 = native with E4M3 keys). isa_model.py compiles this file twice with clang-22 for gfx950:
//   with -D'TQ_HOT_PATH_ASSUME(c)=__builtin_assume(c)': the step loop as the default config runs
//     it (every row sees all 128 tokens of the step, no soft cap): the hot path;
//   without it: every path of the loop (edge steps, windows, soft cap) for reference.
// The instantiations name the kernel by its template arguments only (decltype of the
// specialization), so a change of its parameter list needs no change here.
#include "tq_fp4_gfx950_attention.cuh"

#define TQ_HOT_PATH_KERNEL(NATIVE, KEY_E4M3) \
  tq::gfx950::tq_fp4_pa_gfx950_kernel<tq::Bf16, 128, 16, 8, NATIVE, false, KEY_E4M3>

template __attribute__((global)) decltype(TQ_HOT_PATH_KERNEL(true, false)) TQ_HOT_PATH_KERNEL(true, false);
template __attribute__((global)) decltype(TQ_HOT_PATH_KERNEL(false, false)) TQ_HOT_PATH_KERNEL(false, false);
template __attribute__((global)) decltype(TQ_HOT_PATH_KERNEL(true, true)) TQ_HOT_PATH_KERNEL(true, true);
