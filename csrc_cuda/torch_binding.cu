// turboquant cuda backend: the one torch file. Implements (CUDA dispatch key) the ops
//   turboquant::paged_attention_fp4_cuda   (ATTENTION_SCHEMA in turboquant/ops.py)
//   turboquant::prefill_workspace_bytes_cuda (WORKSPACE_BYTES_SCHEMA)
//   turboquant::reshape_and_cache_fp4_cuda (CACHE_WRITE_SCHEMA)
//   turboquant::merge_attention_states_cuda (MERGE_STATES_SCHEMA)
//   turboquant::shared_records_cuda        (SHARED_RECORDS_SCHEMA: turboquant/shared_state.py)
//   turboquant::shared_enter_sinks_cuda    (SHARED_ENTER_SINKS_SCHEMA)
// The schemas are defined once, in Python (turboquant/_backends/cuda.py, from ops.py), before
// this library is loaded; here only TORCH_LIBRARY_IMPL. Metadata checks only: no host sync.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "cache_writer.cuh"
#include "merge_states.cuh"
#include "attention_plan.cuh"
#include "shared_state.cuh"

namespace tq = turboquant::cuda_fp4;

namespace {

// The cache pointers and byte strides: the same fields in AttnParams and CacheWriteParams.
template <typename Params>
void set_cache_fields(Params& p, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& key_scales, const at::Tensor& value_scales) {
  p.key_cache = static_cast<uint8_t*>(key_cache.data_ptr());  // uint8, or float8_e4m3fn (K8V4)
  p.value_cache = value_cache.data_ptr<uint8_t>();
  p.kc_stride_blk = key_cache.stride(0);
  p.kc_stride_head = key_cache.stride(1);
  p.vc_stride_blk = value_cache.stride(0);
  p.vc_stride_head = value_cache.stride(1);
  p.key_scales = key_scales.data_ptr<uint8_t>();
  p.value_scales = value_scales.data_ptr<uint8_t>();
}

// The transforms of both parameter structs (CONTRACT.md section 2): rotation signs, state
// records and their slot ids (one per sequence for attention, per token for the writer; none
// with layer_record: seq_state is the layer's one record, slot 0 for every sequence).
template <typename Params>
void set_transform_fields(Params& p, int D, int hkv, int num_ids,
                          const std::optional<at::Tensor>& rotation_signs,
                          const std::optional<at::Tensor>& seq_state,
                          const std::optional<at::Tensor>& state_ids, bool layer_record = false) {
  p.rot_signs = nullptr;
  p.seq_state = nullptr;
  p.state_ids = nullptr;
  p.num_slots = 0;
  p.rot_norm = (float)std::pow((double)D, -0.5);  // as turboquant.rotation.rotation_norm
  if (rotation_signs.has_value()) {
    const at::Tensor& r = *rotation_signs;
    TORCH_CHECK(r.is_cuda() && r.scalar_type() == at::kFloat && r.dim() == 1 && r.size(0) == D && r.is_contiguous(),
                "rotation_signs: expected a contiguous float32 [D] CUDA tensor");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(r.data_ptr()) % 16 == 0,
                "rotation_signs: expected a 16-byte aligned tensor");
    p.rot_signs = r.data_ptr<float>();
  }
  if (layer_record) {
    TORCH_CHECK(seq_state.has_value() && !state_ids.has_value() && seq_state->dim() == 4 && seq_state->size(0) == 1,
                "seq_state/state_ids: with sink_kv, expected the layer's one record [1, num_kv_heads, 5, D] "
                "and no state_ids");
  } else {
    TORCH_CHECK(seq_state.has_value() == state_ids.has_value(), "seq_state/state_ids: expected both or neither");
  }
  if (seq_state.has_value()) {
    const at::Tensor& st = *seq_state;
    TORCH_CHECK(st.is_cuda() && st.scalar_type() == at::kFloat && st.dim() == 4 && st.size(1) == hkv &&
                    st.size(2) == tq::STATE_ROWS && st.size(3) == D && st.is_contiguous(),
                "seq_state: expected a contiguous float32 [num_slots, num_kv_heads, 5, D] CUDA tensor");
    TORCH_CHECK(st.size(0) < (1LL << 31), "seq_state: fewer than 2^31 slots");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(st.data_ptr()) % 16 == 0, "seq_state: expected a 16-byte aligned tensor");
    p.seq_state = st.data_ptr<float>();
    p.num_slots = (int)st.size(0);
  }
  if (state_ids.has_value()) {
    const at::Tensor& ids = *state_ids;
    TORCH_CHECK(ids.is_cuda() && ids.scalar_type() == at::kInt && ids.dim() == 1 && ids.size(0) == num_ids &&
                    ids.is_contiguous(),
                "state_ids: expected a contiguous int32 CUDA tensor with one slot per sequence (attention) "
                "or token (writer)");
    p.state_ids = ids.data_ptr<int>();
  }
}

// TURBOQUANT_PREFILL_WORKSPACE: "0" never takes the prefill kernel's decode-once workspace, "1"
// takes it for every prefill-kernel call the byte bound allows; unset or anything else:
// tuning.cuh's rule (read at every call, as the plan is made).
int prefill_workspace_mode() {
  const char* v = std::getenv("TURBOQUANT_PREFILL_WORKSPACE");
  if (v != nullptr && std::strcmp(v, "0") == 0) return tq::kWsOff;
  if (v != nullptr && std::strcmp(v, "1") == 0) return tq::kWsOn;
  return tq::kWsAuto;
}

int num_sms(int device) {
  static int cache[64] = {0};
  if (device < 0 || device >= 64) return 132;
  if (!cache[device]) cache[device] = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  return cache[device];
}

// The shared state's view of a cache (shared_state.cuh).
tq::SharedCache shared_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& key_scales, const at::Tensor& value_scales) {
  TORCH_CHECK(key_cache.is_cuda() && key_cache.dim() == 4 && value_cache.dim() == 4,
              "key_cache/value_cache: expected 4-D CUDA tensors");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "key_cache/value_cache: rows contiguous");
  TORCH_CHECK(key_scales.is_contiguous() && value_scales.is_contiguous(), "key_scales/value_scales: contiguous");
  tq::SharedCache c{};
  c.key_cache = static_cast<const uint8_t*>(key_cache.data_ptr());
  c.value_cache = value_cache.data_ptr<uint8_t>();
  c.key_scales = key_scales.data_ptr<uint8_t>();
  c.value_scales = value_scales.data_ptr<uint8_t>();
  c.kc_blk = key_cache.stride(0);
  c.kc_head = key_cache.stride(1);
  c.kc_tok = key_cache.stride(2);
  c.vc_blk = value_cache.stride(0);
  c.vc_head = value_cache.stride(1);
  c.vc_tok = value_cache.stride(2);
  c.key_e4m3 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  c.key_bytes = (int)key_cache.size(3);
  c.value_bytes = (int)value_cache.size(3);
  c.head_dim = 2 * c.value_bytes;
  c.num_blocks = (int)value_cache.size(0);
  c.hkv = (int)value_cache.size(1);
  c.block_size = (int)value_cache.size(2);
  c.groups = key_scales.dim() == 4 ? (int)key_scales.size(3) : 1;
  return c;
}

// tq_shared_records_kernel: the records [num_seqs, Hkv, 5, D] and ids 0 .. num_seqs - 1 of a
// call's sequences from the layer's record smoothing [1, Hkv, 5, D] and sink table.
void launch_shared_records(at::Tensor& records, at::Tensor& state_ids, const tq::SharedCache& c,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& smoothing,
                           const at::Tensor& sink_kv, const at::Tensor& sink_tags) {
  const dim3 grid((unsigned)block_tables.size(0), (c.hkv + tq::kSharedWarps - 1) / tq::kSharedWarps);
  C10_CUDA_CHECK(tq::launch_programmatic(
      tq::tq_shared_records_kernel, grid, dim3(tq::kSharedThreads), 0, at::cuda::getCurrentCUDAStream(),
      records.data_ptr<float>(), state_ids.data_ptr<int>(), c,
      static_cast<const int*>(block_tables.data_ptr<int>()), (int)block_tables.stride(0),
      (int)block_tables.size(1), static_cast<const int*>(seq_lens.data_ptr<int>()),
      static_cast<const float*>(smoothing.data_ptr<float>()),
      reinterpret_cast<const uint16_t*>(sink_kv.data_ptr()),
      static_cast<const int64_t*>(sink_tags.data_ptr<int64_t>()), (int)sink_tags.size(0) - 1));
}

void paged_attention_fp4_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& key_scales,
                              const at::Tensor& value_scales, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens,
                              const std::optional<at::Tensor>& cu_query_lens, double scale,
                              int64_t sliding_window, double logits_soft_cap, int64_t max_seq_len,
                              const std::optional<at::Tensor>& rotation_signs,  // float32 [D]
                              const std::optional<at::Tensor>& seq_state,  // float32 [slots, Hkv, 5, D]
                              const std::optional<at::Tensor>& state_ids,  // int32 [num_seqs]
                              bool sink,
                              const std::optional<at::Tensor>& sinks,  // float32 [num_heads]
                              const std::optional<at::Tensor>& lse,  // float32 [num_tokens, num_heads]
                              const std::optional<at::Tensor>& workspace,  // uint8 [bytes]
                              const std::optional<at::Tensor>& sink_kv,    // bf16 [S + 1, Hkv, 2, D]
                              const std::optional<at::Tensor>& sink_tags) {  // int64 [S + 1, Hkv]
  TORCH_CHECK(!sink || seq_state.has_value(), "sink: needs seq_state");
  TORCH_CHECK(query.is_cuda() && query.dim() == 3, "query: expected a 3-D CUDA tensor");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out: expected the query's shape and dtype");
  TORCH_CHECK(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16,
              "query: expected float16 or bfloat16");
  TORCH_CHECK(key_cache.dim() == 4 && (key_cache.scalar_type() == at::kByte || key_cache.scalar_type() == at::kFloat8_e4m3fn),
              "key_cache: expected uint8 (FP4) or float8_e4m3fn (K8V4) 4-D");
  TORCH_CHECK(key_scales.dim() == 3, "key_scales: the cuda backend supports one scale per (token, head) only");
  const int num_tokens = (int)query.size(0), num_heads = (int)query.size(1), D = (int)query.size(2);
  const int num_blocks = (int)key_cache.size(0), hkv = (int)key_cache.size(1), bs = (int)key_cache.size(2);
  const bool key_e4m3 = key_cache.scalar_type() == at::kFloat8_e4m3fn;  // K8V4
  TORCH_CHECK(key_cache.size(3) == (key_e4m3 ? D : D / 2), "key_cache: row size mismatch (D/2; K8V4: D)");
  TORCH_CHECK(tq::is_head_dim(D), "head_dim ", D, " is not one the kernels are built for (limits.cuh)");
  TORCH_CHECK(bs >= tq::kMinBlockSize && (bs & (bs - 1)) == 0, "block_size must be a power of two >= ",
              tq::kMinBlockSize);
  TORCH_CHECK(num_heads % hkv == 0, "num_heads % num_kv_heads != 0");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out: last dim must be contiguous");
  TORCH_CHECK(key_cache.stride(3) == 1 && key_cache.stride(2) == (key_e4m3 ? D : D / 2) &&
                  value_cache.stride(3) == 1 && value_cache.stride(2) == D / 2,
              "key_cache/value_cache: [block_size, D/2] (K8V4 keys: [block_size, D]) must be contiguous");
  TORCH_CHECK(key_scales.is_contiguous() && value_scales.is_contiguous(), "scales must be contiguous");
  TORCH_CHECK(key_cache.stride(0) == (key_e4m3 ? 2 : 1) * value_cache.stride(0) && key_cache.stride(0) < (1LL << 31),
              "key_cache/value_cache: expected key_cache's block stride = value_cache's (K8V4: twice it), below 2^31 bytes");
  TORCH_CHECK((long long)num_blocks * bs <= (1LL << 32), "key_cache: at most 2^32 token slots (num_blocks * block_size)");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables/seq_lens: expected int32");
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables: rows must be contiguous");
  if (sinks.has_value())
    TORCH_CHECK(sinks->is_cuda() && sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                    sinks->size(0) == num_heads && sinks->is_contiguous(),
                "sinks: expected a contiguous float32 [num_heads] CUDA tensor");
  if (lse.has_value())
    TORCH_CHECK(lse->is_cuda() && lse->scalar_type() == at::kFloat && lse->dim() == 2 && lse->size(0) == num_tokens &&
                    lse->size(1) == num_heads && lse->is_contiguous(),
                "lse: expected a contiguous float32 [num_tokens, num_heads] CUDA tensor");
  if (workspace.has_value())
    TORCH_CHECK(workspace->device() == query.device() && workspace->scalar_type() == at::kByte &&
                    workspace->dim() == 1 && workspace->is_contiguous() &&
                    reinterpret_cast<uintptr_t>(workspace->data_ptr()) % 16 == 0,
                "workspace: expected a contiguous 1-D uint8 tensor on the query's device, 16-byte aligned");
  if (num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  const int num_seqs = (int)seq_lens.size(0);
  const int G = num_heads / hkv;
  const bool multi = cu_query_lens.has_value();
  if (multi) {
    TORCH_CHECK(cu_query_lens->scalar_type() == at::kInt && cu_query_lens->is_contiguous(),
                "cu_query_lens: expected contiguous int32");
  } else {
    TORCH_CHECK(num_tokens == num_seqs, "decode: one query token per sequence");
  }
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(query.get_device());
  const tq::AttnPlan plan = tq::plan_attention(D, key_e4m3, multi, num_tokens, num_seqs, hkv, G,
                                               (int)std::max<int64_t>(max_seq_len, 0),
                                               num_sms(query.get_device()), prop->major,
                                               (int)prop->sharedMemPerBlockOptin, prefill_workspace_mode(),
                                               workspace.has_value() ? workspace->numel() : -1);
  // the kernel's shared memory must fit this GPU (a named error, not a failed launch)
  TORCH_CHECK(plan.smem_bytes <= (int)prop->sharedMemPerBlockOptin, "paged_attention_fp4 (cuda): the ", plan.name,
              " attention kernel needs ", plan.smem_bytes, " bytes of shared memory per block at head_dim ", D,
              key_e4m3 ? " with K8V4 keys" : "", "; this GPU (SM ", prop->major, ".", prop->minor, ") allows ",
              prop->sharedMemPerBlockOptin, ": run this call with backend='reference'");
  if (num_seqs == 0) return;
  TORCH_CHECK(plan.grid_x * hkv < (1LL << 31), "query: too many (row tile, kv head) pairs for one grid");
  const int nparts = plan.num_partitions;
  TORCH_CHECK(nparts <= 65535, "max_seq_len too large");

  // the decode-once workspace: the caller's (the plan fitted the call to it), else one of its own
  at::Tensor tmp_out, tmp_ml, ws;
  if (plan.ws_steps > 0)
    ws = workspace.has_value() ? *workspace : at::empty({plan.ws_bytes}, query.options().dtype(at::kByte));
  if (nparts > 1) {
    auto fopts = query.options().dtype(at::kFloat);
    tmp_out = at::empty({num_tokens, num_heads, nparts, D}, fopts);
    tmp_ml = at::empty({num_tokens, num_heads, nparts, 2}, fopts);
  }
  tq::AttnParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.q_stride_tok = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.o_stride_tok = out.stride(0);
  p.o_stride_head = out.stride(1);
  set_cache_fields(p, key_cache, value_cache, key_scales, value_scales);
  p.block_tables = block_tables.data_ptr<int>();
  p.bt_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.cu_query_lens = multi ? cu_query_lens->data_ptr<int>() : nullptr;
  p.tmp_out = nparts > 1 ? tmp_out.data_ptr<float>() : nullptr;
  p.tmp_ml = nparts > 1 ? reinterpret_cast<float2*>(tmp_ml.data_ptr<float>()) : nullptr;
  p.num_seqs = num_seqs;
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.num_kv_heads = hkv;
  p.group_size = G;
  int lbs = 0;
  while ((1 << lbs) < bs) ++lbs;
  p.log2_block_size = lbs;
  p.num_blocks = num_blocks;
  p.max_blocks_per_seq = (int)block_tables.size(1);
  p.partition_size = plan.partition_size;
  p.num_partitions = nparts;
  p.tiles_per_seq = plan.tiles_per_seq;
  p.sliding_window = (int)sliding_window;
  p.soft_cap = (float)logits_soft_cap;
  p.scale = (float)scale;
  const bool table = sink_kv.has_value() || sink_tags.has_value();
  set_transform_fields(p, D, hkv, num_seqs, rotation_signs, seq_state, state_ids, table);
  p.sink = sink ? 1 : 0;
  p.sink_kv = nullptr;
  p.sink_tags = nullptr;
  p.sink_entries = 0;
  at::Tensor records, record_ids;  // a kernel that reads records: built from the table first
  if (table) {
    TORCH_CHECK(sink_kv.has_value() && sink_tags.has_value(), "sink_kv/sink_tags: expected both or neither");
    const at::Tensor &kv = *sink_kv, &tags = *sink_tags;
    TORCH_CHECK(tags.device() == query.device() && tags.scalar_type() == at::kLong && tags.dim() == 2 &&
                    tags.size(0) >= 2 && tags.size(0) < (1LL << 31) && tags.size(1) == hkv && tags.is_contiguous(),
                "sink_tags: expected a contiguous int64 [S + 1, num_kv_heads] tensor on the query's device, S >= 1");
    TORCH_CHECK(kv.device() == query.device() && kv.scalar_type() == at::kBFloat16 && kv.dim() == 4 &&
                    kv.size(0) == tags.size(0) && kv.size(1) == hkv && kv.size(2) == 2 && kv.size(3) == D &&
                    kv.is_contiguous(),
                "sink_kv: expected a contiguous bfloat16 [S + 1, num_kv_heads, 2, D] tensor on the query's device");
    if (tq::reads_sink_table(plan.kernel)) {
      p.sink_kv = reinterpret_cast<const uint16_t*>(kv.data_ptr());
      p.sink_tags = tags.data_ptr<int64_t>();
      p.sink_entries = (int)tags.size(0) - 1;
    } else {
      records = at::empty({num_seqs, hkv, tq::STATE_ROWS, D}, query.options().dtype(at::kFloat));
      record_ids = at::empty({num_seqs}, query.options().dtype(at::kInt));
      launch_shared_records(records, record_ids, shared_cache(key_cache, value_cache, key_scales, value_scales),
                            block_tables, seq_lens, *seq_state, kv, tags);
      p.seq_state = records.data_ptr<float>();
      p.state_ids = record_ids.data_ptr<int>();
      p.num_slots = num_seqs;
    }
  }
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.key_e4m3 = key_e4m3 ? 1 : 0;
  p.ws = plan.ws_steps > 0 ? ws.data_ptr<uint8_t>() : nullptr;
  p.ws_steps = plan.ws_steps;

  cudaError_t err = cudaSuccess;
#define TQ_LAUNCH(DD, TT) err = tq::launch_paged_attention<DD, TT>(p, plan.kernel, (int)plan.grid_x, stream)
  const bool half = query.scalar_type() == at::kHalf;
#ifdef TQ_ONLY_D128_BF16  // fast tuning builds (benchmarks/tune_cuda.py)
  TORCH_CHECK(D == 128 && !half, "this tuning build has only D=128 bf16");
  TQ_LAUNCH(128, __nv_bfloat16);
#else
  tq::for_head_dim(D, [&](auto d) {
    if (half) TQ_LAUNCH(decltype(d)::value, __half); else TQ_LAUNCH(decltype(d)::value, __nv_bfloat16);
  });
#endif
#undef TQ_LAUNCH
  C10_CUDA_CHECK(err);
}

// The bytes of a workspace that serves every paged_attention_fp4_cuda call of query's device,
// head dim and key format with at most num_seqs sequences of at most max_seq_len keys (0 where
// such calls never take the decode-once workspace: below SM90, or where the prefill kernel does
// not fit), at most tuning::PREFILL_WS_MAX_BYTES (calls that need more decode in the kernel).
int64_t prefill_workspace_bytes_cuda(const at::Tensor& query,  // [any, num_heads, D]: device, D
                                     int64_t num_seqs, int64_t max_seq_len, int64_t num_kv_heads,
                                     bool key_e4m3) {
  TORCH_CHECK(query.is_cuda() && query.dim() == 3, "query: expected a 3-D CUDA tensor");
  const int D = (int)query.size(2);
  TORCH_CHECK(tq::is_head_dim(D), "head_dim ", D, " is not one the kernels are built for (limits.cuh)");
  TORCH_CHECK(num_seqs >= 0 && num_seqs < (1LL << 31), "num_seqs: expected 0 <= num_seqs < 2^31");
  TORCH_CHECK(max_seq_len >= 0 && max_seq_len < (1LL << 31), "max_seq_len: expected 0 <= max_seq_len < 2^31");
  TORCH_CHECK(num_kv_heads > 0 && num_kv_heads <= 65535, "num_kv_heads: expected 1 .. 65535");
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(query.get_device());
  if (!tq::prefill_uses_wgmma(prop->major) ||
      !tq::prefill_fits(D, key_e4m3, prop->major, (int)prop->sharedMemPerBlockOptin))
    return 0;
  return std::min(tq::prefill_workspace_bytes(D, key_e4m3, (int)num_seqs, (int)num_kv_heads, (int)max_seq_len),
                  turboquant::tuning::PREFILL_WS_MAX_BYTES);
}

void reshape_and_cache_fp4_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                                at::Tensor& value_cache, at::Tensor& key_scales, at::Tensor& value_scales,
                                const at::Tensor& slot_mapping,
                                const std::optional<at::Tensor>& rotation_signs,  // float32 [D]
                                const std::optional<at::Tensor>& seq_state,  // float32 [slots, Hkv, 5, D]
                                const std::optional<at::Tensor>& state_ids) {  // int32 [num_tokens]
  TORCH_CHECK(key.is_cuda() && key.dim() == 3 && value.sizes() == key.sizes(), "key/value: expected 3-D CUDA");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key/value dtype mismatch");
  const int num_tokens = (int)key.size(0), hkv = (int)key.size(1), D = (int)key.size(2);
  TORCH_CHECK(tq::is_head_dim(D), "head_dim ", D, " is not one the kernels are built for (limits.cuh)");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value: last dim must be contiguous");
  const bool key_e4m3 = key_cache.scalar_type() == at::kFloat8_e4m3fn;  // K8V4
  TORCH_CHECK(key_cache.stride(3) == 1 && key_cache.stride(2) == (key_e4m3 ? D : D / 2) &&
                  value_cache.stride(3) == 1 && value_cache.stride(2) == D / 2,
              "key_cache/value_cache: [block_size, D/2] (K8V4 keys: [block_size, D]) must be contiguous");
  TORCH_CHECK(key_scales.is_contiguous() && value_scales.is_contiguous(), "scales must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "slot_mapping: expected int64 or int32");
  TORCH_CHECK(slot_mapping.is_contiguous(), "slot_mapping: expected contiguous");
  if (num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  tq::CacheWriteParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.k_stride_tok = key.stride(0);
  p.k_stride_head = key.stride(1);
  p.v_stride_tok = value.stride(0);
  p.v_stride_head = value.stride(1);
  set_cache_fields(p, key_cache, value_cache, key_scales, value_scales);
  p.slot_mapping = slot_mapping.data_ptr();
  p.slot_is_64 = slot_mapping.scalar_type() == at::kLong;
  p.num_tokens = num_tokens;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.group = key_scales.dim() == 4 ? 32 : D;
  p.key_e4m3 = key_e4m3 ? 1 : 0;
  p.block_size = (int)key_cache.size(2);
  TORCH_CHECK(p.block_size > 0 && (p.block_size & (p.block_size - 1)) == 0, "block_size must be a power of two");
  p.log2_block_size = 0;
  while ((1 << p.log2_block_size) < p.block_size) ++p.log2_block_size;
  p.num_blocks = (int)key_cache.size(0);
  set_transform_fields(p, D, hkv, num_tokens, rotation_signs, seq_state, state_ids);
  cudaError_t err = cudaSuccess;
#define TQ_W(TT) \
  tq::for_head_dim(D, [&](auto d) { err = tq::launch_reshape_and_cache<TT, decltype(d)::value>(p, stream); });
#ifdef TQ_ONLY_D128_BF16
  TORCH_CHECK(D == 128 && key.scalar_type() == at::kBFloat16, "tuning build: D=128 bf16 only");
  err = tq::launch_reshape_and_cache<__nv_bfloat16, 128>(p, stream);
#else
  if (key.scalar_type() == at::kHalf) { TQ_W(__half) }
  else if (key.scalar_type() == at::kBFloat16) { TQ_W(__nv_bfloat16) }
  else { TORCH_CHECK(key.scalar_type() == at::kFloat, "key: expected fp16/bf16/fp32"); TQ_W(float) }
#endif
#undef TQ_W
  C10_CUDA_CHECK(err);
}

template <typename T>
void launch_merge(at::Tensor& out, at::Tensor& lse, const std::vector<at::Tensor>& outs,
                  const std::vector<at::Tensor>& lses, cudaStream_t stream) {
  tq::MergeParams<T> p{};
  for (size_t r = 0; r < outs.size(); ++r) {
    p.part_out[r] = static_cast<const T*>(outs[r].data_ptr());
    p.part_lse[r] = lses[r].data_ptr<float>();
  }
  p.out = static_cast<T*>(out.data_ptr());
  p.lse = lse.data_ptr<float>();
  p.parts = (int)outs.size();
  p.rows = (int)(out.size(0) * out.size(1));
  p.D = (int)out.size(2);
  C10_CUDA_CHECK(tq::launch_merge_states<T>(p, stream));
}

void merge_attention_states_cuda(at::Tensor& out,  // [num_tokens, num_heads, D] like each part
                                 at::Tensor& lse,  // float32 [num_tokens, num_heads]
                                 const std::vector<at::Tensor>& outs,   // R x [num_tokens, num_heads, D]
                                 const std::vector<at::Tensor>& lses) {  // R x float32 [num_tokens, num_heads]
  const int parts = (int)outs.size();
  TORCH_CHECK(parts >= 1 && parts <= tq::kMaxMergeParts && (int)lses.size() == parts,
              "outs/lses: expected 1 to ", tq::kMaxMergeParts, " parts, as many lses as outs");
  TORCH_CHECK(out.is_cuda() && out.dim() == 3 && out.is_contiguous(), "out: expected a contiguous 3-D CUDA tensor");
  TORCH_CHECK(out.size(2) % 2 == 0, "out: expected an even head dim");
  TORCH_CHECK(out.size(0) * out.size(1) < (1LL << 31), "out: fewer than 2^31 rows");
  const at::ScalarType dt = out.scalar_type();
  TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat, "out: expected float16, bfloat16 or float32");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 && lse.size(0) == out.size(0) &&
                  lse.size(1) == out.size(1) && lse.device() == out.device(),
              "lse: expected contiguous float32 [num_tokens, num_heads] on out's device");
  const size_t align = dt == at::kFloat ? 8 : 4;  // the kernel's 2-element accesses
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % align == 0, "out: misaligned");
  for (int r = 0; r < parts; ++r) {
    TORCH_CHECK(outs[r].sizes() == out.sizes() && outs[r].scalar_type() == dt && outs[r].is_contiguous() &&
                    outs[r].device() == out.device() && reinterpret_cast<uintptr_t>(outs[r].data_ptr()) % align == 0,
                "outs[", r, "]: expected a contiguous, aligned tensor of out's shape, dtype and device");
    TORCH_CHECK(lses[r].sizes() == lse.sizes() && lses[r].scalar_type() == at::kFloat && lses[r].is_contiguous() &&
                    lses[r].device() == out.device(),
                "lses[", r, "]: expected a contiguous float32 tensor of lse's shape on out's device");
  }
  const c10::cuda::CUDAGuard guard(out.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (dt == at::kHalf) launch_merge<__half>(out, lse, outs, lses, stream);
  else if (dt == at::kBFloat16) launch_merge<__nv_bfloat16>(out, lse, outs, lses, stream);
  else launch_merge<float>(out, lse, outs, lses, stream);
}


void shared_records_cuda(at::Tensor& records,        // float32 [num_seqs, Hkv, 5, D]
                         at::Tensor& state_ids,      // int32 [num_seqs]: 0 .. num_seqs - 1
                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& key_scales, const at::Tensor& value_scales,
                         const at::Tensor& block_tables,  // int32 [num_seqs, cols]
                         const at::Tensor& seq_lens,      // int32 [num_seqs]
                         const at::Tensor& smoothing,     // float32 [1, Hkv, 5, D]
                         const at::Tensor& sink_kv,       // bf16 [S + 1, Hkv, 2, D]
                         const at::Tensor& sink_tags) {   // int64 [S + 1, Hkv]
  const tq::SharedCache c = shared_cache(key_cache, value_cache, key_scales, value_scales);
  const int ns = (int)block_tables.size(0);
  TORCH_CHECK(records.is_contiguous() && records.scalar_type() == at::kFloat && records.size(0) == ns,
              "records: expected contiguous float32 [num_seqs, Hkv, 5, D]");
  TORCH_CHECK(state_ids.scalar_type() == at::kInt && state_ids.is_contiguous() && state_ids.size(0) == ns,
              "state_ids: expected contiguous int32 [num_seqs]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables: int32, rows contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: contiguous int32");
  TORCH_CHECK(smoothing.is_contiguous() && sink_kv.is_contiguous() && sink_tags.is_contiguous() &&
                  sink_kv.scalar_type() == at::kBFloat16 && sink_tags.scalar_type() == at::kLong,
              "shared_state: contiguous smoothing, bf16 sink_kv, int64 sink_tags");
  if (ns == 0) return;
  const c10::cuda::CUDAGuard guard(records.device());
  launch_shared_records(records, state_ids, c, block_tables, seq_lens, smoothing, sink_kv, sink_tags);
}

void shared_enter_sinks_cuda(const at::Tensor& key, const at::Tensor& value,  // [n, Hkv, D]
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& key_scales, const at::Tensor& value_scales,
                             const at::Tensor& slot_mapping,  // int64 [n]
                             const at::Tensor& positions,     // int64 [n]
                             const std::optional<at::Tensor>& smoothing,  // float32 [1, Hkv, 5, D]
                             at::Tensor& sink_kv, at::Tensor& sink_tags,
                             const std::optional<at::Tensor>& rotation_signs) {  // float32 [D]
  const tq::SharedCache c = shared_cache(key_cache, value_cache, key_scales, value_scales);
  const int n = (int)key.size(0), D = c.head_dim;
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == D && value.stride(2) == 1 && value.stride(1) == D,
              "key/value: heads and elements contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous() && positions.is_contiguous(),
              "slot_mapping/positions: contiguous int64");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  const float norm = (float)(1.0 / std::sqrt((double)D));
  const float* signs = rotation_signs ? rotation_signs->data_ptr<float>() : nullptr;
  const float* sm = smoothing ? smoothing->data_ptr<float>() : nullptr;
  const size_t shm = 2 * D * sizeof(float);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto* kv = reinterpret_cast<uint16_t*>(sink_kv.data_ptr());
  const int entries = (int)sink_tags.size(0) - 1;
#define TQ_ENTER(T)                                                                           \
  tq::tq_shared_enter_sinks_kernel<T><<<1, tq::kSharedThreads, shm, stream>>>(                \
      static_cast<const T*>(key.data_ptr()), static_cast<const T*>(value.data_ptr()),         \
      key.stride(0), value.stride(0), n, c, slot_mapping.data_ptr<int64_t>(),                 \
      positions.data_ptr<int64_t>(), sm, signs, norm, kv, sink_tags.data_ptr<int64_t>(), entries)
  if (key.scalar_type() == at::kHalf) TQ_ENTER(__half);
  else if (key.scalar_type() == at::kBFloat16) TQ_ENTER(uint16_t);
  else TQ_ENTER(float);
#undef TQ_ENTER
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(turboquant, CUDA, m) {
  m.impl("shared_records_cuda", &shared_records_cuda);
  m.impl("shared_enter_sinks_cuda", &shared_enter_sinks_cuda);
  m.impl("paged_attention_fp4_cuda", &paged_attention_fp4_cuda);
  m.impl("prefill_workspace_bytes_cuda", &prefill_workspace_bytes_cuda);
  m.impl("reshape_and_cache_fp4_cuda", &reshape_and_cache_fp4_cuda);
  m.impl("merge_attention_states_cuda", &merge_attention_states_cuda);
}
