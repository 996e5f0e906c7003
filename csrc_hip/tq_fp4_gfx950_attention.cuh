// turboquant FP4 paged attention for gfx950 (MI350X/MI355X): one kernel per call, one wave
// per (row tile, partition, kv head). A partition is `partition_len` tokens (a multiple of
// 128, chosen by the launcher), streamed in steps of 128 tokens with an online softmax in the
// log2 domain.
//   Prologue (transform_q_rows): the accuracy transforms of the tile's query rows (q * lam,
//    the Walsh-Hadamard rotation, q.m), the logit factor (scale * log2(e), or scale alone under
//    a soft cap), the quantization into two E4M3 terms with one E8M0 scale per row, and the
//    sink's fp32 logit, into LDS. Every partition wave of a tile repeats it (a few hundred VALU
//    per wave) instead of a pre-pass kernel whose results a second, dependent launch would wait
//    for: at small batch the launch costs more than the redone work.
// Per step:
//      QK:  8 tiles of 16 tokens, v_mfma_scale_f32_16x16x128_f8f6f4 with A = K (the cache's FP4
//           bytes as they are, or E4M3 bytes for K8V4, or FP4 decoded through a table on the LUT
//           path) and B = Q's E4M3 terms; lane l holds the logits of row l % 16 for tokens
//           16 j + 4 (l / 16) + i of tile j (i = 0..3).
//      P:   e = 2^(x - m), the running max m per row (each lane holds one row, so rescaling the
//           output is lane-local); the per-token V scale folded into P as w = 2^(vs - vb) with
//           vb the step's largest V scale byte, P' = e * w normalized by a per-row power of two,
//           split into two E4M3 terms (hi + lo / 16). A lane's 32 P bytes are exactly its B
//           operand of the PV MFMA (token order tau below): P never leaves the registers.
//      PV:  O^T += V^T P^T, A = V^T as FP4 straight from the cache bytes (LUT: E4M3), tokens
//           along K, read from LDS with the transposing read ds_read_b64_tr_b4 (LUT:
//           ds_read_b64_tr_b8), B = P^T, scale_b = the row's P scale byte; the accumulator of
//           lane l holds output elements 16 mt + 4 (l / 16) + i of row l % 16.
//    A step whose 128 tokens every live row sees takes the unmasked path (no selects); edge
//    steps (the partition's or sequence's ends, position 0 with the sink, windows, causal
//    multi-token rows) select per token. The partition writes (m, l, O / l) per row, O / l in
//    fp32, then takes its row tile's ticket (a device-scope atomic): the last partition of the
//    tile to finish reduces it, combining the partitions by their log-sum-exp, merging the sink
//    (x0, v0 from the record) and learned sinks, writing the lse and un-rotating the output
//    (the rotation is linear, so once per row instead of per partition); it leaves the ticket
//    at zero for the next call (the launcher's ticket array, zero when first allocated, is
//    therefore zero whenever a call starts).
//
// Token order tau within a step (the K index of the PV MFMA): the FP8 B operand of lane
// (n = l % 16, g = l / 16) holds K = 16 g + j (bytes j < 16) and K = 64 + 16 g + (j - 16), and
// its logits are tokens 16 t + 4 g + i. K = 64 h + 16 g + j is therefore token
// tau = 64 h + 16 (j / 4) + 4 g + j % 4: P's dword w is tile w's four logits. The V^T operand
// (FP4, lane (m, g) holds K 32 g .. 32 g + 31) follows the same tau (v_operand_token).
//
// Masking, NaN: a token outside a row's range has x = -inf (e = 0) and P' = 0 by selection, so
// no garbage byte or NaN scale reaches a row that does not see it; a NaN V scale (255) that a
// row sees makes w NaN and the row's output NaN. Tokens past the tile's keys are read from
// the tile's last block (valid memory), never from block-table entries past the sequence. A
// block-table entry outside [0, num_blocks) reads block 0 and counts as NaN scales: the rows
// that see its tokens are NaN, and no load leaves the caches.
// Subnormals: AITER builds with -fgpu-flush-denormals-to-zero. Every fp32 value here that could
// fall below 2^-126 is a weight relative to the row's or step's largest (e, w, the reduce's
// 2^(m - M)) or a Q element under 2^-126 of its row's scale, so flushing it changes nothing
// beyond fp32's own rounding; the E8M0 scales reach the MFMA and the scaled conversions as
// exponent bytes, not as fp32 values. (The lane simulation does not flush.)
// Cache layout: CONTRACT.md section 1 (key/value [num_blocks, num_kv_heads, block_size,
// HEAD/2] of E2M1 codes, K8V4 keys [.., HEAD] E4M3; scales [num_blocks, block_size,
// num_kv_heads] of E8M0 bytes).
#pragma once

#include "tq_fp4_common.cuh"

// The ISA model's hot-path build (benchmarks/isa_model.py) defines this as __builtin_assume:
// the count of a step where every row sees all 128 tokens and no soft cap is set.
#ifndef TQ_HOT_PATH_ASSUME
#define TQ_HOT_PATH_ASSUME(cond)
#endif

namespace tq {
namespace gfx950 {

constexpr int kWave = 64;
constexpr int kStep = 128;                 // tokens per online-softmax step = PV MFMA K
constexpr int kTilesPerStep = kStep / kTile;

// Per-row results of Q's transform, kept in LDS from the prologue to the reduce.
struct QRow {
  int qscale;   // E8M0 byte of Q's hi term (the lo term's is qscale - 4)
  float qadd;   // scale * q.m, in the logits' units (log2, or natural under a soft cap)
  float x0;     // the sink's logit, log2 units (-inf without a sink)
};

// Wave-wide maximum over all 64 lanes (xor stages 1 .. 32).
TQ_HD float wave_max(float v) {
  for (int m = 1; m < kWave; m *= 2) v = fmax_f32(v, wave_shfl_xor(v, m));
  return v;
}
// Wave-wide reductions over the 8 lanes of a row group (xor stages 1, 2, 4).
TQ_HD float group8_sum(float v) {
  for (int m = 1; m < 8; m *= 2) v += wave_shfl_xor(v, m);
  return v;
}
TQ_HD float group8_max(float v) {
  for (int m = 1; m < 8; m *= 2) v = fmax_f32(v, wave_shfl_xor(v, m));
  return v;
}

// The token (within a 128-token step) of K index k of the PV MFMA (tau in the design note).
TQ_HD int step_token(int k) { return 64 * (k / 64) + 16 * ((k % 16) / 4) + 4 * ((k % 64) / 16) + k % 4; }
// The token of nibble x (0..31) of the FP4 V^T operand of a lane in K group g: K = 32 g + x.
TQ_HD int v_operand_token(int g, int x) { return step_token(32 * g + x); }

// ---------------------------------------------------------------------------------------
// Q's transform, in the prologue of every partition wave (see the design note above).
// The tile's rows (at most ROWS) in passes of 8, 8 lanes per row: lane s of a row holds
// elements kQe s .. kQe s + kQe - 1 (kQe = HEAD / 8), so Q's row is two to eight 16-byte loads
// per lane, the rotation's first log2(kQe) butterfly stages are within a lane and the last
// three across the row's lanes (xor 1, 2, 4), and every row sum or maximum is 8 lanes wide: a
// few hundred VALU per wave, no dependent chain longer than three shuffles. Each wave of a row
// tile repeats it for its rows (the price of one launch instead of a pre-pass kernel and its
// dependent launch). Results: Q's two E4M3 terms per row into LDS (q8, read back below as the
// QK MFMA's B operand) and the row's QRow (qscale, q.m in logit units, the sink's logit).
template <int HEAD, int ROWS>
struct QLds {
  uint8_t q8[ROWS][2][HEAD];  // E4M3 hi, lo terms of each row
};

template <class Scalar, int HEAD, int ROWS, class RowQuery>
TQ_HD void transform_q_rows(QLds<HEAD, ROWS>* ql, QRow* rows, int nrows, RowQuery row_query,
                            float scale, float logits_soft_cap, const float* rotation_signs,
                            const float* record, bool has_state, int sink, int lane) {
  constexpr int kQe = HEAD / 8;
  static_assert(kQe % 8 == 0, "whole 16-byte query loads per lane");
  const int s = lane % 8;
  // The per-kv-head vectors, the same for every row: the lane's kQe elements.
  auto vec = [&](const float* v, float* dst) {
    for (int j = 0; j < kQe; j += 4) {
      const f32x4 w = *reinterpret_cast<const f32x4*>(v + kQe * s + j);
      for (int i = 0; i < 4; ++i) dst[j + i] = w[i];
    }
  };
  float center[kQe], lam[kQe], sign[kQe], k0[kQe];
  const bool bad_record = has_state && record == nullptr;  // a bad slot: NaN rows
  if (has_state && !bad_record) {
    vec(record + kKeyCenter * HEAD, center);
    vec(record + kKeyScale * HEAD, lam);
    if (sink != 0) vec(record + kSinkKey * HEAD, k0);
  }
  if (rotation_signs != nullptr) vec(rotation_signs, sign);
  // The MFMA's logits come out in the units the partition kernel works in: log2 (x = scale *
  // log2(e) * q.k), or natural under a soft cap (the cap acts there).
  const float f = logits_soft_cap > 0.0f ? scale : scale * kLog2e;
  for (int pass = 0; pass < (ROWS + 7) / 8; ++pass) {
    const int r = 8 * pass + lane / 8;
    if (8 * pass >= nrows) break;  // uniform
    const bool live = r < nrows;
    float q[kQe];
    const uint16_t* qp = row_query(live ? r : 0) + kQe * s;
    for (int j = 0; j < kQe; j += 8) {
      const u32x4 w = load_u32x4(reinterpret_cast<const uint8_t*>(qp + j));
      for (int i = 0; i < 4; ++i) {
        q[j + 2 * i] = Scalar::to_float(uint16_t(w[i]));
        q[j + 2 * i + 1] = Scalar::to_float(uint16_t(w[i] >> 16));
      }
    }
    float qdm = 0.0f;
    if (has_state) {
      for (int j = 0; j < kQe; ++j) {
        qdm += bad_record ? __builtin_nanf("") : q[j] * center[j];
        q[j] = bad_record ? __builtin_nanf("") : q[j] * lam[j];
      }
      qdm = group8_sum(qdm);
    }
    if (rotation_signs != nullptr) {
      // q' = fwht(q' * s) * HEAD^-0.5, stages h = 1 .. HEAD/2 in the reference's order: in the
      // lane up to kQe / 2, then across lanes.
      for (int j = 0; j < kQe; ++j) q[j] *= sign[j];
      for (int h = 1; h < kQe; h *= 2)
        for (int j = 0; j < kQe; ++j)
          if ((j & h) == 0) butterfly(q[j], q[j + h]);
      for (int m = 1; m < 8; m *= 2)
        for (int j = 0; j < kQe; ++j) q[j] = butterfly_xor(q[j], lane, m);
      for (int j = 0; j < kQe; ++j) q[j] *= rotation_norm<HEAD>();
    }
    float x0 = -__builtin_inff();
    if (sink != 0) {
      float d = 0.0f;
      // (no record at all, a bad slot or none passed: the sink's logit is NaN)
      for (int j = 0; j < kQe; ++j) d += q[j] * (record == nullptr ? __builtin_nanf("") : k0[j]);
      x0 = (group8_sum(d) + qdm) * scale;
      if (logits_soft_cap > 0.0f) x0 = soft_cap(x0, logits_soft_cap);
      x0 *= kLog2e;
    }
    float amax = 0.0f, nan = 0.0f;
    for (int j = 0; j < kQe; ++j) {
      q[j] *= f;
      amax = fmax_f32(amax, fabs_f32(q[j]));
      nan = q[j] == q[j] ? nan : 1.0f;  // fmax drops NaN: look for it apart
    }
    amax = group8_max(amax);
    const int qscale = group8_max(nan) > 0.0f ? 255 : q_scale_byte(amax);
    if (live) {
      for (int j = 0; j < kQe; j += 4) {
        const E4m3Split t = split_e4m3x4(ldexp_f32(q[j], kE8m0One - qscale),
                                         ldexp_f32(q[j + 1], kE8m0One - qscale),
                                         ldexp_f32(q[j + 2], kE8m0One - qscale),
                                         ldexp_f32(q[j + 3], kE8m0One - qscale));
        *reinterpret_cast<uint32_t*>(&ql->q8[r][0][kQe * s + j]) = t.hi;
        *reinterpret_cast<uint32_t*>(&ql->q8[r][1][kQe * s + j]) = qscale >= 4 ? t.lo : 0u;
      }
      if (s == 0) rows[r] = {qscale, qdm * f, x0};
    }
  }
}

// ---------------------------------------------------------------------------------------
// The partition kernel.

template <int HEAD, bool NATIVE>
struct StepLds {
  uint8_t v[kStep * (NATIVE ? HEAD / 2 : HEAD)];  // the step's V rows: FP4 [token][HEAD/2],
                                                  // or E4M3 [token][HEAD] (LUT)
  float w[kStep];  // 2^(vs - vb) per token of the step (NaN for a NaN scale, 0 unserved)
};

// The partition kernel's LDS: Q's terms (prologue) and the step's V rows share their bytes;
// the rows' records stay for the reduce.
template <int HEAD, bool NATIVE, int ROWS>
struct PartitionLds {
  union {
    QLds<HEAD, ROWS> q;
    StepLds<HEAD, NATIVE> step;
  };
  QRow rows[ROWS];
};

// The FP4 V^T operand of output tile mt (elements 16 mt ..) from the step's V rows in LDS
// (row_bytes each): lane (m, g) gets nibble x = element 16 mt + m of token
// v_operand_token(g, x), by two transposing reads: in read h, lane k of each 16-lane group
// addresses the 8 bytes (elements 16 mt .. 16 mt + 15) of token v_operand_token(g, 16 h + k).
TQ_HD u32x4 v_operand_fp4(const uint8_t* v, int row_bytes, int mt, int lane) {
  const int k = lane & 15, g = lane >> 4;
  u32x4 a;
  for (int h = 0; h < 2; ++h) {
    const uint64_t d = lds_read_tr4_b64(v + v_operand_token(g, 16 * h + k) * row_bytes + 8 * mt);
    a[2 * h] = uint32_t(d);
    a[2 * h + 1] = uint32_t(d >> 32);
  }
  return a;
}

// The same operand as E4M3 bytes (LUT path; V rows of row_bytes decoded bytes in LDS): lane
// (m, g) gets byte j = element 16 mt + m of the token of K = 16 g + j (j < 16) or
// 64 + 16 g + j - 16, by four tr8 reads: read r gives bytes 8 r .. 8 r + 7, and the group's
// lane s addresses elements 16 mt + 8 (s % 2) .. + 7 of the token of byte 8 r + s / 2.
TQ_HD i32x8 v_operand_fp8(const uint8_t* v, int row_bytes, int mt, int lane) {
  const int s = lane & 15, g = lane >> 4;
  i32x8 a;
  for (int r = 0; r < 4; ++r) {
    const int j = 8 * r + s / 2;
    const int k = j < 16 ? 16 * g + j : 64 + 16 * g + (j - 16);
    const uint64_t d = lds_read_tr8_b64(v + step_token(k) * row_bytes + 16 * mt + 8 * (s % 2));
    a[2 * r] = int(uint32_t(d));
    a[2 * r + 1] = int(uint32_t(d >> 32));
  }
  return a;
}

// grid (row tiles, partitions, num_kv_heads)  block (64)
template <class Scalar, int HEAD, int BLOCK_SIZE, int GQA, bool NATIVE, bool MULTI_TOKEN, bool KEY_E4M3>
TQ_KERNEL(kWave, kWave) void tq_fp4_pa_gfx950_kernel(
    const uint16_t* __restrict__ query,       // [num_tokens, num_heads, HEAD] Scalar, token stride q_stride
    const uint8_t* __restrict__ key_cache,    // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD/2] (KEY_E4M3: HEAD)
    const uint8_t* __restrict__ value_cache,  // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD/2]
    const uint8_t* __restrict__ key_scales,   // [num_blocks, BLOCK_SIZE, num_kv_heads]
    const uint8_t* __restrict__ value_scales, // [num_blocks, BLOCK_SIZE, num_kv_heads]
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,         // [num_seqs]
    const int* __restrict__ cu_query_lens,    // [num_seqs + 1] with MULTI_TOKEN
    float* __restrict__ exp_sums,             // [num_tokens, num_heads, max_num_partitions]: l
    float* __restrict__ max_logits,           // [num_tokens, num_heads, max_num_partitions]: m (log2)
    float* __restrict__ tmp_out,              // [num_tokens, num_heads, max_num_partitions, HEAD] fp32
    float scale, float logits_soft_cap, int sliding_window, int max_blocks_per_seq,
    int max_num_partitions,
    int partition_len,                        // tokens per partition, a multiple of kStep
    int num_seqs, int num_tokens, int num_kv_heads, int q_stride,
    int num_blocks,                           // the caches' first dimension (block-id bound)
    int64_t kv_block_stride, int kv_head_stride, int kv_seq_stride,  // value_cache's byte strides
    int sink,                                 // != 0: position 0 comes from the record (reduce)
    int add_qm,                               // != 0: add QRow::qadd before the soft cap
    uint16_t* __restrict__ out,               // [num_tokens, num_heads, HEAD] Scalar
    float* __restrict__ lse,                  // [num_tokens, num_heads], or nullptr
    const float* __restrict__ sinks,          // [num_heads] learned sink logits, or nullptr
    const float* __restrict__ rotation_signs, // [HEAD] of +-1, or nullptr
    const float* __restrict__ seq_state,      // [num_slots, num_kv_heads, 5, HEAD], or nullptr
    const int* __restrict__ state_ids,        // [num_seqs]
    int num_slots,
    uint32_t* __restrict__ tickets) {         // [row tiles, num_kv_heads], zero when the call starts
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head size 64, 128 or 256");
  static_assert(GQA >= 1 && (MULTI_TOKEN || GQA <= kTile), "a decode tile holds the whole GQA group");
  static_assert(BLOCK_SIZE >= 16 && BLOCK_SIZE <= 256 && (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0,
                "block size a power of two in [16, 256]");
  static_assert(NATIVE || !kGfx942, "gfx950 kernel");
  constexpr int kQk = (HEAD + kMfmaK - 1) / kMfmaK;   // QK MFMA K-steps per tile
  constexpr int kMt = HEAD / kTile;                   // PV output tiles (16 elements each)
  constexpr int kVRow = HEAD / 2;                     // FP4 bytes per V row
  constexpr int kKeyRow = KEY_E4M3 ? HEAD : HEAD / 2;
  constexpr int64_t kKeyStride = KEY_E4M3 ? 2 : 1;    // key strides = value strides x this
  constexpr int kVChunks = kStep * kVRow / 16;        // 16-byte V pieces per step
  static_assert(kVChunks % kWave == 0, "whole V loads per lane");

  const int tile = block_id_x(), part = block_id_y(), kvh = block_id_z(), lane = thread_id();
  const RowTile<GQA, MULTI_TOKEN> rt = row_tile<GQA, MULTI_TOKEN>(cu_query_lens, num_seqs, num_tokens, tile);
  if (rt.nrows <= 0) return;  // a spare tile
  const int seq = rt.seq, nrows = rt.nrows;
  const int seq_len = seq_lens[seq];
  auto row_head = [&](int n) { return rt.head(kvh, n); };
  auto row_keys = [&](int n) { return query_keys(seq_len, rt.qn, rt.token(n), sliding_window); };
  auto out_row = [&](int n) { return rt.out_row(kvh, num_kv_heads, n); };
  const KeyRange tile_keys = {row_keys(0).lo, row_keys(nrows - 1).hi};
  const int p_start = part * partition_len;
  // The partitions that hold some of the tile's keys, [first_part, first_part + tile_parts):
  // each runs and takes a ticket, the last one to finish reduces the tile's rows. A tile with no
  // keys at all (hi <= 0) has none: its partition 0 reduces at once (zeros, learned sinks).
  const int first_part = tile_keys.hi > 0 ? tile_keys.lo / partition_len : 0;
  // (none either when the caller's max_seq_len is below a window's start: zeros, not garbage)
  const int tile_parts = tile_keys.hi > 0
      ? max_i32(min_i32((tile_keys.hi - 1) / partition_len + 1, max_num_partitions) - first_part, 0)
      : 0;
  const bool runs = part >= first_part && part < first_part + tile_parts;
  if (!runs && !(tile_parts == 0 && part == 0)) return;
  const int first_pos = sink != 0 ? 1 : 0;
  // The FP4 stream serves [kv_lo, tile_keys.hi); every live row sees [all_lo, all_hi).
  const int kv_lo = max_i32(tile_keys.lo, first_pos);
  const int all_lo = max_i32(row_keys(nrows - 1).lo, first_pos), all_hi = row_keys(0).hi;
  const int my_row = lane & 15, g = lane >> 4;
  const bool row_live = my_row < nrows;
  const KeyRange my_keys = row_keys(row_live ? my_row : 0);
  const int row_lo = max_i32(my_keys.lo, first_pos);
  const uint32_t row_n = uint32_t(max_i32(my_keys.hi - row_lo, 0));

  // Q's transform for the tile's rows (LDS: Q's terms, then the step's V rows in the same bytes).
  constexpr int kQRows = MULTI_TOKEN ? kTile : GQA;
  using Lds = PartitionLds<HEAD, NATIVE, kQRows>;
  TQ_LDS(Lds, lds_all);
  StepLds<HEAD, NATIVE>* const lds = &lds_all->step;
  const int slot = seq_state != nullptr ? state_ids[seq] : 0;
  const float* const record = (seq_state != nullptr && slot >= 0 && slot < num_slots)
      ? seq_state + (int64_t(slot) * num_kv_heads + kvh) * (kStateRows * HEAD) : nullptr;
  transform_q_rows<Scalar, HEAD, kQRows>(
      &lds_all->q, lds_all->rows, nrows,
      [&](int n) { return query + int64_t(rt.q0 + rt.token(n)) * q_stride + int64_t(row_head(n)) * HEAD; },
      scale, logits_soft_cap, rotation_signs, record, seq_state != nullptr, sink, lane);
  block_barrier();  // the rows' terms and records visible to every lane

  // The fused reduce's rows (see there): kRowsR of them, lane l's is l % kRowsR. Their learned
  // sink logits are loaded before the ticket, so that the atomic's wait covers them.
  constexpr int kRowsR = (MULTI_TOKEN || GQA > 8) ? 16 : GQA > 4 ? 8 : GQA > 2 ? 4 : GQA > 1 ? 2 : 1;
  auto learned_sink = [&]() {
    const int nr = lane % kRowsR;
    return sinks != nullptr ? sinks[row_head(nr < nrows ? nr : 0)] : -__builtin_inff();
  };
  float learned_raw;

  if (runs) {
  // Q's E4M3 terms as the B operand: lane (n, g) holds elements 128 c + mfma_fp8_k(g, j).
  const uint8_t* qp = lds_all->q.q8[row_live ? my_row : 0][0];
  i32x8 qhi[kQk], qlo[kQk];
  for (int c = 0; c < kQk; ++c)
    for (int h = 0; h < 2; ++h) {
      const int off = c * kMfmaK + 64 * h + 16 * g;
      const u32x4 zero = {0u, 0u, 0u, 0u};
      const u32x4 a = off < HEAD ? load_u32x4(qp + off) : zero;
      const u32x4 b = off < HEAD ? load_u32x4(qp + HEAD + off) : zero;
      for (int i = 0; i < 4; ++i) {
        qhi[c][4 * h + i] = int(a[i]);
        qlo[c][4 * h + i] = int(b[i]);
      }
    }
  const QRow qrow = lds_all->rows[row_live ? my_row : 0];
  const int qscale = qrow.qscale, qscale_lo = lo_scale_byte(qrow.qscale);
  const float qadd = add_qm != 0 ? qrow.qadd : 0.0f;
  block_barrier();  // every lane's Q terms read before the first step writes V over them

  float m_run = -__builtin_inff(), l_run = 0.0f;
  f32x4 o[kMt];
  for (int mt = 0; mt < kMt; ++mt) o[mt] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};
  const int p_end = min_i32(p_start + partition_len, tile_keys.hi);
  const int* btab = block_tables + int64_t(seq) * max_blocks_per_seq;
  const int last_block = (tile_keys.hi - 1) / BLOCK_SIZE;
  // The cache block of block-table column col, and whether the entry is one: an entry outside
  // [0, num_blocks), or a column past the table, reads block 0 (valid memory) and its tokens'
  // V scales read as NaN, so exactly the rows that see them are NaN (CONTRACT section 3).
  auto cache_block = [&](int col, bool& ok) {
    const int b = col < max_blocks_per_seq ? btab[col] : -1;
    ok = uint32_t(b) < uint32_t(num_blocks);
    return ok ? b : 0;
  };

  const uint32_t koff = uint32_t(mfma_row(lane) * kKeyStride * kv_seq_stride);  // the lane's K row
  const uint32_t kscale_off = uint32_t(mfma_row(lane) * num_kv_heads);
  for (int t0 = max_i32(p_start, (kv_lo / kStep) * kStep); t0 < p_end; t0 += kStep) {
    // Each tile's block (uniform; past the tile's keys, its last block: valid memory) gives
    // uniform row and scale addresses, computed where they are used from the block id alone
    // (few SGPRs live across the step); a lane adds its own 32-bit offset (the saddr form of
    // global loads: no 64-bit address arithmetic per lane).
    // With blocks of at least a step (the step is aligned to its length) one block serves all.
    constexpr int kBlocksPerStep = BLOCK_SIZE >= kStep ? 1 : kStep / BLOCK_SIZE;
    int blk[kBlocksPerStep];
    #pragma unroll
    for (int b = 0; b < kBlocksPerStep; ++b) {
      bool ok;  // (a bad entry: its V scales below make its tokens NaN)
      blk[b] = cache_block(min_i32((t0 + BLOCK_SIZE * b) / BLOCK_SIZE, last_block), ok);
    }
    auto tile_block = [&](int j) { return blk[kBlocksPerStep == 1 ? 0 : kTile * j / BLOCK_SIZE]; };
    auto kbase = [&](int j) {  // byte offset of tile j's first V row (K: x kKeyStride)
      return int64_t(tile_block(j)) * kv_block_stride + int64_t(kvh) * kv_head_stride +
             int64_t((t0 + kTile * j) % BLOCK_SIZE) * kv_seq_stride;
    };
    auto kscales = [&](int j) {  // tile j's first key scale byte
      return key_scales + (int64_t(tile_block(j)) * BLOCK_SIZE + (t0 + kTile * j) % BLOCK_SIZE) *
                              num_kv_heads + kvh;
    };
    const bool full = t0 >= all_lo && t0 + kStep <= all_hi;
    TQ_HOT_PATH_ASSUME(full && !(logits_soft_cap > 0.0f));
    auto served = [&](int pos) { return pos >= kv_lo && pos < tile_keys.hi; };
    auto visible = [&](int pos) { return uint32_t(pos - row_lo) < row_n; };

    // V rows of the step into LDS: load it covers kRowsPerLoad tokens from it * kRowsPerLoad,
    // lane l piece l % kLanesPerRow of token l / kLanesPerRow, at LDS piece 64 it + l (rows in
    // token order). The token's tile is uniform per load (two tiles at head 64).
    constexpr int kLanesPerRow = kVRow / 16, kRowsPerLoad = kWave / kLanesPerRow;
    #pragma unroll
    for (int it = 0; it < kStep / kRowsPerLoad; ++it) {
      const int tl = lane / kLanesPerRow, piece = lane % kLanesPerRow;
      const int tok0 = it * kRowsPerLoad;
      // (head 64: lanes 32.. take the next tile, a select of two uniform bases, no index)
      const uint8_t* tile_rows = value_cache + ((kRowsPerLoad > kTile && tl >= kTile)
                                                    ? kbase(tok0 / kTile + 1) : kbase(tok0 / kTile));
      const uint32_t off = uint32_t((tok0 % kTile + tl % kTile) * kv_seq_stride + 16 * piece);
      const u32x4 codes = load_u32x4(tile_rows + off);
      const int chunk = kWave * it + lane;
      if constexpr (NATIVE) {
        *reinterpret_cast<u32x4*>(&lds->v[16 * chunk]) = codes;
      } else {  // LUT: the 32 codes as E4M3 bytes, rows of HEAD bytes
        u32x4 e[2];
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          const E4m3x8 d = fp4x8_to_e4m3x8(codes[i]);
          e[i / 2][2 * (i % 2)] = d.lo;
          e[i / 2][2 * (i % 2) + 1] = d.hi;
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) *reinterpret_cast<u32x4*>(&lds->v[32 * chunk + 16 * h]) = e[h];
      }
    }
    float vbf;
    {
      float vs[2];
      #pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int tl = 2 * lane + k;  // per lane: its own block lookup
        const int tok = t0 + tl;
        bool ok;
        const int blk = cache_block(min_i32(tok / BLOCK_SIZE, last_block), ok);
        const int b = value_scales[(int64_t(blk) * BLOCK_SIZE + tok % BLOCK_SIZE) * num_kv_heads + kvh];
        // unserved: no weight (w = 0); a bad block id: the NaN scale byte
        vs[k] = served(t0 + tl) ? (ok ? float(b) : 255.0f) : -1.0f;
      }
      // vb: the step's largest finite V scale byte (NaN bytes 255 excluded).
      vbf = wave_max(fmax_f32(vs[0] < 255.0f ? vs[0] : 0.0f, vs[1] < 255.0f ? vs[1] : 0.0f));
      #pragma unroll
      for (int k = 0; k < 2; ++k)
        lds->w[2 * lane + k] = vs[k] < 0.0f ? 0.0f
                             : (vs[k] == 255.0f ? __builtin_nanf("") : ldexp_f32(1.0f, int(vs[k] - vbf)));
    }
    block_barrier();  // the step's V rows and weights visible to every lane

    // QK: tile j, A row r = token t0 + 16 j + r.
    f32x4 x[kTilesPerStep];
    #pragma unroll
    for (int j = 0; j < kTilesPerStep; ++j) {
      const int r = mfma_row(lane);
      const uint8_t* krow = key_cache + kKeyStride * kbase(j) + koff;
      const int kscale = kscales(j)[kscale_off];
      const u32x4 zero = {0u, 0u, 0u, 0u};
      f32x4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
      #pragma unroll
      for (int c = 0; c < kQk; ++c) {
        if constexpr (KEY_E4M3) {
          i32x8 a;
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int off = c * kMfmaK + mfma_fp8_k(g, 16 * h);
            const u32x4 w = off < kKeyRow ? load_u32x4(krow + off) : zero;
            #pragma unroll
            for (int i = 0; i < 4; ++i) a[4 * h + i] = int(w[i]);
          }
          acc = mfma_fp8_fp8(a, qhi[c], acc, kscale, qscale);
          acc = mfma_fp8_fp8(a, qlo[c], acc, kscale, qscale_lo);
        } else if constexpr (NATIVE) {
          const int off = c * kFp4BytesPerK + mfma_fp4_first_byte(g);
          const u32x4 a = off < kKeyRow ? load_u32x4(krow + off) : zero;
          acc = mfma_qk_fp4_fp8(a, qhi[c], acc, kscale, qscale);
          acc = mfma_qk_fp4_fp8(a, qlo[c], acc, kscale, qscale_lo);
        } else {
          const i32x8 a = fp4_row_as_fp8_operand(krow, c, g, kKeyRow, true);
          acc = mfma_fp8_fp8(a, qhi[c], acc, kscale, qscale);
          acc = mfma_fp8_fp8(a, qlo[c], acc, kscale, qscale_lo);
        }
      }
      x[j] = acc;
    }

    // Softmax step (lane: row my_row, tokens t0 + 16 j + 4 g + i), four logits of a tile as
    // one vector (packed v_pk_* arithmetic where the operation is linear).
    float mx = -__builtin_inff();
    #pragma unroll
    for (int j = 0; j < kTilesPerStep; ++j) {
      if (logits_soft_cap > 0.0f)
        #pragma unroll
        for (int i = 0; i < 4; ++i) x[j][i] = soft_cap(x[j][i] + qadd, logits_soft_cap) * kLog2e;
      if (!full)
        #pragma unroll
        for (int i = 0; i < 4; ++i)
          x[j][i] = visible(t0 + kTile * j + 4 * g + i) ? x[j][i] : -__builtin_inff();
      #pragma unroll
      for (int i = 0; i < 4; ++i) mx = fmax_f32(mx, x[j][i]);
    }
    mx = row_max(mx);
    const float m_new = fmax_f32(m_run, mx);
    const float m_use = m_new == -__builtin_inff() ? 0.0f : m_new;
    const float alpha = m_run == m_new ? 1.0f : exp2_fast(m_run - m_use);
    m_run = m_new;
    #pragma unroll
    for (int mt = 0; mt < kMt; ++mt) o[mt] = o[mt] * alpha;
    f32x4 lsum = {0.0f, 0.0f, 0.0f, 0.0f};
    f32x4 pw[kTilesPerStep];
    float smax = 0.0f;
    const f32x4 neg_m = {-m_use, -m_use, -m_use, -m_use};
    #pragma unroll
    for (int j = 0; j < kTilesPerStep; ++j) {
      const f32x4 t = x[j] + neg_m;
      f32x4 e;
      #pragma unroll
      for (int i = 0; i < 4; ++i) e[i] = exp2_fast(t[i]);
      lsum += e;
      pw[j] = e * *reinterpret_cast<const f32x4*>(&lds->w[kTile * j + 4 * g]);
      if (!full)
        #pragma unroll
        for (int i = 0; i < 4; ++i) pw[j][i] = visible(t0 + kTile * j + 4 * g + i) ? pw[j][i] : 0.0f;
      #pragma unroll
      for (int i = 0; i < 4; ++i) smax = fmax_f32(smax, pw[j][i]);
    }
    l_run = l_run * alpha + ((lsum[0] + lsum[1]) + (lsum[2] + lsum[3]));
    // P' = pw / 2^E < 1 with E the exponent of the row's largest pw (at least -127, the
    // smallest E8M0 scale), as two E4M3 terms hi + lo / 16 converted with E as the conversion's
    // scale; the PV scale byte is vb + E (pw = e 2^(vs - vb)). A NaN pw (a NaN V scale the row
    // sees) becomes the NaN byte, and the row's output NaN. A step whose scale byte would fall
    // below 1 (its P under 2^-126 of the output's units) is dropped: converted with 2^127.
    smax = row_max(smax);
    const int vb = int(vbf);
    const int pexp = smax > 0.0f ? max_i32(frexp_exp_f32(smax), -kE8m0One) : 0;
    const int pscale_raw = vb + min_i32(pexp, 254 - vb);
    const bool pdrop = pscale_raw < 1;
    const int cscale = pdrop ? 254 : kE8m0One + min_i32(pexp, 254 - vb);  // conversion's E8M0
    const int pscale = pdrop ? kE8m0One : pscale_raw;
    const int pscale_lo = lo_scale_byte(pscale);
    // The lo term where its scales exist; else converted with 2^127 (all zero bytes).
    const int cscale_lo = (pscale >= 4 && cscale >= 4) ? cscale - 4 : 254;
    i32x8 phi, plo;
    #pragma unroll
    for (int j = 0; j < kTilesPerStep; ++j) {
      uint32_t hi = 0, lo = 0;
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        hi = cvt_scaled_pk_e4m3(pw[j][2 * h], pw[j][2 * h + 1], cscale, hi, h == 1);
        f32x2 back;
        cvt_scaled_pk_f32_e4m3(hi, cscale, h == 1, back);
        const f32x2 r = f32x2{pw[j][2 * h], pw[j][2 * h + 1]} - back;
        lo = cvt_scaled_pk_e4m3(r[0], r[1], cscale_lo, lo, h == 1);
      }
      phi[j] = int(hi);
      plo[j] = int(lo);
    }

    // PV: O^T[element][row] += V^T P^T per 16-element output tile.
    #pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      if constexpr (NATIVE) {
        const u32x4 a = v_operand_fp4(lds->v, kVRow, mt, lane);
        o[mt] = mfma_qk_fp4_fp8(a, phi, o[mt], kE8m0One, pscale);
        o[mt] = mfma_qk_fp4_fp8(a, plo, o[mt], kE8m0One, pscale_lo);
      } else {
        const i32x8 a = v_operand_fp8(lds->v, HEAD, mt, lane);
        o[mt] = mfma_fp8_fp8(a, phi, o[mt], kE8m0One, pscale);
        o[mt] = mfma_fp8_fp8(a, plo, o[mt], kE8m0One, pscale_lo);
      }
    }
    block_barrier();  // every lane's reads of this step's V before the next step's writes
  }

  // The row's partial: m, l over its four lanes, O / l.
  const float l = row_sum(l_run);
  if (row_live) {
    const int64_t idx = out_row(my_row) * max_num_partitions + part;
    if (g == 0) {
      exp_sums[idx] = l;
      max_logits[idx] = m_run;
    }
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;  // a NaN l stays NaN
    for (int mt = 0; mt < kMt; ++mt)
      *reinterpret_cast<f32x4*>(tmp_out + idx * HEAD + kTile * mt + 4 * g) = o[mt] * inv;
  }
  // The last partition of the tile to finish reduces it (the partials written before the
  // ticket, read after it); it leaves the ticket at 0 for the next call, a store after the
  // acquire fence, which nothing waits for.
  learned_raw = learned_sink();
  fence_release_device();
  const uint32_t ticket = wave_first_lane(lane == 0 ? atomic_add_device(&tickets[int64_t(tile) * num_kv_heads + kvh], 1u) : 0u);
  if (ticket != uint32_t(tile_parts - 1)) return;
  fence_acquire_device();
  if (lane == 0) tickets[int64_t(tile) * num_kv_heads + kvh] = 0u;
  } else {  // runs
    learned_raw = learned_sink();
  }

  // Fused reduce, the tile's rows at once, spread over the lanes: kRowsR rows (the tile's 16,
  // or a decode group's GQA rounded up to a power of two) of kLanesR lanes each, lane
  // l = n + kRowsR q owning row n and elements 8 (kLanesR k + q) + i (k < kKR, i < 8; lanes past
  // kRowsR x kLanesR idle). Partitions are combined by their log-sum-exp in chunks (the
  // partials' m are log2 units, without q.m unless the soft cap added it), then the sink (x0, v0:
  // one more partial of weight 1) for rows that see position 0, learned sinks (one more logit,
  // no value), the lse, and o = fwht(o) * HEAD^-0.5 * s with the rotation: stages h = 1, 2, 4
  // pair registers i, the next log2(kLanesR) stages lanes (xor kRowsR, 2 kRowsR, ..), the rest
  // registers k.
  constexpr int kLanesR = kWave / kRowsR < HEAD / 8 ? kWave / kRowsR : HEAD / 8;
  constexpr int kKR = HEAD / (8 * kLanesR);
  // Partitions per round trip: their loads in at most 128 VGPRs (kKR x 8 per partition).
  constexpr int kChunk = 16 / kKR < 1 ? 1 : (16 / kKR > 8 ? 8 : 16 / kKR);
  const int n = lane % kRowsR, q8l = lane / kRowsR;
  const bool live = n < nrows && q8l < kLanesR;
  auto elem = [&](int k, int i) { return 8 * (kLanesR * k + q8l) + i; };
  const KeyRange keys = row_keys(live ? n : 0);
  const int64_t row = out_row(live ? n : 0);
  const int begin = keys.hi > 0 ? keys.lo / partition_len : 0;
  const int end = (live && keys.hi > 0)
      ? min_i32((keys.hi - 1) / partition_len + 1, max_num_partitions) : begin;
  const QRow qr = lds_all->rows[live ? n : 0];
  const float qadd_r = add_qm != 0 ? 0.0f : qr.qadd;
  const bool sees0 = sink != 0 && keys.hi > 0 && keys.lo == 0;
  const float learned = learned_raw * kLog2e;
  float M = -__builtin_inff(), den = 0.0f;
  f32x4 num[kKR][2];  // elements elem(k, 4 h + i)
  for (int k = 0; k < kKR; ++k) num[k][0] = num[k][1] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};
  // Rescales (M, den, num) to the maximum M' = max(M, mc) and returns 2^(-M') as the scale of
  // new weights' exponents (0 when M' is -inf).
  auto raise_max = [&](float mc) {
    const float m2 = fmax_f32(M, mc);
    const float ms = m2 == -__builtin_inff() ? 0.0f : m2;
    const float f = M == m2 ? 1.0f : exp2_fast(M - ms);
    den *= f;
    for (int k = 0; k < kKR; ++k)
      for (int h = 0; h < 2; ++h) num[k][h] = num[k][h] * f;
    M = m2;
    return ms;
  };
  const int64_t pbase = row * max_num_partitions;
  for (int p0 = begin; p0 < end; p0 += kChunk) {
    float ml[kChunk], es[kChunk];
    f32x4 v[kChunk][kKR][2];
    for (int c = 0; c < kChunk; ++c) {
      const int64_t p = pbase + min_i32(p0 + c, end - 1);
      ml[c] = max_logits[p];
      es[c] = exp_sums[p];
      for (int k = 0; k < kKR; ++k)
        for (int h = 0; h < 2; ++h)
          v[c][k][h] = *reinterpret_cast<const f32x4*>(tmp_out + p * HEAD + elem(k, 4 * h));
    }
    sched_barrier();
    float mc = -__builtin_inff();
    for (int c = 0; c < kChunk; ++c) mc = p0 + c < end ? fmax_f32(mc, ml[c] + qadd_r) : mc;
    const float ms = raise_max(mc);
    for (int c = 0; c < kChunk; ++c) {  // l == 0: no key of the row there (a NaN l stays NaN)
      const float w = (p0 + c >= end || es[c] == 0.0f) ? 0.0f : es[c] * exp2_fast(ml[c] + qadd_r - ms);
      den += w;
      for (int k = 0; k < kKR; ++k)
        for (int h = 0; h < 2; ++h) num[k][h] += v[c][k][h] * w;
    }
  }
  if (sees0) {
    const float ms = raise_max(qr.x0);
    const float w = exp2_fast(qr.x0 - ms);
    den += w;
    for (int k = 0; k < kKR; ++k)
      for (int i = 0; i < 8; ++i)
        num[k][i / 4][i % 4] += w * record_at<HEAD>(record, kSinkValue, elem(k, i));
  }
  if (!(learned == -__builtin_inff())) {  // a NaN learned sink makes the row NaN
    const float ms = raise_max(learned);
    den += exp2_fast(learned - ms);
  }
  const bool any = begin < end || sees0;
  const float inv = any ? 1.0f / den : 0.0f;  // one division per row, not one per element
  float o[kKR][8];
  for (int k = 0; k < kKR; ++k)
    for (int i = 0; i < 8; ++i) o[k][i] = any ? num[k][i / 4][i % 4] * inv : 0.0f;
  if (lse != nullptr && live && q8l == 0)  // a row that sees nothing: its learned sink, or -inf
    lse[row] = o[0][0] != o[0][0] ? o[0][0] : any ? (M + log2_f32(den)) / kLog2e
             : learned_raw;
  if (rotation_signs != nullptr) {
    for (int h = 1; h < 8; h *= 2)
      for (int k = 0; k < kKR; ++k)
        for (int i = 0; i < 8; ++i)
          if ((i & h) == 0) butterfly(o[k][i], o[k][i + h]);
    for (int m = kRowsR; m < kRowsR * kLanesR; m *= 2)
      for (int k = 0; k < kKR; ++k)
        for (int i = 0; i < 8; ++i) o[k][i] = butterfly_xor(o[k][i], lane, m);
    for (int h = 1; h < kKR; h *= 2)
      for (int k = 0; k < kKR; ++k)
        if ((k & h) == 0)
          for (int i = 0; i < 8; ++i) butterfly(o[k][i], o[k + h][i]);
    for (int k = 0; k < kKR; ++k)
      for (int i = 0; i < 8; ++i)
        o[k][i] *= rotation_norm<HEAD>() * rotation_signs[elem(k, i)];
  }
  if (live)
    for (int k = 0; k < kKR; ++k) {
      u32x4 w;
      for (int i = 0; i < 4; ++i)
        w[i] = uint32_t(Scalar::from_float(o[k][2 * i])) | uint32_t(Scalar::from_float(o[k][2 * i + 1])) << 16;
      *reinterpret_cast<u32x4*>(out + row * HEAD + elem(k, 0)) = w;
    }
}

}  // namespace gfx950
}  // namespace tq
