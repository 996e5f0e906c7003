// The parameters every attention kernel of the cuda backend takes (AttnParams, filled by the
// binding from the call), and the paged-KV lookup they all make (BlockRow). Torch-free.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "paged_kv.cuh"

namespace turboquant {
namespace cuda_fp4 {

struct AttnParams {
  void* out;                 // [num_tokens, num_heads, D] T (query dtype)
  const void* query;         // [num_tokens, num_heads, D] T, last dim contiguous
  long long q_stride_tok, q_stride_head;  // elements
  long long o_stride_tok, o_stride_head;  // elements
  const uint8_t* key_cache;    // [num_blocks, Hkv, block_size, D/2] ([bs, D/2] contiguous); K8V4: E4M3 [.., D]
  const uint8_t* value_cache;  // [num_blocks, Hkv, block_size, D/2]
  long long kc_stride_blk, kc_stride_head;  // bytes; the binding requires kc_stride_blk = (key row
  long long vc_stride_blk, vc_stride_head;  // bytes / (D/2)) * vc_stride_blk < 2^31 (one offset per tile)
  const uint8_t* key_scales;    // [num_blocks, block_size, Hkv] contiguous
  const uint8_t* value_scales;  // [num_blocks, block_size, Hkv] contiguous
  const int* block_tables;      // [num_seqs, max_blocks_per_seq]
  long long bt_stride;          // elements between rows
  const int* seq_lens;          // [num_seqs]
  const int* cu_query_lens;     // [num_seqs + 1] or nullptr (decode)
  float* tmp_out;               // [num_tokens, num_heads, num_partitions, D] (partials)
  float2* tmp_ml;               // [num_tokens, num_heads, num_partitions] (m, l)
  int num_seqs, num_tokens, num_heads, num_kv_heads, group_size;
  int log2_block_size, num_blocks, max_blocks_per_seq;
  int partition_size, num_partitions, tiles_per_seq;
  int sliding_window;
  float soft_cap, scale;
  // accuracy transforms (CONTRACT.md section 2); nullptr / 0: off
  const float* rot_signs;  // [D] +-1: Q rotated in the prologue, O un-rotated before its store
  float rot_norm;          // D^-0.5 as the fp32 constant of turboquant.rotation.rotation_norm
  const float* seq_state;  // [num_slots, Hkv, STATE_ROWS, D] fp32 records: Q * lam (row 1); sink K/V rows 2, 3
  const int* state_ids;    // [num_seqs] slot of each sequence (outside [0, num_slots): NaN rows),
                           // or nullptr: every sequence reads slot 0 (the layer's record)
  int num_slots;
  int sink;                // position 0 comes from the record (rows 2, 3) or the sink table, not from the FP4 cache
  // the layer's sink table (turboquant/shared_state.py), or nullptr: the sink rows are the record's
  const uint16_t* sink_kv;   // [sink_entries + 1, Hkv, 2, D] bf16 bits: an entry's transformed K and V rows
  const int64_t* sink_tags;  // [sink_entries + 1, Hkv]: each entry's fingerprint
  int sink_entries;
  // attention states (turboquant.states); nullptr: off
  float* lse;              // [num_tokens, num_heads] fp32: each row's log-sum-exp (natural log)
  const float* sinks;      // [num_heads] fp32: learned sink logits (one more logit, no value)
  int key_e4m3;            // K8V4: key_cache holds E4M3 bytes, D per row
  // the prefill kernel's decode-once workspace (prefill_workspace.cuh), or nullptr (it decodes)
  uint8_t* ws;             // [num_seqs, ws_steps, num_kv_heads] tiles of PrefillLayout::WS_TILE bytes
  int ws_steps;            // steps of PREFILL_TILE keys per sequence it holds
};

// The paged-KV lookup every kernel makes (paged_kv.cuh), for one sequence's row of the block
// table and a token of it.
struct BlockRow {
  const AttnParams& p;
  const int* row;
  __device__ __forceinline__ BlockRow(const AttnParams& params, int s)
      : p(params), row(params.block_tables + (long long)s * params.bt_stride) {}
  // the table's entry for token tok's block: -1 past the table (entries past it are never read)
  __device__ __forceinline__ int entry(int tok) const {
    return paged_kv::table_entry(row, tok >> p.log2_block_size, p.max_blocks_per_seq);
  }
  // token tok's block id: -1 past the table or outside the cache's [0, num_blocks)
  __device__ __forceinline__ int id(int tok) const {
    return paged_kv::block_id(row, tok >> p.log2_block_size, p.max_blocks_per_seq, p.num_blocks);
  }
};

}  // namespace cuda_fp4
}  // namespace turboquant
