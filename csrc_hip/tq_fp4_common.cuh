// turboquant AMD kernels: what the gfx950 and gfx942 kernels share: MFMA lane layouts and
// wrappers, element types, the FP4 -> E4M3 table, Q's and P's E4M3 split, row reductions, the
// Walsh-Hadamard butterflies, key ranges and row tiles. The kernels:
// tq_fp4_gfx950_attention.cuh (MI350X/MI355X) and tq_fp4_paged_attention.cuh (MI300X).
#pragma once

#include "tq_fp4_platform.cuh"

namespace tq {

constexpr int kThreads = 256;  // the largest workgroup of the kernels (the lane simulation's)
constexpr int kWaveSize = 64;
constexpr int kTile = 16;                             // MFMA M = N = 16
constexpr int kMfmaK = 128;                           // MFMA K: head elements (QK) or tokens (PV)
constexpr int kFp4BytesPerK = kMfmaK / 2;             // one MFMA K step of a packed FP4 row: 64 bytes
constexpr int kE8m0One = 127;
constexpr float kLog2e = 1.4426950408889634f;
// Rows of a state record (turboquant/smoothing.py): key center m, key scale lam, sink K, V,
// 1 / lam (the writer's row; attention never reads it).
constexpr int kKeyCenter = 0, kKeyScale = 1, kSinkKey = 2, kSinkValue = 3, kStateRows = 5;

// HEAD^-0.5 as the fp32 constant the rotation multiplies by (turboquant.rotation.rotation_norm:
// the double D^-0.5 rounded to fp32): 2^(-k/2) for HEAD = 2^k, sqrt(1/2) for odd k.
template <int HEAD>
constexpr float rotation_norm() {
  static_assert(HEAD >= 2 && (HEAD & (HEAD - 1)) == 0, "power-of-two head size");
  int k = 0;
  while ((1 << k) < HEAD) ++k;
  double r = (k & 1) ? 0.70710678118654752440 : 1.0;
  for (int i = 0; i < k / 2; ++i) r *= 0.5;
  return float(r);
}

// ---------------------------------------------------------------------------------------
// v_mfma_scale_f32_16x16x128_f8f6f4 lane layout (wave64), as documented for gfx950 and
// modelled by the lane simulation. Lane l: row/column r = l % 16, K group g = l / 16.
//   FP4 operand (format 4): the lane's 16 bytes are K [32g, 32g + 32) of row r, packed like
//     the cache (byte j = elements 32g + 2j in the low, 32g + 2j + 1 in the high nibble).
//   FP8 operand (format 0): byte j < 16 is K 16g + j, byte j >= 16 is K 64 + 16g + (j - 16).
//   scale operand: byte 0 (op_sel 0) is the E8M0 scale of K [32g, 32g + 32) of row r.
//   accumulator: element i is D[row 4 * (l / 16) + i][column l % 16].
TQ_HD int mfma_row(int lane) { return lane & 15; }
TQ_HD int mfma_kgroup(int lane) { return lane >> 4; }
TQ_HD int mfma_fp4_first_byte(int kgroup) { return 16 * kgroup; }
TQ_HD int mfma_fp8_k(int kgroup, int byte) {
  return byte < 16 ? 16 * kgroup + byte : 64 + 16 * kgroup + (byte - 16);
}
TQ_HD int mfma_out_row(int lane, int i) { return 4 * (lane >> 4) + i; }
TQ_HD int mfma_out_col(int lane) { return lane & 15; }

// v_mfma_scale_f32_16x16x128_f8f6f4 with A in format CBSZ (0: FP8 E4M3, 4: FP4 E2M1) and B
// FP8 E4M3 (blgp 0), scale bytes op_sel 0; the lane simulation's model on the host.
template <int CBSZ>
TQ_HD f32x4 mfma_scale(i32x8 a, i32x8 b_fp8, f32x4 c, int scale_a, int scale_b) {
#if defined(TQ_HOST_SIM)
  return sim::mfma_scale_16x16x128(CBSZ, 0, a, b_fp8, c, scale_a, scale_b);
#elif !TQ_GFX950
  __builtin_trap();
#else
  return __builtin_amdgcn_mfma_scale_f32_16x16x128_f8f6f4(a, b_fp8, c, CBSZ, 0, 0, scale_a, 0,
                                                          scale_b);
#endif
}

// A = K as FP4 (cbsz 4, only the first 4 dwords are read), B = Q as FP8 (blgp 0).
TQ_HD f32x4 mfma_qk_fp4_fp8(u32x4 a_fp4, i32x8 b_fp8, f32x4 c, int scale_a, int scale_b) {
  const i32x8 a = {int(a_fp4[0]), int(a_fp4[1]), int(a_fp4[2]), int(a_fp4[3]), 0, 0, 0, 0};
  return mfma_scale<4>(a, b_fp8, c, scale_a, scale_b);
}

// A and B both FP8 E4M3 (cbsz 0, blgp 0): QK on the LUT path, and PV on both paths.
TQ_HD f32x4 mfma_fp8_fp8(i32x8 a_fp8, i32x8 b_fp8, f32x4 c, int scale_a, int scale_b) {
  return mfma_scale<0>(a_fp8, b_fp8, c, scale_a, scale_b);
}

// ---------------------------------------------------------------------------------------
// Element types of the query and output (raw 16-bit storage).
struct Bf16 {
  static TQ_HD float to_float(uint16_t b) { return __builtin_bit_cast(float, uint32_t(b) << 16); }
  static TQ_HD uint16_t from_float(float f) {
    const uint32_t u = __builtin_bit_cast(uint32_t, f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);                 // nearest even
  }
};
struct Fp16 {
  static TQ_HD float to_float(uint16_t b) { return float(__builtin_bit_cast(_Float16, b)); }
  static TQ_HD uint16_t from_float(float f) { return __builtin_bit_cast(uint16_t, _Float16(f)); }
};

// 8 packed FP4 codes (4 bytes, element 0 in the low nibble) -> 8 E4M3 bytes in element order
// (lo: elements 0..3, hi: elements 4..7): kFp4ToE4m3 as one v_perm_b32 on the magnitudes
// (codes & 7) plus the sign bit (code & 8 -> bit 7) per 4 codes. gfx942: kFp4ToE4m3Fnuz, the
// sign bit only where the magnitude is not 0 (m + 7 has bit 3 set iff m >= 1), so -0 is 0x00.
struct E4m3x8 { uint32_t lo, hi; };
TQ_HD uint32_t fp4x4_to_e4m3x4(uint32_t four_codes_in_16_bits) {
  const uint32_t x = four_codes_in_16_bits;
  const uint32_t spread = (x & 0xFu) | ((x & 0xF0u) << 4) | ((x & 0xF00u) << 8) | ((x & 0xF000u) << 12);
  if constexpr (kGfx942) {
    const uint32_t mag = spread & 0x07070707u;
    return perm_b32(kFnuzMagHi, kFnuzMagLo, mag) | ((spread & (mag + 0x07070707u) & 0x08080808u) << 4);
  }
  return perm_b32(kE4m3MagHi, kE4m3MagLo, spread & 0x07070707u) | ((spread & 0x08080808u) << 4);
}
TQ_HD E4m3x8 fp4x8_to_e4m3x8(uint32_t w) {
  return {fp4x4_to_e4m3x4(w & 0xFFFFu), fp4x4_to_e4m3x4(w >> 16)};
}

// The FP8 operand (A or B) of one 128-element K step c of an FP4 row, decoded through the
// table: operand bytes 0..15 are elements 128 c + 16 g .., bytes 16..31 elements 128 c + 64 +
// 16 g .. (mfma_fp8_k), i.e. the row's packed bytes 64 c + 8 g and 64 c + 32 + 8 g, 8 each;
// bytes at or past row_bytes (head 64), or of a row not loaded (live false), are code 0.
TQ_HD i32x8 fp4_row_as_fp8_operand(const uint8_t* row, int c, int g, int row_bytes, bool live) {
  i32x8 a;
  for (int h = 0; h < 2; ++h) {
    const int off = c * kFp4BytesPerK + 32 * h + 8 * g;
    const uint64_t codes = (live && off < row_bytes) ? load_u64(row + off) : 0u;
    const E4m3x8 d0 = fp4x8_to_e4m3x8(uint32_t(codes));
    const E4m3x8 d1 = fp4x8_to_e4m3x8(uint32_t(codes >> 32));
    a[4 * h + 0] = int(d0.lo);
    a[4 * h + 1] = int(d0.hi);
    a[4 * h + 2] = int(d1.lo);
    a[4 * h + 3] = int(d1.hi);
  }
  return a;
}

// Smallest E8M0 exponent byte s with amax / 2^(s-127) <= kFp8Max (the largest E4M3: 448, or
// 240 for gfx942's FNUZ): Q's scale.
TQ_HD int q_scale_byte(float amax) {
  if (amax == 0.0f) return kE8m0One;
  if (!(amax <= 3.0e38f)) return 255;                 // Inf or NaN in the query row
  const float r = amax * (1.0f / kFp8Max);
  int e = frexp_exp_f32(r);                           // r = m * 2^e, m in [0.5, 1)
  if (ldexp_f32(1.0f, e - 1) >= r) e -= 1;            // r a power of two: 2^(e-1) suffices
  e += kE8m0One;
  return e < 1 ? 1 : (e > 254 ? 254 : e);
}

// Four floats -> two E4M3 words with x = hi + lo / 16 up to E4M3 rounding of lo (the
// difference x - hi is exact in fp32; times 16 it fits E4M3 again).
struct E4m3Split { uint32_t hi, lo; };
TQ_HD E4m3Split split_e4m3x4(float a, float b, float c, float d) {
  const uint32_t hi = pack_e4m3x4(a, b, c, d);
  float h[4];
  unpack_e4m3x4(hi, h);
  return {hi, pack_e4m3x4((a - h[0]) * 16.0f, (b - h[1]) * 16.0f, (c - h[2]) * 16.0f,
                          (d - h[3]) * 16.0f)};
}

// The E8M0 scale of the lo term of a split operand whose hi term has scale byte s: s - 4.
// NaN stays NaN; below 4 the lo term is dropped (its bytes zeroed), it is < 2^-123 anyway.
TQ_HD int lo_scale_byte(int s) { return s == 255 ? 255 : (s >= 4 ? s - 4 : kE8m0One); }

TQ_HD float soft_cap(float x, float cap) {
  // cap * tanh(x / cap) from exp2, so no libm is needed on the device.
  const float z = fabs_f32(x / cap);
  const float t = 1.0f - 2.0f / (exp2_f32(2.0f * kLog2e * z) + 1.0f);
  return x < 0.0f ? -cap * t : cap * t;
}

// Wave-wide max / sum over the four lanes that share a row (lanes l, l^16, l^32, l^48).
TQ_HD float row_max(float v) {
  v = fmax_f32(v, wave_shfl_xor(v, 16));
  return fmax_f32(v, wave_shfl_xor(v, 32));
}
TQ_HD float row_sum(float v) {
  v += wave_shfl_xor(v, 16);
  return v + wave_shfl_xor(v, 32);
}


// A state record value: row `row`, element e of the record (nullptr: a bad slot, NaN).
template <int HEAD>
TQ_HD float record_at(const float* record, int row, int e) {
  return record != nullptr ? record[row * HEAD + e] : __builtin_nanf("");
}

// One butterfly of the Walsh-Hadamard transform on a pair held by one lane:
// (a, b) -> (a + b, a - b).
TQ_HD void butterfly(float& a, float& b) {
  const float s = a + b, d = a - b;
  a = s;
  b = d;
}
// The same butterfly across lanes l and l ^ mask (one shuffle): the lane with the mask bit
// clear holds a and gets a + b, its partner holds b and gets a - b.
TQ_HD float butterfly_xor(float v, int lane, int mask) {
  const float other = wave_shfl_xor(v, mask);
  return (lane & mask) ? other - v : v + other;
}

TQ_HD int min_i32(int a, int b) { return a < b ? a : b; }
TQ_HD int max_i32(int a, int b) { return a > b ? a : b; }

// The keys [lo, hi) query token qi of a sequence with qn query tokens and seq_len keys sees
// (position p = seq_len - qn + qi, hi = p + 1; lo = hi - W with a sliding window W > 0). hi <= 0:
// none (the row's output is 0).
struct KeyRange { int lo, hi; };
TQ_HD KeyRange query_keys(int seq_len, int qn, int qi, int sliding_window) {
  const int hi = seq_len - qn + qi + 1;
  return {sliding_window > 0 ? max_i32(0, hi - sliding_window) : 0, hi};
}

// Multi-token row tiles (see the design note): the first tile of sequence s is
// base(s) = s + floor(cu[s] * GQA / 16); the tile's sequence is the last s with base(s) <= tile.
template <int GQA>
TQ_HD int tile_base(int s, int first_token) {
  return s + int(int64_t(first_token) * GQA / kTile);
}
template <int GQA>
TQ_HD int tile_sequence(const int* cu_query_lens, int num_seqs, int tile) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_base<GQA>(mid, max_i32(cu_query_lens[mid], 0)) <= tile) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}
// A row tile (see the kernels' design notes): its sequence, the sequence's query tokens
// [q0, q0 + qn), its rows first_row .. first_row + nrows - 1 (nrows <= 0: a spare tile of a
// multi-token grid), and each row's query token, head and index in [num_tokens, num_heads].
template <int GQA, bool MULTI_TOKEN>
struct RowTile {
  int seq, q0, qn, first_row, nrows;
  TQ_HD int token(int n) const { return MULTI_TOKEN ? (first_row + n) / GQA : 0; }
  TQ_HD int head(int kvh, int n) const { return kvh * GQA + (MULTI_TOKEN ? (first_row + n) % GQA : n); }
  TQ_HD int64_t out_row(int kvh, int num_kv_heads, int n) const {
    return int64_t(q0 + token(n)) * (num_kv_heads * GQA) + head(kvh, n);
  }
};
template <int GQA, bool MULTI_TOKEN>
TQ_HD RowTile<GQA, MULTI_TOKEN> row_tile(const int* cu_query_lens, int num_seqs, int num_tokens,
                                         int tile) {
  if constexpr (!MULTI_TOKEN) return {tile, tile, 1, 0, GQA};
  const int seq = tile_sequence<GQA>(cu_query_lens, num_seqs, tile);
  const int q0 = min_i32(max_i32(cu_query_lens[seq], 0), num_tokens);
  const int qn = min_i32(cu_query_lens[seq + 1], num_tokens) - q0;
  const int first_row = kTile * (tile - tile_base<GQA>(seq, q0));
  return {seq, q0, qn, first_row, min_i32(kTile, qn * GQA - first_row)};
}

// The sequence of query token `token`: the last s with cu[s] <= token.
TQ_HD int token_sequence(const int* cu_query_lens, int num_seqs, int token) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_query_lens[mid] <= token) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace tq
