// The translation unit benchmarks/aiter_anchor.py compiles for gfx950: AITER pa_v1's partition
// body (`_paged_attention_kernel` of attention_common.cuh, read from the pinned amd-aiter wheel
// at run time, not kept here) in the instantiation that pa_v1 launches for an FP8 E4M3 KV cache
// with a bf16 query, head size 128, block size 16, GQA 8, no ALiBi, no soft cap, decode.
//
// Why a wrapper: attention_v1.cu defines its kernel entry only for gfx90a/gfx94x, so the entry
// is restated here with the same arguments and the same work before the body: a sequence per
// blockIdx.x, a 256-token partition per blockIdx.y, a kv head per blockIdx.z, 256 threads;
// rows of a multi-token query and partitions past the context return.
#include "attention_common.cuh"

using Variant = ck_tile::ComposedAttention<0>;
constexpr int kBlockSize = 16, kHeadSize = 128, kThreads = 256, kGqa = 8, kPartition = 256;

extern "C" __global__ __launch_bounds__(kThreads) void aiter_pa_v1_fp8_partition(
    const __hip_bfloat16* __restrict__ q, const uint8_t* __restrict__ k_cache,
    const uint8_t* __restrict__ v_cache, const float scale, const int* __restrict__ block_tables,
    const int* __restrict__ cu_query_lens, const int* __restrict__ context_lens,
    const int max_num_blocks_per_seq, const float* __restrict__ alibi_slopes, const int q_stride,
    const int kv_block_stride, const int kv_head_stride, const int kv_seq_stride,
    float* __restrict__ exp_sums, float* __restrict__ max_logits, __hip_bfloat16* __restrict__ out,
    float logits_soft_cap, float logits_soft_cap_rcp, const float* k_scale_ptr,
    const float* v_scale_ptr, const Variant* variant) {
  const int seq = blockIdx.x;
  const int query_loc = cu_query_lens ? cu_query_lens[seq] : seq;
  if (cu_query_lens && cu_query_lens[seq + 1] - query_loc > 1) return;  // decode rows only
  const int context_len = context_lens[seq];
  const int start = blockIdx.y * kPartition;
  if (start >= context_len) return;
  _paged_attention_kernel<__hip_bfloat16, uint8_t, vllm::Fp8KVCacheDataType::kFp8E4M3, kBlockSize,
                          kHeadSize, kThreads, false, kGqa, Variant>(
      block_tables + seq * max_num_blocks_per_seq, query_loc, context_len, start, q, k_cache,
      v_cache, scale, alibi_slopes, q_stride, kv_block_stride, kv_head_stride, kv_seq_stride,
      exp_sums, max_logits, out, logits_soft_cap, logits_soft_cap_rcp, k_scale_ptr, v_scale_ptr,
      variant);
}
