// FP4 KV-cache paged attention for the SM120 family on block-scaled warp MMAs. Torch-free.
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
// Split-KV: each split writes an unnormalized partial (fp32 O, base-2 max, sum); a second
//   kernel combines the splits and writes the output dtype.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

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
  const uint8_t* key_cache;       // [num_blocks, num_kv_heads, block_size, D/2]
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
};

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

// grid (num_seqs * num_kv_heads, num_splits, tile_stride) block kThreads
template <typename T, int D, bool kPer32>
__global__ void __launch_bounds__(kThreads) paged_attention_sm120_kernel(const AttentionParams p) {
  static_assert(D == 64 || D == 128 || D == 256, "head dim 64, 128 or 256");
  constexpr int kSteps = D / 32;                   // k32 steps of QK^T
  constexpr int kScaleWords = (kSteps + 3) / 4;    // per-key scale words (byte s % 4 of word s / 4)
  constexpr int kGroups = kPer32 ? D / 32 : 1;     // V scale groups along the head dim
  constexpr int kTiles = D / 8;                    // n8 tiles of the output
  constexpr int kTilesPerGroup = kTiles / kGroups;
  constexpr float kLog2e = 1.4426950408889634f;

  __shared__ __align__(16) uint8_t smem_v[kWarps][D * kChunk];  // per warp: V chunk [channel][slot]
  __shared__ float smem_m[kWarps][kRows], smem_l[kWarps][kRows];
  __shared__ int smem_nan[kWarps][kRows];

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

  for (int tile = blockIdx.z; tile * kRows < rows; tile += gridDim.z) {
    // This lane's rows g and g + 8: position in the sequence (-1: padding row) and query row.
    int row_pos[2];
    const T* q_row[2];
    for (int h = 0; h < 2; ++h) {
      const int r = tile * kRows + g + 8 * h;
      const int j = r / group;
      row_pos[h] = r < rows ? seq_len - q_len + j : -1;
      q_row[h] = query + ((long long)(q_start + j) * p.num_heads + kv_head * group + r % group) * D;
    }

    // Q -> E4M3 A fragments, k permuted as K is loaded; Q's E8M0 scales in one register.
    uint32_t qa[kSteps][4];
    uint32_t q_sf = 0;
    static_for<kSteps>([&](auto S) {
      constexpr int s = decltype(S)::value;
      for (int h = 0; h < 2; ++h) {
        float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (row_pos[h] >= 0) {
          const uint4 raw = *reinterpret_cast<const uint4*>(q_row[h] + 32 * s + 8 * t);
          const T* e = reinterpret_cast<const T*>(&raw);
          for (int i = 0; i < 8; ++i) x[i] = to_float(e[i]);
        }
        float amax = 0.f;
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(x[i]));
        const int ex = e4m3_block_exponent(quad_max(amax));
        const float inv = ldexpf(1.0f, -ex);
        qa[s][h] = pack_e4m3x4(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv);
        qa[s][h + 2] = pack_e4m3x4(x[4] * inv, x[5] * inv, x[6] * inv, x[7] * inv);
        if ((t & 1) == h && (t >> 1) == s / 4) q_sf |= uint32_t(ex + 127) << (8 * (s % 4));
      }
    });

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
      const int key = chunk + lane;
      const bool key_ok = key < key_hi;
      long long cache_row = 0;  // row in the [num_blocks * num_kv_heads * block_size] key/value rows
      uint32_t k_sf[kScaleWords], v_sf[kScaleWords];
      bool key_nan = false, key_in_cache = false;
      {
        long long scale_row = 0;  // row in the [num_blocks * block_size * num_kv_heads] scale rows
        if (key_ok) {
          const int index = key / p.block_size, offset = key % p.block_size;
          const long long block = index < p.max_blocks_per_seq ? block_table[index] : -1;
          key_in_cache = block >= 0 && block < p.num_blocks;
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
        const uint8_t* kp = p.key_cache + row_j * (D / 2) + 4 * t;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        static_for<kSteps>([&](auto S) {
          constexpr int s = decltype(S)::value;
          const uint32_t packed = ok_j ? __ldg(reinterpret_cast<const unsigned int*>(kp + 16 * s)) : 0u;
          uint32_t b[2];
          expand_e2m1x8(packed, b[0], b[1]);
          mma_mxf8f6f4_e4m3_e2m1_m16n8k32<s % 4, s / 4, s % 4, j>(acc, qa[s], b, acc, q_sf, k_sfb[s / 4]);
        });
        for (int i = 0; i < 4; ++i) sc[j][i] = acc[i];
      });

      // Logits (soft-cap, masks by selection), base 2; online softmax.
      uint32_t ok_bits = 0;  // bit 4j + i: element sc[j][i] is attended
      float chunk_max[2] = {-INFINITY, -INFINITY};
      for (int j = 0; j < 4; ++j) {
        for (int i = 0; i < 4; ++i) {
          const int h = i >> 1, k = 8 * j + 2 * t + (i & 1), kpos = chunk + k;
          bool ok = kpos < key_hi && kpos <= row_pos[h] &&
                    (p.sliding_window <= 0 || kpos > row_pos[h] - p.sliding_window);
          if (ok && ((nan_keys >> k) & 1u)) {
            row_nan[h] = true;
            ok = false;
          }
          float x = sc[j][i] * p.scale;
          if (p.logits_soft_cap > 0.f) x = p.logits_soft_cap * tanhf(x / p.logits_soft_cap);
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
    for (int idx = threadIdx.x; idx < kRows * D; idx += kThreads) {
      const int r = tile * kRows + idx / D;
      if (r < rows) {
        const long long out_row = (long long)split * p.num_tokens + q_start + r / group;
        p.part_out[(out_row * p.num_heads + kv_head * group + r % group) * D + idx % D] = merged[idx];
      }
    }
    if (threadIdx.x < kRows) {
      const int row = threadIdx.x, r = tile * kRows + row;
      if (r < rows) {
        float row_max = -INFINITY, row_sum = 0.f;
        bool nan = false;
        for (int w = 0; w < kWarps; ++w) row_max = fmaxf(row_max, smem_m[w][row]);
        for (int w = 0; w < kWarps; ++w) {
          if (smem_m[w][row] != -INFINITY) row_sum += smem_l[w][row] * exp2f(smem_m[w][row] - row_max);
          nan |= smem_nan[w][row] != 0;
        }
        const long long at = ((long long)split * p.num_tokens + q_start + r / group) * p.num_heads + kv_head * group + r % group;
        p.part_max[at] = nan ? 0.f : row_max;
        p.part_sum[at] = nan ? NAN : row_sum;
      }
    }
    __syncthreads();  // the next tile reuses the shared buffers
  }
}

// grid (num_tokens, num_heads) block kThreads
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) combine_splits_sm120_kernel(const AttentionParams p) {
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
  for (int c = threadIdx.x; c < D; c += kThreads) {
    float num = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float mx = p.part_max[s * stride + row];
      if (mx != -INFINITY) num += p.part_out[(s * stride + row) * D + c] * exp2f(mx - row_max);
    }
    // denom is 0 when the row attended no key (seq_len 0): zeros; NaN when a NaN scale was attended.
    const float value = denom > 0.f ? num / denom : (denom == denom ? 0.f : NAN);
    out[c] = from_float<T>(value);
  }
}

template <typename T, int D, bool kPer32>
inline cudaError_t launch_with(const AttentionParams& p, int tile_stride, cudaStream_t stream) {
  if (p.num_seqs > 0 && p.num_tokens > 0) {
    paged_attention_sm120_kernel<T, D, kPer32>
        <<<dim3(p.num_seqs * p.num_kv_heads, p.num_splits, tile_stride), kThreads, 0, stream>>>(p);
    combine_splits_sm120_kernel<T, D><<<dim3(p.num_tokens, p.num_heads), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// Launches the attention and combine kernels. T: __nv_bfloat16 or __half. The workspace
// pointers in p must hold p.num_splits partials (see plan_attention).
template <typename T>
inline cudaError_t launch_paged_attention_sm120(const AttentionParams& p, int head_dim, bool per32_scales, int tile_stride,
                                                cudaStream_t stream) {
  switch (head_dim * 2 + (per32_scales ? 1 : 0)) {
    case 128: return launch_with<T, 64, false>(p, tile_stride, stream);
    case 129: return launch_with<T, 64, true>(p, tile_stride, stream);
    case 256: return launch_with<T, 128, false>(p, tile_stride, stream);
    case 257: return launch_with<T, 128, true>(p, tile_stride, stream);
    case 512: return launch_with<T, 256, false>(p, tile_stride, stream);
    case 513: return launch_with<T, 256, true>(p, tile_stride, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace sm120
}  // namespace tq
