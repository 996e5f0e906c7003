// The prefill kernel's decode-once workspace (torch-free): the first of the two stages of a
// long chunked-prefill call on SM90a.
//
// Why: the prefill kernel gives each CTA 128 rows of one sequence and kv head, and every CTA
// decodes every FP4 tile of the context it reads. At 2048 query tokens with 4 query heads per
// kv head that is 64 CTAs per kv head, so each KV tile is decoded 64 times per call, and the
// decode (integer work of the producer warps) paces the row warps. Decoded once, the same
// call's CTAs copy finished tiles instead: the decode becomes a per-byte cost paid once.
//
// What: for each (sequence, 64-key step, kv head) of the call that some row can see, one tile
// of PrefillLayout::WS_TILE bytes: the step's K and V decoded exactly as the prefill kernel's
// producers decode them into a decode buffer (key_chunk_off, value_chunk_off and
// decode_key_chunk: the same placement and bytes), then the K and V scale bytes of its keys,
// then per 16-key sub-tile a flag for a bad block id (the kernel then makes the rows that need
// that sub-tile NaN, as it does when it meets the id itself). Keys past the sequence and
// sub-tiles with a bad block id are written as zero codes (finite values: a masked key's V must
// not turn its P = 0 into NaN) and zero scale bytes. Steps no row can see (before the sliding
// window of the chunk's first query, or past the sequence) are not written, and the kernel never
// reads them. The prefill kernel with kWs then copies the tiles it needs (attention_prefill.cuh)
// and writes the scale words from the bytes, as its decode does.
//
// Size: num_seqs x ws_steps x num_kv_heads tiles, ws_steps = ceil(max_seq_len / 64); a tile is
// 24,832 bytes at D 128 (8 KB of E5M2 or E4M3 K rows, 16 KB of fp16 V, 132 bytes of scales and
// flags), about 388 bytes per key and kv head: 1 x 16k keys x 8 kv heads, 51 MB. Reads 8.2 KB of
// FP4 codes and writes 24.8 KB per tile: at 16k x 8 kv heads about 17 MB read and 51 MB written.
#pragma once

#include "attention_prefill.cuh"

namespace turboquant {
namespace cuda_fp4 {

// grid (ws_steps, num_seqs * num_kv_heads), block 128 threads, no shared memory.
template <int D, bool kE4m3>
__global__ void __launch_bounds__(128) prefill_workspace_kernel(const AttnParams p) {
  using L = PrefillLayout<D, kE4m3, true>;
  constexpr int TK = L::TK;
  pdl_wait();  // the cache was written by the kernels before this one
  pdl_launch_dependents();
  const int step = blockIdx.x, Hkv = p.num_kv_heads;
  const int s = blockIdx.y / Hkv, kvh = blockIdx.y - s * Hkv;
  const int seq_len = __ldg(p.seq_lens + s);
  const int q0 = max(__ldg(p.cu_query_lens + s), 0);
  const int qn = min(__ldg(p.cu_query_lens + s + 1), p.num_tokens) - q0;
  // the earliest key a row of this sequence sees (the prefill kernel's row_lo of its first query)
  const int lo = p.sliding_window > 0 ? max(0, seq_len - qn - p.sliding_window + 1) : 0;
  const int t0 = step * TK;
  if (qn <= 0 || t0 >= seq_len || t0 + TK <= lo) return;
  uint8_t* tile = p.ws + (((long long)s * p.ws_steps + step) * Hkv + kvh) * L::WS_TILE;
  const BlockRow blocks(p, s);
  const int bs_mask = (1 << p.log2_block_size) - 1;
  // K chunks [0, KCH), then V chunks: chunk q of key r of the step
  for (int c = threadIdx.x; c < L::KCH + L::VCH; c += blockDim.x) {
    const bool key = c < L::KCH;
    const int cc = key ? c : c - L::KCH, cpr = key ? L::KCPR : L::VCPR;
    const int r = cc / cpr, q = cc - r * cpr, tok = t0 + r;
    const int b = tok < seq_len ? blocks.id(tok) : -1;
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    if (b >= 0) {
      const uint8_t* src = key ? p.key_cache + kvh * p.kc_stride_head + b * p.kc_stride_blk + (tok & bs_mask) * L::KROWB
                               : p.value_cache + kvh * p.vc_stride_head + b * p.vc_stride_blk + (tok & bs_mask) * L::VROWB;
      w = __ldg(reinterpret_cast<const uint4*>(src + q * 16));
    }
    if (key) decode_key_chunk<L>(w, tile, key_chunk_off<L>(r, q));
    else decode_fp4_chunk(w, tile, value_chunk_off<L>(r, q));
  }
  // scale bytes (K of key r at r, V at TK + r) and the sub-tiles' bad flags
  for (int r = threadIdx.x; r < TK; r += blockDim.x) {
    const int tok = t0 + r;
    const int b = tok < seq_len ? blocks.id(tok) : -1;
    const long long at = b >= 0 ? (((long long)b << p.log2_block_size) + (tok & bs_mask)) * Hkv + kvh : 0;
    tile[L::WS_SCALES + r] = b >= 0 ? __ldg(p.key_scales + at) : 0;
    tile[L::WS_SCALES + TK + r] = b >= 0 ? __ldg(p.value_scales + at) : 0;
    if ((r & 15) == 0) tile[L::WS_BAD + (r >> 4)] = tok < seq_len && b < 0;
  }
}

// Bytes of one workspace tile at head dim D (0 where the prefill kernel does not run: D > 128).
inline long long prefill_ws_tile_bytes(int D, bool key_e4m3) {
  long long bytes = 0;
  for_head_dim(D, [&](auto d) {
    constexpr int DD = decltype(d)::value;
    if constexpr (DD <= 128) bytes = key_e4m3 ? PrefillLayout<DD, true, true>::WS_TILE : PrefillLayout<DD, false, true>::WS_TILE;
  });
  return bytes;
}

// The workspace pass before the prefill kernel (kWs): grid (ws_steps, num_seqs * num_kv_heads).
template <int D, bool kE4m3>
cudaError_t launch_prefill_workspace(const AttnParams& p, cudaStream_t stream) {
  return launch_programmatic(prefill_workspace_kernel<D, kE4m3>,
                             dim3(p.ws_steps, p.num_seqs * p.num_kv_heads), dim3(128), 0, stream, p);
}

}  // namespace cuda_fp4
}  // namespace turboquant
