// torch.library registration of the SM120 kernels.
//
// Built two ways by turboquant/_backends/sm120.py:
//   - for sm_120a + sm_121a: implements turboquant::paged_attention_fp4_sm120 and
//     turboquant::sm120_mma_probe (the real block-scaled MMA instructions);
//   - with -DTQ_SM120_EMULATE for sm_90a: the same kernels with the MMA wrappers replaced by
//     their software model, as turboquant::paged_attention_fp4_sm120_emulated and
//     turboquant::sm120_mma_probe_emulated.
// The schemas are defined in Python (turboquant/_backends/sm120.py, attention: turboquant.ops.
// ATTENTION_SCHEMA); this file adds the CUDA implementations.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "mma_probe_sm120.cuh"
#include "paged_attention_sm120.cuh"

#if defined(TQ_SM120_EMULATE)
#define TQ_SM120_SUFFIX "_emulated"
#else
#define TQ_SM120_SUFFIX ""
#endif

namespace {

void check_contiguous_uint8(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kByte && t.is_contiguous(), name,
              ": expected a contiguous uint8 CUDA tensor, got ", t.scalar_type(), " on ", t.device());
}

void paged_attention_fp4_sm120(at::Tensor& out,               // [num_tokens, num_heads, D] bf16/fp16
                               const at::Tensor& query,       // [num_tokens, num_heads, D] bf16/fp16
                               // uint8 [num_blocks, num_kv_heads, block_size, D/2] FP4 codes, or
                               // float8_e4m3fn [num_blocks, num_kv_heads, block_size, D] (K8V4)
                               const at::Tensor& key_cache,
                               const at::Tensor& value_cache, // uint8 [num_blocks, num_kv_heads, block_size, D/2]
                               const at::Tensor& key_scales,  // uint8 [num_blocks, block_size, num_kv_heads(, D/32)]
                               const at::Tensor& value_scales,  // same shape as key_scales
                               const at::Tensor& block_tables,  // int32 [num_seqs, max_blocks_per_seq]
                               const at::Tensor& seq_lens,      // int32 [num_seqs]
                               const std::optional<at::Tensor>& cu_query_lens,  // int32 [num_seqs + 1]
                               double scale, int64_t sliding_window, double logits_soft_cap, int64_t max_seq_len,
                               const std::optional<at::Tensor>& rotation_signs,  // float32 [D] of +-1, or None
                               const std::optional<at::Tensor>& seq_state,  // float32 [num_slots, num_kv_heads, 5, D]
                               const std::optional<at::Tensor>& state_ids,  // int32 [num_seqs]
                               bool sink,
                               const std::optional<at::Tensor>& sinks,  // float32 [num_heads]: not here yet
                               const std::optional<at::Tensor>& lse,  // float32 [num_tokens, num_heads]: not here yet
                               const std::optional<at::Tensor>& workspace,  // uint8 [bytes]: unused (no decode-once pass)
                               const std::optional<at::Tensor>& sink_kv,    // the sink table: not here
                               const std::optional<at::Tensor>& sink_tags) {
  TORCH_CHECK(!sink_kv.has_value() && !sink_tags.has_value(),
              "sink_kv/sink_tags: the sm120 kernel reads per-sequence records "
              "(turboquant.shared_state.call_with_records builds them)");
  TORCH_CHECK(!sinks.has_value() && !lse.has_value(),
              "sinks/lse: the sm120 kernel has no learned sinks or log-sum-exp output yet (the backend declines them)");
  TORCH_CHECK(query.is_cuda() && query.dim() == 3, "query: expected a 3-d CUDA tensor");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kHalf,
              "query: expected bfloat16 or float16, got ", query.scalar_type());
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() && out.device() == query.device(),
              "out: expected the query's shape, dtype and device");
  const bool key_e4m3 = key_cache.scalar_type() == at::kFloat8_e4m3fn;  // K8V4: E4M3 key bytes
  TORCH_CHECK(key_cache.is_cuda() && (key_e4m3 || key_cache.scalar_type() == at::kByte) && key_cache.is_contiguous(),
              "key_cache: expected a contiguous uint8 (FP4) or float8_e4m3fn (K8V4) CUDA tensor, got ",
              key_cache.scalar_type(), " on ", key_cache.device());
  check_contiguous_uint8(value_cache, "value_cache");
  check_contiguous_uint8(key_scales, "key_scales");
  check_contiguous_uint8(value_scales, "value_scales");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables: expected a contiguous int32 [num_seqs, max_blocks_per_seq] tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: expected contiguous int32");
  const int num_tokens = int(query.size(0)), num_heads = int(query.size(1)), head_dim = int(query.size(2));
  TORCH_CHECK(key_cache.dim() == 4, "key_cache: expected 4 dims [num_blocks, num_kv_heads, block_size, row]");
  const int num_kv_heads = int(key_cache.size(1)), block_size = int(key_cache.size(2));
  const int key_row = key_e4m3 ? head_dim : head_dim / 2;  // bytes per (token, kv head)
  TORCH_CHECK(key_cache.size(3) == key_row, "key_cache: expected last dim ", key_row,
              key_e4m3 ? " (D: one E4M3 byte per element)" : " (D/2: two FP4 codes per byte)", ", got ",
              key_cache.size(3));
  TORCH_CHECK(value_cache.dim() == 4 && value_cache.size(0) == key_cache.size(0) && value_cache.size(1) == num_kv_heads &&
                  value_cache.size(2) == block_size && value_cache.size(3) * 2 == head_dim,
              "value_cache: expected [", key_cache.size(0), ", ", num_kv_heads, ", ", block_size, ", ", head_dim / 2,
              "] (key_cache's blocks, D/2 bytes per row), got ", value_cache.sizes());
  // Both contiguous with these shapes: the kernel addresses both caches by one row index
  // (block, kv head, offset), and key_cache's block stride is value_cache's (K8V4: twice it).
  TORCH_CHECK(turboquant::cuda_fp4::is_head_dim(head_dim), "query: head dim ", head_dim,
              " is not one the kernels are built for (csrc_cuda/limits.cuh)");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query: num_heads must be a multiple of num_kv_heads");
  const bool per32 = key_scales.dim() == 4;
  TORCH_CHECK(!per32 || key_scales.size(3) == head_dim / 32, "key_scales: expected last dim D/32");
  TORCH_CHECK(!(per32 && key_e4m3),
              "key_scales: a K8V4 cache (float8_e4m3fn keys) has one scale per (token, kv head), "
              "[num_blocks, block_size, num_kv_heads]");
  const int num_seqs = int(seq_lens.size(0));
  const int32_t* cu = nullptr;
  if (cu_query_lens.has_value()) {
    TORCH_CHECK(cu_query_lens->scalar_type() == at::kInt && cu_query_lens->is_contiguous() &&
                    cu_query_lens->numel() == num_seqs + 1,
                "cu_query_lens: expected contiguous int32 [num_seqs + 1]");
    cu = cu_query_lens->data_ptr<int32_t>();
  } else {
    TORCH_CHECK(num_tokens == num_seqs, "query: without cu_query_lens, expected one token per sequence");
  }

  // The transforms (CONTRACT.md section 2), fused into the kernel's Q prologue, sink merge and
  // combine (design note in paged_attention_sm120.cuh).
  if (rotation_signs.has_value()) {
    TORCH_CHECK(rotation_signs->scalar_type() == at::kFloat && rotation_signs->is_contiguous() &&
                    rotation_signs->dim() == 1 && rotation_signs->size(0) == head_dim &&
                    rotation_signs->device() == query.device(),
                "rotation_signs: expected a contiguous float32 [", head_dim, "] tensor on the query's device");
  }
  TORCH_CHECK(seq_state.has_value() == state_ids.has_value(), "seq_state/state_ids: expected both or neither");
  TORCH_CHECK(!sink || seq_state.has_value(), "sink: needs seq_state and state_ids (the sink rows live there)");
  if (seq_state.has_value()) {
    TORCH_CHECK(seq_state->scalar_type() == at::kFloat && seq_state->is_contiguous() && seq_state->dim() == 4 &&
                    seq_state->size(1) == num_kv_heads && seq_state->size(2) == tq::sm120::kStateRows &&
                    seq_state->size(3) == head_dim && seq_state->device() == query.device(),
                "seq_state: expected a contiguous float32 [num_slots, ", num_kv_heads, ", ", tq::sm120::kStateRows,
                ", ", head_dim, "] tensor on the query's device");
    TORCH_CHECK(state_ids->scalar_type() == at::kInt && state_ids->is_contiguous() && state_ids->numel() == num_seqs &&
                    state_ids->device() == query.device(),
                "state_ids: expected a contiguous int32 [num_seqs] tensor on the query's device");
  }

  const c10::cuda::CUDAGuard guard(query.device());
  int sm_count = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, query.get_device()) == cudaSuccess,
              "paged_attention_fp4_sm120: cannot read the multiprocessor count");
  const tq::sm120::LaunchPlan plan = tq::sm120::plan_attention(num_seqs, num_kv_heads, num_heads, num_tokens,
                                                               cu != nullptr, int(max_seq_len), sm_count);
  // the kernel reads 16-byte pieces of each query row
  const bool q_ok = query.is_contiguous() && reinterpret_cast<uintptr_t>(query.data_ptr()) % 16 == 0;
  const at::Tensor q = q_ok ? query : query.clone(at::MemoryFormat::Contiguous);
  at::Tensor dst = out.is_contiguous() ? out : at::empty_like(q);
  const int64_t rows = int64_t(plan.num_splits) * num_tokens * num_heads;
  at::Tensor parts = at::empty({rows * (head_dim + 2)}, query.options().dtype(at::kFloat));

  tq::sm120::AttentionParams p;
  p.out = dst.data_ptr();
  p.query = q.data_ptr();
  p.key_cache = static_cast<const uint8_t*>(key_cache.data_ptr());  // FP4 codes or E4M3 bytes
  p.value_cache = value_cache.data_ptr<uint8_t>();
  p.key_scales = key_scales.data_ptr<uint8_t>();
  p.value_scales = value_scales.data_ptr<uint8_t>();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.cu_query_lens = cu;
  p.part_out = parts.data_ptr<float>();
  p.part_max = p.part_out + rows * head_dim;
  p.part_sum = p.part_max + rows;
  p.num_seqs = num_seqs;
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.block_size = block_size;
  p.max_blocks_per_seq = int(block_tables.size(1));
  p.num_blocks = int(key_cache.size(0));
  p.num_splits = plan.num_splits;
  p.partition_size = plan.partition_size;
  p.scale = float(scale);
  p.logits_soft_cap = float(logits_soft_cap);
  p.sliding_window = int(sliding_window);
  p.rotation_signs = rotation_signs.has_value() ? rotation_signs->data_ptr<float>() : nullptr;
  p.seq_state = seq_state.has_value() ? seq_state->data_ptr<float>() : nullptr;
  p.state_ids = state_ids.has_value() ? state_ids->data_ptr<int32_t>() : nullptr;
  p.num_slots = seq_state.has_value() ? int(seq_state->size(0)) : 0;
  p.rotation_norm = static_cast<float>(std::pow(double(head_dim), -0.5));  // turboquant.rotation.rotation_norm
  p.sink = sink;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err =
      query.scalar_type() == at::kBFloat16
          ? tq::sm120::launch_paged_attention_sm120<__nv_bfloat16>(p, head_dim, per32, key_e4m3, plan.tile_stride,
                                                                   stream)
          : tq::sm120::launch_paged_attention_sm120<__half>(p, head_dim, per32, key_e4m3, plan.tile_stride, stream);
  TORCH_CHECK(err == cudaSuccess, "paged_attention_fp4_sm120: launch failed: ", cudaGetErrorString(err));
  if (!dst.is_same(out)) out.copy_(dst);
}

// One MMA instruction on per-lane registers (int32 tensors hold the uint32 register bits).
at::Tensor sm120_mma_probe(const at::Tensor& a,    // int32 [32, 4]
                           const at::Tensor& b,    // int32 [32, 2]
                           const at::Tensor& sfa,  // int32 [32]
                           const at::Tensor& sfb,  // int32 [32]
                           const at::Tensor& c,    // float32 [32, 4]
                           int64_t kind,  // tq::sm120::ProbeKind
                           int64_t selectors) {
  TORCH_CHECK(a.is_cuda() && a.scalar_type() == at::kInt && a.numel() == 128, "a: expected int32 [32, 4] on CUDA");
  TORCH_CHECK(b.is_cuda() && b.scalar_type() == at::kInt && b.numel() == 64, "b: expected int32 [32, 2] on CUDA");
  TORCH_CHECK(sfa.scalar_type() == at::kInt && sfa.numel() == 32, "sfa: expected int32 [32]");
  TORCH_CHECK(sfb.scalar_type() == at::kInt && sfb.numel() == 32, "sfb: expected int32 [32]");
  TORCH_CHECK(c.scalar_type() == at::kFloat && c.numel() == 128, "c: expected float32 [32, 4]");
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), sac = sfa.contiguous(), sbc = sfb.contiguous(),
                   cc = c.contiguous();
  at::Tensor d = at::empty({32, 4}, c.options());
  const cudaError_t err = tq::sm120::launch_mma_probe_sm120(
      int(kind), int(selectors), reinterpret_cast<const uint32_t*>(ac.data_ptr<int32_t>()),
      reinterpret_cast<const uint32_t*>(bc.data_ptr<int32_t>()), reinterpret_cast<const uint32_t*>(sac.data_ptr<int32_t>()),
      reinterpret_cast<const uint32_t*>(sbc.data_ptr<int32_t>()), cc.data_ptr<float>(), d.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "sm120_mma_probe: launch failed: ", cudaGetErrorString(err));
  return d;
}

}  // namespace

TORCH_LIBRARY_IMPL(turboquant, CUDA, m) {
  m.impl("paged_attention_fp4_sm120" TQ_SM120_SUFFIX, &paged_attention_fp4_sm120);
  m.impl("sm120_mma_probe" TQ_SM120_SUFFIX, &sm120_mma_probe);
}
