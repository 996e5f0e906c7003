// The launch plan of one paged_attention_fp4 call (torch-free): which kernel, its grid, how the
// KV range is split, the shared memory it needs. The binding asks for it once, checks it against
// the device (shared memory, grid limits) and launches it; nothing downstream chooses again.
#pragma once
#include <algorithm>

#include "attention_launch.cuh"

namespace turboquant {
namespace cuda_fp4 {

// Shared memory per CTA of kernel k (the prefill kernel's layout: that of a device of compute
// capability `major`), and its name. The binding compares it with the device's opt-in limit, so
// a kernel that cannot launch on a GPU is named in the error instead of failing at launch as a
// bare CUDA error. Examples (this build, bytes): decode D 128, FP4: 58992; short multi-token
// (16 columns) D 128, K8V4: 90320; general D 128, K8V4: 136336, over SM86 / SM89's 101376;
// general D 256, FP4: 173200, over SM80's 166912 (tests/test_cuda_compile.py prints them).
template <int D>
int attention_smem_bytes_d(AttnKernel k, bool key_e4m3, int major, const char** kernel) {
  switch (k) {
    case AttnKernel::kPrefill:
      *kernel = "prefill";
      if constexpr (D <= 128) return key_e4m3 ? prefill_smem_bytes<D, true>(major) : prefill_smem_bytes<D, false>(major);
      return 0;
    case AttnKernel::kDecode:
      *kernel = "decode";
      return key_e4m3 ? DecodeLayout<D, true, 1>::TOTAL : DecodeLayout<D, false, 1>::TOTAL;
    case AttnKernel::kDecodeWgmma:
      *kernel = "decode (wgmma)";
      return DecodeWgmmaLayout::TOTAL;
    case AttnKernel::kSpec8:
      *kernel = "short multi-token (8-column decode)";
      if constexpr (D <= 128) return key_e4m3 ? DecodeLayout<D, true, 1>::TOTAL : DecodeLayout<D, false, 1>::TOTAL;
      return 0;
    case AttnKernel::kSpec16:
      *kernel = "short multi-token (16-column decode)";
      if constexpr (D <= 128) return key_e4m3 ? DecodeLayout<D, true, 2>::TOTAL : DecodeLayout<D, false, 2>::TOTAL;
      return 0;
    default:
      *kernel = "general";
      return key_e4m3 ? AttnLayout<D, true>::TOTAL : AttnLayout<D, false>::TOTAL;
  }
}
inline int attention_smem_bytes(AttnKernel k, int D, bool key_e4m3, int major, const char** kernel) {
  int bytes = 0;
  for_head_dim(D, [&](auto d) { bytes = attention_smem_bytes_d<decltype(d)::value>(k, key_e4m3, major, kernel); });
  return bytes;
}

// The prefill kernel runs where tuning::use_prefill_kernel picks it and its shared memory fits
// the device. SM86, SM89 and SM12x allow 99 KB per CTA; K8V4 keys at D 128 take 109 KB in the
// warp-MMA layout, so there those calls run the general kernel. Example: H100 (227 KB), 1 x 2048
// @ 16k, FP4 or K8V4: prefill (182 / 202 KB); RTX 4090, the same call with K8V4 keys: general
// kernel; with FP4 keys: prefill (97 KB).
// (Only asked where use_prefill_kernel holds, so D <= 128.)
inline bool prefill_fits(int D, bool key_e4m3, int major, int optin_smem) {
  const char* name = "";
  return attention_smem_bytes(AttnKernel::kPrefill, D, key_e4m3, major, &name) <= optin_smem;
}

struct AttnPlan {
  AttnKernel kernel;
  const char* name;      // the kernel's name, for errors
  int smem_bytes;        // shared memory per CTA on a device of the given compute capability
  long long grid_x;      // see launch_paged_attention; the grid is grid_x * num_kv_heads CTAs
  int tiles_per_seq;     // 16-row head tiles per sequence (the decode grid's unit)
  int partition_size;    // keys per split of the KV range (tuning.cuh's choices) ...
  int num_partitions;    // ... and the number of splits (> 1: a reduce pass follows)
  int ws_steps;          // the prefill kernel's decode-once workspace: steps per sequence (0: none)
  long long ws_bytes;    // ... and its bytes (prefill_workspace.cuh)
};

// Whether a prefill-kernel call takes the decode-once workspace: tuning.cuh's rule, or the
// caller's choice (ws_mode 0: never, 1: whenever the byte bound allows, -1: the rule).
enum : int { kWsAuto = -1, kWsOff = 0, kWsOn = 1 };

// The decode-once workspace (prefill_workspace.cuh): per sequence of at most max_seq_len keys,
// its steps of PREFILL_TILE keys; for num_seqs sequences, its bytes (a tile per sequence, step
// and kv head).
inline int prefill_workspace_steps(int max_seq_len) {
  return (std::max(max_seq_len, 0) + tuning::PREFILL_TILE - 1) / tuning::PREFILL_TILE;
}
inline long long prefill_workspace_bytes(int D, bool key_e4m3, int num_seqs, int num_kv_heads,
                                         int max_seq_len) {
  return (long long)std::max(num_seqs, 0) * prefill_workspace_steps(max_seq_len) * num_kv_heads *
         prefill_ws_tile_bytes(D, key_e4m3);
}

// num_tokens query tokens of num_seqs sequences (multi: cu_query_lens given), group_size query
// heads per kv head, max_seq_len a host-side bound of the keys, on a device with num_sms SMs of
// compute capability major that allows optin_smem bytes of shared memory per CTA. ws_capacity:
// the bytes of the caller's workspace (the call takes the decode-once workspace only where it
// fits), or -1 where the call allocates its own (up to tuning::PREFILL_WS_MAX_BYTES).
inline AttnPlan plan_attention(int D, bool key_e4m3, bool multi, int num_tokens, int num_seqs,
                               int num_kv_heads, int group_size, int max_seq_len, int num_sms,
                               int major, int optin_smem, int ws_mode = kWsAuto,
                               long long ws_capacity = -1) {
  AttnPlan plan{};
  const bool prefill = tuning::use_prefill_kernel(multi, D, num_tokens, num_seqs, group_size) &&
                       prefill_fits(D, key_e4m3, major, optin_smem);
  plan.kernel = choose_attention_kernel(prefill, multi, D, num_tokens, num_seqs, group_size,
                                        use_decode_wgmma(major, D, key_e4m3));
  plan.smem_bytes = attention_smem_bytes(plan.kernel, D, key_e4m3, major, &plan.name);
  plan.tiles_per_seq = (group_size + 15) / 16;
  // grid x: row groups of PREFILL_ROWS (prefill kernel), row tiles of TR rows (general: 16; the
  // short multi-token forms: their 8 or 16 columns), sequences (decode)
  const int TR = plan.kernel == AttnKernel::kSpec8 ? 8 : 16;
  const long long rows = (long long)num_tokens * group_size;
  plan.grid_x = prefill ? (long long)num_seqs + rows / tuning::PREFILL_ROWS
                : multi ? (long long)num_seqs + (rows + TR - 1) / TR
                        : (long long)num_seqs * plan.tiles_per_seq;
  const int msl = std::max(max_seq_len, 0);
  // CTAs per partition: one per (row tile or group, kv head)
  const int base_ctas = (int)std::min<long long>(plan.grid_x * num_kv_heads, 1 << 30);
  // the short multi-token forms' grid has spare tiles (grid_x leaves room for ragged
  // sequences): its wave model counts the tiles of evenly split sequences
  const bool spec = plan.kernel == AttnKernel::kSpec8 || plan.kernel == AttnKernel::kSpec16;
  const long long spec_ctas = std::max<long long>(num_seqs, (rows + TR - 1) / TR) * num_kv_heads;
  plan.partition_size =
      plan.kernel == AttnKernel::kPrefill ? std::max(msl, 1)  // one partition
      : plan.kernel == AttnKernel::kDecode ? tuning::choose_decode_partition_size(msl, base_ctas, num_sms)
      : plan.kernel == AttnKernel::kDecodeWgmma
          ? tuning::choose_decode_partition_size(msl, base_ctas, num_sms, tuning::DECODE_WGMMA_MIN_BLOCKS,
                                                 tuning::DECODE_WGMMA_CTA_COST)
      : spec ? tuning::choose_decode_partition_size(msl, (int)std::min<long long>(spec_ctas, 1 << 30), num_sms)
             : tuning::choose_partition_size(msl, base_ctas, num_sms);
  plan.num_partitions = std::max(1, (msl + plan.partition_size - 1) / plan.partition_size);
  // the decode-once workspace: the wgmma build's prefill kernel only; one grid row per
  // (sequence, kv head) of the workspace pass (at most 65535)
  const bool ws = prefill && prefill_uses_wgmma(major) && ws_mode != kWsOff &&
                  (ws_mode == kWsOn || tuning::use_prefill_workspace(num_tokens, num_seqs, group_size));
  const long long bytes = prefill_workspace_bytes(D, key_e4m3, num_seqs, num_kv_heads, msl);
  const long long bound = ws_capacity >= 0 ? ws_capacity : tuning::PREFILL_WS_MAX_BYTES;
  if (ws && bytes > 0 && bytes <= bound && (long long)num_seqs * num_kv_heads <= 65535) {
    plan.ws_steps = prefill_workspace_steps(msl);
    plan.ws_bytes = bytes;
  }
  return plan;
}

}  // namespace cuda_fp4
}  // namespace turboquant
