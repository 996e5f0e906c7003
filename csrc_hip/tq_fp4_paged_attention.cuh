// turboquant FP4 paged attention for gfx942 (MI300X), in the shape of AITER's pa_v1:
// 256 threads = 4 wavefronts of 64, one workgroup per (row tile, partition of 256 tokens,
// kv head), per-partition exp_sums / max_logits / tmp_out, then a reduce kernel. gfx942 has
// neither the scaled f8f6f4 MFMA nor the transposing LDS reads that gfx950's kernel
// (tq_fp4_gfx950_attention.cuh) is built on: here K and V are decoded through a table and V is
// transposed in LDS. Built for another arch (AITER compiles a library for every arch in
// GPU_ARCHS, and the host pass instantiates it too) its MFMA traps; it is launched on gfx942
// only.
//
// Rows: the MFMA's 16 columns of Q are 16 rows of (query token, head of the GQA group) of one
// sequence and one kv head, query-token major: row R of a sequence is its query token R / GQA
// and head kvh * GQA + R % GQA, and row tile i holds rows 16i .. 16i + 15.
//   Decode (MULTI_TOKEN false, one query token per sequence): one tile per sequence, row =
//     head, GQA <= 16 live columns; grid x is the sequence. A decode call with a larger GQA
//     runs the multi-token instantiation with cu_query_lens = 0, 1, .., num_seqs.
//   Multi-token (MULTI_TOKEN true, cu_query_lens [num_seqs + 1]): a sequence with q query
//     tokens has ceil(q * GQA / 16) tiles, numbered base(s) + i with base(s) = s +
//     floor(cu[s] * GQA / 16): strictly increasing with room for every sequence's tiles, so
//     grid x = num_seqs + ceil(num_tokens * GQA / 16) covers them all, a workgroup finds its
//     sequence by a binary search over cu_query_lens (no host sync) and spare tiles exit.
//     GQA 16 gives one query token per tile, GQA 8 two, GQA 1 sixteen; with a GQA that does
//     not divide 16 a token's heads may straddle two tiles, and above 16 they take several
//     (each row is on its own).
// Keys a row sees (turboquant/reference.py): query token j of q, with seq_len keys, is at
// position p = seq_len - q + j and sees [lo, p], lo = max(0, p - W + 1) with a sliding window W
// (else 0). lo and p grow with the row, so a tile's rows together see [lo of its first row,
// p of its last]: a partition outside that range exits before reading anything, and the
// reduce of a row combines exactly the partitions lo / 256 .. p / 256 (each holds at least
// one of its keys, so every partial it reads was written by a workgroup that ran). Inside a
// partition each lane applies its own row's range by selection (logit -inf); tokens past the
// tile's range are not loaded, tokens before it only in its first partition, with constant
// scales (see the kernel's prologue).
//
// Cache (CONTRACT.md section 1): key/value uint8 [num_blocks, num_kv_heads, block_size,
// HEAD/2] of packed E2M1 codes (even element in the low nibble), scales uint8
// [num_blocks, block_size, num_kv_heads] of E8M0 bytes, one per (token, kv head). K8V4 caches
// are declined on gfx942 (their OCP E4M3 key bytes are not its FNUZ FP8).
//
// QK^T: A = K (16 tokens) and B = Q (the 16 rows of the tile) in FP8 E4M3FNUZ on
// v_mfma_f32_16x16x32_fp8_fp8, four per 128-element K step (mfma_fp8_fp8_k128_unscaled), so a
// lane's accumulator holds logits of one row; the FP4 codes are decoded through a 16-entry
// table, and the E8M0 scales (K's per token, Q's per row) are applied in fp32 to the logits.
//   Q is scaled by one E8M0 power of two per row (largest |q| <= 240) and split into two
//   E4M3FNUZ terms, q = hi + lo / 16, each its own MFMA chain: about 8 significant bits
//   instead of FP8's 4.
// PV: the same instructions, K = tokens. V's codes are decoded to FP8 (exact) without their
// scale and transposed in LDS; the per-token V scale is folded into the probabilities in the
// log domain (y = logit * log2(e) + vscale - 127, p' = 2^(y - ceil(max y)) <= 1), p' is split
// into two FP8 terms like Q, and the remaining per-row power of two and the rest are a float
// multiply at the end.
// Masking is by selection: tokens outside the tile's range (past seq_len included) have their
// K fragment, scales and V codes replaced by constants; a token outside a row's own range has
// its logit replaced by -inf (so its P bytes are 2^-inf = 0, and its V scale is not looked
// at); no garbage byte is ever multiplied into an output. Soft cap, window and causality
// compose: the cap acts on each logit, the ranges select which logits count.
//
// Accuracy transforms (CONTRACT.md section 2; turboquant/reference.py defines them), each on
// only when its argument is given, all in fp32 and fused into this kernel (no extra pass):
//   - state record (seq_state [num_slots, num_kv_heads, 5, HEAD], slot r = state_ids[seq]):
//     q' = q * lam_r in the prologue. A slot outside [0, num_slots) is never read: the
//     sequence's partials are NaN, so its output rows are. With a soft cap the logit is
//     scale * (q'.k' + q.m_r): q.m_r is one more row_sum in the prologue. A call that wants
//     the lse output or learned sinks (true_logits) adds q.m_r without a cap too, so that
//     the partials' max logits, and with them the lse and the sinks' weights, are the true
//     logits' (softmax itself does not depend on it).
//   - rotation (rotation_signs [HEAD] of +-1): q' = fwht(q' * s) * HEAD^-0.5 in the prologue,
//     in registers, in the Q operand's own layout: register qv[c][16b + j] of the lane in K
//     group g = lane / 16 holds element 128c + 64b + 16g + j, so butterfly stages h = 1, 2,
//     4, 8 pair registers of one lane, h = 16 and 32 pair lanes l and l ^ h (one shuffle per
//     value), h = 64 and 128 pair registers again: the stages run in the reference's order
//     h = 1 .. HEAD/2 with the same fp32 roundings. The output is un-rotated per partition
//     (the reduce is linear): o = fwht(o') * HEAD^-0.5 * s in the epilogue, where each wave
//     owns whole rows and lane l holds elements 64j + l (stages h < 64 pair lanes,
//     h >= 64 registers), again in the reference's order.
//   - sink: position 0 is removed from the FP4 stream (it is outside every row's FP4 range:
//     not loaded, its logit -inf), and in partition 0 its fp32 key and value from the record
//     are merged, for each row whose range holds position 0 (a window may leave it out, as in
//     the reference), into the row's softmax state as one more key:
//     m' = max(m, x0), l' = l e^(m - m') + e^(x0 - m'), o' = (o l e^(m - m') + e^(x0 - m') v0) / l'.
//     x0 = q'.k0 uses the fp32 q' (not its E4M3 terms); v0 is added in fp32 in the epilogue.
//     A sequence of one token is the sink alone: o' = v0 exactly.
// Learned sinks and the lse output (CONTRACT.md; turboquant/states.py) live in the reduce:
// a learned sink is one more logit of its head with no value (not capped, whatever the
// window), so it joins the max and the denominator of the partials' combination, and the
// row's lse = m + ln(sum of the weights) comes out of the same numbers.
// The epilogue stages the partition's fp32 output o'[row][element] in LDS (over the V tile,
// which is dead by then) so that one wave holds whole rows for the sink term, the NaN of a
// bad slot and the un-rotation, and stores each row as consecutive elements.
#pragma once

#include "tq_fp4_common.cuh"

namespace tq {

constexpr int kWaves = kThreads / kWaveSize;
constexpr int kPartition = 256;                       // tokens per workgroup (pa_v1's T_PAR_SIZE)
constexpr int kTokensPerWave = kPartition / kWaves;   // QK: each wave owns 64 tokens
constexpr int kTilesPerWave = kTokensPerWave / kTile; // 4 QK MFMAs per 128 head elements
constexpr int kPvSteps = kPartition / kMfmaK;         // 2 PV K-steps per partition


// gfx942 (no scale operand, FNUZ FP8): one 128-K step of two FP8 operands built in the
// 16x16x128 FP8 operand order above, as four v_mfma_f32_16x16x32_fp8_fp8, instruction i
// taking bytes 8i .. 8i + 7 of every lane of A and of B. That maps (lane, byte) pairs to K
// differently from the gfx950 instruction, but identically for A and B (lane (r, g) of A and
// lane (c, g) of B hold the same logical K at the same byte), so the four instructions sum
// the same 128 products: the result is the unscaled dot product; the caller applies the
// E8M0 scales in fp32.
TQ_HD f32x4 mfma_fp8_fp8_k128_unscaled(i32x8 a, i32x8 b, f32x4 c) {
  for (int i = 0; i < 4; ++i) {
    const uint64_t a64 = uint64_t(uint32_t(a[2 * i])) | uint64_t(uint32_t(a[2 * i + 1])) << 32;
    const uint64_t b64 = uint64_t(uint32_t(b[2 * i])) | uint64_t(uint32_t(b[2 * i + 1])) << 32;
    c = mfma_16x16x32_fp8_fnuz(a64, b64, c);
  }
  return c;
}

// x * 2^(sa - 127) * 2^(sb - 127) for two E8M0 bytes, as one ldexp (exact unless the result
// leaves fp32's range); a NaN byte (255) gives NaN, as the gfx950 scale operand does.
TQ_HD float scale_e8m0_pair(float x, int sa, int sb) {
  return (sa == 255 || sb == 255) ? __builtin_nanf("") : ldexp_f32(x, sa + sb - 2 * kE8m0One);
}

template <int HEAD>
struct PartitionLds {
  static_assert(kTile * (HEAD + 4) * 4 <= HEAD * kMfmaK, "obuf fits in vt");
  int64_t row_offset[kPartition];  // byte offset of the token's row, block and slot applied
  uint8_t kscale[kPartition];      // K E8M0 byte of the token (127 past seq_len)
  uint8_t vscale[kPartition];      // V E8M0 byte of the token (127 past seq_len)
  float red[3][kWaves][kTile];     // per wave and row: max logit, max y, V NaN flag
  float red_sum[kWaves][kTile];    // per wave and row: sum of exp(logit - max)
  float post[kTile];               // per row: float factor applied to the PV accumulator
  float sinkw[kTile];              // per row: weight of the sink value (partition 0, sink on)
  uint8_t p8[2][kTile][kPartition];  // P as two E4M3 terms (hi, lo), [term][row][token]
  union {
    uint8_t vt[HEAD][kMfmaK];      // V of one PV K-step as E4M3, transposed: [element][token]
    float obuf[kTile][HEAD + 4];   // epilogue: the partition's fp32 output o'[row][element]
  };                               // (rows padded: the 4 row groups of a wave hit other banks)
};


// grid (row tiles: num_seqs in decode, num_seqs + ceil(num_tokens * GQA / 16) with MULTI_TOKEN;
//       max_num_partitions, num_kv_heads)  block (256)
template <class Scalar, int HEAD, int BLOCK_SIZE, int GQA, bool MULTI_TOKEN>
TQ_KERNEL(kThreads, kThreads) void tq_fp4_pa_partition_kernel(
    const uint16_t* __restrict__ query,       // [num_tokens, num_kv_heads * GQA, HEAD] Scalar, row stride q_stride
    const uint8_t* __restrict__ key_cache,    // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD/2]
    const uint8_t* __restrict__ value_cache,  // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD/2]
    const uint8_t* __restrict__ key_scales,   // [num_blocks, BLOCK_SIZE, num_kv_heads]
    const uint8_t* __restrict__ value_scales, // [num_blocks, BLOCK_SIZE, num_kv_heads]
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,         // [num_seqs]
    const int* __restrict__ cu_query_lens,    // [num_seqs + 1] with MULTI_TOKEN (decode: unused, token = sequence)
    float* __restrict__ exp_sums,             // [num_tokens, num_kv_heads * GQA, max_num_partitions]
    float* __restrict__ max_logits,           // [num_tokens, num_kv_heads * GQA, max_num_partitions]
    uint16_t* __restrict__ tmp_out,           // [num_tokens, num_kv_heads * GQA, max_num_partitions, HEAD] Scalar
    float scale, float logits_soft_cap,
    int sliding_window,                       // W > 0: position p sees keys p - W + 1 .. p; 0: off
    int max_blocks_per_seq, int max_num_partitions, int num_seqs, int num_tokens,
    int num_kv_heads, int q_stride,
    int num_blocks,                           // the caches' first dimension (block-id bound)
    int64_t kv_block_stride, int kv_head_stride, int kv_seq_stride,  // value_cache's byte strides
    const float* __restrict__ rotation_signs, // [HEAD] of +-1, or nullptr: no rotation
    const float* __restrict__ seq_state,      // [num_slots, num_kv_heads, 5, HEAD], or nullptr: no record
    const int* __restrict__ state_ids,        // [num_seqs]: each sequence's slot (read with seq_state)
    int num_slots, int sink,                  // sink != 0: position 0 from the record (needs seq_state)
    int true_logits) {                        // != 0: logits carry q.m without a soft cap too (lse, learned sinks)
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head size 64, 128 or 256");
  static_assert(GQA >= 1 && (MULTI_TOKEN || GQA <= kTile), "a decode tile holds the whole GQA group");
  static_assert(BLOCK_SIZE >= 16 && BLOCK_SIZE <= kPartition && (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0,
                "block size a power of two in [16, 256]");
  constexpr int kRowBytes = HEAD / 2;                         // packed FP4 bytes per K or V row
  constexpr int kQkSteps = (HEAD + kMfmaK - 1) / kMfmaK;      // MFMAs per 16-token tile
  constexpr int kNTilesPerWave = HEAD / kTile / kWaves;       // PV output tiles per wave
  constexpr int kVDwordsPerRow = kRowBytes / 4;               // V decode: 8 codes per dword
  constexpr int kVUnits = (kMfmaK / 4) * kVDwordsPerRow;      // (4 tokens x 1 dword) units per K-step

  const int tile = block_id_x();
  const int part = block_id_y();
  const int kvh = block_id_z();
  const int tid = thread_id();
  const int wave = tid / kWaveSize;
  const int lane = tid % kWaveSize;
  // The tile's sequence, its query tokens [q0, q0 + qn), and its rows first_row .. + nrows - 1.
  const RowTile<GQA, MULTI_TOKEN> rt = row_tile<GQA, MULTI_TOKEN>(cu_query_lens, num_seqs, num_tokens, tile);
  if (rt.nrows <= 0) return;  // a spare tile (the whole workgroup leaves together)
  const int seq = rt.seq, q0 = rt.q0, qn = rt.qn, nrows = rt.nrows;
  const int seq_len = seq_lens[seq];
  auto row_token = [&](int n) { return rt.token(n); };
  auto row_head = [&](int n) { return rt.head(kvh, n); };
  auto row_keys = [&](int n) { return query_keys(seq_len, qn, row_token(n), sliding_window); };
  auto out_row = [&](int n) { return rt.out_row(kvh, num_kv_heads, n); };
  // The tile's keys: from its first row's lo to its last row's hi (see the design note).
  const KeyRange tile_keys = {row_keys(0).lo, row_keys(nrows - 1).hi};
  const int part_start = part * kPartition;
  if (part_start >= tile_keys.hi || part_start + kPartition <= tile_keys.lo) return;
  // The sequence's state record; a slot outside [0, num_slots) is never read (NaN output).
  const bool has_state = seq_state != nullptr;
  const int state_slot = has_state ? state_ids[seq] : 0;
  const bool state_bad = has_state && (state_slot < 0 || state_slot >= num_slots);
  const float* record = (has_state && !state_bad)
      ? seq_state + (int64_t(state_slot) * num_kv_heads + kvh) * (kStateRows * HEAD) : nullptr;
  // The logit gets q.m back: under a soft cap, and when the call wants the true logits
  // (the lse output, learned sinks: both are in the true logits' terms).
  const bool add_qm = has_state && (logits_soft_cap > 0.0f || true_logits != 0);
  const bool sink_here = sink != 0 && part == 0 && tile_keys.lo == 0;  // some row sees position 0
  // Row n sees position 0 (in decode every row has the tile's keys: sink_here says it).
  auto sees_sink = [&](int n) { return sink_here && (!MULTI_TOKEN || row_keys(n).lo == 0); };
  // Positions the FP4 stream serves: the tile's keys from first_pos on (with the sink,
  // position 0 comes from the record). Tokens past the tile's keys are not loaded; a token
  // before them (and position 0 with the sink) may be, in the partition where they start,
  // but its scales are staged as constants and its logit is -inf in every row, so its codes
  // (finite FP4) meet only P = 0. Each lane's row sees [row_lo, row_lo + row_n); one unsigned
  // compare per token (a position below the start wraps around): a second compare per token
  // would keep masks live across the softmax and cost SGPR spills. In decode every row has the
  // tile's range (uniform), in multi-token each lane has its own.
  const int first_pos = sink != 0 ? 1 : 0;
  const int kv_lo = max_i32(tile_keys.lo, first_pos);
  const uint32_t kv_n = uint32_t(max_i32(tile_keys.hi - kv_lo, 0));
  auto served = [&](int pos) { return uint32_t(pos - kv_lo) < kv_n; };
  auto loaded = [&](int pos) { return pos < tile_keys.hi; };
  const int my_row = mfma_out_col(lane);  // the lane's row: column of Q (B) and of the logits
  const bool row_live = my_row < nrows;
  const KeyRange my_keys = row_keys(my_row);
  const int row_lo = MULTI_TOKEN ? max_i32(my_keys.lo, first_pos) : kv_lo;
  const uint32_t row_n = MULTI_TOKEN ? (row_live ? uint32_t(max_i32(my_keys.hi - row_lo, 0)) : 0u) : kv_n;
  auto visible = [&](int pos) { return (MULTI_TOKEN || row_live) && uint32_t(pos - row_lo) < row_n; };

  TQ_LDS(PartitionLds<HEAD>, lds);

  // Stage the partition's token rows and scales: thread tid owns token part_start + tid.
  {
    const int tok = part_start + tid;
    const bool live = served(tok);
    const int logical = live ? tok / BLOCK_SIZE : (tile_keys.hi - 1) / BLOCK_SIZE;
    // A table entry outside [0, num_blocks), or a column past the table, reads block 0 (valid
    // memory) with a NaN value scale: the rows that see the token are NaN (CONTRACT section 3).
    const int entry = logical < max_blocks_per_seq
        ? block_tables[int64_t(seq) * max_blocks_per_seq + logical] : -1;
    const bool ok = uint32_t(entry) < uint32_t(num_blocks);
    const int64_t blk = ok ? entry : 0;
    const int slot = tok % BLOCK_SIZE;
    lds->row_offset[tid] = blk * kv_block_stride + int64_t(slot) * kv_seq_stride + int64_t(kvh) * kv_head_stride;
    const int64_t sidx = (blk * BLOCK_SIZE + slot) * num_kv_heads + kvh;
    lds->kscale[tid] = live ? key_scales[sidx] : uint8_t(kE8m0One);
    lds->vscale[tid] = live ? (ok ? value_scales[sidx] : uint8_t(255)) : uint8_t(kE8m0One);
  }

  // Q as the B operand: lane (column n = row of the tile, K group g) holds head elements
  // 128c + mfma_fp8_k(g, j) of the row's query as E4M3 with the row's E8M0 scale.
  const int qg = mfma_kgroup(lane);
  const int qcol = row_live ? my_row : 0;
  const uint16_t* qrow = query + int64_t(q0 + row_token(qcol)) * q_stride + int64_t(row_head(qcol)) * HEAD;
  float qv[kQkSteps][32];
  constexpr int kQRegs = HEAD < kMfmaK ? 16 : 32;  // registers j of qv that hold head elements
  float qdm = 0.0f;  // q.m of the original q (add_qm only), this lane's part
  // Registers 16r .. 16r + 15 of qv[c] are the 16 consecutive elements e0(c, r) + i
  // (mfma_fp8_k), run k = 2c + r: 32 query bytes and 64 bytes of each record row, loaded as
  // 16-byte vectors (the query rows must be 16-byte aligned, as the caches' are), a group's
  // loads all before its first use: one memory round trip per 8 elements instead of one per
  // element and array. Runs past HEAD (HEAD 64: r = 1) are 0. The query row of a dead lane
  // is row 0's (qcol), a valid address; its values are replaced by 0. The arithmetic is the
  // element-at-a-time one, in the same order.
  constexpr int kRuns = 2 * kQkSteps;
  auto run_e0 = [&](int k) { return (k / 2) * kMfmaK + 64 * (k % 2) + 16 * qg; };
  auto run_in = [](int k) { return (k / 2) * kMfmaK + 64 * (k % 2) < HEAD; };
  // 4n floats of run k from its element i0 on, as n 16-byte loads.
  auto load_f32 = [&](const float* src, int k, int i0, int n, float* v) {
    for (int h = 0; h < n; ++h) {
      const u32x4 w = load_u32x4(reinterpret_cast<const uint8_t*>(src + run_e0(k) + i0 + 4 * h));
      for (int i = 0; i < 4; ++i) {
        // Through a scalar: clang-22 folds __builtin_bit_cast of a vector element w[i] to
        // w[0] (every i), gcc does not.
        const uint32_t u = w[i];
        v[4 * h + i] = __builtin_bit_cast(float, u);
      }
    }
  };
  // Eight elements at a time (their lam, m and signs are 24 VGPRs; a whole run's or all
  // runs' at once would cost occupancy): the record's and the signs' loads of a group sit
  // under uniform branches with nothing in an else (a bad slot's NaN is written after the
  // loop), so no path writes their registers while the loads are in flight, and the group's
  // one wait is at its first use.
  constexpr int kGroup = 8;
  const bool rec = record != nullptr;
  auto group = [&](int k, int i0) {
    if (!run_in(k)) {
      for (int i = i0; i < i0 + kGroup; ++i) qv[k / 2][16 * (k % 2) + i] = 0.0f;
      return;
    }
    const u32x4 qw = load_u32x4(reinterpret_cast<const uint8_t*>(qrow + run_e0(k) + i0));
    float lam[kGroup] = {}, qm[kGroup] = {}, sgn[kGroup] = {};
    if (rec) {
      load_f32(record + kKeyScale * HEAD, k, i0, kGroup / 4, lam);
      if (add_qm) load_f32(record + kKeyCenter * HEAD, k, i0, kGroup / 4, qm);
    }
    if (rotation_signs != nullptr) load_f32(rotation_signs, k, i0, kGroup / 4, sgn);
    float x[kGroup];
    for (int i = 0; i < kGroup; ++i) {
      const uint32_t bits = (qw[i / 2] >> (16 * (i % 2))) & 0xFFFFu;
      x[i] = row_live ? Scalar::to_float(uint16_t(bits)) : 0.0f;
    }
    if (has_state) {
      if (add_qm)
        for (int i = 0; i < kGroup; ++i) qdm += x[i] * qm[i];
      for (int i = 0; i < kGroup; ++i) x[i] *= lam[i];  // q' = q * lam
    }
    if (rotation_signs != nullptr)
      for (int i = 0; i < kGroup; ++i) x[i] *= sgn[i];
    for (int i = 0; i < kGroup; ++i) qv[k / 2][16 * (k % 2) + i0 + i] = x[i];
    sched_barrier();  // the next group's loads stay below: one group's registers at a time
  };
  if constexpr (kRuns <= 2) {
    // HEAD <= 128: a loop (unrolled, the scheduler would keep more groups' registers live:
    // the kernel would lose an occupancy step).
#pragma nounroll
    for (int k = 0; k < kRuns; ++k)
      for (int i0 = 0; i0 < 16; i0 += kGroup) group(k, i0);
  } else {
    // HEAD 256: unrolled (a run-time qv[k / 2] would put qv in scratch memory).
    for (int k = 0; k < kRuns; ++k)
      for (int i0 = 0; i0 < 16; i0 += kGroup) group(k, i0);
  }
  // A bad slot (has_state, no record): q * NaN * s is the quiet NaN, and so is q.m's sum.
  if (has_state && !rec) {
    for (int k = 0; k < kRuns; ++k)
      if (run_in(k))
        for (int i = 0; i < 16; ++i) qv[k / 2][16 * (k % 2) + i] = __builtin_nanf("");
    if (add_qm) qdm = __builtin_nanf("");
  }
  if (add_qm) qdm = row_sum(qdm);
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
    // k0 in the same runs as lam above, a run's loads before its first use, summed in the
    // element-at-a-time order: c, then registers j < kQRegs.
    float dot = 0.0f;
    for (int k = 0; k < kRuns; ++k)
      if (run_in(k)) {
        float k0[16] = {};
        if (rec) load_f32(record + kSinkKey * HEAD, k, 0, 4, k0);
        for (int i = 0; i < 16; ++i)
          dot += qv[k / 2][16 * (k % 2) + i] * (rec ? k0[i] : __builtin_nanf(""));
      }
    sink_logit = (row_sum(dot) + qdm) * scale;
    if (logits_soft_cap > 0.0f) sink_logit = soft_cap(sink_logit, logits_soft_cap);
  }
  float amax = 0.0f;
  for (int c = 0; c < kQkSteps; ++c)
    for (int j = 0; j < 32; ++j) amax = fmax_f32(amax, fabs_f32(qv[c][j]));
  amax = row_max(amax);
  const int qscale = q_scale_byte(amax);
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
    const bool klive = loaded(part_start + ktok);
    const uint8_t* krow = key_cache + lds->row_offset[ktok];
    const int kscale = lds->kscale[ktok];
    const u32x4 zero = {0u, 0u, 0u, 0u};
    f32x4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
    f32x4 acc_lo = {0.0f, 0.0f, 0.0f, 0.0f};  // the lo terms' own (unscaled) sum
    for (int c = 0; c < kQkSteps; ++c) {
      const i32x8 a = fp4_row_as_fp8_operand(krow, c, kg, kRowBytes, klive);
      acc = mfma_fp8_fp8_k128_unscaled(a, q8[c], acc);
      acc_lo = mfma_fp8_fp8_k128_unscaled(a, q8lo[c], acc_lo);
    }
    // The E8M0 scales in fp32: K's byte belongs to the output row's token (tokens
    // 4 (lane / 16) + i of the tile, one aligned dword of kscale), Q's to the lane's own row;
    // the lo terms weigh 1/16.
    const uint32_t ks4 = *reinterpret_cast<const uint32_t*>(
        &lds->kscale[wave * kTokensPerWave + t * kTile + mfma_out_row(lane, 0)]);
    for (int i = 0; i < 4; ++i)
      logit[t][i] = scale_e8m0_pair(acc[i] + acc_lo[i] * 0.0625f, int((ks4 >> (8 * i)) & 0xFFu), qscale);
  }

  // Softmax statistics. Lane holds row my_row, tokens 64w + 16t + mfma_out_row(lane, i).
  float mx = -__builtin_inff(), ymax = -__builtin_inff(), vnan = 0.0f;
  float y[kTilesPerWave][4];
  for (int t = 0; t < kTilesPerWave; ++t)
    for (int i = 0; i < 4; ++i) {
      const int tok = wave * kTokensPerWave + t * kTile + mfma_out_row(lane, i);
      const bool live = visible(part_start + tok);
      float x = (logit[t][i] + qdm) * scale;
      if (logits_soft_cap > 0.0f) x = soft_cap(x, logits_soft_cap);
      const int vs = lds->vscale[tok];
      logit[t][i] = live ? x : -__builtin_inff();
      y[t][i] = live ? x * kLog2e + float(vs - kE8m0One) : -__builtin_inff();
      vnan = (live && vs == 255) ? 1.0f : vnan;
      mx = fmax_f32(mx, logit[t][i]);
      ymax = fmax_f32(ymax, y[t][i]);
    }
  mx = row_max(mx);
  ymax = row_max(ymax);
  vnan = row_max(vnan);
  if (lane < kTile) {
    lds->red[0][wave][lane] = mx;
    lds->red[1][wave][lane] = ymax;
    lds->red[2][wave][lane] = vnan;
  }
  block_barrier();
  mx = lds->red[0][0][my_row];
  ymax = lds->red[1][0][my_row];
  vnan = lds->red[2][0][my_row];
  for (int w = 1; w < kWaves; ++w) {
    mx = fmax_f32(mx, lds->red[0][w][my_row]);
    ymax = fmax_f32(ymax, lds->red[1][w][my_row]);
    vnan = fmax_f32(vnan, lds->red[2][w][my_row]);
  }
  // The PV accumulator of row r is sum_t p'_t * v4_t * 2^(pscale - 127) with
  // p'_t = 2^(logit_t*log2e + vscale_t - 127 - ytop), so the partition output
  // sum_t exp(logit_t - mx) * v_t / l is acc * 2^(tpow - (pscale - 127)) / l, tpow = ytop - mx*log2e.
  // The lane's row (column of the logits) is also its row of P in the PV MFMA: each lane
  // knows its own pscale.
  const float ytop = ceil_f32(ymax);
  const float tpow = ytop - mx * kLog2e;
  const float fl = floor_f32(tpow);
  const int ip = (row_live && fl == fl) ? (fl < -127.0f ? 0 : (fl > 127.0f ? 254 : int(fl) + kE8m0One)) : kE8m0One;
  const int pscale = vnan > 0.0f ? 255 : ip;
  const float mx_safe = mx == -__builtin_inff() ? 0.0f : mx;
  const float ytop_safe = ytop == -__builtin_inff() ? 0.0f : ytop;
  float lsum = 0.0f;
  for (int t = 0; t < kTilesPerWave; ++t)
    for (int i = 0; i < 4; ++i) {
      const int tok = wave * kTokensPerWave + t * kTile + mfma_out_row(lane, i);
      // Dead tokens and rows hold logit = y = -inf from the loop above: exp2 gives 0 and the
      // P bytes 0 (mx_safe, ytop_safe: a row with no FP4 token, the sink alone, gets 0s too).
      lsum += exp2_f32((logit[t][i] - mx_safe) * kLog2e);
      // p' = 2^(y - ytop) <= 1 as hi + lo / 16; dead tokens and rows are the constant 0.
      const E4m3Split p = split_e4m3x4(exp2_f32(y[t][i] - ytop_safe), 0.0f, 0.0f, 0.0f);
      lds->p8[0][my_row][tok] = uint8_t(p.hi);
      lds->p8[1][my_row][tok] = uint8_t(pscale >= 4 ? p.lo : 0u);
    }
  lsum = row_sum(lsum);
  if (lane < kTile) lds->red_sum[wave][lane] = lsum;
  block_barrier();

  // Per-row results, by the first 16 lanes of wave 0 (lane = my_row). A row whose keys
  // miss this partition gets numbers here that the reduce never reads.
  if (wave == 0 && lane < kTile) {
    float l = 0.0f;
    for (int w = 0; w < kWaves; ++w) l += lds->red_sum[w][lane];
    float post = 0.0f, sinkw = 0.0f;
    if (row_live) {
      post = exp2_f32(tpow - float(ip - kE8m0One)) / l;
      float l_out = l, m_out = mx;
      if (sees_sink(lane)) {
        // The sink as one more key of the row: a two-way log-sum-exp merge. l == 0: no FP4
        // token (the row sees position 0 only), the sink alone; a NaN l (NaN logits) stays NaN.
        const bool fp4_any = !(l == 0.0f);
        m_out = fmax_f32(mx, sink_logit);
        const float alpha = fp4_any ? exp2_f32((mx - m_out) * kLog2e) : 0.0f;
        const float beta = exp2_f32((sink_logit - m_out) * kLog2e);
        l_out = l * alpha + beta;
        post = fp4_any ? post * (l * alpha / l_out) : 0.0f;
        sinkw = beta / l_out;
      }
      const int64_t idx = out_row(lane) * max_num_partitions + part;
      exp_sums[idx] = l_out;
      max_logits[idx] = m_out;
    }
    // gfx942: the PV MFMA applies no scale; P's power of two (lane = row here) joins post.
    post = scale_e8m0_pair(post, pscale, kE8m0One);
    lds->post[lane] = post;
    lds->sinkw[lane] = sinkw;
  }

  // PV: A = P (row = row of the tile, K = 128 tokens of step s), B = V (column = head element).
  f32x4 out_acc[kNTilesPerWave];
  f32x4 out_lo[kNTilesPerWave];  // the lo terms' own (unscaled) sum
  for (int n = 0; n < kNTilesPerWave; ++n) out_acc[n] = out_lo[n] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};
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
        const bool live = loaded(part_start + tok);
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
    // A lane (row = lane % 16, K group g): P bytes of tokens 128s + mfma_fp8_k(g, j).
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
      out_acc[n] = mfma_fp8_fp8_k128_unscaled(a, b, out_acc[n]);
      out_lo[n] = mfma_fp8_fp8_k128_unscaled(a_lo, b, out_lo[n]);
    }
  }

  // Output: accumulator i of tile n is row mfma_out_row(lane, i), element 16 (w + 4n) + lane % 16.
  // It goes to LDS as o'[row][element] (fp32), over vt once every wave is done with vt; dead
  // rows (past nrows) are written too (no branch: post is 0 there) and never read.
  block_barrier();
  for (int n = 0; n < kNTilesPerWave; ++n)
    for (int i = 0; i < 4; ++i) {
      const int h = mfma_out_row(lane, i);
      const float o = out_acc[n][i] + out_lo[n][i] * 0.0625f;
      lds->obuf[h][(wave + kWaves * n) * kTile + mfma_out_col(lane)] = o * lds->post[h];
    }
  block_barrier();
  // Wave w finishes rows w, w + 4, ..: lane l holds elements 64j + l of the row.
  constexpr int kOutPerLane = HEAD / kWaveSize;
  for (int h = wave; h < nrows; h += kWaves) {
    float o[kOutPerLane];
    for (int j = 0; j < kOutPerLane; ++j) o[j] = lds->obuf[h][kWaveSize * j + lane];
    if (sees_sink(h)) {
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
    const int64_t row = (out_row(h) * max_num_partitions + part) * HEAD;
    for (int j = 0; j < kOutPerLane; ++j) tmp_out[row + kWaveSize * j + lane] = Scalar::from_float(o[j]);
  }
}

// The partitions [begin, end) the reduce combines for query token qi of a sequence (qn query
// tokens, seq_len keys): those that hold the row's keys (query_keys), within the grid's count.
struct PartRange { int begin, end; };
TQ_HD PartRange row_partitions(int seq_len, int qn, int qi, int sliding_window, int max_num_partitions) {
  const KeyRange k = query_keys(seq_len, qn, qi, sliding_window);
  if (k.hi <= 0 || qi >= qn) return {0, 0};
  return {k.lo / kPartition, min_i32((k.hi - 1) / kPartition + 1, max_num_partitions)};
}

// One output element of the reduce: combine the partitions [parts.begin, parts.end) of row
// `row` of [num_tokens, num_heads] for element d (no partition: 0), with the head's learned
// sink as one more logit without a value (sink = -inf: none): its weight joins the
// denominator only. Element 0's thread also writes the row's lse (lse != nullptr): natural-log
// log-sum-exp of the row's logits, m + ln(den) (-inf for a row that sees nothing, the sink's
// logit when it has one); NaN when the row's output is NaN (a NaN value scale or state slot
// makes the partials' outputs NaN, not their sums).
template <class Scalar, int HEAD>
TQ_HD void reduce_one(int64_t row, int d, PartRange parts, int max_num_partitions,
                      const float* exp_sums, const float* max_logits, const uint16_t* tmp_out,
                      float sink, uint16_t* out, float* lse) {
  // Partitions in chunks of kReduceChunk: a chunk's loads are all issued (indices clamped to
  // the last partition, so every address is one the row owns) before any value is used: one
  // memory round trip per chunk, not one per partition. The sums run over the partitions in
  // order, as one at a time would; a clamped duplicate is left out by a select.
  constexpr int kReduceChunk = 8;
  const int64_t base = row * max_num_partitions;
  const int last = parts.end - 1;
  float m = sink;
  for (int p0 = parts.begin; p0 < parts.end; p0 += kReduceChunk) {
    float ml[kReduceChunk];
    for (int i = 0; i < kReduceChunk; ++i) ml[i] = max_logits[base + min_i32(p0 + i, last)];
    sched_barrier();
    for (int i = 0; i < kReduceChunk; ++i) m = p0 + i < parts.end ? fmax_f32(m, ml[i]) : m;
  }
  float num = 0.0f;
  float den = sink > -__builtin_inff() ? exp2_f32((sink - m) * kLog2e) : 0.0f;
  for (int p0 = parts.begin; p0 < parts.end; p0 += kReduceChunk) {
    float es[kReduceChunk], ml[kReduceChunk];
    uint16_t v[kReduceChunk];
    for (int i = 0; i < kReduceChunk; ++i) {
      const int64_t p = base + min_i32(p0 + i, last);
      es[i] = exp_sums[p];
      ml[i] = max_logits[p];
      v[i] = tmp_out[p * HEAD + d];
    }
    sched_barrier();
    for (int i = 0; i < kReduceChunk; ++i) {  // selects, not branches: nothing sinks a load
      const bool in = p0 + i < parts.end;
      const float w = es[i] * exp2_f32((ml[i] - m) * kLog2e);
      den = in ? den + w : den;
      num = in ? num + w * Scalar::to_float(v[i]) : num;
    }
  }
  const float o = parts.begin < parts.end ? num / den : 0.0f;
  out[row * HEAD + d] = Scalar::from_float(o);
  if (lse != nullptr && d == 0) lse[row] = o == o ? m + log2_f32(den) * (1.0f / kLog2e) : o;
}

// The partitions of query token `token` (MULTI_TOKEN: the token's sequence
// from cu_query_lens; decode: token = sequence).
template <bool MULTI_TOKEN>
TQ_HD PartRange token_partitions(int token, const int* seq_lens, const int* cu_query_lens,
                                 int num_seqs, int sliding_window, int max_num_partitions) {
  if constexpr (MULTI_TOKEN) {
    const int seq = token_sequence(cu_query_lens, num_seqs, token);
    const int q0 = cu_query_lens[seq];
    return row_partitions(seq_lens[seq], cu_query_lens[seq + 1] - q0, token - q0, sliding_window,
                          max_num_partitions);
  } else {
    return row_partitions(seq_lens[token], 1, 0, sliding_window, max_num_partitions);
  }
}

// grid (num_tokens, num_heads)  block (HEAD)   (tokens on x: grid y and z stop at 65535)
template <class Scalar, int HEAD, bool MULTI_TOKEN>
TQ_KERNEL(HEAD, HEAD) void tq_fp4_pa_reduce_kernel(
    uint16_t* __restrict__ out,               // [num_tokens, num_heads, HEAD] Scalar
    float* __restrict__ lse,                  // [num_tokens, num_heads], or nullptr: not wanted
    const float* __restrict__ exp_sums,       // [num_tokens, num_heads, max_num_partitions]
    const float* __restrict__ max_logits,     // [num_tokens, num_heads, max_num_partitions]
    const uint16_t* __restrict__ tmp_out,     // [num_tokens, num_heads, max_num_partitions, HEAD] Scalar
    const int* __restrict__ seq_lens,         // [num_seqs]
    const int* __restrict__ cu_query_lens,    // [num_seqs + 1] with MULTI_TOKEN (decode: unused)
    const float* __restrict__ sinks,          // [num_heads] learned sink logits, or nullptr: none
    int num_seqs, int num_heads, int max_num_partitions, int sliding_window) {
  const int token = block_id_x();
  const int head = block_id_y();
  const PartRange parts = token_partitions<MULTI_TOKEN>(token, seq_lens, cu_query_lens, num_seqs,
                                                        sliding_window, max_num_partitions);
  const float sink = sinks != nullptr ? sinks[head] : -__builtin_inff();
  reduce_one<Scalar, HEAD>(int64_t(token) * num_heads + head, thread_id(), parts,
                           max_num_partitions, exp_sums, max_logits, tmp_out, sink, out, lse);
}

}  // namespace tq
