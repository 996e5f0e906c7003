// turboquant cuda backend (SM80-SM90): the decode kernel, one query token per sequence and at
// most 8 query heads per kv head, in the swapped form S^T = K Q^T, O^T = V^T P^T; and the same
// kernel with 8 or 16 (query token, head) columns for short multi-token queries (speculative
// decoding; kMulti below, NB = 1 or 2, tuning::use_spec_kernel and spec_columns).
// Torch-free. Shares the parameters and the register helpers (attention_common.cuh) and the
// reduce pass with the general kernel (attention_general.cuh: multi-token queries and groups of
// more than 8 heads).
//
// ============================== design note ==============================================
// Why a second kernel: in decode the MMA rows of the general kernel are the G query heads of a
//   GQA group padded to 16, so at G = 4 three quarters of its Q.K^T / P.V work, softmax
//   instructions and O registers are padding. Here the KV tokens are the MMA's M dimension and
//   the (at most 8) heads its N dimension (m16n8k16): per 16-token tile a warp runs D/16 MMAs for
//   S^T and D/16 for O^T instead of twice as many, O^T takes D/4 registers instead of D/2, and
//   every thread holds 4 logits instead of 8.
// Grid (num_seqs x num_kv_heads, num_partitions) for decode (the multi-token forms: row tiles of
//   8 or 16 columns x num_kv_heads, see the kernel), DECODE_WARPS warps per CTA, each walking its
//   own 16-token tiles of the partition (tile k of warp w = w + W k) through a private
//   STAGES-deep cp.async ring, then merged in shared memory like the general kernel; with more
//   than one partition the CTA writes partials that paged_attention_reduce_kernel combines.
// Lane = 4 g + t. Per tile:
//   S^T[16 x 8] = K[16 x D] Q^T[D x 8]: A = K rows g and g+8 (lane t reads a contiguous quarter
//     of each, D/8 bytes of FP4 or D/4 of E4M3 (K8V4), and decodes it in registers with
//     decode_key8; D/16 k-steps), B = Q^T fragments built once
//     per CTA (D/16 x 2 words, same reduction-dimension permutation as the general kernel; in
//     registers up to DECODE_QREG_MAX_D, else re-read from shared memory). C: thread holds
//     tokens g, g+8 x heads 2t, 2t+1.
//   Softmax in the exp2 domain with lazy rescaling (tuning.cuh RESCALE_SLACK): the row maxima
//     are NOT reduced on every tile. A thread only checks its own 4 logits against the reference
//     maximum + SLACK, its tokens' V-scale bytes against the warp's running maximum VM, and its
//     K-scale bytes against 255; one vote decides. Only a tile where some check fails (or that
//     needs masking) takes the slow path: NaN scales, masking, the exact row maxima (shuffles),
//     the V-scale maximum, and the rescale of O and l.
//   P' = 2^(x - m) * 2^(vb - VM + 15 - SLACK) (V scale folded into P, as in the general kernel),
//     packed to fp16: thread holds P'[token g | g+8][head 2t, 2t+1], which is the C fragment of
//     two 8x8 blocks; movmatrix.trans turns each into the B fragment of O^T = V^T P^T
//     (tokens 2t, 2t+1 | 2t+8, 2t+9 of head g). No shuffles.
//   O^T[D x 8] += V^T[D x 16] P^T[16 x 8]: A = V^T; thread g owns head-dim range
//     [g D/8, (g+1) D/8) of tokens 2t, 2t+1, 2t+8, 2t+9: the bytes of two tokens are interleaved
//     with prmt so that one decode yields fp16 pairs (token 2t, token 2t+1) at one head-dim index.
//     m-tile j = 4 w + i holds head-dim g D/8 + 8 w + i (rows g) and + 4 (rows g+8).
// Shared-memory layouts (per ring slot: K tile, V tile, 32 scale words):
//   K: token r at row r, 16-byte chunks placed by k_chunk (rows of 128 or 256 bytes: FP4 at
//     D = 256, E4M3 keys at D >= 128). Reads: rows g, g+8, a quarter row per lane.
//   V: token r at row dv_row(r), chunks XOR dv_swz(r); chosen so that the four tokens
//     2t + a (t = 0..3) one V load instruction reads fall in distinct banks (see dv_row).
//   Scales: words of K(g), K(g+8), V(g), V(g+8) at 16 g (one 16-byte load per thread).
//   cp.async (16 B per lane): K chunks in token order, V chunks in dv_copy_token order (so the
//   8 lanes of a store phase hit distinct banks); chunk i of a lane is chunk 0 moved by a
//   compile-time number of token rows (dk_step / dv_step), so each lane keeps one address per
//   cache.
// Where the tiles are: the lanes of a warp hold the cache offsets of its tiles kc .. kc+31 and
//   the block ids of the next 32 (prefetched), one shuffle per tile. The prologue issues its
//   three independent loads together (seq_len, the thread's 16 bytes of Q, the first block ids,
//   located from the partition start). Partitions: tuning.cuh choose_decode_partition_size.
// Masking, NaN and bad block ids follow the general kernel: tokens outside the visible range
//   get logit -inf and P 0 by selection; a visible token whose scale byte is 255 makes the rows
//   that see it NaN; a block id out of range makes the sequence's rows NaN, never a read.
// ===========================================================================================
#pragma once

#include "attention_common.cuh"

namespace turboquant {
namespace cuda_fp4 {

// NB n-blocks of 8 MMA columns: NB = 1 for decode (the heads of one GQA group) and for short
// multi-token queries of at most 8 (query token, head) pairs per sequence on average, NB = 2
// for up to 16 (tuning::spec_columns).
template <int D, bool kE4m3, int NB = 1>
struct DecodeLayout : KVSlot<D, kE4m3> {
  static constexpr int W = tuning::DECODE_WARPS;
  static constexpr int NC = 8 * NB;             // MMA columns: heads, or (query token, head) pairs
  static constexpr int ST = tuning::DecodeStages<D>::value;
  static constexpr int PIPE = W * ST * KVSlot<D, kE4m3>::STAGE;
  static constexpr int QRAW = NC * D * 4;       // Q rows in fp32, after the transforms
  static constexpr int MROW = D + 4;            // merge row pitch (floats)
  static constexpr int MERGE = W * NC * MROW * 4;
  static constexpr int OFF_QRAW = PIPE;
  static constexpr int BIG = (PIPE + QRAW) > MERGE ? (PIPE + QRAW) : MERGE;
  static constexpr int OFF_QFRAG = BIG;         // NB x (D/16) x 32 lanes x 2 words
  static constexpr int OFF_M = OFF_QFRAG + NB * (D / 16) * 32 * 8;
  static constexpr int OFF_L = OFF_M + W * NC * 4;
  static constexpr int OFF_MISC = OFF_L + W * NC * 4;
  static constexpr int OFF_SINK = OFF_MISC + 16;  // NC floats: q'.k0' of each column (sink)
  static constexpr int OFF_QM = OFF_SINK + NC * 4;  // NC floats: scale * q.m of each column (soft cap)
  static constexpr int OFF_CHI = OFF_QM + NC * 4;  // NC ints: each column's last key (multi-token)
  static constexpr int TOTAL = OFF_CHI + NC * 4;
};

// V rows: token r is stored at row dv_row(r) with its 16-byte chunks XOR dv_swz(r). A V load
// instruction reads tokens 2t + a (t = 0..3, a in {0, 1, 8, 9}) at head-dim bytes g D/16:
//   D=64  (4 B, one 32-lane phase; row = 8 banks): rows 2t+a land on bank quarters t (dv_row).
//   D=128 (8 B, 16-lane phases; row = 16 banks): row parity from token bit 2, chunk XOR from
//         token bit 1 -> the 4 tokens x 2 chunks of a phase fill 8 distinct 16-byte bank groups.
//   D=256 (16 B, 8-lane phases; row = 32 banks): chunk XOR 2 (token bits 1..2).
template <int D> __device__ __forceinline__ int dv_row(int r) {
  if constexpr (D == 64) return ((r >> 1) & 3) | ((r & 1) << 2) | (r & 8);
  else if constexpr (D == 128) return (r & 10) | ((r >> 2) & 1) | ((r & 1) << 2);
  else return r;
}
template <int D> __device__ __forceinline__ int dv_swz(int r) {
  if constexpr (D == 64) return 0;
  else if constexpr (D == 128) return r & 2;
  else return (r & 6);
}
// K rows: token r at row r, chunks placed by k_chunk (attention_common.cuh).
// Copy order of V: copy index q (lane / CPR + (32 / CPR) i) -> token. D=128: tokens r, r+4 in
// one 8-lane store phase (different row parity); D=64/256: tokens with distinct bits 1..2.
template <int D> __device__ __forceinline__ int dv_copy_token(int q) {
  if constexpr (D == 128) return 8 * (q >> 3) + ((q & 7) >> 1) + 4 * (q & 1);
  else return 2 * (q & 3) + ((q >> 2) & 1) + 8 * (q >> 3);
}
// rows between chunk 0 and chunk i of a lane (K: token order, KCPR chunks per row, which keeps
// k_chunk's row parity; V: the copy order above)
template <int KCPR> __host__ __device__ constexpr int dk_step(int i) { return (32 / KCPR) * i; }
template <int D> __host__ __device__ constexpr int dv_step(int i) {
  return D == 128 ? 8 * i : (i & 1) + 8 * (i >> 1);
}

// ---- movmatrix.sync.aligned.m8n8.trans.b16 ------------------------------------------------
// Transposes an 8x8 matrix of 16-bit elements held as an MMA fragment: in, lane 4g+t holds
// row g, columns 2t, 2t+1; out, it holds row g, columns 2t, 2t+1 of the transpose.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// The same FP4 word (8 head-dim elements) of two tokens a, b -> e[i] = fp16x2 (a_i, b_i).
__device__ __forceinline__ void decode_v_pair(uint32_t a, uint32_t b, uint32_t (&e)[8]) {
  uint32_t l0, h0, l1, h1;
  fp4x8_to_f16hi8(prmt(a, b, 0x5140u), l0, h0);  // nibbles a0 a1 b0 b1 a2 a3 b2 b3
  fp4x8_to_f16hi8(prmt(a, b, 0x7362u), l1, h1);
  f16hi4_to_f16x2x2(l0, e[0], e[2]);
  f16hi4_to_f16x2x2(h0, e[1], e[3]);
  f16hi4_to_f16x2x2(l1, e[4], e[6]);
  f16hi4_to_f16x2x2(h1, e[5], e[7]);
}

// kMulti false (decode, NB = 1): grid (num_seqs * num_kv_heads, num_partitions); requires
//   cu_query_lens == nullptr and group_size <= 8; the 8 columns are the heads of the group
//   (padded).
// kMulti true (short multi-token queries, tuning::use_spec_kernel; NC = 8 NB columns, NB from
//   tuning::spec_columns): grid (row tiles * num_kv_heads, num_partitions), tiles of NC rows
//   numbered as find_row_tile<NC> says: a CTA holds NC (query token, head) columns of one
//   sequence, token-major (column c of tile lt: R = NC lt + c, query token R / G, head
//   kvh G + R % G), so speculative decoding's q tokens x G heads read each KV tile once per NC
//   columns; every column has its own causal / window key range, applied by selection in the
//   slow path (which every tile that any column does not wholly see takes).
// block 32 * DECODE_WARPS, dynamic smem DecodeLayout<D, kE4m3, NB>::TOTAL bytes. kStates and
// kE4m3 (K8V4 keys) as for the general kernel.
template <int D, typename T, bool kStates, bool kE4m3, int NB, bool kMulti>
__global__ void __launch_bounds__(32 * tuning::DECODE_WARPS, tuning::DecodeMinBlocks<NB>::value)
    paged_attention_fp4_decode_kernel(const AttnParams p) {
  static_assert(NB == 1 || kMulti, "16 columns: multi-token queries only");
  using L = DecodeLayout<D, kE4m3, NB>;
  constexpr int NC = L::NC;
  constexpr int ST = L::ST, ROW = L::ROW, CPR = L::CPR, KROW = L::KROW, KCPR = L::KCPR;
  constexpr int KW = KROW / 16;  // words per thread per K row (a quarter row)
  constexpr int NW = D / 64;  // FP4 words per thread per V row
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int G = p.group_size;
  // the kv heads of a sequence (row tile) are consecutive CTAs (see the launch below)
  const int tile = blockIdx.x / p.num_kv_heads, kvh = blockIdx.x - tile * p.num_kv_heads, part = blockIdx.y;
  pdl_wait();  // launched as a programmatic dependent (launch_programmatic)
  if (p.num_partitions > 1) pdl_launch_dependents();  // see the SM90a decode kernel
  // sequence s, its query tokens [q0, q0 + qn), this CTA's columns [NC lt, NC lt + NC) of them
  int s = tile, q0 = tile, qn = 1, lt = 0;
  if constexpr (kMulti) {
    s = find_row_tile<NC>(p, tile, q0, qn, lt);
    if (s < 0) return;
  }
  // column c -> (query token, head); false for a padding column
  auto column = [&](int c, int& tok, int& head) -> bool {
    if constexpr (kMulti) {
      const int R = NC * lt + c;
      tok = q0 + R / G;
      head = kvh * G + R % G;
      return R < qn * G;
    } else {
      tok = s;
      head = kvh * G + c;
      return c < G;
    }
  };

  // The three loads of the prologue are independent and issued together: seq_len, this
  // thread's 16 bytes of Q, and the block ids of the warp's first 32 tiles, located from the
  // partition start (a sliding window that starts later relocates them below).
  const int seq_len = __ldg(p.seq_lens + s);
  int slot = state_slot(p, s);
  const int P = p.partition_size, nparts = p.num_partitions;
  static_assert(NC * D / 8 <= 32 * L::W, "one 16-byte Q chunk per thread");
  const int q_r = tid / (D / 8), q_col = (tid % (D / 8)) * 8;  // Q chunk: column q_r, 8 elements
  uint4 q_v = make_uint4(0, 0, 0, 0);
  {
    int q_tok, q_head;
    if (q_r < NC && column(q_r, q_tok, q_head))
      q_v = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(p.query) + q_tok * p.q_stride_tok +
                                            q_head * p.q_stride_head + q_col);
  }
  const int lbs = p.log2_block_size, bs_mask = (1 << lbs) - 1;
  const BlockRow blocks(p, s);
  const uint32_t blk_stride = (uint32_t)p.vc_stride_blk;  // K: KROW / ROW times it (binding checks)
  // tile k of this warp, counted from tile_first tf: its block id (-1 if out of range; unused
  // tiles may be looked up: the block table row is read only below max_blocks_per_seq), then
  // the byte offset of its first V token row in the kv head's cache (~0 for a bad id; K's is
  // KROW / ROW times it) and its first scale row (block * block_size + offset)
  // blocks.id's test, written on the entry: the form this kernel's measured SASS comes from
  // (blocks.id's early return schedules it differently)
  auto load_bid = [&](int tf, int k) -> int {
    const int b = blocks.entry((tf + warp + L::W * k) * 16);
    return (b < 0 || b >= p.num_blocks) ? -1 : b;
  };
  auto locate = [&](int tf, int k, int b, unsigned long long& toff, uint32_t& srow) {
    const int off = ((tf + warp + L::W * k) * 16) & bs_mask;
    toff = b < 0 ? ~0ull : (unsigned long long)(uint32_t)b * blk_stride + (uint32_t)(off * ROW);
    srow = ((uint32_t)max(b, 0) << lbs) + (uint32_t)off;
  };
  // the lanes hold tiles kc + lane (located) and kc + 32 + lane (block id, prefetched)
  int bid_nxt = load_bid((part * P) >> 4, 32 + lane);
  unsigned long long toff_l;
  uint32_t srow_l;
  locate((part * P) >> 4, lane, load_bid((part * P) >> 4, lane), toff_l, srow_l);

  // query token i of the sequence (position seq_len - qn + i) sees keys [key_lo(i), key_hi(i)];
  // with the sink, position 0 comes from the state record, merged in by the CTA of partition 0
  // for the columns whose range holds it
  auto key_hi = [&](int i) { return seq_len - qn + i; };
  auto key_lo = [&](int i) { return p.sliding_window > 0 ? max(0, key_hi(i) - p.sliding_window + 1) : 0; };
  int i_first = 0, i_last = 0;  // the CTA's first and last query token
  if constexpr (kMulti) {
    i_first = NC * lt / G;
    i_last = (min(NC * lt + NC, qn * G) - 1) / G;
  }
  const int lo_min = key_lo(i_first), lo_max = key_lo(i_last), hi_min = key_hi(i_first), hi_max = key_hi(i_last);
  const bool sink_here = p.sink && part == 0 && lo_min == 0 && seq_len > 0;
  // the keys some column sees, [r_lo, r_hi); every column sees [lo_max, hi_min]
  const int r_lo = max(p.sink ? max(lo_min, 1) : lo_min, part * P), r_hi = min(hi_max + 1, part * P + P);

  // constant rows (empty partition: 0 / (-inf, 0); bad block id: NaN)
  auto write_const_rows = [&](float oval, float mval, float lval) {
    for (int i = tid; i < NC * D; i += blockDim.x) {
      const int c = i / D, d = i % D;
      int tok, head;
      if (column(c, tok, head)) write_const_element<D, T, kStates>(p, tok, head, d, nparts, part, oval, mval, lval);
    }
  };
  if (r_lo >= r_hi && !sink_here) {
    write_const_rows(0.f, -INFINITY, 0.f);
    return;
  }
  int* misc = reinterpret_cast<int*>(smem + L::OFF_MISC);
  float* sinkS = reinterpret_cast<float*>(smem + L::OFF_SINK);
  float* qmS = reinterpret_cast<float*>(smem + L::OFF_QM);
  const bool cap_state = p.soft_cap > 0.f && p.seq_state != nullptr;
  // the transforms' inputs of this thread's Q chunk (lam, signs, sink key), issued before the
  // KV copies
  QChunk qc;
  load_q_chunk<D, kStates>(p, slot, kvh, q_col, sink_here, qc);
  float* mS = reinterpret_cast<float*>(smem + L::OFF_M);
  float* lS = reinterpret_cast<float*>(smem + L::OFF_L);
  if (tid == 0) {
    misc[0] = 0;  // Q amax bits
    misc[1] = 0;  // a block id was out of range
    if constexpr (kMulti) {  // the multi-token forms read the union range here in the slow
                             // path (registers)
      misc[2] = r_lo;
      misc[3] = r_hi;
    }
  }
  // multi-token: the last key each column sees, c_hi[c] (its first: key_lo of it), read only in
  // the slow path (from shared memory: registers are what the 16 columns are short of, and the
  // 8-column form keeps the decode's register budget); a padding column's range is arbitrary
  // (its output is never stored)
  int* c_hi = reinterpret_cast<int*>(smem + L::OFF_CHI);
  if constexpr (kMulti) {
    if (tid < NC) {
      int tok, head;
      c_hi[tid] = column(tid, tok, head) ? key_hi(tok - q0) : seq_len;
    }
  }

  // ---- tiles of this warp (the lanes hold where tiles kc .. kc + 31 are) ----
  const int tile_first = r_lo >> 4;
  const int ntiles = ((r_hi - 1) >> 4) - tile_first + 1;
  const int my_n = ntiles > warp ? (ntiles - warp + L::W - 1) / L::W : 0;
  const int Hkv = p.num_kv_heads;
  if (tile_first != (part * P) >> 4) {  // a window start: relocate
    locate(tile_first, lane, load_bid(tile_first, lane), toff_l, srow_l);
    bid_nxt = load_bid(tile_first, 32 + lane);
  }
  int kc = 0;
  bool bad = false;

  // ---- per-lane copy offsets (chunk 0; chunk i is dk_step / dv_step rows further) ----
  const int qk = lane / KCPR, jk = lane % KCPR;  // K: row, chunk
  const int rv = lane / CPR, j0 = lane % CPR;    // V
  const int vt = dv_copy_token<D>(rv);
  const uint32_t k_dst = qk * KROW + k_chunk<KROW>(qk, jk) * 16;
  const uint32_t v_dst = L::K_TILE + dv_row<D>(vt) * ROW + ((j0 ^ dv_swz<D>(vt)) * 16);
  const int s_tok = lane & 15;  // scale word: K of token s_tok (lanes 0-15), V (lanes 16-31)
  const uint32_t s_dst = L::K_TILE + L::V_TILE + 16 * (s_tok & 7) + 4 * (s_tok >> 3) + ((lane & 16) >> 1);
  const uint8_t* s_base = (lane < 16 ? p.key_scales : p.value_scales) + (long long)s_tok * Hkv + kvh;
  const uint8_t* k_base = p.key_cache + kvh * p.kc_stride_head + qk * KROW + jk * 16;
  const uint8_t* v_base = p.value_cache + kvh * p.vc_stride_head + vt * ROW + j0 * 16;
  const uint32_t pipe_s = (uint32_t)__cvta_generic_to_shared(smem + warp * ST * L::STAGE);
  uint32_t st_issue = 0;
  auto issue = [&](int k) {
    if (k >= kc + 32) {  // the next 32 tiles: locate the prefetched ids, prefetch the next
      kc += 32;
      locate(tile_first, kc + lane, bid_nxt, toff_l, srow_l);
      bid_nxt = load_bid(tile_first, kc + 32 + lane);
    }
    const unsigned long long toff = __shfl_sync(0xffffffffu, toff_l, k - kc);
    const uint32_t srow = __shfl_sync(0xffffffffu, srow_l, k - kc);
    const uint32_t st = pipe_s + st_issue * L::STAGE;
    st_issue = (st_issue + 1 == ST) ? 0 : st_issue + 1;
    if (toff == ~0ull) { bad = true; return; }
#pragma unroll
    for (int i = 0; i < L::NI_K; ++i)
      cp_async_16(st + k_dst + dk_step<KCPR>(i) * KROW, k_base + toff * (KROW / ROW) + dk_step<KCPR>(i) * KROW);
#pragma unroll
    for (int i = 0; i < L::NI_V; ++i)
      cp_async_16(st + v_dst + dv_step<D>(i) * ROW, v_base + toff + dv_step<D>(i) * ROW);
    cp_async_4(st + s_dst, reinterpret_cast<const void*>((uintptr_t)(s_base + (unsigned long long)srow * (uint32_t)Hkv) & ~(uintptr_t)3));
  };
#pragma unroll
  for (int k = 0; k < ST - 1; ++k) {
    if (k < my_n) issue(k);
    cp_async_commit();
  }
  // with the sink table: where the sink rows are, under the first copies
  slot = sink_ref<D>(p, s, kvh, sink_here, slot);
  if (sink_here && p.sink_tags != nullptr) sink_elements<D, 8, true>(p, slot, kvh, q_col, qc.sk);

  // ---- Q: the NC columns' rows (padding rows 0), the transforms in fp32 (q * lam, rotation;
  //      D/8 lanes per row), the sink's logit, tile amax, power-of-two prescale, fp16 B
  //      fragments ----
  float qv[8];
  const int q_row = min(q_r, NC - 1);  // threads past the NC rows store nothing
  prepare_q8<D, T, kStates>(p, qc, q_v, sink_here, q_r < NC && q_col == 0, sinkS + q_row, qmS + q_row, qv, lane);
  float* qraw = reinterpret_cast<float*>(smem + L::OFF_QRAW);
  unsigned amax_bits = 0;
  if (q_r < NC) {
    *reinterpret_cast<float4*>(qraw + q_r * D + q_col) = make_float4(qv[0], qv[1], qv[2], qv[3]);
    *reinterpret_cast<float4*>(qraw + q_r * D + q_col + 4) = make_float4(qv[4], qv[5], qv[6], qv[7]);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax_bits = max(amax_bits, __float_as_uint(fabsf(qv[i])));
  }
  const int qexp = q_prescale_exponent(amax_bits, reinterpret_cast<unsigned*>(misc));
  const float qmul = pow2i(qexp);
  uint2* qf = reinterpret_cast<uint2*>(smem + L::OFF_QFRAG);
  for (int idx = tid; idx < NB * (D / 16) * 32; idx += blockDim.x) {
    const int nb = idx / ((D / 16) * 32), ks = (idx >> 5) % (D / 16), gg = (idx & 31) >> 2, tt = idx & 3;
    // B fragment of n-block nb, k-step ks: Q^T rows (slots) 2t, 2t+1 | 2t+8, 2t+9 of column
    // 8 nb + gg, in the permutation of decode_key8
    const int E0 = tt * (D / 4) + 8 * (ks >> 1) + (ks & 1);
    const int A1 = 2, B0 = 4;
    auto q = [&](int d) { return qraw[(8 * nb + gg) * D + d] * qmul; };
    qf[idx] = make_uint2(pack_f16x2(q(E0), q(E0 + A1)), pack_f16x2(q(E0 + B0), q(E0 + B0 + A1)));
  }
  __syncthreads();
  constexpr bool QREG = NB * D <= tuning::DECODE_QREG_MAX_D;
  uint32_t qb[QREG ? NB : 1][QREG ? D / 16 : 1][2];
  if constexpr (QREG) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const uint2 f = qf[(nb * (D / 16) + ks) * 32 + lane];
        qb[nb][ks][0] = f.x;
        qb[nb][ks][1] = f.y;
      }
  }

  const bool cap = p.soft_cap > 0.f;
  // logit = acc * 2^(b-127) * kmul (see the general kernel)
  const float kmul = p.scale * pow2i(KeyRow<D, kE4m3>::DEC_EXP - qexp) * (cap ? 1.f : LOG2E);
  const float cap_v = p.soft_cap, inv_cap = soft_cap_reciprocal(p);
  const uint32_t k_sel = 0x4440u | (uint32_t)(((uintptr_t)p.key_scales + kvh + g * Hkv) & 3);
  const uint32_t v_sel = 0x4440u | (uint32_t)(((uintptr_t)p.value_scales + kvh + g * Hkv) & 3);
  constexpr float SLACK = (float)tuning::RESCALE_SLACK;

  float acc[NB][D / 16][4];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int j = 0; j < D / 16; ++j) acc[nb][j][0] = acc[nb][j][1] = acc[nb][j][2] = acc[nb][j][3] = 0.f;
  // per column 8 nb + 2t, 8 nb + 2t + 1: reference maximum (-inf: none yet), the same with
  // -inf -> 0 (used in exp2), the fast-path threshold, and this thread's share of the row sum
  float m_ref[NB][2], m_use[NB][2], m_thr[NB][2], l_run[NB][2];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_ref[nb][h] = m_thr[nb][h] = -INFINITY;
      m_use[nb][h] = l_run[nb][h] = 0.f;
    }
  // NB 1 keeps the exp2 offset and the fast-path threshold in registers; NB 2 (twice the
  // columns and accumulators) derives them from m_ref where used, within 128 registers
  auto m_off = [&](int nb, int h) { return NB == 1 ? m_use[nb][h] : (m_ref[nb][h] == -INFINITY ? 0.f : m_ref[nb][h]); };
  auto m_fast = [&](int nb, int h) { return NB == 1 ? m_thr[nb][h] : m_ref[nb][h] + SLACK; };
  int VM = 0;  // running maximum V-scale byte of the warp's visible tokens
  // every column sees the keys [all_lo, all_hi): a tile inside needs no per-column mask
  const int all_lo = max(r_lo, lo_max), all_hi = min(r_hi, hi_min + 1);

  uint32_t st_comp = 0;
  for (int k = 0; k < my_n; ++k) {
    if (k + ST - 1 < my_n) issue(k + ST - 1);
    cp_async_commit();
    cp_async_wait<ST - 1>();
    __syncwarp();
    const uint8_t* st = smem + (warp * ST + st_comp) * L::STAGE;
    st_comp = (st_comp + 1 == ST) ? 0 : st_comp + 1;
    const int t0 = (tile_first + warp + L::W * k) * 16;
    // a tile some column does not wholly see: masks (union range; per column for multi-token)
    const bool need_mask = (t0 < all_lo) || (t0 + 16 > all_hi);

    const uint4 sw = *reinterpret_cast<const uint4*>(st + L::K_TILE + L::V_TILE + 16 * g);
    uint32_t kb0 = prmt(sw.x, 0, k_sel), kb1 = prmt(sw.y, 0, k_sel);  // tokens g, g+8
    uint32_t vb0 = prmt(sw.z, 0, v_sel), vb1 = prmt(sw.w, 0, v_sel);

    // ---- S^T = K Q^T, per n-block ----
    uint32_t ka[KW], kb[KW];  // this thread's quarter of token rows g, g+8
    load_key_quarter<KROW>(st + g * KROW, g, t4, ka);
    load_key_quarter<KROW>(st + (g + 8) * KROW, g + 8, t4, kb);
    float sa[NB][4], sb[NB][4];  // even / odd k-steps (NB 1; sa only for NB 2)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int i = 0; i < 4; ++i) sa[nb][i] = sb[nb][i] = 0.f;
    constexpr int W8 = KeyRow<D, kE4m3>::WORDS8;
#pragma unroll
    for (int w = 0; w < D / 32; ++w) {  // 8 elements of each row per step
      uint32_t h0[4], h1[4];
      decode_key8<kE4m3>(ka + W8 * w, h0);
      decode_key8<kE4m3>(kb + W8 * w, h1);
      const uint32_t a_even[4] = {h0[0], h1[0], h0[1], h1[1]};
      const uint32_t a_odd[4] = {h0[2], h1[2], h0[3], h1[3]};
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        // NB 1: even and odd k-steps in two accumulators (two independent MMA chains); NB 2:
        // the two n-blocks are the independent chains, one accumulator each (registers)
        float (&odd_acc)[4] = NB == 1 ? sb[nb] : sa[nb];
        if constexpr (QREG) {
          mma_m16n8k16_f16(sa[nb], a_even, qb[nb][2 * w][0], qb[nb][2 * w][1]);
          mma_m16n8k16_f16(odd_acc, a_odd, qb[nb][2 * w + 1][0], qb[nb][2 * w + 1][1]);
        } else {
          const uint2 f0 = qf[(nb * (D / 16) + 2 * w) * 32 + lane], f1 = qf[(nb * (D / 16) + 2 * w + 1) * 32 + lane];
          mma_m16n8k16_f16(sa[nb], a_even, f0.x, f0.y);
          mma_m16n8k16_f16(odd_acc, a_odd, f1.x, f1.y);
        }
      }
    }
    // x[nb][0] token g column 2t, [1] token g column 2t+1, [2] token g+8 column 2t, [3] token
    // g+8 column 2t+1 (columns of n-block nb)
    float x[NB][4];
    {
      const float kf0 = __int_as_float(kb0 << 23) * kmul, kf1 = __int_as_float(kb1 << 23) * kmul;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        float d[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) d[i] = NB == 1 ? sa[nb][i] + sb[nb][i] : sa[nb][i];
        x[nb][0] = d[0] * kf0;
        x[nb][1] = d[1] * kf0;
        x[nb][2] = d[2] * kf1;
        x[nb][3] = d[3] * kf1;
      }
    }
    if (cap) {  // warp-uniform; q.m of columns 2t, 2t+1 back in (records)
      // (NB 2 recomputes 1 / cap here rather than keep it in a register through the loop)
      const float rcap = NB == 1 ? inv_cap : soft_cap_reciprocal(p);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float qm = cap_state ? qmS[8 * nb + 2 * t4 + (i & 1)] : 0.f;
          x[nb][i] = cap_v * tanhf((x[nb][i] + qm) * rcap) * LOG2E;
        }
    }
    bool odd = (max(vb0, vb1) > (uint32_t)VM) || (max(kb0, kb1) == 255u);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
      odd = odd || (fmaxf(x[nb][0], x[nb][2]) > m_fast(nb, 0)) || (fmaxf(x[nb][1], x[nb][3]) > m_fast(nb, 1));
    float vf0, vf1;  // V-scale factors of tokens g, g+8 folded into P
    if (__any_sync(0xffffffffu, odd || need_mask)) {
      // ---- slow path: NaN scales, masking, exact maxima, rescale ----
      const float NaN = __int_as_float(0x7fc00000);
      const int tok0 = t0 + g, tok1 = t0 + g + 8;
      const int u_lo = kMulti ? misc[2] : r_lo, u_hi = kMulti ? misc[3] : r_hi;
      const bool out0 = tok0 < u_lo || tok0 >= u_hi, out1 = tok1 < u_lo || tok1 >= u_hi;  // no column sees it
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        if (kb0 == 255u) x[nb][0] = x[nb][1] = NaN;
        if (kb1 == 255u) x[nb][2] = x[nb][3] = NaN;
        if (need_mask) {
          if (out0) x[nb][0] = x[nb][1] = -INFINITY;
          if (out1) x[nb][2] = x[nb][3] = -INFINITY;
          if constexpr (kMulti) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int tok = i < 2 ? tok0 : tok1, hi = c_hi[8 * nb + 2 * t4 + (i & 1)];
              const int lo = p.sliding_window > 0 ? hi - p.sliding_window + 1 : 0;
              if (tok < lo || tok > hi) x[nb][i] = -INFINITY;
            }
          }
        }
      }
      if (need_mask) {  // tokens no column sees leave the V-scale maximum
        if (out0) vb0 = 0u;
        if (out1) vb1 = 0u;
      }
      float mx[NB][2];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        mx[nb][0] = fmaxf(x[nb][0], x[nb][2]);
        mx[nb][1] = fmaxf(x[nb][1], x[nb][3]);
      }
      int vmax = max(vb0 == 255u ? 0 : (int)vb0, vb1 == 255u ? 0 : (int)vb1);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          mx[nb][0] = fmaxf(mx[nb][0], __shfl_xor_sync(0xffffffffu, mx[nb][0], o));
          mx[nb][1] = fmaxf(mx[nb][1], __shfl_xor_sync(0xffffffffu, mx[nb][1], o));
        }
        vmax = max(vmax, __shfl_xor_sync(0xffffffffu, vmax, o));
      }
      const int VM_new = max(VM, vmax);
      const float vr = pow2i(VM - VM_new);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        float f[2];
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const float m_new = fmaxf(m_ref[nb][rh], mx[nb][rh]);
          const float alpha = (m_new == -INFINITY) ? 1.f : fast_exp2(m_ref[nb][rh] - m_new);
          l_run[nb][rh] *= alpha;
          f[rh] = alpha * vr;
          m_ref[nb][rh] = m_new;
          m_use[nb][rh] = (m_new == -INFINITY) ? 0.f : m_new;
          m_thr[nb][rh] = m_new + SLACK;
        }
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
          acc[nb][j][0] *= f[0]; acc[nb][j][1] *= f[1]; acc[nb][j][2] *= f[0]; acc[nb][j][3] *= f[1];
        }
      }
      VM = VM_new;
      vf0 = vb0 == 255u ? NaN : p_vscale(vb0, VM);
      vf1 = vb1 == 255u ? NaN : p_vscale(vb1, VM);
    } else {  // every byte is <= VM < 255 here
      vf0 = p_vscale(vb0, VM);
      vf1 = p_vscale(vb1, VM);
    }
    // ---- P' (fp16), transposed into the B fragments of O^T = V^T P^T ----
    uint32_t pb0[NB], pb1[NB];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const float u0 = m_off(nb, 0), u1 = m_off(nb, 1);
      const float p0 = fast_exp2(x[nb][0] - u0), p1 = fast_exp2(x[nb][1] - u1);
      const float p2 = fast_exp2(x[nb][2] - u0), p3 = fast_exp2(x[nb][3] - u1);
      l_run[nb][0] += p0 + p2;
      l_run[nb][1] += p1 + p3;
      float pv[4] = {p0 * vf0, p1 * vf0, p2 * vf1, p3 * vf1};
      if constexpr (kMulti) {  // a V scale of 255 is NaN only for the columns that see its token
        if (need_mask) {
#pragma unroll
          for (int i = 0; i < 4; ++i) pv[i] = x[nb][i] == -INFINITY ? 0.f : pv[i];  // (a masked logit is
        // -inf; a visible one only if q.k overflows fp32, where this gives 0 and the reference NaN)
        }
      }
      pb0[nb] = movmatrix_trans(pack_f16x2(pv[0], pv[1]));
      pb1[nb] = movmatrix_trans(pack_f16x2(pv[2], pv[3]));
    }

    // ---- O^T += V^T P^T: tokens 2t, 2t+1 (a0, a1) and 2t+8, 2t+9 (a2, a3) ----
    {
      uint32_t xv[4][NW];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int tok = 2 * t4 + (q & 1) + 8 * (q >> 1);
        const int byte = g * (D / 16);
        const uint8_t* src = st + L::K_TILE + dv_row<D>(tok) * ROW + (((byte >> 4) ^ dv_swz<D>(tok)) * 16) + (byte & 15);
        if constexpr (NW == 1) {
          xv[q][0] = *reinterpret_cast<const uint32_t*>(src);
        } else if constexpr (NW == 2) {
          const uint2 a = *reinterpret_cast<const uint2*>(src);
          xv[q][0] = a.x; xv[q][1] = a.y;
        } else {
          const uint4 a = *reinterpret_cast<const uint4*>(src);
          xv[q][0] = a.x; xv[q][1] = a.y; xv[q][2] = a.z; xv[q][3] = a.w;
        }
      }
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        uint32_t e01[8], e89[8];
        decode_v_pair(xv[0][w], xv[1][w], e01);
        decode_v_pair(xv[2][w], xv[3][w], e89);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t a[4] = {e01[i], e01[i + 4], e89[i], e89[i + 4]};
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) mma_m16n8k16_f16(acc[nb][4 * w + i], a, pb0[nb], pb1[nb]);
        }
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();

  // ---- merge the warps ----
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh)
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) l_run[nb][rh] += __shfl_xor_sync(0xffffffffu, l_run[nb][rh], o);
  const bool any_bad = __any_sync(0xffffffffu, bad);
  // partition 0: the sink value elements this lane writes (loaded under the merge below)
  constexpr int EPL = D / 32;
  float sv[EPL];
  // (NB 2 with records reads the slot again rather than keep it in a register through the key
  // loop)
  if (sink_here) load_sink_value<D, true>(p, NB == 1 || p.sink_tags != nullptr ? slot : state_slot(p, s), kvh, lane * EPL, sv);
  __syncthreads();  // every warp is done with its pipeline buffers
  if (any_bad && lane == 0) misc[1] = 1;
  if (g == 0) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mS[warp * NC + 8 * nb + 2 * t4 + h] = m_ref[nb][h];
        lS[warp * NC + 8 * nb + 2 * t4 + h] = l_run[nb][h];
      }
  }
  {
    float* mo = reinterpret_cast<float*>(smem);  // [W][NC columns][MROW], natural head-dim order
    const float osc = pow2i(VM - 142 + TQ_SLACK + TQ_DEC_EXP);  // undo P's and the decode's powers of two
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      float* m0 = mo + (warp * NC + 8 * nb + 2 * t4) * L::MROW + g * (D / 8);
      float* m1 = m0 + L::MROW;
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        const int d = 8 * (j >> 2) + (j & 3);
        m0[d] = acc[nb][j][0] * osc;
        m1[d] = acc[nb][j][1] * osc;
        m0[d + 4] = acc[nb][j][2] * osc;
        m1[d + 4] = acc[nb][j][3] * osc;
      }
    }
  }
  __syncthreads();
  if (misc[1]) {
    write_const_rows(__int_as_float(0x7fc00000), 0.f, __int_as_float(0x7fc00000));
    return;
  }
  // warp w writes columns w, w + W, ..; lane: D/32 consecutive elements
  const float* mo = reinterpret_cast<const float*>(smem);
  const int d0 = lane * EPL;
#pragma unroll
  for (int r = warp; r < NC; r += L::W) {
    int tok, head;
    if (!column(r, tok, head)) break;  // warp-uniform; padding columns come last
    float wt[L::W], M;
    float Ls = merge_weights(mS + r, lS + r, NC, wt, M);
    const float inv = (Ls == 0.f) ? 0.f : 1.f / Ls;  // NaN stays NaN
    float a[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) a[e] = merge_sum(wt, mo + r * L::MROW + d0 + e, NC * L::MROW) * inv;
    // the sink joins the columns whose range holds position 0 as one more key (exp2 domain;
    // not a query token at a negative position, with more query tokens than keys)
    if (sink_here && (!kMulti || (key_lo(tok - q0) == 0 && key_hi(tok - q0) >= 0)))
      merge_sink<EPL>(sink_logit(p, sinkS[r], cap_state ? qmS[r] : 0.f), sv, M, Ls, a);
    store_decode_row<D, T, kStates>(p, tok, head, part, nparts, needs_q_dot_center<kStates>(p) ? qmS[r] : 0.f,
                                    M, Ls, a, lane);
  }
}

// One instantiation of the decode kernel (NB = 1, kMulti false: decode; kMulti: short
// multi-token queries in NB n-blocks of 8 columns) on grid (ctas * num_kv_heads, num_partitions).
template <int D, typename T, bool kStates, bool kE4m3, int NB, bool kMulti>
cudaError_t launch_decode_kernel(const AttnParams& p, int ctas, cudaStream_t stream) {
  using L = DecodeLayout<D, kE4m3, NB>;
  auto kern = paged_attention_fp4_decode_kernel<D, T, kStates, kE4m3, NB, kMulti>;
  static bool attr_set[kMaxDevices] = {};  // per instantiation and device
  // CTA x = s * num_kv_heads + kv head: the kv heads of one sequence start together and walk
  // their blocks in step, so the scale sectors they share ([block, token, kv head] bytes: a
  // 32-byte sector holds 32 / num_kv_heads tokens of every head) come from DRAM once and from
  // L2 for the other heads. With the sequence index fastest the heads of a sequence would run
  // num_seqs CTAs apart, often in different waves (ncu, 64 x 16k: 5.8 % more DRAM bytes than
  // the kernel needs, about what re-reading the scale sectors per head costs: 224 of 2080
  // bytes per tile and head without reuse).
  return launch_kv_grid(kern, attr_set, ctas, L::W, L::TOTAL, p, stream);
}

}  // namespace cuda_fp4
}  // namespace turboquant
