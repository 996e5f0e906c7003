// FP4 KV-cache paged attention for the SM120 family on block-scaled warp MMAs, for both key
// formats (FP4 keys, and K8V4's E4M3 keys; values are FP4 in both). Torch-free.
//
// Design (one CTA = one (sequence, kv head, KV split); 4 warps; each warp owns 32-key chunks):
//
// Rows. The 16 MMA rows of a tile are (query token j, head h of the kv head's GQA group),
// row R = j * group + h, so decode with GQA fills the tile with heads and multi-token queries
// add more rows (more tiles when q_len * group > 16). Grid z strides over the tiles, because
// the number of query tokens per sequence is only known on the device.
//
// QK^T: mma m16n8k32 kind::mxf8f6f4 e4m3 x e2m1, block_scale scale_vec::1X.
//   A = Q, quantized once per tile to FP8 E4M3 with one E8M0 scale per (row, 32 head-dim
//   elements): the smallest power of two s with amax / s <= 448 (no element saturates).
//   B = K straight from the packed cache: a dot product may visit k in any order as long as
//   A and B agree, so lane (g,t) loads ONE 32-bit word per k32 step, bytes 16s+4t..16s+4t+3
//   of key g (head-dim elements 32s+8t..32s+8t+7), expands the 8 nibbles to 8-bit containers
//   (bits 5..2) and feeds elements 0..3 as MMA k 4t..4t+3 and 4..7 as k 16+4t..16+4t+3; Q is
//   gathered in the same order. Every k32 step stays inside one 32-element group, so the
//   per-32 scale option maps onto scale_vec::1X exactly: K's E8M0 bytes go to SF_B unchanged
//   (byte-id-b = step % 4, one 32-bit word per 4 steps; the per-head-dim scale is the same
//   byte replicated). Key n of n-tile j supplies its scale from lane 4n + j (thread-id-b = j),
//   so one register holds the scales of all 32 keys of a chunk. Q's scale of row m, step s
//   sits in byte s % 4 of lane sfa_lane(m, s / 4) (thread-id-a = s / 4, byte-id-a = s % 4),
//   so one register holds the Q scales for head dims up to 256. All selectors are immediates.
//   K8V4 (kKeyE4m3): B = K as E4M3, the e4m3 x e4m3 form of the same instruction (same
//   fragment and scale layouts). A key row is D bytes, one element per byte, which is already
//   the instruction's 8-bit container: lane (g,t) loads 8 bytes per k32 step, bytes (= head-dim
//   elements) 32s+8t..32s+8t+7 of key g, and feeds the low 4 as MMA k 4t..4t+3 and the high 4
//   as k 16+4t..16+4t+3: the same element order as the FP4 path, so Q's fragments and scales
//   are gathered exactly as there. K8V4 keeps one E8M0 scale per (token, kv head), replicated
//   into SF_B as the FP4 per-head scale is; V, PV, softmax and the transforms are unchanged
//   (they act on Q and on the records; the key bytes only decode differently).
// Softmax: fp32, base 2, online over chunks (running max / sum per row), soft-cap and the
//   causal / sliding-window masks applied by selection on the fp32 logits.
// PV: mma m16n8k32 kind::mxf8f6f4 e4m3 x e2m1 again, k = 32 keys of the chunk.
//   B = V codes as e2m1 with SF_B = 1.0: the S accumulator gives lane (g,t) keys 8j+2t, 8j+2t+1
//   (j = 0..3), which become its A slots 4t..4t+3 (j = 0,1) and 16+4t..16+4t+3 (j = 2,3); V's
//   chunk is written to shared memory transposed ([channel][slot], one container byte per
//   code) in that same key order, so each B register is one 32-bit shared load.
//   A = P' = P * sV: V's per-key E8M0 scale varies along k, which SF_B (one scale per column)
//   cannot express, so it is folded into P before P' is quantized to E4M3 with its own E8M0
//   scale per (row, chunk) (same rule as Q). sV is a power of two, so the fold is exact and
//   the only rounding is E4M3's. With per-32 V scales, each group of 32 channels has its own
//   P' (D/32 quantizations per chunk). The row sum l uses the unquantized fp32 P.
// kind::mxf4 (m16n8k64, e2m1 x e2m1, twice the MMA rate) is not used here: it needs Q and P in
//   FP4, whose 3-bit grid (about 18 dB SQNR) would dominate the error, while decode is bound by
//   the KV bytes read, not by MMA rate. It would pay for compute-bound long prefill tiles where
//   FP4 queries are acceptable; its wrapper and layout probes exist (mma_sm120.cuh,
//   mma_probe_sm120.cuh), so such a path would start from layouts the probes check.
// NaN: a key whose K or V E8M0 byte is 255 and that a row attends makes that row's output NaN
//   through an explicit flag; it never depends on how the tensor core treats NaN scales. A key
//   whose block id lies outside the block table row or the cache is never read and counts as
//   NaN. Keys past the split / sequence are never loaded (zeros) and are masked by selection.
//   K8V4's E4M3 NaN bytes are not cache content (a NaN group gets scale 255 and zero bytes).
// Split-KV: each split writes an unnormalized partial (fp32 O, base-2 max, sum); a second
//   kernel combines the splits and writes the output dtype.
// Transforms (CONTRACT.md section 2; turboquant/reference.py is the definition), all in fp32:
//   Q prologue. The CTA stages its 16-row Q tile once in shared memory (fp32, in the V buffer,
//   free at that point) and each warp gathers its E4M3 fragments from there. Thread (row
//   tid / 8, part tid % 8) holds elements D/8 * part .. + D/8 - 1 of one row: q' = q * lam_r
//   (key smoothing), then with rotation q' = fwht(q' * signs) * D^-0.5, the butterfly stages
//   h < D/8 inside the thread and h = D/8, D/4, D/2 across lanes xor 1, 2, 4, in ascending h
//   with the same fp32 operations as turboquant.rotation, so q' matches the reference bit for
//   bit before its E4M3 rounding. The same threads reduce, per row, q.m_r (original q; only
//   with a soft cap: logit = scale * (q'.k' + q.m)) and the sink logit scale * q'.k0 (fp32 q',
//   split 0 only). A row whose q' is not finite (an uninitialized NaN record), or that sees a
//   non-finite sink key / value, is flagged NaN explicitly, not through the MMA; so is every
//   row of a sequence whose state slot lies outside seq_state (lam is then NaN; the record is
//   never read). The prologue's loads are tile-invariant: `opaque` keeps the compiler from
//   hoisting them out of the tile loop, where they would stay live through the key loop.
//   Sink. Position 0 is masked out of the FP4 stream (never loaded); in split 0, for each row
//   that sees position 0 (sliding window permitting), the record's fp32 sink key and value
//   join the CTA's merged softmax state as one more key: m' = max(m, x0), l' = l a + b,
//   O' = O a + v0 b (a = 2^(m - m'), b = 2^(x0 - m')). A one-token sequence gives exactly v0.
//   Output. The combine kernel (always launched) un-rotates each normalized output row in
//   shared memory, fwht(o') * D^-0.5 * signs, before the store; partials stay rotated.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "../limits.cuh"
#include "../paged_kv.cuh"
#include "mma_sm120.cuh"

namespace tq {
namespace sm120 {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 32;  // keys per warp step (k of one PV MMA)
constexpr int kRows = 16;   // (query token, head) rows per tile (M of the MMAs)

struct AttentionParams {
  void* out;                      // [num_tokens, num_heads, D] bf16/fp16
  const void* query;              // [num_tokens, num_heads, D] bf16/fp16
  const uint8_t* key_cache;       // [num_blocks, num_kv_heads, block_size, D/2] FP4 codes;
                                  // K8V4: [num_blocks, num_kv_heads, block_size, D] E4M3 bytes
  const uint8_t* value_cache;     // [num_blocks, num_kv_heads, block_size, D/2]
  const uint8_t* key_scales;      // [num_blocks, block_size, num_kv_heads(, D/32)]
  const uint8_t* value_scales;    // [num_blocks, block_size, num_kv_heads(, D/32)]
  const int32_t* block_tables;    // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens;        // [num_seqs]
  const int32_t* cu_query_lens;   // [num_seqs + 1], or nullptr (one query token per sequence)
  float* part_out;                // [num_splits, num_tokens, num_heads, D]
  float* part_max;                // [num_splits, num_tokens, num_heads] (base-2 logits)
  float* part_sum;                // [num_splits, num_tokens, num_heads]
  int num_seqs, num_tokens, num_heads, num_kv_heads, block_size, max_blocks_per_seq, num_blocks;
  int num_splits, partition_size;  // partition_size: keys per split, a multiple of 32 * kWarps
  float scale, logits_soft_cap;
  int sliding_window;
  // Transforms; all off with null pointers and sink false.
  const float* rotation_signs;    // [D] of +-1, or nullptr (no rotation)
  const float* seq_state;         // [num_slots, num_kv_heads, 5, D] (rows kStateCenter..), or nullptr
  const int32_t* state_ids;       // [num_seqs]: each sequence's slot in seq_state
  int num_slots;                  // seq_state's dim 0; a slot outside [0, num_slots) gives NaN rows
  float rotation_norm;            // D^-0.5 as fp32 (turboquant.rotation.rotation_norm)
  bool sink;                      // position 0 from the record's sink rows (needs seq_state)
};

// Rows of a state record (turboquant/smoothing.py; row 4, 1 / lam, is the writer's).
constexpr int kStateCenter = 0, kStateScale = 1, kStateSinkKey = 2, kStateSinkValue = 3, kStateRows = 5;
// Per-row flags of a tile, set by the Q prologue.
constexpr int kRowNan = 1;   // the row's output is NaN (q' not finite, slot outside, sink not finite)
constexpr int kRowSink = 2;  // the row sees position 0 and this CTA merges the sink into it

struct LaunchPlan {
  int num_splits, partition_size, tile_stride;
};

// Enough CTAs to fill the GPU twice over, splits of whole 128-key steps, and a grid-z stride
// over query tiles sized for the average sequence (any sequence may hold more: CTAs loop).
inline LaunchPlan plan_attention(int num_seqs, int num_kv_heads, int num_heads, int num_tokens, bool multi_token,
                                 int max_seq_len, int sm_count) {
  const int step = kChunk * kWarps;
  const int group = num_heads / num_kv_heads;
  if (num_seqs < 1) num_seqs = 1;  // nothing is launched then; keep the arithmetic defined
  const int max_q = multi_token ? (num_tokens > 0 ? num_tokens : 1) : 1;
  const long long max_tiles = ((long long)max_q * group + kRows - 1) / kRows;
  const long long avg_tiles = ((long long)num_tokens * group + (long long)kRows * num_seqs - 1) / ((long long)kRows * num_seqs);
  long long tile_stride = avg_tiles < 1 ? 1 : avg_tiles;
  if (tile_stride > max_tiles) tile_stride = max_tiles;
  if (tile_stride > 65535) tile_stride = 65535;
  const long long ctas = (long long)num_seqs * num_kv_heads * tile_stride;
  const int keys = max_seq_len > 0 ? max_seq_len : 1;
  const int max_parts = (keys + step - 1) / step;
  long long want = (2LL * sm_count + ctas - 1) / ctas;
  if (want < 1) want = 1;
  int splits = want < max_parts ? int(want) : max_parts;
  const int per_split = (keys + splits - 1) / splits;
  const int partition = (per_split + step - 1) / step * step;
  splits = (keys + partition - 1) / partition;
  return LaunchPlan{splits, partition, int(tile_stride)};
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

template <int... I, class F>
__device__ __forceinline__ void static_for_impl(std::integer_sequence<int, I...>, F&& f) {
  (f(std::integral_constant<int, I>{}), ...);
}
// f(std::integral_constant<int, i>) for i = 0..N-1: the index is a constant expression, so it
// can pick MMA selectors (immediates).
template <int N, class F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl(std::make_integer_sequence<int, N>{}, f);
}

// The smallest e with amax <= 448 * 2^e (E4M3's largest finite value is 448), clamped to the
// E8M0 range; 0 when amax is 0 or NaN.
__device__ __forceinline__ int e4m3_block_exponent(float amax) {
  if (!(amax > 0.0f)) return 0;
  int x;
  const float m = frexpf(amax, &x);  // amax = m * 2^x, m in [0.5, 1); 448 = 0.875 * 2^9
  const int e = m <= 0.875f ? x - 9 : x - 8;
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// Four floats -> four E4M3 bytes, x0 in the lowest byte (cvt puts its first source in the
// upper byte). Round to nearest even, saturating.
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(lo) : "f"(x0), "f"(x1));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(hi) : "f"(x2), "f"(x3));
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// 8 packed e2m1 codes (nibble i = element i) -> 8-bit containers with the code in bits 5..2:
// lo = elements 0..3, hi = elements 4..7 (byte i = element i).
__device__ __forceinline__ void expand_e2m1x8(uint32_t v, uint32_t& lo, uint32_t& hi) {
  const uint32_t even = (v << 2) & 0x3C3C3C3Cu, odd = (v >> 2) & 0x3C3C3C3Cu;
  lo = __byte_perm(even, odd, 0x5140);
  hi = __byte_perm(even, odd, 0x7362);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ long long shfl_i64(long long x, int src) {
  const int lo = __shfl_sync(0xffffffffu, int(x & 0xffffffffLL), src);
  const int hi = __shfl_sync(0xffffffffu, int(x >> 32), src);
  return (long long)(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo);
}

// Unnormalized Walsh-Hadamard stages h = 1 .. N/2 of N register values (turboquant.rotation.fwht
// restricted to one thread's contiguous elements).
template <int N>
__device__ __forceinline__ void fwht_registers(float (&x)[N]) {
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
}

// The Walsh-Hadamard stage pairing lane with lane ^ mask, element by element: the lane holding
// the lower index keeps a + b, its partner a - b (the same fp32 operations as the reference).
template <int N>
__device__ __forceinline__ void fwht_stage_across_lanes(float (&x)[N], int lane, int mask) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float other = __shfl_xor_sync(0xffffffffu, x[i], mask);
    x[i] = (lane & mask) ? other - x[i] : x[i] + other;
  }
}

// The pointer, with its value hidden from the compiler (an empty asm that may change it): loads
// through the result cannot be hoisted out of the loop this sits in. The Q prologue's loads
// (lam, m, signs, sink rows) are tile-invariant; hoisted out of the tile loop they would stay
// live in registers through the whole key loop (+70 registers at D 128).
template <class P>
__device__ __forceinline__ const P* opaque(const P* ptr) {
  asm volatile("" : "+l"(ptr));
  return ptr;
}

// Sum over the 8 lanes lane & ~7 .. lane | 7.
__device__ __forceinline__ float octet_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x + __shfl_xor_sync(0xffffffffu, x, 4);
}

__device__ __forceinline__ int octet_or(int x) {
  x |= __shfl_xor_sync(0xffffffffu, x, 1);
  x |= __shfl_xor_sync(0xffffffffu, x, 2);
  return x | __shfl_xor_sync(0xffffffffu, x, 4);
}

// PV's A slot of key k (0..31) of a chunk: slot 16h + 4t + 2a + b holds key 16h + 8a + 2t + b,
// the order in which lane (g,t) holds the keys in its S accumulators.
__device__ __forceinline__ int pv_slot_of_key(int k) {
  return 16 * (k >> 4) + 4 * ((k >> 1) & 3) + 2 * ((k >> 3) & 1) + (k & 1);
}

// Byte offset of (channel, slot) in a warp's V chunk [D][32]: the 4-byte word index is
// XOR-swizzled with bit 2 of the channel, so the 32 lanes of one B load hit 32 banks.
__device__ __forceinline__ int v_smem_offset(int channel, int slot) {
  return channel * kChunk + ((((slot >> 2) ^ (((channel >> 2) & 1) << 2))) << 2) + (slot & 3);
}

// CTAs per SM the register budget must allow: 3 at D <= 128 (at most 170 registers; without the
// bound ptxas's schedule for the per-32 kernel takes 196 since the transforms were added, which
// leaves room for only 2), no bound at D = 256 (about 250 registers, 2 CTAs either way).
template <int D>
constexpr int min_ctas_per_sm() { return D <= 128 ? 3 : 1; }

// grid (num_seqs * num_kv_heads, num_splits, tile_stride) block kThreads
// kPer32: one scale per 32 elements (else per (token, head)); kKeyE4m3: K8V4 (E4M3 keys).
template <typename T, int D, bool kPer32, bool kKeyE4m3>
__global__ void __launch_bounds__(kThreads, min_ctas_per_sm<D>()) paged_attention_sm120_kernel(const AttentionParams p) {
  static_assert(D == 64 || D == 128 || D == 256, "head dim 64, 128 or 256");
  static_assert(!(kPer32 && kKeyE4m3), "K8V4 has one key scale per (token, head)");
  constexpr int kSteps = D / 32;                   // k32 steps of QK^T
  constexpr int kScaleWords = (kSteps + 3) / 4;    // per-key scale words (byte s % 4 of word s / 4)
  constexpr int kGroups = kPer32 ? D / 32 : 1;     // V scale groups along the head dim
  constexpr int kTiles = D / 8;                    // n8 tiles of the output
  constexpr int kTilesPerGroup = kTiles / kGroups;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int kKeyRowBytes = kKeyE4m3 ? D : D / 2;  // bytes per (token, kv head) key row
  constexpr int kKeyLaneBytes = kKeyE4m3 ? 8 : 4;     // key bytes one lane loads per k32 step

  constexpr int kQStride = D + 4;                 // floats per row of the staged Q tile
  constexpr int kPerThread = D / 8;               // Q prologue: elements of one row per thread
  static_assert(kThreads == 8 * kRows, "Q prologue: 8 threads per row");
  static_assert(kRows * kQStride * 4 <= kWarps * D * kChunk, "the Q tile fits in the V buffer");

  __shared__ __align__(16) uint8_t smem_v[kWarps][D * kChunk];  // per warp: V chunk [channel][slot]
  __shared__ float smem_m[kWarps][kRows], smem_l[kWarps][kRows];
  __shared__ int smem_nan[kWarps][kRows];
  __shared__ float smem_q_dot_m[kRows], smem_sink_logit[kRows];  // per row, from the Q prologue
  __shared__ float smem_keep[kRows], smem_add[kRows];            // per row: O' = O keep + v0 add
  __shared__ int smem_flags[kRows];                              // per row: kRowNan | kRowSink

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.x / p.num_kv_heads, kv_head = blockIdx.x % p.num_kv_heads;
  const int split = blockIdx.y;
  const int seq_len = p.seq_lens[seq];
  const int q_start = p.cu_query_lens ? p.cu_query_lens[seq] : seq;
  const int q_len = p.cu_query_lens ? p.cu_query_lens[seq + 1] - q_start : 1;
  const int group = p.num_heads / p.num_kv_heads;
  const int rows = q_len * group;
  const int split_lo = split * p.partition_size;
  const int split_hi = min(seq_len, split_lo + p.partition_size);
  const int32_t* block_table = p.block_tables + (long long)p.max_blocks_per_seq * seq;
  const T* query = static_cast<const T*>(p.query);
  // This (sequence, kv head)'s state record [5][D]; nullptr without seq_state or when the slot
  // lies outside it (then never read: lam, m and the sink count as NaN).
  const float* record = nullptr;
  if (p.seq_state != nullptr) {
    const int slot = p.state_ids[seq];
    if (slot >= 0 && slot < p.num_slots)
      record = p.seq_state + ((long long)slot * p.num_kv_heads + kv_head) * (kStateRows * D);
  }
  const bool merge_sink = p.sink && split == 0;  // this CTA's partition holds position 0

  for (int tile = blockIdx.z; tile * kRows < rows; tile += gridDim.z) {
    // This lane's rows g and g + 8: position in the sequence (-1: padding row).
    int row_pos[2];
    for (int h = 0; h < 2; ++h) {
      const int r = tile * kRows + g + 8 * h;
      row_pos[h] = r < rows ? seq_len - q_len + r / group : -1;
    }

    // Q prologue: q' = rotate(q * lam) in fp32 into shared memory, plus q.m and the sink logit.
    float* q_tile = reinterpret_cast<float*>(&smem_v[0][0]);  // [kRows][kQStride]
    {
      const int row = threadIdx.x >> 3, part = threadIdx.x & 7, c0 = kPerThread * part;
      const float* const rec = record ? opaque(record) + c0 : nullptr;  // this thread's columns of the record
      const float* const signs = p.rotation_signs ? opaque(p.rotation_signs) + c0 : nullptr;
      const int r = tile * kRows + row;
      const int pos = r < rows ? seq_len - q_len + r / group : -1;
      float x[kPerThread];
      for (int i = 0; i < kPerThread; ++i) x[i] = 0.f;
      float q_dot_m = 0.f;
      if (pos >= 0) {
        const T* src = query + ((long long)(q_start + r / group) * p.num_heads + kv_head * group + r % group) * D + c0;
        for (int v = 0; v < kPerThread / 8; ++v) {
          const uint4 raw = *reinterpret_cast<const uint4*>(src + 8 * v);
          const T* e = reinterpret_cast<const T*>(&raw);
          for (int i = 0; i < 8; ++i) x[8 * v + i] = to_float(e[i]);
        }
        if (p.seq_state != nullptr) {
          for (int i = 0; i < kPerThread; ++i) {
            if (p.logits_soft_cap > 0.f) q_dot_m += x[i] * (rec ? __ldg(rec + kStateCenter * D + i) : NAN);
            x[i] = x[i] * (rec ? __ldg(rec + kStateScale * D + i) : NAN);
          }
        }
      }
      if (signs != nullptr) {  // uniform: every lane takes part in the shuffles
        for (int i = 0; i < kPerThread; ++i) x[i] = x[i] * __ldg(signs + i);
        fwht_registers(x);
        fwht_stage_across_lanes(x, part, 1);
        fwht_stage_across_lanes(x, part, 2);
        fwht_stage_across_lanes(x, part, 4);
        for (int i = 0; i < kPerThread; ++i) x[i] = x[i] * p.rotation_norm;
      }
      bool bad = false;
      for (int i = 0; i < kPerThread; ++i) bad |= !isfinite(x[i]);
      for (int i = 0; i < kPerThread; i += 4)
        *reinterpret_cast<float4*>(q_tile + row * kQStride + c0 + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
      // The sink: position 0 is visible to this row (window permitting) and this CTA holds it.
      // Without a record (slot outside seq_state) the row is NaN already: lam is NaN.
      const bool sees_sink = merge_sink && rec != nullptr && pos >= 0 && (p.sliding_window <= 0 || pos < p.sliding_window);
      float sink_dot = 0.f;
      bool sink_bad = false;
      if (sees_sink) {  // the 8 threads of a row agree
        for (int i = 0; i < kPerThread; ++i) {
          const float k0 = __ldg(rec + kStateSinkKey * D + i), v0 = __ldg(rec + kStateSinkValue * D + i);
          sink_dot += x[i] * k0;
          sink_bad |= !isfinite(v0);
        }
      }
      q_dot_m = octet_sum(q_dot_m);
      sink_dot = octet_sum(sink_dot);
      const int any_bad = octet_or(int(bad) | (int(sink_bad) << 1));
      if (part == 0) {
        float x0 = (p.logits_soft_cap > 0.f ? sink_dot + q_dot_m : sink_dot) * p.scale;
        if (p.logits_soft_cap > 0.f) x0 = p.logits_soft_cap * tanhf(x0 / p.logits_soft_cap);
        x0 *= kLog2e;
        const bool row_nan = pos >= 0 && ((any_bad & 1) || (sees_sink && ((any_bad & 2) || !isfinite(x0))));
        smem_q_dot_m[row] = q_dot_m;
        smem_sink_logit[row] = x0;
        smem_flags[row] = (row_nan ? kRowNan : 0) | (sees_sink ? kRowSink : 0);
      }
    }
    __syncthreads();

    // Q -> E4M3 A fragments, k permuted as K is loaded; Q's E8M0 scales in one register.
    uint32_t qa[kSteps][4];
    uint32_t q_sf = 0;
    static_for<kSteps>([&](auto S) {
      constexpr int s = decltype(S)::value;
      for (int h = 0; h < 2; ++h) {
        const float4* src = reinterpret_cast<const float4*>(q_tile + (g + 8 * h) * kQStride + 32 * s + 8 * t);
        const float4 lo = src[0], hi = src[1];
        const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        float amax = 0.f;
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(x[i]));
        const int ex = e4m3_block_exponent(quad_max(amax));
        const float inv = ldexpf(1.0f, -ex);
        qa[s][h] = pack_e4m3x4(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv);
        qa[s][h + 2] = pack_e4m3x4(x[4] * inv, x[5] * inv, x[6] * inv, x[7] * inv);
        if ((t & 1) == h && (t >> 1) == s / 4) q_sf |= uint32_t(ex + 127) << (8 * (s % 4));
      }
    });
    __syncthreads();  // the V chunks below overwrite the Q tile

    // Keys this tile can see within this split.
    const int r_first = tile * kRows, r_last = min(rows, r_first + kRows) - 1;
    const int pos_min = seq_len - q_len + r_first / group, pos_max = seq_len - q_len + r_last / group;
    const int key_lo = max(split_lo, p.sliding_window > 0 ? pos_min - p.sliding_window + 1 : 0);
    const int key_hi = min(split_hi, pos_max + 1);

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[kTiles][4];
    for (int n = 0; n < kTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    bool row_nan[2] = {false, false};
    uint8_t* vs = smem_v[warp];

    for (int chunk = (key_lo / kChunk) * kChunk + kChunk * warp; chunk < key_hi; chunk += kChunk * kWarps) {
      // Lane k owns key chunk + k: its cache row, scales and NaN flag.
      // A key whose block id lies outside the block table or the cache is never read: it
      // counts as NaN, so the rows that see it come out NaN.
      // With the sink, position 0 comes from the state record instead: never loaded, masked.
      const int key = chunk + lane;
      const bool key_ok = key < key_hi && (key > 0 || !p.sink);
      long long cache_row = 0;  // row in the [num_blocks * num_kv_heads * block_size] key/value rows
      uint32_t k_sf[kScaleWords], v_sf[kScaleWords];
      bool key_nan = false, key_in_cache = false;
      {
        long long scale_row = 0;  // row in the [num_blocks * block_size * num_kv_heads] scale rows
        if (key_ok) {
          const int offset = key % p.block_size;
          const long long block = turboquant::paged_kv::block_id(block_table, key / p.block_size,
                                                                 p.max_blocks_per_seq, p.num_blocks);
          key_in_cache = block >= 0;
          key_nan = !key_in_cache;
          if (key_in_cache) {
            cache_row = (block * p.num_kv_heads + kv_head) * p.block_size + offset;
            scale_row = (block * p.block_size + offset) * p.num_kv_heads + kv_head;
          }
        }
        for (int w = 0; w < kScaleWords; ++w) k_sf[w] = v_sf[w] = 0u;
        if constexpr (kPer32) {
#pragma unroll
          for (int s = 0; s < kSteps; ++s) {
            const uint32_t kb = key_in_cache ? p.key_scales[scale_row * kSteps + s] : 127u;
            const uint32_t vb = key_in_cache ? p.value_scales[scale_row * kSteps + s] : 127u;
            key_nan |= kb == 255u || vb == 255u;
            k_sf[s / 4] |= kb << (8 * (s % 4));
            v_sf[s / 4] |= vb << (8 * (s % 4));
          }
        } else {
          const uint32_t kb = key_in_cache ? p.key_scales[scale_row] : 127u;
          const uint32_t vb = key_in_cache ? p.value_scales[scale_row] : 127u;
          key_nan |= kb == 255u || vb == 255u;
#pragma unroll
          for (int w = 0; w < kScaleWords; ++w) {
            k_sf[w] = kb * 0x01010101u;
            v_sf[w] = vb;
          }
        }
      }
      const uint32_t nan_keys = __ballot_sync(0xffffffffu, key_ok && key_nan);

      // S = Q K^T for the 4 n-tiles (keys 8j..8j+7). Lane 4n + j supplies key 8j + n's scales.
      uint32_t k_sfb[kScaleWords];
      for (int w = 0; w < kScaleWords; ++w) k_sfb[w] = __shfl_sync(0xffffffffu, k_sf[w], 8 * t + g);
      float sc[4][4];
      static_for<4>([&](auto J) {
        constexpr int j = decltype(J)::value;
        const long long row_j = shfl_i64(cache_row, 8 * j + g);
        const bool ok_j = __shfl_sync(0xffffffffu, int(key_in_cache), 8 * j + g) != 0;
        const uint8_t* kp = p.key_cache + row_j * kKeyRowBytes + kKeyLaneBytes * t;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        static_for<kSteps>([&](auto S) {
          constexpr int s = decltype(S)::value;
          uint32_t b[2];
          if constexpr (kKeyE4m3) {  // elements 32s+8t..+7: E4M3 bytes are the MMA's containers
            const uint2 raw = ok_j ? __ldg(reinterpret_cast<const uint2*>(kp + 32 * s)) : make_uint2(0u, 0u);
            b[0] = raw.x;
            b[1] = raw.y;
            mma_mxf8f6f4_e4m3_e4m3_m16n8k32<s % 4, s / 4, s % 4, j>(acc, qa[s], b, acc, q_sf, k_sfb[s / 4]);
          } else {  // elements 32s+8t..+7: 8 packed FP4 codes, expanded to containers
            const uint32_t packed = ok_j ? __ldg(reinterpret_cast<const unsigned int*>(kp + 16 * s)) : 0u;
            expand_e2m1x8(packed, b[0], b[1]);
            mma_mxf8f6f4_e4m3_e2m1_m16n8k32<s % 4, s / 4, s % 4, j>(acc, qa[s], b, acc, q_sf, k_sfb[s / 4]);
          }
        });
        for (int i = 0; i < 4; ++i) sc[j][i] = acc[i];
      });

      // Logits (soft-cap, masks by selection), base 2; online softmax.
      uint32_t ok_bits = 0;  // bit 4j + i: element sc[j][i] is attended
      float chunk_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = i >> 1, k = 8 * j + 2 * t + (i & 1), kpos = chunk + k;
          bool ok = kpos < key_hi && kpos <= row_pos[h] && (kpos > 0 || !p.sink) &&
                    (p.sliding_window <= 0 || kpos > row_pos[h] - p.sliding_window);
          if (ok && ((nan_keys >> k) & 1u)) {
            row_nan[h] = true;
            ok = false;
          }
          float x;
          if (p.logits_soft_cap > 0.f) {  // with key smoothing, q.m is part of the capped logit
            x = (sc[j][i] + smem_q_dot_m[g + 8 * h]) * p.scale;
            x = p.logits_soft_cap * tanhf(x / p.logits_soft_cap);
          } else {
            x = sc[j][i] * p.scale;
          }
          sc[j][i] = ok ? x * kLog2e : -INFINITY;
          ok_bits |= uint32_t(ok) << (4 * j + i);
          chunk_max[h] = fmaxf(chunk_max[h], sc[j][i]);
        }
      }
      float m_use[2];
      for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m[h], quad_max(chunk_max[h]));
        m_use[h] = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2f(m[h] - m_use[h]);
        m[h] = m_new;
        l[h] *= alpha;
        for (int n = 0; n < kTiles; ++n) {
          o[n][2 * h] *= alpha;
          o[n][2 * h + 1] *= alpha;
        }
      }
      for (int j = 0; j < 4; ++j) {
        for (int i = 0; i < 4; ++i) {
          sc[j][i] = exp2f(sc[j][i] - m_use[i >> 1]);
          l[i >> 1] += sc[j][i];
        }
      }

      // V chunk -> shared memory, transposed, in PV slot order.
      __syncwarp();
      {
        const int slot = pv_slot_of_key(lane);
        const uint4* vp = reinterpret_cast<const uint4*>(p.value_cache + cache_row * (D / 2));
        for (int piece = 0; piece < D / 32; ++piece) {
          const uint4 raw = key_in_cache ? __ldg(vp + piece) : make_uint4(0u, 0u, 0u, 0u);
          const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
          for (int q = 0; q < 4; ++q) {
            for (int i = 0; i < 8; ++i) {
              const int channel = 32 * piece + 8 * q + i;
              vs[v_smem_offset(channel, slot)] = uint8_t(((words[q] >> (4 * i)) & 15u) << 2);
            }
          }
        }
      }
      __syncwarp();

      // O += P' V per V scale group; P' = P * sV quantized to E4M3 with an E8M0 scale per row.
      static_for<kGroups>([&](auto CG) {
        constexpr int cg = decltype(CG)::value;
        float pv[2][8];  // [row g / g+8][slot order: 4t..4t+3, 16+4t..16+4t+3]
        for (int q = 0; q < 8; ++q) {
          const int j = q >> 1, b = q & 1;
          const uint32_t vb = byte_of(__shfl_sync(0xffffffffu, v_sf[cg / 4], 8 * j + 2 * t + b), cg % 4);
          const float sv = vb == 255u ? 0.f : ldexpf(1.0f, int(vb) - 127);
          for (int h = 0; h < 2; ++h)
            pv[h][q] = ((ok_bits >> (4 * j + 2 * h + b)) & 1u) ? sc[j][2 * h + b] * sv : 0.f;
        }
        uint32_t pa[4];
        int pex[2];
        for (int h = 0; h < 2; ++h) {
          float amax = 0.f;
          for (int q = 0; q < 8; ++q) amax = fmaxf(amax, pv[h][q]);
          pex[h] = e4m3_block_exponent(quad_max(amax));
          const float inv = ldexpf(1.0f, -pex[h]);
          pa[h] = pack_e4m3x4(pv[h][0] * inv, pv[h][1] * inv, pv[h][2] * inv, pv[h][3] * inv);
          pa[h + 2] = pack_e4m3x4(pv[h][4] * inv, pv[h][5] * inv, pv[h][6] * inv, pv[h][7] * inv);
        }
        const uint32_t p_sf = uint32_t(((t & 1) ? pex[1] : pex[0]) + 127);  // lanes 4g / 4g+1: rows g / g+8
        static_for<kTilesPerGroup>([&](auto NT) {
          constexpr int n = cg * kTilesPerGroup + decltype(NT)::value;
          const int channel = 8 * n + g;
          uint32_t b[2];
          b[0] = *reinterpret_cast<const uint32_t*>(vs + v_smem_offset(channel, 4 * t));
          b[1] = *reinterpret_cast<const uint32_t*>(vs + v_smem_offset(channel, 16 + 4 * t));
          mma_mxf8f6f4_e4m3_e2m1_m16n8k32<0, 0, 0, 0>(o[n], pa, b, o[n], p_sf, 0x7F7F7F7Fu);
        });
      });
    }

    // Merge the 4 warps' partial softmax states, then write this split's partial result.
    for (int h = 0; h < 2; ++h) {
      l[h] = quad_sum(l[h]);
      row_nan[h] = __shfl_xor_sync(0xffffffffu, int(row_nan[h]), 1) | row_nan[h];
      row_nan[h] = __shfl_xor_sync(0xffffffffu, int(row_nan[h]), 2) | row_nan[h];
    }
    if (t == 0) {
      for (int h = 0; h < 2; ++h) {
        smem_m[warp][g + 8 * h] = m[h];
        smem_l[warp][g + 8 * h] = l[h];
        smem_nan[warp][g + 8 * h] = row_nan[h];
      }
    }
    __syncthreads();  // also: every warp is done reading its V chunk
    float* merged = reinterpret_cast<float*>(&smem_v[0][0]);  // [kRows][D]
    for (int idx = threadIdx.x; idx < kRows * D; idx += kThreads) merged[idx] = 0.f;
    float factor[2];
    for (int h = 0; h < 2; ++h) {
      float row_max = -INFINITY;
      for (int w = 0; w < kWarps; ++w) row_max = fmaxf(row_max, smem_m[w][g + 8 * h]);
      factor[h] = m[h] == -INFINITY ? 0.f : exp2f(m[h] - row_max);
    }
    __syncthreads();
    for (int w = 0; w < kWarps; ++w) {
      if (warp == w) {
        for (int n = 0; n < kTiles; ++n)
          for (int i = 0; i < 4; ++i) merged[cd_row(lane, i) * D + 8 * n + cd_col(lane, i)] += o[n][i] * factor[i >> 1];
      }
      __syncthreads();
    }
    // Per row: the merged max and sum, the sink merged in as one more key, the NaN flag.
    if (threadIdx.x < kRows) {
      const int row = threadIdx.x, r = tile * kRows + row;
      float row_max = -INFINITY, row_sum = 0.f;
      const int flags = smem_flags[row];
      bool nan = (flags & kRowNan) != 0;
      for (int w = 0; w < kWarps; ++w) row_max = fmaxf(row_max, smem_m[w][row]);
      for (int w = 0; w < kWarps; ++w) {
        if (smem_m[w][row] != -INFINITY) row_sum += smem_l[w][row] * exp2f(smem_m[w][row] - row_max);
        nan |= smem_nan[w][row] != 0;
      }
      float keep = 1.f, add = 0.f;
      if (flags & kRowSink) {  // x0 is finite here (kRowNan otherwise)
        const float x0 = smem_sink_logit[row];
        const float m_new = fmaxf(row_max, x0);
        keep = row_max == -INFINITY ? 0.f : exp2f(row_max - m_new);
        add = exp2f(x0 - m_new);
        row_sum = row_sum * keep + add;
        row_max = m_new;
      }
      smem_keep[row] = keep;
      smem_add[row] = add;
      if (r < rows) {
        const long long at = ((long long)split * p.num_tokens + q_start + r / group) * p.num_heads + kv_head * group + r % group;
        p.part_max[at] = nan ? 0.f : row_max;
        p.part_sum[at] = nan ? NAN : row_sum;
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < kRows * D; idx += kThreads) {
      const int row = idx / D, r = tile * kRows + row;
      if (r < rows) {
        float value = merged[idx];
        if (smem_flags[row] & kRowSink)  // record is set: a row without it is never kRowSink
          value = value * smem_keep[row] + __ldg(record + kStateSinkValue * D + idx % D) * smem_add[row];
        const long long out_row = (long long)split * p.num_tokens + q_start + r / group;
        p.part_out[(out_row * p.num_heads + kv_head * group + r % group) * D + idx % D] = value;
      }
    }
    __syncthreads();  // the next tile reuses the shared buffers
  }
}

// grid (num_tokens, num_heads) block kThreads. With rotation, each normalized row o' is
// un-rotated before the store: o = fwht(o') * D^-0.5 * signs (turboquant.rotation.unrotate).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) combine_splits_sm120_kernel(const AttentionParams p) {
  __shared__ float row_buf[D];  // the normalized row, for the un-rotation
  const int token = blockIdx.x, head = blockIdx.y;
  const long long stride = (long long)p.num_tokens * p.num_heads;
  const long long row = (long long)token * p.num_heads + head;
  float row_max = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) row_max = fmaxf(row_max, p.part_max[s * stride + row]);
  float denom = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float mx = p.part_max[s * stride + row];
    if (mx != -INFINITY) denom += p.part_sum[s * stride + row] * exp2f(mx - row_max);
  }
  T* out = static_cast<T*>(p.out) + row * D;
  const bool rotated = p.rotation_signs != nullptr;
  for (int c = threadIdx.x; c < D; c += kThreads) {
    float num = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float mx = p.part_max[s * stride + row];
      if (mx != -INFINITY) num += p.part_out[(s * stride + row) * D + c] * exp2f(mx - row_max);
    }
    // denom is 0 when the row attended no key (seq_len 0): zeros; NaN when a NaN scale was attended.
    const float value = denom > 0.f ? num / denom : (denom == denom ? 0.f : NAN);
    if (rotated) {
      row_buf[c] = value;
    } else {
      out[c] = from_float<T>(value);
    }
  }
  if (rotated) {  // uniform across the CTA
    for (int h = 1; h < D; h <<= 1) {
      __syncthreads();
      for (int i = threadIdx.x; i < D / 2; i += kThreads) {  // pair i: elements lo, lo + h
        const int lo = ((i & ~(h - 1)) << 1) | (i & (h - 1));
        const float a = row_buf[lo], b = row_buf[lo + h];
        row_buf[lo] = a + b;
        row_buf[lo + h] = a - b;
      }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += kThreads)
      out[c] = from_float<T>(row_buf[c] * p.rotation_norm * __ldg(p.rotation_signs + c));
  }
}

template <typename T, int D, bool kPer32, bool kKeyE4m3>
inline cudaError_t launch_with(const AttentionParams& p, int tile_stride, cudaStream_t stream) {
  static_assert(turboquant::cuda_fp4::supported_head_dim<D>(), "D: a head dim of limits.cuh");
  if (p.num_seqs > 0 && p.num_tokens > 0) {
    paged_attention_sm120_kernel<T, D, kPer32, kKeyE4m3>
        <<<dim3(p.num_seqs * p.num_kv_heads, p.num_splits, tile_stride), kThreads, 0, stream>>>(p);
    combine_splits_sm120_kernel<T, D><<<dim3(p.num_tokens, p.num_heads), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// Launches the attention and combine kernels. T: __nv_bfloat16 or __half. key_e4m3: a K8V4
// cache (E4M3 keys; one scale per (token, head), so never with per32_scales). The workspace
// pointers in p must hold p.num_splits partials (see plan_attention).
template <typename T>
inline cudaError_t launch_paged_attention_sm120(const AttentionParams& p, int head_dim, bool per32_scales, bool key_e4m3,
                                                int tile_stride, cudaStream_t stream) {
  if (key_e4m3 && per32_scales) return cudaErrorInvalidValue;
  cudaError_t err = cudaErrorInvalidValue;  // stays so for a head dim limits.cuh does not list
  turboquant::cuda_fp4::for_head_dim(head_dim, [&](auto d) {
    constexpr int D = decltype(d)::value;
    err = key_e4m3       ? launch_with<T, D, false, true>(p, tile_stride, stream)
          : per32_scales ? launch_with<T, D, true, false>(p, tile_stride, stream)
                         : launch_with<T, D, false, false>(p, tile_stride, stream);
  });
  return err;
}

}  // namespace sm120
}  // namespace tq
