// turboquant FP4 paged attention for gfx950 (MI355X), in the shape of AITER's pa_v1:
// 256 threads = 4 wavefronts of 64, one workgroup per (sequence, partition of 256 tokens,
// kv head), per-partition exp_sums / max_logits / tmp_out, then a reduce kernel.
//
// Cache (DESIGN.md section 1): key/value uint8 [num_blocks, num_kv_heads, block_size, HEAD/2]
// of packed E2M1 codes (even element in the low nibble), scales uint8
// [num_blocks, block_size, num_kv_heads] of E8M0 bytes, one per (token, kv head).
//
// QK^T: v_mfma_scale_f32_16x16x128_f8f6f4 with A = K (16 tokens) and B = Q (16 query heads
// of one GQA group) in FP8 E4M3, so a lane's accumulator holds logits of one query head.
//   USE_NATIVE_FP4_MFMA: A is the cache's FP4 bytes as they are (cbsz = 4) and scale_a is the
//     token's E8M0 byte from the cache: the instruction applies the cache scale itself.
//   LUT: the FP4 codes are decoded to E4M3 through a 16-entry table (cbsz = 0); scale_a is
//     still the cache byte, exact because one scale covers the whole row.
//   Q is scaled by one E8M0 power of two per query head (largest |q| <= 448) and split into
//   two E4M3 terms, q = hi + lo / 16, each its own MFMA with scale_b = the head's byte (hi)
//   or that byte - 4 (lo): about 8 significant bits instead of E4M3's 4. With P split the
//   same way this doubles the MFMAs (16 instead of 8 per wave and partition at head size
//   128), which a kernel bound by memory does not feel. Every scale operand is the same byte
//   in all four K groups of a row, so the result does not depend on how the hardware maps
//   FP8 K groups to scale blocks.
// PV: the same instruction, FP8 x FP8, K = tokens. V's codes are decoded to E4M3 (exact)
// without their scale; the per-token V scale is folded into the probabilities in the log
// domain (y = logit * log2(e) + vscale - 127, p' = 2^(y - ceil(max y)) <= 1), p' is split into
// two E4M3 terms like Q, the remaining per-head power of two is P's scale_a byte and the rest
// a float multiply at the end.
// Tokens past seq_len are removed by selection: their K fragment and scale and V codes are
// replaced by constants, their logits by -inf (so their P bytes are 2^-inf = 0); no garbage
// byte is ever multiplied.
//
// Accuracy transforms (CONTRACT.md section 2; turboquant/reference.py defines them), each on
// only when its argument is given, all in fp32 and fused into this kernel (no extra pass):
//   - state record (seq_state [num_slots, num_kv_heads, 5, HEAD], slot r = state_ids[seq]):
//     q' = q * lam_r in the prologue. A slot outside [0, num_slots) is never read: the
//     sequence's partials are NaN, so its output rows are. With a soft cap the logit is
//     scale * (q'.k' + q.m_r): q.m_r is one more head_sum in the prologue.
//   - rotation (rotation_signs [HEAD] of +-1): q' = fwht(q' * s) * HEAD^-0.5 in the prologue,
//     in registers, in the Q operand's own layout: register qv[c][16b + j] of the lane in K
//     group g = lane / 16 holds element 128c + 64b + 16g + j, so butterfly stages h = 1, 2,
//     4, 8 pair registers of one lane, h = 16 and 32 pair lanes l and l ^ h (one shuffle per
//     value), h = 64 and 128 pair registers again: the stages run in the reference's order
//     h = 1 .. HEAD/2 with the same fp32 roundings. The output is un-rotated per partition
//     (the reduce is linear): o = fwht(o') * HEAD^-0.5 * s in the epilogue, where each wave
//     owns whole query heads and lane l holds elements 64j + l (stages h < 64 pair lanes,
//     h >= 64 registers), again in the reference's order.
//   - sink: position 0 is removed from the FP4 stream by selection (its scales are staged as
//     constants and its logit replaced by -inf, so its P bytes are 0; its K and V codes are
//     finite FP4 and meet only those constants), and in partition 0 its fp32 key and value
//     from the record are merged into the partition's softmax state as one more key:
//     m' = max(m, x0), l' = l e^(m - m') + e^(x0 - m'), o' = (o l e^(m - m') + e^(x0 - m') v0) / l'.
//     x0 = q'.k0 uses the fp32 q' (not its E4M3 terms); v0 is added in fp32 in the epilogue.
//     A sequence of one token is the sink alone: o' = v0 exactly.
// The epilogue stages the partition's fp32 output o'[head][element] in LDS (over the V tile,
// which is dead by then) so that one wave holds whole heads for the sink term, the NaN of a
// bad slot and the un-rotation, and stores each head row as consecutive elements.
#pragma once

#include "tq_fp4_platform.cuh"

namespace tq {

constexpr int kThreads = 256;
constexpr int kWaveSize = 64;
constexpr int kWaves = kThreads / kWaveSize;
constexpr int kPartition = 256;                       // tokens per workgroup (pa_v1's T_PAR_SIZE)
constexpr int kTokensPerWave = kPartition / kWaves;   // QK: each wave owns 64 tokens
constexpr int kTile = 16;                             // MFMA M = N = 16
constexpr int kTilesPerWave = kTokensPerWave / kTile; // 4 QK MFMAs per 128 head elements
constexpr int kMfmaK = 128;                           // MFMA K: head elements (QK) or tokens (PV)
constexpr int kPvSteps = kPartition / kMfmaK;         // 2 PV K-steps per partition
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

// A = K as FP4 (cbsz 4, only the first 4 dwords are read), B = Q as FP8 (blgp 0).
TQ_HD f32x4 mfma_qk_fp4_fp8(u32x4 a_fp4, i32x8 b_fp8, f32x4 c, int scale_a, int scale_b) {
  const i32x8 a = {int(a_fp4[0]), int(a_fp4[1]), int(a_fp4[2]), int(a_fp4[3]), 0, 0, 0, 0};
#if defined(TQ_HOST_SIM)
  return sim::mfma_scale_16x16x128(4, 0, a, b_fp8, c, scale_a, scale_b);
#elif !TQ_GFX950
  __builtin_trap();
#else
  return __builtin_amdgcn_mfma_scale_f32_16x16x128_f8f6f4(a, b_fp8, c, 4, 0, 0, scale_a, 0,
                                                          scale_b);
#endif
}

// A and B both FP8 E4M3 (cbsz 0, blgp 0): QK on the LUT path, and PV on both paths.
TQ_HD f32x4 mfma_fp8_fp8(i32x8 a_fp8, i32x8 b_fp8, f32x4 c, int scale_a, int scale_b) {
#if defined(TQ_HOST_SIM)
  return sim::mfma_scale_16x16x128(0, 0, a_fp8, b_fp8, c, scale_a, scale_b);
#elif !TQ_GFX950
  __builtin_trap();
#else
  return __builtin_amdgcn_mfma_scale_f32_16x16x128_f8f6f4(a_fp8, b_fp8, c, 0, 0, 0, scale_a, 0,
                                                          scale_b);
#endif
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
// (codes & 7) plus the sign bit (code & 8 -> bit 7) per 4 codes.
struct E4m3x8 { uint32_t lo, hi; };
TQ_HD uint32_t fp4x4_to_e4m3x4(uint32_t four_codes_in_16_bits) {
  const uint32_t x = four_codes_in_16_bits;
  const uint32_t spread = (x & 0xFu) | ((x & 0xF0u) << 4) | ((x & 0xF00u) << 8) | ((x & 0xF000u) << 12);
  return perm_b32(kE4m3MagHi, kE4m3MagLo, spread & 0x07070707u) | ((spread & 0x08080808u) << 4);
}
TQ_HD E4m3x8 fp4x8_to_e4m3x8(uint32_t w) {
  return {fp4x4_to_e4m3x4(w & 0xFFFFu), fp4x4_to_e4m3x4(w >> 16)};
}

// Smallest E8M0 exponent byte s with amax / 2^(s-127) <= 448 (the largest E4M3): Q's scale.
TQ_HD int q_scale_byte(float amax) {
  if (amax == 0.0f) return kE8m0One;
  if (!(amax <= 3.0e38f)) return 255;                 // Inf or NaN in the query row
  const float r = amax * (1.0f / 448.0f);
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

// Wave-wide max / sum over the four lanes that share a query head (lanes l, l^16, l^32, l^48).
TQ_HD float head_max(float v) {
  v = fmax_f32(v, wave_shfl_xor(v, 16));
  return fmax_f32(v, wave_shfl_xor(v, 32));
}
TQ_HD float head_sum(float v) {
  v += wave_shfl_xor(v, 16);
  return v + wave_shfl_xor(v, 32);
}

template <int HEAD>
struct PartitionLds {
  static_assert(kTile * (HEAD + 4) * 4 <= HEAD * kMfmaK, "obuf fits in vt");
  int64_t row_offset[kPartition];  // byte offset of the token's row, block and slot applied
  uint8_t kscale[kPartition];      // K E8M0 byte of the token (127 past seq_len)
  uint8_t vscale[kPartition];      // V E8M0 byte of the token (127 past seq_len)
  float red[3][kWaves][kTile];     // per wave and head: max logit, max y, V NaN flag
  float red_sum[kWaves][kTile];    // per wave and head: sum of exp(logit - max)
  float post[kTile];               // per head: float factor applied to the PV accumulator
  float sinkw[kTile];              // per head: weight of the sink value (partition 0, sink on)
  uint8_t p8[2][kTile][kPartition];  // P as two E4M3 terms (hi, lo), [term][head][token]
  union {
    uint8_t vt[HEAD][kMfmaK];      // V of one PV K-step as E4M3, transposed: [element][token]
    float obuf[kTile][HEAD + 4];   // epilogue: the partition's fp32 output o'[head][element]
  };                               // (rows padded: the 4 head groups of a wave hit other banks)
};

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

// grid (num_seqs, max_num_partitions, num_kv_heads)  block (256)
template <class Scalar, int HEAD, int BLOCK_SIZE, int GQA, bool USE_NATIVE_FP4_MFMA>
TQ_KERNEL(kThreads, kThreads) void tq_fp4_pa_partition_kernel(
    const uint16_t* __restrict__ query,       // [num_seqs, num_kv_heads * GQA, HEAD] Scalar, row stride q_stride
    const uint8_t* __restrict__ key_cache,    // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD/2]
    const uint8_t* __restrict__ value_cache,  // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD/2]
    const uint8_t* __restrict__ key_scales,   // [num_blocks, BLOCK_SIZE, num_kv_heads]
    const uint8_t* __restrict__ value_scales, // [num_blocks, BLOCK_SIZE, num_kv_heads]
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,         // [num_seqs]
    float* __restrict__ exp_sums,             // [num_seqs, num_kv_heads * GQA, max_num_partitions]
    float* __restrict__ max_logits,           // [num_seqs, num_kv_heads * GQA, max_num_partitions]
    uint16_t* __restrict__ tmp_out,           // [num_seqs, num_kv_heads * GQA, max_num_partitions, HEAD] Scalar
    float scale, float logits_soft_cap, int max_blocks_per_seq, int max_num_partitions,
    int num_kv_heads, int q_stride, int64_t kv_block_stride, int kv_head_stride,
    int kv_seq_stride,
    const float* __restrict__ rotation_signs, // [HEAD] of +-1, or nullptr: no rotation
    const float* __restrict__ seq_state,      // [num_slots, num_kv_heads, 5, HEAD], or nullptr: no record
    const int* __restrict__ state_ids,        // [num_seqs]: each sequence's slot (read with seq_state)
    int num_slots, int sink) {                // sink != 0: position 0 from the record (needs seq_state)
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head size 64, 128 or 256");
  static_assert(GQA >= 1 && GQA <= kTile, "one MFMA column per query head of the group");
  static_assert(BLOCK_SIZE >= 16 && BLOCK_SIZE <= kPartition && (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0,
                "block size a power of two in [16, 256]");
  constexpr int kRowBytes = HEAD / 2;                         // packed FP4 bytes per token row
  constexpr int kQkSteps = (HEAD + kMfmaK - 1) / kMfmaK;      // MFMAs per 16-token tile
  constexpr int kNTilesPerWave = HEAD / kTile / kWaves;       // PV output tiles per wave
  constexpr int kVDwordsPerRow = kRowBytes / 4;               // V decode: 8 codes per dword
  constexpr int kVUnits = (kMfmaK / 4) * kVDwordsPerRow;      // (4 tokens x 1 dword) units per K-step

  const int seq = block_id_x();
  const int part = block_id_y();
  const int kvh = block_id_z();
  const int tid = thread_id();
  const int wave = tid / kWaveSize;
  const int lane = tid % kWaveSize;
  const int seq_len = seq_lens[seq];
  const int part_start = part * kPartition;
  if (part_start >= seq_len) return;  // the whole workgroup leaves together
  const int num_heads = num_kv_heads * GQA;
  const int last_block = (seq_len - 1) / BLOCK_SIZE;
  // The sequence's state record; a slot outside [0, num_slots) is never read (NaN output).
  const bool has_state = seq_state != nullptr;
  const int state_slot = has_state ? state_ids[seq] : 0;
  const bool state_bad = has_state && (state_slot < 0 || state_slot >= num_slots);
  const float* record = (has_state && !state_bad)
      ? seq_state + (int64_t(state_slot) * num_kv_heads + kvh) * (kStateRows * HEAD) : nullptr;
  const bool smooth_cap = has_state && logits_soft_cap > 0.0f;  // logit gets q.m back
  const bool sink_here = sink != 0 && part == 0;  // this partition holds position 0
  // Positions the FP4 stream serves: [first_pos, seq_len). With the sink, position 0 comes
  // from the record: its scales are staged as constants and its logit and P bytes replaced by
  // selection (its K and V codes are finite and meet only the replaced values). One unsigned
  // compare per token (a position below first_pos wraps around): a second compare per token
  // kept masks live across the softmax and cost SGPR spills.
  const int first_pos = sink != 0 ? 1 : 0;
  const uint32_t served_len = uint32_t(seq_len - first_pos);
  auto visible = [&](int pos) { return uint32_t(pos - first_pos) < served_len; };

  TQ_LDS(PartitionLds<HEAD>, lds);

  // Stage the partition's token rows and scales: thread tid owns token part_start + tid.
  {
    const int tok = part_start + tid;
    const bool live = tok < seq_len;
    const int logical = live ? tok / BLOCK_SIZE : last_block;
    const int64_t blk = block_tables[int64_t(seq) * max_blocks_per_seq + logical];
    const int slot = tok % BLOCK_SIZE;
    lds->row_offset[tid] = blk * kv_block_stride + int64_t(slot) * kv_seq_stride + int64_t(kvh) * kv_head_stride;
    const int64_t sidx = (blk * BLOCK_SIZE + slot) * num_kv_heads + kvh;
    const bool served = live && visible(tok);  // position 0 with the sink: constant scales
    lds->kscale[tid] = served ? key_scales[sidx] : uint8_t(kE8m0One);
    lds->vscale[tid] = served ? value_scales[sidx] : uint8_t(kE8m0One);
  }

  // Q as the B operand: lane (column n = query head of the group, K group g) holds head
  // elements 128c + mfma_fp8_k(g, j) as E4M3 with the head's E8M0 scale.
  const int qn = mfma_row(lane);
  const int qg = mfma_kgroup(lane);
  const bool q_live = qn < GQA;
  const uint16_t* qrow = query + int64_t(seq) * q_stride + int64_t(kvh * GQA + (q_live ? qn : 0)) * HEAD;
  float qv[kQkSteps][32];
  constexpr int kQRegs = HEAD < kMfmaK ? 16 : 32;  // registers j of qv that hold head elements
  float qdm = 0.0f;  // q.m of the original q (soft cap with a record only), this lane's part
  for (int c = 0; c < kQkSteps; ++c)
    for (int j = 0; j < 32; ++j) {
      const int e = c * kMfmaK + mfma_fp8_k(qg, j);
      const bool in = e < HEAD;
      float x = (q_live && in) ? Scalar::to_float(qrow[e]) : 0.0f;
      if (has_state && in) {
        if (smooth_cap) qdm += x * record_at<HEAD>(record, kKeyCenter, e);
        x *= record_at<HEAD>(record, kKeyScale, e);  // q' = q * lam
      }
      if (rotation_signs != nullptr && in) x *= rotation_signs[e];
      qv[c][j] = x;
    }
  if (smooth_cap) qdm = head_sum(qdm);
  if (rotation_signs != nullptr) {
    // q' = fwht(q' * s) * HEAD^-0.5, stages h = 1 .. HEAD/2 in order (see the design note).
    for (int h = 1; h < 16 && h < HEAD; h *= 2)
      for (int c = 0; c < kQkSteps; ++c)
        for (int j = 0; j < kQRegs; ++j)
          if ((j & h) == 0) butterfly(qv[c][j], qv[c][j + h]);
    for (int h = 16; h < 64 && h < HEAD; h *= 2)
      for (int c = 0; c < kQkSteps; ++c)
        for (int j = 0; j < kQRegs; ++j) qv[c][j] = butterfly_xor(qv[c][j], lane, h);
    if constexpr (HEAD > 64)
      for (int c = 0; c < kQkSteps; ++c)
        for (int j = 0; j < 16; ++j) butterfly(qv[c][j], qv[c][j + 16]);
    if constexpr (HEAD > 128)
      for (int j = 0; j < 32; ++j) butterfly(qv[0][j], qv[kQkSteps - 1][j]);
    for (int c = 0; c < kQkSteps; ++c)
      for (int j = 0; j < kQRegs; ++j) qv[c][j] *= rotation_norm<HEAD>();
  }
  // The sink's logit from the fp32 q' (partition 0 only): scale * (q'.k0 + q.m), soft-capped.
  float sink_logit = 0.0f;
  if (sink_here) {
    float dot = 0.0f;
    for (int c = 0; c < kQkSteps; ++c)
      for (int j = 0; j < kQRegs; ++j)
        dot += qv[c][j] * record_at<HEAD>(record, kSinkKey, c * kMfmaK + mfma_fp8_k(qg, j));
    sink_logit = (head_sum(dot) + qdm) * scale;
    if (logits_soft_cap > 0.0f) sink_logit = soft_cap(sink_logit, logits_soft_cap);
  }
  float amax = 0.0f;
  for (int c = 0; c < kQkSteps; ++c)
    for (int j = 0; j < 32; ++j) amax = fmax_f32(amax, fabs_f32(qv[c][j]));
  amax = head_max(amax);
  const int qscale = q_scale_byte(amax);
  const int qscale_lo = lo_scale_byte(qscale);
  i32x8 q8[kQkSteps], q8lo[kQkSteps];
  for (int c = 0; c < kQkSteps; ++c)
    for (int w = 0; w < 8; ++w) {
      const E4m3Split q = split_e4m3x4(ldexp_f32(qv[c][4 * w], kE8m0One - qscale),
                                       ldexp_f32(qv[c][4 * w + 1], kE8m0One - qscale),
                                       ldexp_f32(qv[c][4 * w + 2], kE8m0One - qscale),
                                       ldexp_f32(qv[c][4 * w + 3], kE8m0One - qscale));
      q8[c][w] = int(q.hi);
      q8lo[c][w] = qscale >= 4 ? int(q.lo) : 0;
    }
  block_barrier();  // staged rows and scales visible

  // QK: wave w, tile t: A row r is token 64w + 16t + r of the partition.
  const int kr = mfma_row(lane);
  const int kg = mfma_kgroup(lane);
  float logit[kTilesPerWave][4];
  for (int t = 0; t < kTilesPerWave; ++t) {
    const int ktok = wave * kTokensPerWave + t * kTile + kr;
    const bool klive = part_start + ktok < seq_len;
    const uint8_t* krow = key_cache + lds->row_offset[ktok];
    const int kscale = lds->kscale[ktok];
    f32x4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = 0; c < kQkSteps; ++c) {
      const int base = c * kFp4BytesPerK;
      if constexpr (USE_NATIVE_FP4_MFMA) {
        const int off = base + mfma_fp4_first_byte(kg);
        const u32x4 zero = {0u, 0u, 0u, 0u};
        const u32x4 a = (klive && off < kRowBytes) ? load_u32x4(krow + off) : zero;
        acc = mfma_qk_fp4_fp8(a, q8[c], acc, kscale, qscale);
        acc = mfma_qk_fp4_fp8(a, q8lo[c], acc, kscale, qscale_lo);
      } else {
        // FP8 operand bytes 0..15 = elements 16g.., bytes 16..31 = elements 64 + 16g..:
        // 8 packed bytes each, at base + 8g and base + 32 + 8g.
        i32x8 a = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int h = 0; h < 2; ++h) {
          const int off = base + 32 * h + 8 * kg;
          const uint64_t codes = (klive && off < kRowBytes) ? load_u64(krow + off) : 0u;
          const E4m3x8 d0 = fp4x8_to_e4m3x8(uint32_t(codes));
          const E4m3x8 d1 = fp4x8_to_e4m3x8(uint32_t(codes >> 32));
          a[4 * h + 0] = int(d0.lo);
          a[4 * h + 1] = int(d0.hi);
          a[4 * h + 2] = int(d1.lo);
          a[4 * h + 3] = int(d1.hi);
        }
        acc = mfma_fp8_fp8(a, q8[c], acc, kscale, qscale);
        acc = mfma_fp8_fp8(a, q8lo[c], acc, kscale, qscale_lo);
      }
    }
    for (int i = 0; i < 4; ++i) logit[t][i] = acc[i];
  }

  // Softmax statistics. Lane holds head mfma_out_col(lane), tokens 64w + 16t + mfma_out_row(lane, i).
  const int head = mfma_out_col(lane);
  const bool head_live = head < GQA;
  float mx = -__builtin_inff(), ymax = -__builtin_inff(), vnan = 0.0f;
  float y[kTilesPerWave][4];
  for (int t = 0; t < kTilesPerWave; ++t)
    for (int i = 0; i < 4; ++i) {
      const int tok = wave * kTokensPerWave + t * kTile + mfma_out_row(lane, i);
      const bool live = head_live && visible(part_start + tok);
      float x = (logit[t][i] + qdm) * scale;
      if (logits_soft_cap > 0.0f) x = soft_cap(x, logits_soft_cap);
      const int vs = lds->vscale[tok];
      logit[t][i] = live ? x : -__builtin_inff();
      y[t][i] = live ? x * kLog2e + float(vs - kE8m0One) : -__builtin_inff();
      vnan = (live && vs == 255) ? 1.0f : vnan;
      mx = fmax_f32(mx, logit[t][i]);
      ymax = fmax_f32(ymax, y[t][i]);
    }
  mx = head_max(mx);
  ymax = head_max(ymax);
  vnan = head_max(vnan);
  if (lane < kTile) {
    lds->red[0][wave][lane] = mx;
    lds->red[1][wave][lane] = ymax;
    lds->red[2][wave][lane] = vnan;
  }
  block_barrier();
  mx = lds->red[0][0][head];
  ymax = lds->red[1][0][head];
  vnan = lds->red[2][0][head];
  for (int w = 1; w < kWaves; ++w) {
    mx = fmax_f32(mx, lds->red[0][w][head]);
    ymax = fmax_f32(ymax, lds->red[1][w][head]);
    vnan = fmax_f32(vnan, lds->red[2][w][head]);
  }
  // The PV accumulator of head h is sum_t p'_t * v4_t * 2^(pscale - 127) with
  // p'_t = 2^(logit_t*log2e + vscale_t - 127 - ytop), so the partition output
  // sum_t exp(logit_t - mx) * v_t / l is acc * 2^(tpow - (pscale - 127)) / l, tpow = ytop - mx*log2e.
  // The lane's head is also its row of P in the PV MFMA: each lane knows its own pscale.
  const float ytop = ceil_f32(ymax);
  const float tpow = ytop - mx * kLog2e;
  const float fl = floor_f32(tpow);
  const int ip = (head_live && fl == fl) ? (fl < -127.0f ? 0 : (fl > 127.0f ? 254 : int(fl) + kE8m0One)) : kE8m0One;
  const int pscale = vnan > 0.0f ? 255 : ip;
  const int pscale_lo = lo_scale_byte(pscale);
  const float mx_safe = mx == -__builtin_inff() ? 0.0f : mx;
  const float ytop_safe = ytop == -__builtin_inff() ? 0.0f : ytop;
  float lsum = 0.0f;
  for (int t = 0; t < kTilesPerWave; ++t)
    for (int i = 0; i < 4; ++i) {
      const int tok = wave * kTokensPerWave + t * kTile + mfma_out_row(lane, i);
      // Dead tokens and heads hold logit = y = -inf from the loop above: exp2 gives 0 and the
      // P bytes 0 (mx_safe, ytop_safe: a head with no FP4 token, the sink alone, gets 0s too).
      lsum += exp2_f32((logit[t][i] - mx_safe) * kLog2e);
      // p' = 2^(y - ytop) <= 1 as hi + lo / 16; dead tokens and heads are the constant 0.
      const E4m3Split p = split_e4m3x4(exp2_f32(y[t][i] - ytop_safe), 0.0f, 0.0f, 0.0f);
      lds->p8[0][head][tok] = uint8_t(p.hi);
      lds->p8[1][head][tok] = uint8_t(pscale >= 4 ? p.lo : 0u);
    }
  lsum = head_sum(lsum);
  if (lane < kTile) lds->red_sum[wave][lane] = lsum;
  block_barrier();

  // Per-head results, by the first 16 lanes of wave 0 (lane = head).
  if (wave == 0 && lane < kTile) {
    float l = 0.0f;
    for (int w = 0; w < kWaves; ++w) l += lds->red_sum[w][lane];
    float post = 0.0f, sinkw = 0.0f;
    if (head_live) {
      post = exp2_f32(tpow - float(ip - kE8m0One)) / l;
      float l_out = l, m_out = mx;
      if (sink_here) {
        // The sink as one more key: a two-way log-sum-exp merge. l == 0: no FP4 token
        // (seq_len 1), the sink alone; a NaN l (NaN logits) stays NaN.
        const bool fp4_any = !(l == 0.0f);
        m_out = fmax_f32(mx, sink_logit);
        const float alpha = fp4_any ? exp2_f32((mx - m_out) * kLog2e) : 0.0f;
        const float beta = exp2_f32((sink_logit - m_out) * kLog2e);
        l_out = l * alpha + beta;
        post = fp4_any ? post * (l * alpha / l_out) : 0.0f;
        sinkw = beta / l_out;
      }
      const int64_t idx = (int64_t(seq) * num_heads + kvh * GQA + lane) * max_num_partitions + part;
      exp_sums[idx] = l_out;
      max_logits[idx] = m_out;
    }
    lds->post[lane] = post;
    lds->sinkw[lane] = sinkw;
  }

  // PV: A = P (row = query head, K = 128 tokens of step s), B = V (column = head element).
  f32x4 out_acc[kNTilesPerWave];
  for (int n = 0; n < kNTilesPerWave; ++n) out_acc[n] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};
  for (int s = 0; s < kPvSteps; ++s) {
    block_barrier();  // previous step's vt fully read; post written
    // Decode V of tokens [128s, 128s + 128) into vt[element][token]: a unit is one dword
    // (8 codes) of 4 consecutive tokens; consecutive threads read consecutive dwords of a row.
    for (int u = tid; u < kVUnits; u += kThreads) {
      const int col = u % kVDwordsPerRow;
      const int quad = u / kVDwordsPerRow;
      uint32_t fp8[4][2];
      for (int j = 0; j < 4; ++j) {
        const int tok = s * kMfmaK + 4 * quad + j;
        const bool live = part_start + tok < seq_len;
        const uint32_t codes = live ? load_u32(value_cache + lds->row_offset[tok] + 4 * col) : 0u;
        const E4m3x8 d = fp4x8_to_e4m3x8(codes);
        fp8[j][0] = d.lo;
        fp8[j][1] = d.hi;
      }
      for (int e = 0; e < 8; ++e) {
        const int sh = 8 * (e & 3);
        const int hv = e >> 2;
        const uint32_t packed = ((fp8[0][hv] >> sh) & 0xFF) | (((fp8[1][hv] >> sh) & 0xFF) << 8) |
                                (((fp8[2][hv] >> sh) & 0xFF) << 16) | (((fp8[3][hv] >> sh) & 0xFF) << 24);
        *reinterpret_cast<uint32_t*>(&lds->vt[8 * col + e][4 * quad]) = packed;
      }
    }
    block_barrier();
    // A lane (row = head = lane % 16, K group g): P bytes of tokens 128s + mfma_fp8_k(g, j).
    const int pr = mfma_row(lane);
    const int pg = mfma_kgroup(lane);
    i32x8 a, a_lo;
    for (int w = 0; w < 8; ++w) {
      const int tok = s * kMfmaK + mfma_fp8_k(pg, 4 * w);
      a[w] = *reinterpret_cast<const int*>(&lds->p8[0][pr][tok]);
      a_lo[w] = *reinterpret_cast<const int*>(&lds->p8[1][pr][tok]);
    }
    for (int n = 0; n < kNTilesPerWave; ++n) {
      const int elem = (wave + kWaves * n) * kTile + mfma_row(lane);
      i32x8 b;
      for (int w = 0; w < 8; ++w)
        b[w] = *reinterpret_cast<const int*>(&lds->vt[elem][mfma_fp8_k(pg, 4 * w)]);
      out_acc[n] = mfma_fp8_fp8(a, b, out_acc[n], pscale, kE8m0One);
      out_acc[n] = mfma_fp8_fp8(a_lo, b, out_acc[n], pscale_lo, kE8m0One);
    }
  }

  // Output: accumulator i of tile n is head mfma_out_row(lane, i), element 16 (w + 4n) + lane % 16.
  // It goes to LDS as o'[head][element] (fp32), over vt once every wave is done with vt; rows
  // of heads past GQA are written too (no branch: post is 0 there) and never read.
  block_barrier();
  for (int n = 0; n < kNTilesPerWave; ++n)
    for (int i = 0; i < 4; ++i) {
      const int h = mfma_out_row(lane, i);
      lds->obuf[h][(wave + kWaves * n) * kTile + mfma_out_col(lane)] = out_acc[n][i] * lds->post[h];
    }
  block_barrier();
  // Wave w finishes heads w, w + 4, ..: lane l holds elements 64j + l of the head.
  constexpr int kOutPerLane = HEAD / kWaveSize;
  for (int h = wave; h < GQA; h += kWaves) {
    float o[kOutPerLane];
    for (int j = 0; j < kOutPerLane; ++j) o[j] = lds->obuf[h][kWaveSize * j + lane];
    if (sink_here) {
      const float w = lds->sinkw[h];
      for (int j = 0; j < kOutPerLane; ++j) o[j] += w * record_at<HEAD>(record, kSinkValue, kWaveSize * j + lane);
    }
    if (state_bad)
      for (int j = 0; j < kOutPerLane; ++j) o[j] = __builtin_nanf("");
    if (rotation_signs != nullptr) {
      // o = fwht(o') * HEAD^-0.5 * s: stages h = 1 .. 32 across lanes, then 64, 128 in registers.
      for (int m = 1; m < kWaveSize && m < HEAD; m *= 2)
        for (int j = 0; j < kOutPerLane; ++j) o[j] = butterfly_xor(o[j], lane, m);
      for (int m = 1; m < kOutPerLane; m *= 2)
        for (int j = 0; j < kOutPerLane; ++j)
          if ((j & m) == 0) butterfly(o[j], o[j + m]);
      for (int j = 0; j < kOutPerLane; ++j)
        o[j] = o[j] * rotation_norm<HEAD>() * rotation_signs[kWaveSize * j + lane];
    }
    const int64_t row = ((int64_t(seq) * num_heads + kvh * GQA + h) * max_num_partitions + part) * HEAD;
    for (int j = 0; j < kOutPerLane; ++j) tmp_out[row + kWaveSize * j + lane] = Scalar::from_float(o[j]);
  }
}

// One output element of the reduce: combine the partitions of (seq, head) for element d.
template <class Scalar, int HEAD>
TQ_HD void reduce_one(int seq, int head, int d, int num_heads, int max_num_partitions, int seq_len,
                      const float* exp_sums, const float* max_logits, const uint16_t* tmp_out,
                      uint16_t* out) {
  const int nparts = (seq_len + kPartition - 1) / kPartition;
  const int64_t row = int64_t(seq) * num_heads + head;
  float m = -__builtin_inff();
  for (int p = 0; p < nparts; ++p) m = fmax_f32(m, max_logits[row * max_num_partitions + p]);
  float num = 0.0f, den = 0.0f;
  for (int p = 0; p < nparts; ++p) {
    const float w = exp_sums[row * max_num_partitions + p] * exp2_f32((max_logits[row * max_num_partitions + p] - m) * kLog2e);
    den += w;
    num += w * Scalar::to_float(tmp_out[(row * max_num_partitions + p) * HEAD + d]);
  }
  out[row * HEAD + d] = Scalar::from_float(nparts == 0 ? 0.0f : num / den);
}

// grid (num_heads, num_seqs)  block (HEAD)
template <class Scalar, int HEAD>
TQ_KERNEL(HEAD, HEAD) void tq_fp4_pa_reduce_kernel(
    uint16_t* __restrict__ out,               // [num_seqs, num_heads, HEAD] Scalar
    const float* __restrict__ exp_sums,       // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ max_logits,     // [num_seqs, num_heads, max_num_partitions]
    const uint16_t* __restrict__ tmp_out,     // [num_seqs, num_heads, max_num_partitions, HEAD] Scalar
    const int* __restrict__ seq_lens,         // [num_seqs]
    int num_heads, int max_num_partitions) {
  const int head = block_id_x();
  const int seq = block_id_y();
  reduce_one<Scalar, HEAD>(seq, head, thread_id(), num_heads, max_num_partitions, seq_lens[seq],
                           exp_sums, max_logits, tmp_out, out);
}

}  // namespace tq
