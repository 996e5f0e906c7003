// Which attention kernel a call runs, and its launch (torch-free): the decode, short
// multi-token, prefill or general kernel, then the split-KV reduce pass. attention_plan.cuh's
// planner makes the choice once per call; launch_paged_attention runs it.
#pragma once

#include "attention_decode.cuh"
#include "attention_decode_wgmma.cuh"
#include "attention_general.cuh"
#include "attention_prefill.cuh"
#include "attention_reduce.cuh"
#include "prefill_workspace.cuh"

namespace turboquant {
namespace cuda_fp4 {

// The decode kernel applies to single-token queries of groups of at most 8 heads.
inline bool use_decode_kernel(bool multi_token, int group_size) { return !multi_token && group_size <= 8; }
// Of those, the SM90a one (attention_decode_wgmma.cuh) takes FP4 keys at D 128 on SM 9.x, for
// which the extension is built as sm_90a (turboquant/_backends/cuda.py); K8V4 keys, D 64 / 256
// and other GPUs run the warp-MMA kernel.
inline bool use_decode_wgmma(int major, int D, bool key_e4m3) {
  return tuning::DECODE_WGMMA && major == 9 && D == 128 && !key_e4m3;
}

// Which attention kernel a call runs (`prefill`: whether the prefill kernel runs, see
// plan_attention in attention_plan.cuh, which asks once per call; the plan carries the answer).
// (kSpec8 / kSpec16: the decode kernel's short multi-token forms of 8 / 16 columns;
// kDecodeWgmma: the SM90a decode kernel, use_decode_wgmma)
enum class AttnKernel { kPrefill, kDecode, kDecodeWgmma, kSpec8, kSpec16, kGeneral };
// Whether kernel k looks the sink up in the layer's table itself (sink_ref). The general and
// prefill kernels read per-sequence records instead, which the binding builds first (the
// records kernel): at their register limits, the lookup's code cost them spills.
constexpr bool reads_sink_table(AttnKernel k) { return k != AttnKernel::kPrefill && k != AttnKernel::kGeneral; }
inline AttnKernel choose_attention_kernel(bool prefill, bool multi, int D, long long num_tokens, long long num_seqs,
                                          int group_size, bool decode_wgmma) {
  if (prefill) return AttnKernel::kPrefill;
  if (use_decode_kernel(multi, group_size)) return decode_wgmma ? AttnKernel::kDecodeWgmma : AttnKernel::kDecode;
  if (tuning::use_spec_kernel(multi, D, num_tokens, num_seqs, group_size))
    return tuning::spec_columns(num_tokens, num_seqs, group_size) == 8 ? AttnKernel::kSpec8 : AttnKernel::kSpec16;
  return AttnKernel::kGeneral;
}

// The plan's kernel (decode, prefill, short multi-token or general), then the reduce pass when
// the KV range is split, for one kStates (see the general kernel).
template <int D, typename T, bool kStates, bool kE4m3>
cudaError_t launch_attention_variant(const AttnParams& p, AttnKernel k, int grid_x, cudaStream_t stream) {
  cudaError_t e;
  if (k == AttnKernel::kPrefill) {  // grid_x row groups, one partition
    if constexpr (D <= 128) {
      if (p.ws == nullptr) return launch_prefill_attention<D, T, kStates, kE4m3, false>(p, grid_x, stream);
      // the decode-once workspace (the plan's ws_steps), then the kernel copying its tiles
      e = launch_prefill_workspace<D, kE4m3>(p, stream);
      if (e != cudaSuccess) return e;
      return launch_prefill_attention<D, T, kStates, kE4m3, true>(p, grid_x, stream);
    }
    return cudaErrorInvalidValue;
  }
  if (k == AttnKernel::kDecode) {
    e = launch_decode_kernel<D, T, kStates, kE4m3, 1, false>(p, p.num_seqs, stream);
  } else if (k == AttnKernel::kDecodeWgmma) {
    if constexpr (D == 128 && !kE4m3) e = launch_decode_wgmma<T, kStates>(p, stream);
    else return cudaErrorInvalidValue;
  } else if (k == AttnKernel::kSpec8 || k == AttnKernel::kSpec16) {
    // grid_x = row tiles of the form's 8 or 16 columns (plan_attention sizes it by TR = NC)
    if constexpr (D <= 128) {
      e = k == AttnKernel::kSpec8 ? launch_decode_kernel<D, T, kStates, kE4m3, 1, true>(p, grid_x, stream)
                                  : launch_decode_kernel<D, T, kStates, kE4m3, 2, true>(p, grid_x, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  } else {
    e = launch_general_attention<D, T, kStates, kE4m3>(p, grid_x, stream);
  }
  if (e != cudaSuccess || p.num_partitions == 1) return e;
  return launch_reduce<D, T, kStates>(p, stream);
}

// Host launcher (torch-free): kernel k on grid_x, as attention_plan.cuh's plan_attention chose
// them (grid_x = row tiles of the general kernel's 16 rows or a short multi-token form's 8 or 16
// columns, sequences for the decode kernel, row groups for the prefill kernel).
template <int D, typename T>
cudaError_t launch_paged_attention(const AttnParams& p, AttnKernel k, int grid_x, cudaStream_t stream) {
  static_assert(supported_head_dim<D>(), "D: not in limits.cuh's HeadDims");
  const bool states = p.lse != nullptr || p.sinks != nullptr;
  if (p.key_e4m3) {
    if (states) return launch_attention_variant<D, T, true, true>(p, k, grid_x, stream);
    return launch_attention_variant<D, T, false, true>(p, k, grid_x, stream);
  }
  if (states) return launch_attention_variant<D, T, true, false>(p, k, grid_x, stream);
  return launch_attention_variant<D, T, false, false>(p, k, grid_x, stream);
}

}  // namespace cuda_fp4
}  // namespace turboquant
