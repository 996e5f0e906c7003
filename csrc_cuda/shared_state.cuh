// turboquant cuda backend: the shared state's two small kernels (turboquant/shared_state.py,
// CONTRACT.md section 2, "Shared state"). Torch-free.
//
// 1. records: a warp per (sequence, kv head) of an attention call builds the record that the
//    kernels reading records take (float32 [num_seqs, Hkv, 5, D]; the general and prefill
//    kernels, other backends; the decode kernels look the sink up themselves, sink_ref in
//    attention_common.cuh, with fingerprint_mix below): the layer's m, lam, 1/lam, and the
//    sink from the layer's table where the fingerprint of the sequence's block 0, slot 0 bytes
//    equals the entry's tag, else position 0 decoded from those bytes (NaN when block 0 is no
//    block of the cache or the sequence has no key). One launch in place of the ~80 small torch
//    operations of the definition (shared_state.records), which cost 150-190 us in a graph.
// 2. enter_sinks: after a write, one block scans the write's tokens in order and enters each
//    one at position 0 (with a slot) under the fingerprint of its bytes just written: its key
//    transformed (rotate((k - m) * (1 / lam))) and its value (rotate(v)) rounded to bf16. One
//    block, tokens in order: of two tokens with the same entry the later wins, and an entry's
//    tag and rows always come from one token.
// Both compute the fingerprint exactly as the definition: the row's key bytes, value bytes, key
// scale bytes, value scale bytes, zero-padded to 32-bit little-endian words w_i (i from 1),
// two mixes summed mod 2^32 (uint32 arithmetic wraps as the definition masks).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "fp4_common.cuh"
#include "limits.cuh"
#include "paged_kv.cuh"

namespace turboquant {
namespace cuda_fp4 {

struct SharedCache {
  const uint8_t* key_cache;    // [num_blocks, Hkv, bs, key_bytes] (FP4 codes, or E4M3 bytes)
  const uint8_t* value_cache;  // [num_blocks, Hkv, bs, D/2]
  const uint8_t* key_scales;   // [num_blocks, bs, Hkv(, groups)] contiguous
  const uint8_t* value_scales; // [num_blocks, bs, Hkv(, groups)] contiguous
  int64_t kc_blk, kc_head, kc_tok, vc_blk, vc_head, vc_tok;  // element (byte) strides
  int key_bytes, value_bytes, groups, hkv, block_size, num_blocks, head_dim;
  bool key_e4m3;
};

// Position `off` of block blk, kv head h: its key row and value row (bytes), and the index of
// its first scale byte in key_scales / value_scales.
__device__ inline const uint8_t* shared_key_row(const SharedCache& c, int64_t blk, int off, int h) {
  return c.key_cache + blk * c.kc_blk + h * c.kc_head + off * c.kc_tok;
}
__device__ inline const uint8_t* shared_value_row(const SharedCache& c, int64_t blk, int off, int h) {
  return c.value_cache + blk * c.vc_blk + h * c.vc_head + off * c.vc_tok;
}
__device__ inline int64_t shared_scale_index(const SharedCache& c, int64_t blk, int off, int h) {
  return ((blk * c.block_size + off) * c.hkv + h) * c.groups;
}

constexpr int kSharedThreads = 128, kSharedWarps = kSharedThreads / 32;
__device__ constexpr uint32_t kMix[2][3] = {{0x2545F491u, 0x3C6EF372u, 0x2C1B3C6Du},
                                 {0x297A2D39u, 0x1B873593u, 0x5BD1E995u}};

// Byte i of the fingerprinted sequence of (block, offset, head): key row, value row, key
// scales, value scales, then zeros.
__device__ inline uint32_t shared_byte(const SharedCache& c, int64_t blk, int off, int h, int i) {
  if (i < c.key_bytes) return shared_key_row(c, blk, off, h)[i];
  i -= c.key_bytes;
  if (i < c.value_bytes) return shared_value_row(c, blk, off, h)[i];
  i -= c.value_bytes;
  const int64_t s = shared_scale_index(c, blk, off, h);
  if (i < c.groups) return c.key_scales[s + i];
  i -= c.groups;
  if (i < c.groups) return c.value_scales[s + i];
  return 0u;
}

// The fingerprint of a sequence of `words` 32-bit words, lane l holding words l + 32 i in w[i]
// (all 32 lanes call it; every lane gets it).
template <int N>
__device__ __forceinline__ int64_t fingerprint_mix(const uint32_t (&w)[N], int words) {
  const int lane = threadIdx.x & 31;
  uint32_t acc[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int k = lane + 32 * i;
    if (k >= words) continue;
    const uint32_t idx = uint32_t(k + 1);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      uint32_t x = w[i] * kMix[m][0] + idx * kMix[m][1];
      x ^= x >> 15;
      x *= kMix[m][2];
      x ^= x >> 13;
      acc[m] += x;
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m)
    for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
  return (int64_t(acc[0] & 0x7FFFFFFFu) << 32) | int64_t(acc[1]) | 1;
}

// The sink table's entry for fingerprint tag (the definition's tag mod S), and a table row's
// bf16 element (its bits) as a float.
__device__ __forceinline__ int64_t sink_entry(int64_t tag, int entries) { return tag % entries; }
__device__ __forceinline__ float bf16_bits_float(uint32_t bits) { return __uint_as_float(bits << 16); }

// The words one lane of shared_fingerprint takes at most: E4M3 key bytes (D), FP4 value bytes
// (D / 2) and two scale bytes per 32 elements, at the largest head dim, over 32 lanes.
constexpr int kFingerprintWords = (kMaxHeadDim + kMaxHeadDim / 2 + 2 * (kMaxHeadDim / 32) + 127) / 128;

// The fingerprint (int64, odd) of (block, offset, head), by one warp (every lane gets it; all
// 32 lanes must call it). A lane loads all its words before it mixes them (one round trip, the
// kernel's time being its chain of them); a word inside the key or the value row is one 32-bit
// load where the rows are 4-byte aligned, the others (the scales) byte by byte.
__device__ inline int64_t shared_fingerprint(const SharedCache& c, int64_t blk, int off, int h) {
  const int lane = threadIdx.x & 31;
  const int len = c.key_bytes + c.value_bytes + 2 * c.groups;
  const int words = (len + 3) / 4;
  const uint8_t* krow = shared_key_row(c, blk, off, h);
  const uint8_t* vrow = shared_value_row(c, blk, off, h);
  const bool aligned = ((reinterpret_cast<uintptr_t>(krow) | reinterpret_cast<uintptr_t>(vrow) |
                         uintptr_t(c.key_bytes) | uintptr_t(c.value_bytes)) & 3u) == 0;
  const int kw = c.key_bytes / 4, vw = (c.key_bytes + c.value_bytes) / 4;  // (when aligned)
  uint32_t word[kFingerprintWords];
#pragma unroll
  for (int i = 0; i < kFingerprintWords; ++i) {
    const int w = lane + 32 * i;
    word[i] = 0u;
    if (w >= words) continue;
    if (aligned && w < kw) {
      word[i] = __ldg(reinterpret_cast<const uint32_t*>(krow) + w);
    } else if (aligned && w < vw) {
      word[i] = __ldg(reinterpret_cast<const uint32_t*>(vrow) + (w - kw));
    } else {
      uint32_t byte[4];  // (all four loaded before they are combined)
#pragma unroll
      for (int b = 0; b < 4; ++b) byte[b] = shared_byte(c, blk, off, h, 4 * w + b);
      word[i] = byte[0] | byte[1] << 8 | byte[2] << 16 | byte[3] << 24;
    }
  }
  return fingerprint_mix(word, words);
}

__device__ inline float e8m0_value(uint32_t b) {
  return b == 255u ? __int_as_float(0x7fc00000) : ldexpf(1.0f, int(b) - 127);
}
__device__ inline float e2m1_value(uint32_t code) {  // 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const float v = e == 0u ? 0.5f * float(m) : ldexpf(1.0f + 0.5f * float(m), int(e) - 1);
  return (code & 8u) ? -v : v;
}
__device__ inline float e4m3_value(uint32_t b) {  // OCP E4M3 (fn): no inf, 0x7F / 0xFF NaN
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float v;
  if (e == 15u && m == 7u) v = __int_as_float(0x7fc00000);
  else if (e == 0u) v = ldexpf(float(m), -9);
  else v = ldexpf(float(8u + m), int(e) - 10);
  return (b & 0x80u) ? -v : v;
}

// Element e of position `off`'s key (is_key) or value row in (blk, h), decoded.
__device__ inline float shared_decode(const SharedCache& c, int64_t blk, int off, int h, int e,
                                      bool is_key) {
  const int64_t s = shared_scale_index(c, blk, off, h) + (c.groups > 1 ? e / 32 : 0);
  const float scale = e8m0_value((is_key ? c.key_scales : c.value_scales)[s]);
  if (is_key && c.key_e4m3) return e4m3_value(shared_key_row(c, blk, off, h)[e]) * scale;
  const uint8_t* row = is_key ? shared_key_row(c, blk, off, h) : shared_value_row(c, blk, off, h);
  const uint32_t byte = row[e / 2];
  return e2m1_value((e & 1) ? (byte >> 4) : (byte & 15u)) * scale;
}

// grid (num_seqs, ceil(Hkv / kSharedWarps)), block (kSharedThreads): warp w of block (s, y)
// builds the record of sequence s, kv head kSharedWarps y + w. A programmatic dependent launch
// (launch_programmatic): its CTAs become resident while the kernel before it drains and wait
// (pdl_wait) for the writes whose bytes they read. It does not trigger its own dependent early:
// the attention kernel's CTAs placed while these are resident spread unevenly over the SMs
// (H200, 64 x 4k, a one-wave grid: 95.0 us with the trigger, 82.2 without; record
// 2026-11-29-h200-shared-records-launch.json).
// A record costs three round trips, each issued whole before its values are used: the block
// id, sequence length and smoothing rows; position 0's bytes (the fingerprint's words and the
// elements a miss decodes); the entry's tag and its rows (a hit's answer, loaded with the tag).
__global__ void __launch_bounds__(kSharedThreads) tq_shared_records_kernel(
    float* __restrict__ records,            // [num_seqs, Hkv, 5, D]
    int* __restrict__ state_ids,            // [num_seqs]: s (the call's state_ids)
    SharedCache c,
    const int* __restrict__ block_tables,   // [num_seqs, bt_stride] (column 0 read)
    int bt_stride, int bt_cols,
    const int* __restrict__ seq_lens,       // [num_seqs]
    const float* __restrict__ smoothing,    // [1, Hkv, 5, D]: a record, rows m, lam, 1/lam
    const uint16_t* __restrict__ sink_kv,   // [S + 1, Hkv, 2, D] bf16 bits
    const int64_t* __restrict__ sink_tags,  // [S + 1, Hkv]
    int entries) {
  pdl_wait();
  const int s = blockIdx.x, D = c.head_dim, lane = threadIdx.x & 31;
  const int h = blockIdx.y * kSharedWarps + threadIdx.x / 32;
  if (threadIdx.x == 0 && blockIdx.y == 0) state_ids[s] = s;
  if (h >= c.hkv) return;
  const int first = paged_kv::block_id(block_tables + int64_t(s) * bt_stride, 0, bt_cols, c.num_blocks);
  const bool ok = first >= 0 && seq_lens[s] > 0;
  const int64_t blk = ok ? first : 0;
  const float nan = __int_as_float(0x7fc00000);
  constexpr int E = kMaxHeadDim / 32;  // elements per lane at most: e = lane + 32 i
  float* rec = records + (int64_t(s) * c.hkv + h) * 5 * D;
  const float* sm = smoothing + int64_t(h) * 5 * D;
  float row[3][E], k0[E], v0[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const int e = lane + 32 * i;
    if (e < D) {
      row[0][i] = __ldg(sm + 0 * D + e);  // KEY_CENTER
      row[1][i] = __ldg(sm + 1 * D + e);  // KEY_SCALE
      row[2][i] = __ldg(sm + 4 * D + e);  // KEY_INV_SCALE
    }
  }
  const int64_t tag = shared_fingerprint(c, blk, 0, h);
#pragma unroll
  for (int i = 0; i < E; ++i) {  // a miss's answer: position 0 decoded
    const int e = lane + 32 * i;
    if (e < D) {
      k0[i] = shared_decode(c, blk, 0, h, e, true);
      v0[i] = shared_decode(c, blk, 0, h, e, false);
    }
  }
  const int64_t entry = sink_entry(tag, entries);
  const uint16_t* kv = sink_kv + (entry * c.hkv + h) * 2 * D;
  uint32_t hk[E], hv[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {  // a hit's answer, loaded with the tag
    const int e = lane + 32 * i;
    if (e < D) {
      hk[i] = __ldg(kv + e);
      hv[i] = __ldg(kv + D + e);
    }
  }
  const bool hit = __ldg(sink_tags + entry * c.hkv + h) == tag;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const int e = lane + 32 * i;
    if (e >= D) continue;
    if (hit) {
      k0[i] = bf16_bits_float(hk[i]);
      v0[i] = bf16_bits_float(hv[i]);
    }
    rec[0 * D + e] = row[0][i];
    rec[1 * D + e] = row[1][i];
    rec[4 * D + e] = row[2][i];
    rec[2 * D + e] = ok ? k0[i] : nan;  // SINK_KEY
    rec[3 * D + e] = ok ? v0[i] : nan;  // SINK_VALUE
  }
}

template <typename T>
__device__ inline float shared_load(const T* p) { return *p; }  // float
template <>
__device__ inline float shared_load<uint16_t>(const uint16_t* p) {  // bf16 bits
  return __uint_as_float(uint32_t(*p) << 16);
}
template <>
__device__ inline float shared_load<__half>(const __half* p) { return __half2float(*p); }

// x [D] in shared memory -> rotate(x) = fwht(x * s) * norm, stages h = 1 .. D/2 (in place).
__device__ inline void shared_rotate(float* x, int D, const float* signs, float norm) {
  for (int e = threadIdx.x; e < D; e += blockDim.x) x[e] *= signs[e];
  __syncthreads();
  for (int hs = 1; hs < D; hs *= 2) {
    for (int p = threadIdx.x; p < D / 2; p += blockDim.x) {
      const int i = (p / hs) * 2 * hs + p % hs;
      const float a = x[i], b = x[i + hs];
      x[i] = a + b;
      x[i + hs] = a - b;
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < D; e += blockDim.x) x[e] *= norm;
  __syncthreads();
}

__device__ inline uint16_t bf16_bits(float f) {  // round to nearest even, NaN kept quiet
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// grid (1), block (kSharedThreads); dynamic shared memory: 2 D floats
template <typename T>  // the key/value dtype: __half, uint16_t (bf16 bits) or float
__global__ void __launch_bounds__(kSharedThreads) tq_shared_enter_sinks_kernel(
    const T* __restrict__ key,              // [n, Hkv, D]
    const T* __restrict__ value,            // [n, Hkv, D]
    int64_t key_stride_tok, int64_t value_stride_tok,  // element strides (heads, D contiguous)
    int n, SharedCache c,
    const int64_t* __restrict__ slot_mapping,  // [n] (int64; -1: not written)
    const int64_t* __restrict__ positions,     // [n]
    const float* __restrict__ smoothing,       // [1, Hkv, 5, D] (rows m, 1/lam read), or nullptr
    const float* __restrict__ signs, float norm,  // rotation signs [D], or nullptr
    uint16_t* __restrict__ sink_kv, int64_t* __restrict__ sink_tags, int entries) {
  extern __shared__ float x[];  // [2][D]
  __shared__ int found[kSharedThreads];
  __shared__ int nfound;
  const int D = c.head_dim;
  for (int base = 0; base < n; base += blockDim.x) {
    // the chunk's tokens at position 0 with a slot, in token order
    if (threadIdx.x == 0) nfound = 0;
    __syncthreads();
    const int t = base + threadIdx.x;
    const bool at0 = t < n && positions[t] == 0 && slot_mapping[t] >= 0;
    const unsigned ballot = __ballot_sync(0xffffffffu, at0);
    const int warp = threadIdx.x / 32;
    __shared__ int warp_count[kSharedThreads / 32];
    if ((threadIdx.x & 31) == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    if (at0) {
      int before = __popc(ballot & ((1u << (threadIdx.x & 31)) - 1u));
      for (int w = 0; w < warp; ++w) before += warp_count[w];
      found[before] = t;
    }
    if (threadIdx.x == 0) {
      int total = 0;
      for (int w = 0; w < (int)blockDim.x / 32; ++w) total += warp_count[w];
      nfound = total;
    }
    __syncthreads();
    const int count = nfound;
    for (int f = 0; f < count; ++f) {
      const int tok = found[f];
      const int64_t slot = slot_mapping[tok];
      const int64_t blk = slot / c.block_size;
      const int off = int(slot % c.block_size);
      for (int h = 0; h < c.hkv; ++h) {
        const int64_t tag = shared_fingerprint(c, blk, off, h);  // (each warp, the same)
        const int64_t entry = sink_entry(tag, entries);
        for (int e = threadIdx.x; e < D; e += blockDim.x) {
          float k = shared_load(key + tok * key_stride_tok + int64_t(h) * D + e);
          if (smoothing != nullptr)
            k = (k - smoothing[(int64_t(h) * 5 + 0) * D + e]) * smoothing[(int64_t(h) * 5 + 4) * D + e];
          x[e] = k;
          x[D + e] = shared_load(value + tok * value_stride_tok + int64_t(h) * D + e);
        }
        __syncthreads();
        if (signs != nullptr) {
          shared_rotate(x, D, signs, norm);
          shared_rotate(x + D, D, signs, norm);
        }
        uint16_t* kv = sink_kv + (entry * c.hkv + h) * 2 * D;
        for (int e = threadIdx.x; e < 2 * D; e += blockDim.x) kv[e] = bf16_bits(x[e]);
        if (threadIdx.x == 0) sink_tags[entry * c.hkv + h] = tag;
        __syncthreads();  // x reused by the next head or token
      }
    }
    __syncthreads();  // found / nfound reused by the next chunk
  }
}

}  // namespace cuda_fp4
}  // namespace turboquant
