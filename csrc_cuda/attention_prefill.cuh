// turboquant cuda backend (SM80-SM90): the prefill kernel, multi-token queries with many rows
// per sequence (chunked prefill), head dim 64 or 128, FP4 or E4M3 (K8V4) keys, with or without
// the lse output and learned sinks. Torch-free. Shares the
// parameters, the Q transforms, the sink merge and the output un-rotation with
// attention_general.cuh (the general kernel, which serves everything this one declines).
//
// ============================== design note ==============================================
// Why a third kernel: the general kernel gives each 16-row tile (query token x head pairs) a
// CTA whose warps split the KV tiles, and every warp decodes its FP4 tiles in registers: a
// 16-token tile's decode (~150 integer instructions per lane) is paid once per 16 rows, which
// caps a long chunk at ~130 TFLOP/s on the H100. Here a CTA holds PREFILL_ROWS rows (16 per
// warp) and its warps walk the SAME KV steps: each step's codes are copied
// once (cp.async ring) and decoded once into shared memory as fp16, which every warp reads: the
// decode is shared by 8 row tiles. Two MMA paths over the same tiles, fp32 accumulation:
//   SM90a: warp-specialized. W producer warps copy and decode (setmaxnreg: 48 registers), W row
//     warps (two warpgroups, 208 registers) run warpgroup MMAs (wgmma), a warpgroup's 64 rows
//     per MMA: S = Q K^T with Q fragments in registers, K from shared memory, O += P' V with P'
//     from registers, both asynchronous; the tiles change hands through named barriers (below);
//     S on FP8 tensor cores (tuning::PREFILL_FP8_S: K tiles of E5M2 bytes from FP4 keys or of
//     K8V4's E4M3 key bytes as they are, Q as two E4M3 terms);
//   SM80-SM89 (and -DTQ_PREFILL_MMA_SYNC): every warp copies, decodes and computes: FA2-style
//     m16n8k16 mma.sync per warp, Q fragments in registers, K / V fragments by ldmatrix.
// H200, 32/8/128, 1 x 2048 @ 16k: 1472 us (350 TFLOP/s). Warp specialization is most of that:
// without the conflict-free decode stores and the warpgroups' turns, 1548 us warp-specialized
// against 1883 us with every warp of the wgmma path also decoding (H100: 1840 us, mma.sync 2541).
// Grid (row groups * num_kv_heads, 1), kv head fastest: sequence s owns row groups
//   [s + floor(cu[s] G / ROWS), s + 1 + floor(cu[s+1] G / ROWS)) (at least the ceil(q G / ROWS)
//   it needs; a CTA past its sequence's rows exits), found by binary search over cu_query_lens;
//   CTA x takes row group (grid x - 1 - x / Hkv): the heaviest groups, a sequence's last rows,
//   start first (H200, one call: 3 x 700 @ 6k 580.0 against 607.7 us, 2 x 1024 @ 8k 674.5
//   against 688.9, 1 x 2048 @ 16k 1210.2 against 1224.7, 1 x 8192 @ 64k 18230.8 against 18355.6).
//   Rows are query-token major as in the general kernel: row R -> token R / G, head R % G.
// Per KV step of TK = PREFILL_TILE tokens (a ring of raw codes, PREFILL_STAGES_* deep):
//   copy (thread t of the NT = 32 W copying threads: the producer warps with wgmma, every warp
//     below): thread t copies 16-byte chunks c(t) (+ 32 W i: E4M3 keys at D 128 have two) of
//     the K and chunk c(t) of the V codes (c: chunk_of_thread, a permutation inside each warp
//     that keeps the decode's stores free of bank conflicts), and threads [0, 2 TK) one scale
//     word each (K, then V);
//     16-token sub-tiles outside the CTA's key range are not copied (their block may not
//     exist); a bad block id of a needed sub-tile makes the CTA's rows NaN, never a read.
//   decode: the same thread decodes what it copied (no barrier needed) into the step's fp16
//     tile (FP8 S: K as E5M2 bytes, or K8V4's E4M3 bytes moved, one 128-byte row per token,
//     each 8 elements' bytes in the order 0 2 4 6 1 3 5 7 that Q's E4M3 columns follow)
//     (dec_off: D / 64 panels of 128-byte rows, 16-byte chunk c of row r at c ^ (r & 7):
//     wgmma's 128-byte swizzle, and the 8 rows an ldmatrix reads hit distinct banks; four
//     tiles with wgmma, two with mma.sync): values E2M1 * 2^-14 (E4M3 keys in fp16 tiles:
//     * 2^-8; on FP8 S as stored); the K
//     scales as floats (2^(kb-127), with wgmma times the logits' factor kmul; NaN for 255, 0
//     where not copied), the V bytes as ints; per 32 tokens the V-scale maximum vmax of the
//     visible tokens (255 excluded), whether a visible token's V byte is 255, and per token
//     2^(vb - vmax) (clamped to [0, 1]).
//   compute (per MMA unit, a warpgroup's or a warp's rows): S = Q K^T (Q power-of-two
//     prescaled per CTA with wgmma, per warp with mma.sync), logits = S * 2^(kb-127) * scale
//     in the exp2 domain, soft cap, causal / window masking by selection on boundary steps, online softmax
//     with the general kernel's lazy rescaling and V-scale folding (P' = p * 2^(vb - VM + 15 -
//     SLACK) = p * 2^(vb - vmax) * 2^(vmax - VM + 15 - SLACK): one multiply per token), O += P' V.
//     Steps outside the unit's rows' key range skip the compute.
//   wgmma: the producers run up to NDEC - 1 steps ahead (NDEC tiles, four: FULL / EMPTY); the
//   row warps wait for step k's tile, issue S, wait for it (and for step k - 1's P V, whose tile
//   they then hand back), do the softmax and issue P V; the two warpgroups take turns to issue
//   (ping-pong: one's MMAs under the other's softmax). mma.sync: the next step's decode runs
//   while other warps do this step's MMAs; one __syncthreads per step.
// With the decode-once workspace (kWs, prefill_workspace.cuh) the producers only copy finished
// tiles: one warpgroup of them at 32 registers, the row warps at 232 (tuning.cuh: 3-4.5 %
// faster than two producer warpgroups), and each warpgroup runs step k's softmax under its own
// step k - 1 O += P' V (S (k) and that MMA issued in one turn, a wait for S alone, then one for
// the MMA; a rescale of O waits for it; unrolled by two so that the two steps' P' fragments
// keep their registers: 2-4 % faster).
// Epilogue: per row, O / l, the sink (rows whose window holds position 0), the learned sink
//   and the lse (kStates), the un-rotation, the store; no cross-warp merge (each warp owns its
//   rows). One partition (no split-KV).
// NaN semantics follow the general kernel: a scale byte 255 of a visible token makes the rows
// that see it NaN; masked tokens never reach a row; a state slot outside seq_state gives the
// sequence's rows NaN (through Q).
// ===========================================================================================
#pragma once

#include "attention_common.cuh"

namespace turboquant {
namespace cuda_fp4 {

template <int D, bool kE4m3, bool kWG, bool kWsL = false>
struct PrefillLayout {
  // W warps hold the rows (16 each); NT threads copy and decode: the same W warps below SM90,
  // PW more (producers) with wgmma: W, or with the workspace (WS: copies only) one warpgroup;
  // NTH threads in all. PREGS / CREGS: the producers' and the row warps' registers (setmaxnreg)
  static constexpr bool WS = kWG && kWsL;
  static constexpr int W = tuning::PREFILL_WARPS, ROWS = tuning::PREFILL_ROWS;
  static constexpr int PW = WS ? tuning::PREFILL_WS_PRODUCER_WARPS : W, NT = 32 * PW, NTH = kWG ? NT + 32 * W : NT;
  static constexpr int PREGS = WS ? tuning::PREFILL_WS_PRODUCER_REGS : tuning::PREFILL_PRODUCER_REGS;
  static constexpr int CREGS = WS ? tuning::PREFILL_WS_CONSUMER_REGS : tuning::PREFILL_CONSUMER_REGS;
  static constexpr int TK = tuning::PREFILL_TILE, ST = kWG ? tuning::PREFILL_STAGES_WGMMA : tuning::PREFILL_STAGES_MMA;
  static constexpr bool E4M3 = kE4m3;
  static constexpr int KROWB = KeyRow<D, kE4m3>::BYTES, VROWB = D / 2;  // code bytes per token
  static constexpr int KCPR = KROWB / 16, VCPR = VROWB / 16;         // 16-byte chunks per token
  static constexpr int KCH = TK * KCPR, VCH = TK * VCPR;              // chunks per step
  static constexpr int NK = (KCH + NT - 1) / NT;                      // K chunks per thread
  static_assert((WS || VCH <= NT) && 2 * TK <= NT && TK % 32 == 0, "one V chunk and one scale word per thread");
  static constexpr int RAW_K = TK * KROWB, RAW_V = TK * VROWB, RAW_S = TK * 4;
  static constexpr int RAW = RAW_K + RAW_V + 2 * RAW_S;  // K codes, V codes, K / V scale words
  // A decoded fp16 tile [TK tokens][D] is D / 64 panels of [TK][64 elements = 128 bytes], each
  // 128-byte row swizzled (dec_off): wgmma's SWIZZLE_128B atoms, read by ldmatrix below SM90.
  static constexpr int DPANEL = TK * 128;
  // FP8 S (tuning::PREFILL_FP8_S, wgmma; D 64 and 128, FP4 and K8V4 keys): the K tile
  // holds E5M2 bytes (FP4 keys) or the E4M3 key bytes (K8V4), one 128-byte row per token
  // (K-major, 128-byte swizzle: chunk c of row r at c ^ (r & 7); D 64 uses its first half),
  // each 8 bytes in the order 0 2 4 6 1 3 5 7
  static constexpr bool S8 = tuning::PREFILL_FP8_S && kWG;
  // decoded key value = code value * 2^-KDEC_EXP (FP8 S: the E4M3 key bytes as they are)
  static constexpr int KDEC_EXP = S8 && kE4m3 ? 0 : KeyRow<D, kE4m3>::DEC_EXP;
  static constexpr int DEC_K = S8 ? TK * 128 : TK * 2 * D, DEC_V = TK * 2 * D;
  // binades the Q prescale's target lies below fp16's [2^14, 2^15) (prescale_exponent): FP8 S
  // puts max |q| 2^e in [2^7, 2^8), inside E4M3's 448; producers and row warps both subtract it
  static constexpr int QEXP_DROP = S8 ? 7 : 0;
  // 4-byte words at OFF_SB: K scales as floats [4 SB_PITCH], V bytes [TK], per 32 tokens the
  // V-scale maximum vmax [TK / 32] and whether a visible token's V byte is 255 [TK / 32], per
  // token 2^(V byte - its 32 tokens' vmax), clamped to [0, 1] [4 SB_PITCH] (wgmma: as fp16, in
  // the first half of that). Token tok's K scale (float) and V factor (fp16 with wgmma, float
  // below) have index sb_slot(tok) in their arrays: with wgmma, part (tok / 2) % 4 holds tokens
  // 8 j + 2 t4 + {0, 1} (j = 0 .. TK / 8 - 1) in order, which is what the row warps' thread t4
  // reads, as 16-byte words: two K-scale pairs, four V-factor pairs. SB_PITCH = TK / 4 + 8: the
  // four parts start 96 bytes apart (floats) and 48 bytes apart (halves), so that each read's
  // four words hit distinct banks and the halves' words stay 16-byte aligned. With mma.sync,
  // token order, read in pairs (the permuted order makes the sm_80 build spill 8 bytes at 255
  // registers). The V bytes, read on NaN steps only, are in token order.
  static constexpr int OFF_SB = DEC_K + DEC_V;
  // The decode-once workspace's tile of one (sequence, step, kv head) (prefill_workspace.cuh):
  // the step's decoded K and V exactly as a decode buffer holds them, then the K and V scale
  // bytes of its TK tokens, then per 16-token sub-tile whether its block id is bad (1) or not.
  static constexpr int WS_SCALES = DEC_K + DEC_V, WS_BAD = WS_SCALES + 2 * TK;
  static constexpr int WS_TILE = (WS_BAD + TK / 16 + 127) / 128 * 128;
  static constexpr int SB_PITCH = TK / 4 + 8;
  static constexpr int SB_KF = 0, SB_VB = 4 * SB_PITCH, SB_VMAX = SB_VB + TK, SB_VNAN = SB_VMAX + TK / 32;
  static constexpr int SB_VG = SB_VNAN + TK / 32;
  static_assert(SB_VG % 4 == 0, "SB_VG: 16-byte aligned");
  static __device__ __forceinline__ int sb_slot(int tok) {
    return kWG ? ((tok >> 1) & 3) * SB_PITCH + (tok >> 3) * 2 + (tok & 1) : tok;
  }
  // the word of tokens 8 j + 2 t4 + {0, 1} (with wgmma and j even: the 16-byte word of j, j + 1)
  static __device__ __forceinline__ int sb_pair(int t4, int j) { return kWG ? SB_PITCH * t4 + 2 * j : 8 * j + 2 * t4; }
  static constexpr int DEC = (OFF_SB + (SB_VG + 4 * SB_PITCH) * 4 + 1023) / 1024 * 1024;  // 1024-byte aligned buffers
  static constexpr int NDEC = kWG ? tuning::PREFILL_DEC_BUFFERS_WGMMA : tuning::PREFILL_DEC_BUFFERS_MMA;
  // wgmma: named barriers FULL + NDEC w + b (decode buffer b is full, for warpgroup w of rows:
  // one per warpgroup, so that neither waits for the other at a tile), EMPTY + b (buffer b has
  // been read by both), BAR_CTA for the whole CTA before the split's end (its warps reach it
  // from two code paths: __syncthreads there is a divergent barrier, compute-sanitizer's
  // synccheck says) and again, as DONE, after the main loop, and TURN + w (warpgroup w's turn
  // to issue its MMAs, the ping-pong below)
  static constexpr int WGS = W / 4;  // warpgroups of rows
  static constexpr int BAR_FULL = 1, BAR_EMPTY = 1 + WGS * NDEC, BAR_CTA = BAR_EMPTY + NDEC, BAR_DONE = BAR_CTA;
  static constexpr int BAR_TURN = BAR_CTA + 1;
  static_assert(BAR_TURN + 1 < 16, "16 hardware barriers");
  static constexpr int OPITCH = D + 4;               // epilogue rows (floats)
  static constexpr int BIG_A = NDEC * DEC, BIG_B = W * 16 * OPITCH * 4, BIG_C = W * 16 * D * 4;
  static constexpr int BIG = BIG_A > BIG_B ? (BIG_A > BIG_C ? BIG_A : BIG_C) : (BIG_B > BIG_C ? BIG_B : BIG_C);
  // NDEC decode buffers after the raw-code ring (none with the workspace); aliased by the
  // prologue's fp32 Q rows and the epilogue's O
  static constexpr int OFF_DEC = WS ? 0 : (ST * RAW + 1023) / 1024 * 1024;
  static constexpr int OFF_ROWS = OFF_DEC + BIG;     // per CTA row: q'.k0', scale * q.m, m, l
  static constexpr int OFF_QAMAX = OFF_ROWS + 4 * ROWS * 4;  // wgmma: one word, the CTA's max |q| (bits)
  static constexpr int TOTAL = OFF_QAMAX + 16 + 1024;  // + the base's alignment to 1024
};

// Byte offset of 16-byte chunk c (head-dim elements 8c .. 8c+7) of token r in a decoded tile of
// TK tokens: panel c / 8, row r, chunk (c % 8) ^ (r % 8) (wgmma's 128-byte swizzle; the 8 rows an
// ldmatrix reads hit distinct banks).
template <int TK>
__device__ __forceinline__ int dec_off(int r, int c) {
  return (c >> 3) * (TK * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// 32 FP4 codes (16 bytes: head-dim elements [32 q, 32 q + 32) of one token r) -> fp16 values
// E2M1 * 2^-14 in head-dim order, four 16-byte chunks of row r of the decoded tile, at
// off ^ (i << 4) for off = dec_off(r, 4 q) (chunks 4 q + i of one panel: the swizzle's XOR
// with r & 7 commutes with i < 4; the thread computes off once). 11 integer ops per 8.
__device__ __forceinline__ void decode_fp4_chunk(uint4 w4, uint8_t* tile, uint32_t off) {
  const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi, o[4];
    fp4x8_to_f16hi8(w[i], lo, hi);                          // lo: e0 e2 e4 e6, hi: e1 e3 e5 e7
    f16hi4_to_f16x2x2(prmt(lo, hi, 0x5140u), o[0], o[1]);  // (e0, e1) (e2, e3)
    f16hi4_to_f16x2x2(prmt(lo, hi, 0x7362u), o[2], o[3]);  // (e4, e5) (e6, e7)
    *reinterpret_cast<uint4*>(tile + (off ^ (i << 4))) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}
// 32 FP4 codes -> 32 E5M2 bytes E2M1 * 2^-14 (fp4x8_to_f16hi8's high bytes, each 8 codes' in its
// order 0 2 4 6 1 3 5 7, which Q's columns follow): two 16-byte chunks of a 128-byte K-major row,
// at off and off ^ 16 (chunks 2 q and 2 q + 1 under the swizzle). 7 integer ops per 8.
__device__ __forceinline__ void decode_fp4_chunk_e5m2(uint4 w4, uint8_t* tile, uint32_t off) {
  uint32_t lo[4], hi[4];
  fp4x8_to_f16hi8(w4.x, lo[0], hi[0]);
  fp4x8_to_f16hi8(w4.y, lo[1], hi[1]);
  fp4x8_to_f16hi8(w4.z, lo[2], hi[2]);
  fp4x8_to_f16hi8(w4.w, lo[3], hi[3]);
  *reinterpret_cast<uint4*>(tile + off) = make_uint4(lo[0], hi[0], lo[1], hi[1]);
  *reinterpret_cast<uint4*>(tile + (off ^ 16)) = make_uint4(lo[2], hi[2], lo[3], hi[3]);
}
// 16 E4M3 key bytes (K8V4: head-dim elements [16 q, 16 q + 16)) -> the same 16 bytes with each
// 8 in the order 0 2 4 6 1 3 5 7 (FP8 S's K row, as decode_fp4_chunk_e5m2 orders its bytes):
// chunk q of a 128-byte K-major row, at off. 4 byte permutes, no conversion.
__device__ __forceinline__ void reorder_e4m3_chunk(uint4 w, uint8_t* tile, uint32_t off) {
  *reinterpret_cast<uint4*>(tile + off) =
      make_uint4(prmt(w.x, w.y, 0x6420u), prmt(w.x, w.y, 0x7531u), prmt(w.z, w.w, 0x6420u), prmt(w.z, w.w, 0x7531u));
}
// 16 E4M3 key bytes (K8V4: head-dim elements [16 q, 16 q + 16)) -> fp16 values E4M3 * 2^-8 in
// head-dim order (decode_key8's placement, without its permutation), two chunks of row r at
// off ^ (i << 4), off = dec_off(r, 2 q).
__device__ __forceinline__ void decode_e4m3_chunk(uint4 w4, uint8_t* tile, uint32_t off) {
  const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 o = make_uint4(e4m3hi_to_f16x2(prmt(w[2 * i], 0, 0x1404u)), e4m3hi_to_f16x2(prmt(w[2 * i], 0, 0x3424u)),
                               e4m3hi_to_f16x2(prmt(w[2 * i + 1], 0, 0x1404u)),
                               e4m3hi_to_f16x2(prmt(w[2 * i + 1], 0, 0x3424u)));
    *reinterpret_cast<uint4*>(tile + (off ^ (i << 4))) = o;
  }
}

// Where 16-byte code chunk q of token r lands in a decoded tile of layout L (K: L::KCPR chunks
// per token, V: L::VCPR), and the decode of a key chunk for L's tile (FP8 S: E5M2 bytes from
// FP4 keys or K8V4's E4M3 bytes reordered; else fp16). The prefill kernel's producers and the
// workspace pass (prefill_workspace.cuh) both place chunks by these.
template <typename L>
__device__ __forceinline__ uint32_t key_chunk_off(int r, int q) {
  return L::S8 ? r * 128 + (((L::E4M3 ? q : 2 * q) ^ (r & 7)) << 4) : dec_off<L::TK>(r, q * (L::E4M3 ? 2 : 4));
}
template <typename L>
__device__ __forceinline__ uint32_t value_chunk_off(int r, int q) {
  return L::DEC_K + dec_off<L::TK>(r, q * 4);
}
template <typename L>
__device__ __forceinline__ void decode_key_chunk(uint4 w, uint8_t* tile, uint32_t off) {
  if constexpr (L::E4M3 && L::S8) reorder_e4m3_chunk(w, tile, off);
  else if constexpr (L::E4M3) decode_e4m3_chunk(w, tile, off);
  else if constexpr (L::S8) decode_fp4_chunk_e5m2(w, tile, off);
  else decode_fp4_chunk(w, tile, off);
}

// The 16-byte code chunk (of CPR per token) that thread t copies and decodes in every step, a
// permutation inside each warp's 32 chunks (the warp still copies one 512-byte run of codes).
// A 16-byte access is served 8 threads at a time, and both ends of a chunk's trip must use 8
// distinct bank groups (16-byte slots modulo 128 bytes): its raw slot (16 c: c % 8) and, in the
// decoded tile, each of its store instructions' positions (dec_off: (chunk in the panel)
// ^ (token % 8)). In token-major order (c = t) the raw side is distinct, but at D 128 a token's
// chunks fill two panels and chunks q and q + CPR / 2 land on the same position of each: every
// decode store would be 2-way conflicted (ncu, 1 x 2048 @ 16k: 35.2 M excess wavefronts, 19 % of
// the kernel's shared traffic). So each first-panel chunk of one token is paired with a
// second-panel chunk of its neighbour inside a group of 8 threads; bit k of t is bk:
//   CPR 4 (FP4 at D 128): token 4 b4 + 2 b2 + b1, chunk 2 (b2 ^ b3) + b0: threads 0-7 hold
//     (token, chunk) (0,0) (0,1) (1,0) (1,1) (2,2) (2,3) (3,2) (3,3): raw slots 0 1 4 5 2 3 6 7,
//     decoded positions (store i) (4 (chunk & 1) + i) ^ token: i ^ {0 4 1 5 2 6 3 7}: distinct;
//   CPR 2 or 4 at D 64 (one panel): token-major order is already conflict-free, except for
//     the keys on FP8 S (kFp8Rows: 128-byte K rows, the first half used), where tokens r, r ^ 2
//     (FP4) or r, r ^ 1 (K8V4) collide:
//     FP4 (CPR 2; a chunk's 32 E5M2 bytes at slots 2 q, 2 q + 1, ^ token % 8): token 8 b4 +
//       2 b1 + b0 + 4 (b2 ^ b3), chunk b2: threads 0-7 hold tokens 0-3 with chunk 0 and 4-7
//       with chunk 1: raw slots 0 2 4 6 1 3 5 7, stores {0 1 2 3 6 7 4 5} and its ^ 1 (threads
//       8-15: tokens 4-7 with chunk 0, 0-3 with chunk 1, alike); a warp's K and V chunks stay
//       in its 16-token run (one block);
//     K8V4 (CPR 4; chunk q at slot q ^ token % 8): token b2 + 2 b3 + 4 (b2 ^ b4), chunk
//       b0 + 2 b1: threads 0-7 hold tokens 0 and 5 (8-15: 2, 7; 16-23: 4, 1; 24-31: 6, 3), each
//       with chunks 0-3: raw slots 0-7, stores {0 1 2 3 5 4 7 6} (and the others' alike);
//     V (fp16) stays token-major;
//   K8V4 (E4M3 keys: CPR 8 at D 128) keeps token-major order for both K and V: on FP8 S a
//     token's 8 key chunks fill its 128-byte row's 8 slots (no conflict); V keeps its 2-way
//     conflicts, since a V permutation costs the 48-register producers 20 bytes of spills (one
//     more live chunk index; nvcc 13.0);
//   and below SM90a (kWG false: every warp copies, decodes and computes at 255 registers) the
//     permutation spills 12 bytes in two D 128 instantiations of sm_80: token-major there.
template <int CPR, int D, bool kWG, bool kFp8Rows = false>
__device__ __forceinline__ int chunk_of_thread(int t) {
  if constexpr (kWG && D == 128 && CPR == 4)
    return (t & ~15) | ((t & 6) << 1) | ((((t >> 2) ^ (t >> 3)) & 1) << 1) | (t & 1);
  else if constexpr (kFp8Rows && D == 64 && CPR == 2)
    return (t & ~15) | ((((t >> 2) ^ (t >> 3)) & 1) << 3) | ((t & 3) << 1) | ((t >> 2) & 1);
  else if constexpr (kFp8Rows && D == 64 && CPR == 4)
    return (t & ~31) | (((t >> 2) & 1) << 2) | (((t >> 3) & 1) << 3) | ((((t >> 2) ^ (t >> 4)) & 1) << 4) | (t & 3);
  else
    return t;
}

// O += P V through the wgmma of N = D columns (64 or 128).
template <int N, int kTransB>
__device__ __forceinline__ void wgmma_n(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "wgmma N");
  if constexpr (N == 64) wgmma_m64n64k16_f16<kTransB>(d, a, desc_b);
  else wgmma_m64n128k16_f16<kTransB>(d, a, desc_b);
}

// grid (row groups * num_kv_heads, 1), block prefill_threads(major) (32 * PREFILL_WARPS, twice
// that on SM90a: the producer warps), dynamic smem prefill_smem_bytes<D, kE4m3> bytes. Requires
// cu_query_lens and num_partitions == 1 (plan_attention). kStates: the lse output or learned sinks are asked for (as the
// general kernel: compiled out of the plain instantiation); kE4m3: K8V4 keys (E4M3 bytes); kWs:
// the tiles come decoded from p.ws (prefill_workspace.cuh wrote them), SM90a only.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(TQ_PREFILL_MMA_SYNC)
#define TQ_PREFILL_KWG true  // warpgroup MMAs, producer and consumer warps (SM90a)
#else
#define TQ_PREFILL_KWG false  // ldmatrix + mma.sync, every warp both
#endif
template <int D, typename T, bool kStates, bool kE4m3, bool kWs>
__global__ void __launch_bounds__(PrefillLayout<D, kE4m3, TQ_PREFILL_KWG, kWs>::NTH, tuning::PREFILL_MIN_BLOCKS)
    paged_attention_fp4_prefill_kernel(const AttnParams p) {
  constexpr bool kWG = TQ_PREFILL_KWG;
  if constexpr (kWs && !kWG) {
    __trap();  // the workspace path is the wgmma build's: plan_attention never launches it elsewhere
    return;
  }
  using L = PrefillLayout<D, kE4m3, kWG, kWs>;
  constexpr int TK = L::TK, ST = L::ST, NK = L::NK;
  static_assert(!kWG || (TK == 64 && L::W % 4 == 0 && L::NDEC >= 3),
                "wgmma path: 64-token steps, whole warpgroups, three tiles (P V runs into the next step)");
  // setmaxnreg moves registers inside the CTA's launch allocation (NTH threads x the launch
  // bound's count, 65536 / NTH rounded down to 8): a .inc the producers' .dec cannot cover
  // waits forever (a four-producer-warp build at 96 / 208 hangs on the device)
  static_assert(!kWG || 32 * (L::PW * L::PREGS + L::W * L::CREGS) <= L::NTH * ((65536 / L::NTH) & ~7),
                "wgmma path: the producer and row warps' registers within the CTA's launch allocation");
  // one MMA unit: a warpgroup's 64 rows (wgmma) or a warp's 16 rows (mma.sync)
  constexpr int UROWS = kWG ? 64 : 16;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* const smem = smem_raw + ((1024u - ((uint32_t)__cvta_generic_to_shared(smem_raw) & 1023u)) & 1023u);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  // wgmma: warps [0, PW) copy and decode (producers), warps [PW, PW + W) hold the rows (consumers);
  // mma.sync: every warp does both. cw: the consumer warp's index (its rows 16 cw .. 16 cw + 15)
  const bool producer = !kWG || warp < L::PW;
  const int cw = kWG ? warp - L::PW : warp;
  const int G = p.group_size, Hkv = p.num_kv_heads;
  // row groups in reverse (the grid's last first): a sequence's later rows see more keys, so the
  // heaviest CTAs start in the first wave and the last wave holds the lightest
  const int grp = (int)(gridDim.x / Hkv) - 1 - (int)(blockIdx.x / Hkv), kvh = blockIdx.x % Hkv;
  pdl_wait();
  pdl_launch_dependents();

  // ---- which sequence / rows: find_row_tile's search, as a binary search (its 32-way warp
  //      search makes six D 128 sm_80 instantiations spill 8 bytes at 255 registers; a prefill
  //      CTA is long enough that the search's dependent loads do not show: equal times on the
  //      H100) ----
  const int* cu = p.cu_query_lens;
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    const long long base = mid + ((long long)max(__ldg(cu + mid), 0) * G) / L::ROWS;
    if (base <= grp) lo = mid; else hi = mid - 1;
  }
  const int s = lo;
  const int q0 = max(__ldg(cu + s), 0);
  const int qn = min(__ldg(cu + s + 1), p.num_tokens) - q0;
  const int lg = grp - (s + (int)(((long long)q0 * G) / L::ROWS));
  if (qn <= 0 || lg < 0 || lg * L::ROWS >= qn * G) return;
  const int nrows = qn * G, row0 = lg * L::ROWS;
  const int seq_len = __ldg(p.seq_lens + s);
  const int slot = state_slot(p, s);
  const int Wn = p.sliding_window;
  // key range of query token qi: [row_lo, row_hi]
  auto row_hi = [&](int qi) { return seq_len - qn + qi; };
  auto row_lo = [&](int qi) { return Wn > 0 ? max(0, seq_len - qn + qi - Wn + 1) : 0; };
  const int lo_min = row_lo(row0 / G), hi_max = row_hi((min(row0 + L::ROWS, nrows) - 1) / G);
  // with the sink, position 0 comes from the state record, merged in for the rows whose
  // window holds it: the FP4 stream starts at 1
  const bool sink_here = p.sink && lo_min == 0 && seq_len > 0;
  const int r_lo = max(lo_min, p.sink ? 1 : 0), r_hi = min(hi_max + 1, seq_len);  // [r_lo, r_hi)

  // constant rows: nothing visible (0, lse of the learned sink or -inf); a bad block id (NaN)
  auto write_const_rows = [&](float oval, float mval) {
    for (int i = tid; i < L::ROWS * D; i += blockDim.x) {
      const int R = row0 + i / D;
      if (R >= nrows) continue;
      const int tok = q0 + R / G, head = kvh * G + R % G;
      T* o = reinterpret_cast<T*>(p.out) + tok * p.o_stride_tok + head * p.o_stride_head;
      o[i % D] = from_float<T>(oval);
      if constexpr (kStates) {
        if (i % D == 0 && p.lse != nullptr) p.lse[(size_t)tok * p.num_heads + head] = const_row_lse(p, head, mval);
      }
    }
  };
  if (r_lo >= r_hi && !sink_here) {
    write_const_rows(0.f, -INFINITY);
    return;
  }
  float* sinkS = reinterpret_cast<float*>(smem + L::OFF_ROWS);  // [ROWS] q'.k0'
  float* qmS = sinkS + L::ROWS;                                   // [ROWS] scale * q.m (cap)
  float* mS = qmS + L::ROWS;                                      // [ROWS] row maximum (exp2)
  float* lS = mS + L::ROWS;                                       // [ROWS] row sum
  const bool cap = p.soft_cap > 0.f, cap_state = cap && p.seq_state != nullptr;

  // ---- this warp's 16 rows and their key ranges ----
  const int wrow0 = row0 + 16 * cw;
  const bool wactive = wrow0 < nrows;  // (read by consumers only)
  const int wlast = min(wrow0 + 15, nrows - 1);
  const int sink_lo = p.sink ? 1 : 0;
  const int w_lo_max = max(row_lo(wlast / G), sink_lo);
  const int w_hi_min = row_hi(wrow0 / G);
  // the MMA unit's rows: its key range decides which steps it computes (unit-uniform)
  const int urow0 = row0 + UROWS * (cw / (UROWS / 16)), ulast = min(urow0 + UROWS - 1, nrows - 1);
  const bool uactive = urow0 < nrows;
  const int u_lo_min = max(row_lo(urow0 / G), sink_lo), u_hi_max = row_hi(ulast / G);
  int rlo[2], rhi[2];  // rows g, g+8 (rows past the sequence see nothing)
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int R = wrow0 + g + 8 * rh;
    rlo[rh] = R < nrows ? max(row_lo(R / G), sink_lo) : 0;
    rhi[rh] = R < nrows ? row_hi(R / G) : -1;
  }

  // ---- copies: the same positions in every step ----
  const int lbs = p.log2_block_size, bs_mask = (1 << lbs) - 1;
  const BlockRow blocks(p, s);
  const int tile_first = r_lo / TK;
  const int nsteps = r_lo < r_hi ? (r_hi - 1) / TK - tile_first + 1 : 0;
  // K chunks kc0 + NT i (i < NK), V chunk vc0, scale word of token cs (threads [0, 2 TK));
  // kc0, vc0: the thread's K and V chunks of its warp's 32 (chunk_of_thread; K8V4: tid)
  const int kc0 = chunk_of_thread<L::KCPR, D, kWG, L::S8>(tid), vc0 = kE4m3 ? tid : chunk_of_thread<L::VCPR, D, kWG>(tid);
  const bool has_v = tid < L::VCH, has_s = tid < 2 * TK;
  const int cv = vc0 / L::VCPR, cs = tid & (TK - 1);  // V chunk's token; scale token
  const uint8_t* k_base = p.key_cache + kvh * p.kc_stride_head;
  const uint8_t* v_base = p.value_cache + kvh * p.vc_stride_head + (vc0 % L::VCPR) * 16;
  auto kchunk = [&](int i) { return kc0 + L::NT * i; };  // < KCH: token kchunk / KCPR
  const uint8_t* s_base = (tid < TK ? p.key_scales : p.value_scales) + kvh;
  // the binding keeps a block's stride below 2^31 bytes: 32-bit factors of a 64-bit product
  const uint32_t kc_blk = (uint32_t)p.kc_stride_blk, vc_blk = (uint32_t)p.vc_stride_blk;
  const uint32_t raw_s = (uint32_t)__cvta_generic_to_shared(smem);
  auto tok_of = [&](int i, int j) { return (tile_first + i) * TK + j; };
  // a 16-token sub-tile is copied when it holds a token of [r_lo, r_hi) (its block may not
  // exist otherwise); `whole`: every sub-tile of the step does (one test for the step)
  const int sub_lo = r_lo & ~15, sub_hi = (r_hi + 15) & ~15;
  auto needed = [&](int tok) { const int sub = tok & ~15; return sub < r_hi && sub + 16 > r_lo; };
  auto raw_bid = [&](int tok) { return blocks.entry(tok); };  // -1 past the table
  // FP4 keys: a thread's K and V chunks are tokens of one aligned 16-token run (the same token,
  // or at D 64 with FP8 S the same 8-token group), so one block id serves both
  constexpr bool kSameTok = NK == 1 && L::KCPR == L::VCPR;
  int b_k[NK], b_v = 0, b_s = 0;  // block ids of the next issue's tokens (prefetched)
  auto prefetch = [&](int i) {
    if constexpr (!kSameTok) {
#pragma unroll
      for (int j = 0; j < NK; ++j) b_k[j] = raw_bid(tok_of(i, min(kchunk(j), L::KCH - 1) / L::KCPR));
    }
    b_v = raw_bid(tok_of(i, cv));
    b_s = raw_bid(tok_of(i, cs));
  };
  if (producer && nsteps > 0) prefetch(0);
  uint32_t st_issue = 0, nib_ring = 0;  // nib_ring: per stage, copied (bit 2) | scale byte (bits 0-1)
  bool bad = false;
  auto issue = [&](int i) {
    const uint32_t st = raw_s + st_issue * L::RAW;
    const int t0 = tok_of(i, 0);
    const bool whole = t0 >= sub_lo && t0 + TK <= sub_hi;
    auto bad_id = [&](int b) { return (unsigned)b >= (unsigned)p.num_blocks; };
#pragma unroll
    for (int j = 0; j < NK; ++j) {
      const int c = kchunk(j), tk = t0 + c / L::KCPR;
      if (c >= L::KCH || !(whole || needed(tk))) continue;
      const int b = kSameTok ? b_v : b_k[j];
      if (bad_id(b)) { bad = true; continue; }
      cp_async_16(st + c * 16, k_base + (unsigned long long)(uint32_t)b * kc_blk +
                                   (uint32_t)((tk & bs_mask) * L::KROWB + (c % L::KCPR) * 16));
    }
    const int tv = t0 + cv, tsc = t0 + cs;
    if (has_v && (whole || needed(tv))) {
      if (bad_id(b_v)) bad = true;
      else cp_async_16(st + L::RAW_K + vc0 * 16, v_base + (unsigned long long)(uint32_t)b_v * vc_blk + (uint32_t)((tv & bs_mask) * L::VROWB));
    }
    uint32_t nib = 0;
    if (has_s && (whole || needed(tsc))) {
      if (bad_id(b_s)) {
        bad = true;
      } else {
        const uintptr_t a = (uintptr_t)(s_base + (((long long)b_s << lbs) + (tsc & bs_mask)) * Hkv);
        cp_async_4(st + L::RAW_K + L::RAW_V + (tid < TK ? 0 : L::RAW_S) + cs * 4, reinterpret_cast<const void*>(a & ~(uintptr_t)3));
        nib = 4u | (uint32_t)(a & 3);
      }
    }
    nib_ring = (nib_ring & ~(15u << (4 * st_issue))) | (nib << (4 * st_issue));
    st_issue = st_issue + 1 == ST ? 0 : st_issue + 1;
    if (i + 1 < nsteps) prefetch(i + 1);  // used one issue later
  };
  // logit = S * 2^(kb - 127) * kmul: kmul folds 2^DEC_EXP (decode), 2^-qexp (the Q prescale),
  // scale and, without a cap, log2(e) (exp2 domain); set once Q is prepared
  float kmul = 0.f;
  // where the thread's chunks go in a decoded tile (the same in every step)
  uint32_t k_off[NK];
#pragma unroll
  for (int j = 0; j < NK; ++j) {
    const int c = min(kchunk(j), L::KCH - 1);
    // FP8 S: a K8V4 chunk is 16 of the row's bytes (chunk q), an FP4 chunk becomes 32 (2 q, 2 q + 1)
    k_off[j] = key_chunk_off<L>(c / L::KCPR, c % L::KCPR);
  }
  const uint32_t v_off = value_chunk_off<L>(cv, vc0 % L::VCPR);
  // the scale words of token cs of step i in decoded tile dec, from its scale byte b (K: a float;
  // V: the byte, its factor, and per 32 tokens the maximum and 255 flag of the visible ones)
  // (threads with has_s; 0 for a token not copied)
  auto put_scale = [&](int i, int* sb, int b) {  // (sb: the tile's scale words)
    if (tid < TK) {
      // 255 -> NaN; wgmma: times the logits' factor (kmul, one per CTA there)
      reinterpret_cast<float*>(sb)[L::SB_KF + L::sb_slot(cs)] = kWG ? e8m0_to_float((uint32_t)b) * kmul : e8m0_to_float((uint32_t)b);
    } else {
      sb[L::SB_VB + cs] = b;
      const int tok = tok_of(i, cs);
      const bool vis = tok >= r_lo && tok < r_hi;
      const int v = __reduce_max_sync(0xffffffffu, (vis && b != 255) ? b : 0);
      const bool nan = __any_sync(0xffffffffu, vis && b == 255);
      // the token's part of P's V-scale factor (make_p): finite for any byte (a masked
      // token's may exceed v, or be 255), 0 below 2^-126 (wgmma, in fp16: below 2^-24)
      const float vg = __int_as_float(min(max(b - v + 127, 0), 127) << 23);
      if constexpr (kWG) reinterpret_cast<__half*>(sb + L::SB_VG)[L::sb_slot(cs)] = __float2half_rn(vg);
      else reinterpret_cast<float*>(sb)[L::SB_VG + L::sb_slot(cs)] = vg;
      if (lane == 0) {
        sb[L::SB_VMAX + (cs >> 5)] = v;
        sb[L::SB_VNAN + (cs >> 5)] = nan;
      }
    }
  };
  uint32_t st_dec = 0, buf_dec = 0;  // ring stage and decode buffer of the next decode
  // the thread decodes what it copied: codes -> fp16 rows; its scale (K: a float, V: the byte;
  // 0 where not copied); the V-scale maximum and 255 flag of the visible tokens (V warps).
  // (The buffer rotation below is next_buf's, written out: calling next_buf here shifts ptxas's
  // register allocation enough to spill 8 bytes in the sm_80 K8V4 build at 255 registers.)
  auto decode = [&](int i) {
    const int sd = (int)st_dec;
    const uint8_t* raw = smem + st_dec * L::RAW;
    uint8_t* dec = smem + L::OFF_DEC + buf_dec;
    st_dec = st_dec + 1 == ST ? 0 : st_dec + 1;
    buf_dec = buf_dec + L::DEC == L::NDEC * L::DEC ? 0 : buf_dec + L::DEC;
#pragma unroll
    for (int j = 0; j < NK; ++j) {
      const int c = kchunk(j);
      if (c >= L::KCH) continue;
      decode_key_chunk<L>(*reinterpret_cast<const uint4*>(raw + c * 16), dec, k_off[j]);
    }
    if (has_v) decode_fp4_chunk(*reinterpret_cast<const uint4*>(raw + L::RAW_K + vc0 * 16), dec, v_off);
    if (has_s) {
      const uint32_t nib = (nib_ring >> (4 * sd)) & 15u;
      const uint32_t w = *reinterpret_cast<const uint32_t*>(raw + L::RAW_K + L::RAW_V + (tid < TK ? 0 : L::RAW_S) + cs * 4);
      put_scale(i, reinterpret_cast<int*>(dec + L::OFF_SB), (nib & 4u) ? (int)((w >> (8 * (nib & 3u))) & 255u) : 0);
    }
    if constexpr (kWG) fence_proxy_async();  // the tile is read by wgmma after the next barrier
  };
  // a barrier of every thread (wgmma: reached from the producer and the consumer code)
  auto cta_sync = [] {
    if constexpr (kWG) named_barrier_sync(L::BAR_CTA, L::NTH);
    else __syncthreads();
  };
  auto first_copies = [&]() {  // steps 0 .. ST - 2
#pragma unroll
    for (int i = 0; i < ST - 1; ++i) {
      if (i < nsteps) issue(i);
      cp_async_commit();
    }
  };
  // logit = S * 2^(kb - 127) * kmul (above), from Q's prescale exponent
  auto logit_factor = [&](int qexp) { return p.scale * pow2i(L::KDEC_EXP - qexp) * (cap ? 1.f : LOG2E); };
  if constexpr (kWG) {
    // Producer and consumer warps, NDEC decoded tiles between them. Named barriers: FULL + b
    // (tile b holds its step: producers arrive, consumers wait) and EMPTY + b (tile b's step has
    // been read: consumers arrive, producers wait before writing it again); each takes every
    // thread of the CTA, and each of its uses completes before the next begins (a producer
    // writes tile b again only after EMPTY + b, which the consumers reach after FULL + b). DONE:
    // the OR of the producers' bad block ids, once every warp is past its loop (the epilogue's
    // O rows alias the tiles). The roles split here, before Q, and never join: ptxas allocates
    // registers per setmaxnreg region, and code before a split or after a join has to fit the
    // smaller count (the Q transforms spill at 80 when the split comes after them).
    if (producer) {
      setmaxnreg_dec<L::PREGS>();
      if constexpr (!kWs) first_copies();
      // the consumers prepare Q: the prescale's barriers (the maximum word zeroed before the
      // first) and the one after it
      unsigned* qamax = reinterpret_cast<unsigned*>(smem + L::OFF_QAMAX);
      if (tid == 0) *qamax = 0u;
      kmul = logit_factor(q_prescale_exponent(0u, qamax, cta_sync) - L::QEXP_DROP);
      cta_sync();
      if constexpr (kWs) {
        // Decode-once workspace: step j's tile is a copy of the workspace's (prefill_workspace.cuh)
        // into decode buffer bj (free once step j - NDEC is read), issued before step j - 1's
        // copy is waited for; then step j - 1's scale words from its scale bytes, as decode()
        // writes them. The scale byte and the bad-block flag of step j are loaded after step
        // j - 1's hand-over and first read in the next iteration, so that no producer waits
        // for a global load's round trip (waiting for them at once held a third of the
        // producers' time, and the row warps at FULL). The copies start after Q (the buffers
        // alias Q's fp32 rows). A sequence longer than the workspace's steps (past the call's
        // max_seq_len) gets NaN rows.
        const bool ws_ok = tile_first + nsteps <= p.ws_steps;
        bad = bad || !ws_ok;
        const uint8_t* ws_seq = p.ws + ((long long)s * p.ws_steps * Hkv + kvh) * L::WS_TILE;
        auto ws_tile = [&](int i) { return ws_seq + (long long)(tile_first + i) * Hkv * L::WS_TILE; };
        // the thread's scale byte and bad flag of the step loaded last (0, 0: not needed)
        int sb_byte = 0, sb_bad = 0;
        uint32_t bj = 0;  // step j's buffer
#pragma unroll 1
        for (int j = 0; j <= nsteps; ++j) {
          if (j < nsteps) {
            if (j >= L::NDEC) named_barrier_sync(L::BAR_EMPTY + bj, L::NTH);  // step j - NDEC's tile is free
            if (ws_ok) {
              static_assert((L::DEC_K + L::DEC_V) % (16 * L::NT) == 0, "whole 16-byte copies per producer thread");
              const uint8_t* tile = ws_tile(j);
              const uint32_t dst = raw_s + L::OFF_DEC + bj * L::DEC + tid * 16;  // (K then V, as in the tile)
              static_for<(L::DEC_K + L::DEC_V) / 16 / L::NT>(
                  [&](auto k) { cp_async_16_at<decltype(k)::value * L::NT * 16>(dst, tile + tid * 16); });
            }
          }
          cp_async_commit();
          if (j > 0) {
            const uint32_t bp = bj == 0 ? L::NDEC - 1 : bj - 1;  // step j - 1's buffer
            bad = bad || sb_bad != 0;
            cp_async_wait<1>();
            if (has_s)
              put_scale(j - 1, reinterpret_cast<int*>(smem + L::OFF_DEC + bp * L::DEC + L::OFF_SB), sb_bad ? 0 : sb_byte);
            fence_proxy_async();  // the tile is read by wgmma after the next barrier
#pragma unroll
            for (int w = 0; w < L::WGS; ++w) named_barrier_arrive(L::BAR_FULL + w * L::NDEC + bp, L::NT + 128);
          }
          sb_byte = sb_bad = 0;
          if (j < nsteps && ws_ok && has_s && needed(tok_of(j, cs))) {
            const uint8_t* tile = ws_tile(j);
            sb_bad = __ldg(tile + L::WS_BAD + (cs >> 4));
            sb_byte = __ldg(tile + L::WS_SCALES + (tid < TK ? 0 : TK) + cs);
          }
          bj = bj + 1 == L::NDEC ? 0 : bj + 1;
        }
      } else {
        // step j: the copy of step j + ST - 1 issued, step j's codes waited for and decoded
        uint32_t b = 0;
#pragma unroll 1
        for (int j = 0; j < nsteps; ++j) {
          if (j + ST - 1 < nsteps) issue(j + ST - 1);  // into the stage step j - 1 left
          cp_async_commit();
          if (j >= L::NDEC) named_barrier_sync(L::BAR_EMPTY + b, L::NTH);  // step j - NDEC's tile is free
          cp_async_wait<ST - 1>();
          decode(j);  // (fence_proxy_async: its tile is read by wgmma)
#pragma unroll
          for (int w = 0; w < L::WGS; ++w) named_barrier_arrive(L::BAR_FULL + w * L::NDEC + b, L::NT + 128);
          b = b + 1 == L::NDEC ? 0 : b + 1;
        }
      }
      cp_async_wait<0>();
      if (named_barrier_or(L::BAR_DONE, L::NTH, bad)) write_const_rows(__int_as_float(0x7fc00000), 0.f);
      return;
    }
    setmaxnreg_inc<L::CREGS>();
  } else {
    first_copies();
  }

  // ---- Q: this warp's 16 rows, the transforms in fp32 (D/8 lanes per row), the sink's and
  //      the cap's per-row terms, a power-of-two prescale, fp16 A fragments in registers (both
  //      paths: with wgmma, S from registers reads 32 KB less shared memory per step than Q
  //      rows in shared memory; the row warps hold 200 registers). The prescale: wgmma, one per
  //      CTA, so that the K-scale floats carry kmul (16 multiplies fewer per step and thread);
  //      mma.sync, one per warp (a CTA-wide one makes the sm_80 K8V4 build spill 20 bytes).
  //      Its maximum is over the finite |q| (a NaN or Inf row stays so, and does not switch the
  //      prescale off for the rows beside it). wgmma: the producer warps only join its barriers ----
  constexpr int LPR = D / 8, RPP = 32 / LPR;  // lanes per row, rows per pass
  float* qraw = reinterpret_cast<float*>(smem + L::OFF_DEC) + cw * 16 * D;  // aliases the decode buffers
  const int col = (lane % LPR) * 8;  // the lane's Q chunk, the same in every pass
  unsigned amax_bits = 0;
  QChunk qc;  // its transform inputs (the CTA's rows share slot and kv head)
  load_q_chunk<D, kStates>(p, slot, kvh, col, sink_here, qc);
#pragma unroll 1
  for (int r0 = 0; r0 < 16; r0 += RPP) {
    const int r = r0 + lane / LPR, R = wrow0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (R < nrows)
      v = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(p.query) + (q0 + R / G) * p.q_stride_tok +
                                          (kvh * G + R % G) * p.q_stride_head + col);
    float qv[8];
    prepare_q8<D, T, kStates>(p, qc, v, sink_here, col == 0, sinkS + 16 * cw + r, qmS + 16 * cw + r, qv, lane);
    *reinterpret_cast<float4*>(qraw + r * D + col) = make_float4(qv[0], qv[1], qv[2], qv[3]);
    *reinterpret_cast<float4*>(qraw + r * D + col + 4) = make_float4(qv[4], qv[5], qv[6], qv[7]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const unsigned a = __float_as_uint(fabsf(qv[e]));
      if (a < 0x7f800000u) amax_bits = max(amax_bits, a);
    }
  }
  int qexp;
  if constexpr (kWG) {
    qexp = q_prescale_exponent(amax_bits, reinterpret_cast<unsigned*>(smem + L::OFF_QAMAX), cta_sync) -
           L::QEXP_DROP;  // also: the warp's qraw rows are written
  } else {
    qexp = prescale_exponent(__reduce_max_sync(0xffffffffu, amax_bits));
    __syncwarp();
  }
  // the A fragments of S = Q K^T (warp MMA and wgmma: the same layout; FP8 S: Q's two E4M3 terms)
  uint32_t qa[D / 16][4];
  const float qmul = pow2i(qexp);
  if constexpr (L::S8) {
    // FP8 S: Q = Q1 + Q2, both E4M3 (qa[ks], qa[D / 32 + ks] for the k32 slice ks), each 8
    // columns in the K tile's byte order (0 2 4 6 1 3 5 7): byte b of the thread's word holds
    // column c0 + 2 b, c0 = 32 ks + 8 (t4 / 2) + t4 % 2 (+ 16 for words 2, 3). An infinite q
    // becomes NaN (E4M3 would saturate it to 448): non-finite in, NaN out.
    auto two_terms = [&](const float* x, uint32_t& w1, uint32_t& w2) {  // x[0], x[2], x[4], x[6]
      float v[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        v[b] = x[2 * b] * qmul;
        if (isinf(v[b])) v[b] = __int_as_float(0x7fc00000);
      }
      uint32_t h01, l01, h23, l23;
      e4m3x2_split(v[0], v[1], h01, l01);
      e4m3x2_split(v[2], v[3], h23, l23);
      w1 = h01 | (h23 << 16);
      w2 = l01 | (l23 << 16);
    };
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks) {
      const float* a = qraw + g * D + 32 * ks + 8 * (t4 >> 1) + (t4 & 1);
      const float* b = a + 8 * D;  // row g + 8
      two_terms(a, qa[ks][0], qa[D / 32 + ks][0]);
      two_terms(b, qa[ks][1], qa[D / 32 + ks][1]);
      two_terms(a + 16, qa[ks][2], qa[D / 32 + ks][2]);
      two_terms(b + 16, qa[ks][3], qa[D / 32 + ks][3]);
    }
  } else {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const float* a = qraw + g * D + 16 * ks + 2 * t4;
      const float* b = a + 8 * D;  // row g + 8
      qa[ks][0] = pack_f16x2(a[0] * qmul, a[1] * qmul);
      qa[ks][1] = pack_f16x2(b[0] * qmul, b[1] * qmul);
      qa[ks][2] = pack_f16x2(a[8] * qmul, a[9] * qmul);
      qa[ks][3] = pack_f16x2(b[8] * qmul, b[9] * qmul);
    }
  }
  const float qm_row[2] = {cap_state ? qmS[16 * cw + g] : 0.f, cap_state ? qmS[16 * cw + g + 8] : 0.f};
  kmul = logit_factor(qexp);
  // (not soft_cap_reciprocal: its opaque divisor cost this kernel 4 bytes of spills, and a CTA
  // here runs its prologue once in a long call)
  const float cap_v = p.soft_cap, inv_cap = cap ? 1.f / p.soft_cap : 0.f;
  cta_sync();  // every warp's Q is in registers: the decode buffers are free

  // the next step's codes: wait for them, decode them, refill the ring (step j's decode is
  // followed by step j + ST - 1's copy, into the stage step j - 1 left)
  auto decode_next = [&](int j) {
    if (j < nsteps) {
      cp_async_wait<ST - 2>();
      decode(j);
    }
    if (j + ST - 1 < nsteps) issue(j + ST - 1);
    cp_async_commit();
  };
  if constexpr (!kWG) {  // (wgmma: the producer warps' loop above)
    decode_next(0);
    __syncthreads();
  }

  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  int VM = 0;
  const uint32_t dec_s = raw_s + L::OFF_DEC;
  auto unit_does = [&](int k) {  // the MMA unit's rows see some token of step k (unit-uniform)
    const int t0 = (tile_first + k) * TK;
    return uactive && t0 <= u_hi_max && t0 + TK - 1 >= u_lo_min;
  };
  // step k's logits from S (this warp's 16 rows x TK tokens, the MMA C layout), the online
  // softmax, and P' packed as the A fragments of O += P' V
  // (buf: step k's decode buffer, (k % NDEC) * DEC)
  constexpr int NJ = TK / 8;  // 8-token blocks per step
  // kOv (the workspace form, tuning::PREFILL_WS_OVERLAP): step k's softmax runs while step
  // k - 1's O += P' V is still on the tensor cores, so a rescale of O waits in o_pend (its
  // factors; o_pend_any: one is waiting) until that MMA is done
  constexpr bool kOv = L::WS && tuning::PREFILL_WS_OVERLAP;
  float o_pend[2] = {1.f, 1.f};
  bool o_pend_any = false;
  // (wgmma) the thread's K-scale word q and V-factor word q of a tile's scale words sb (the
  // V-factor halves sit at sb_slot: this is word sb_pair(t4, 4 q) / 2, written out so that it
  // folds: the division form compiles to 8 more SASS instructions per kernel)
  auto kf_word = [&](const int* sb, int q) {
    return *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(sb) + L::SB_KF + L::sb_pair(t4, 2 * q));
  };
  auto vg_word = [&](const int* sb, int q) {
    return *reinterpret_cast<const uint4*>(sb + L::SB_VG + (L::SB_PITCH / 2) * t4 + 4 * q);
  };
  // (kOv) the step's scale words the softmax reads, from its tile: the K-scale floats of the
  // thread's tokens (one 16-byte word for j = 2q, 2q + 1), the V-scale maxima and 255 flags
  // per 32 tokens, the fp16 V factors (one 16-byte word for j = 4q .. 4q + 3), which kOv loads
  // as soon as the tile is FULL, before it issues the step's MMAs: loaded after the wait for S,
  // they held the first logits and the vote; loaded right before that wait, the first logit's
  // FFMA still waited on them (2-3.5 % slower, H200). (The kernel that decodes reads them where
  // it uses them: loaded at its softmax's start, 2.5 % slower, H200.)
  float4 kf_pre[NJ / 2];
  int vmax_pre[TK / 32];
  uint4 vg_pre[NJ / 4];
  bool nan_pre = false;
  auto load_scales = [&](uint32_t buf) {
    const int* sb = reinterpret_cast<const int*>(smem + L::OFF_DEC + buf + L::OFF_SB);
#pragma unroll
    for (int q = 0; q < NJ / 2; ++q) kf_pre[q] = kf_word(sb, q);
    nan_pre = false;
#pragma unroll
    for (int i = 0; i < TK / 32; ++i) {
      vmax_pre[i] = sb[L::SB_VMAX + i];
      nan_pre |= sb[L::SB_VNAN + i] != 0;
    }
#pragma unroll
    for (int q = 0; q < NJ / 4; ++q) vg_pre[q] = vg_word(sb, q);
  };
  auto softmax_p = [&](int k, uint32_t buf, const float (&sacc)[NJ][4], uint32_t (&pa)[NJ / 2][4]) {
    const int t0 = (tile_first + k) * TK;
    const int* sb = reinterpret_cast<const int*>(smem + L::OFF_DEC + buf + L::OFF_SB);
    const float* sbf = reinterpret_cast<const float*>(sb);
    // ---- y = logit - ms (exp2 domain), ms the row maxima the state holds before this step
    //      (max_offset): without a cap one FFMA per logit, and the exponentials below wait for
    //      no reduction (the row maxima are taken only when the state has to move). The thread
    //      holds rows g, g+8 x tokens 8j + 2 t4 + {0, 1}; K-scale floats at sb_pair (wgmma:
    //      load_scales' words with kOv) ----
    float ms[2] = {max_offset(m_run[0]), max_offset(m_run[1])};
    float y[NJ][4];
    auto logits = [&](auto capped) {
#pragma unroll
      for (int q = 0; q < NJ / 2; ++q) {
        float kfs[4];
        if constexpr (kWG) {
          const float4 kq = kOv ? kf_pre[q] : kf_word(sb, q);
          kfs[0] = kq.x; kfs[1] = kq.y; kfs[2] = kq.z; kfs[3] = kq.w;  // (times kmul already)
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * q + h;
          if constexpr (!kWG) {
            const float2 kp = *reinterpret_cast<const float2*>(sbf + L::SB_KF + L::sb_pair(t4, j));
            kfs[2 * h] = kp.x * kmul;
            kfs[2 * h + 1] = kp.y * kmul;
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float kf = kfs[2 * h + (i & 1)];
            if constexpr (decltype(capped)::value)
              y[j][i] = cap_v * tanhf((sacc[j][i] * kf + qm_row[i >> 1]) * inv_cap) * LOG2E - ms[i >> 1];
            else
              y[j][i] = fmaf(sacc[j][i], kf, -ms[i >> 1]);
          }
        }
      }
    };
    if (cap) logits(BoolConst<true>{}); else logits(BoolConst<false>{});
    const bool need_mask = t0 < w_lo_max || t0 + TK - 1 > w_hi_min || wlast - wrow0 < 15;
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tok = t0 + 8 * j + 2 * t4 + (i & 1);
          if (tok < rlo[i >> 1] || tok > rhi[i >> 1]) y[j][i] = -INFINITY;
        }
    }
    // ---- online softmax with lazy rescaling (the general kernel's rule, lazy_rescale): the
    //      state moves only when some logit exceeds its row's maximum by more than SLACK (a row
    //      without one takes its first) or the V-scale maximum grows. Each thread tests its own
    //      y, one vote per warp; only then the row maxima are reduced (shuffles), the state
    //      rescaled and y moved to the new maxima ----
    int VM_new = VM;  // the step's V-scale maximum, one partial per warp of V-scale words
    // (kOv also runs the steps whose keys the unit's rows do not see, all masked: they leave the
    // state as it was, as a kernel that skips them does, VM included)
    if (!kOv || unit_does(k)) {
#pragma unroll
      for (int i = 0; i < TK / 32; ++i) VM_new = max(VM_new, kOv ? vmax_pre[i] : sb[L::SB_VMAX + i]);
    }
    float mloc[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      mloc[0] = fmaxf(mloc[0], fmaxf(y[j][0], y[j][1]));
      mloc[1] = fmaxf(mloc[1], fmaxf(y[j][2], y[j][3]));
    }
    constexpr float SLACK = (float)tuning::RESCALE_SLACK;
    const bool grow = mloc[0] > (m_run[0] == -INFINITY ? -INFINITY : SLACK) ||
                      mloc[1] > (m_run[1] == -INFINITY ? -INFINITY : SLACK) || VM_new != VM;
    if (__any_sync(0xffffffffu, grow)) {
      float m_new[2];
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        float mx = mloc[rh];
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        m_new[rh] = fmaxf(m_run[rh], mx + ms[rh]);
      }
      if constexpr (kOv) {
        float f[2];
        rescale_factors(m_new, VM_new, m_run, l_run, VM, f);
        o_pend[0] *= f[0];
        o_pend[1] *= f[1];
        o_pend_any = true;
      } else {
        rescale_state(m_new, VM_new, m_run, l_run, VM, acc);
      }
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const float d = max_offset(m_run[rh]) - ms[rh];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          y[j][2 * rh] -= d;
          y[j][2 * rh + 1] -= d;
        }
      }
    }
    // ---- P' = 2^y * V-scale factor 2^(b - VM + 15 - SLACK), as the product of the token's
    //      2^(b - vmax) (SB_VG) and its 32 tokens' 2^(vmax - VM + 15 - SLACK) (one per 32
    //      tokens; vmax <= VM). wgmma: in fp16 pairs (the factors' product, exact down to
    //      2^-24, then one multiply per pair of P, after P's rounding to fp16); mma.sync: in
    //      fp32, one multiply per token, then the rounding. (In fp16 a factor below 2^-24, a V
    //      scale more than 31 binades below the running maximum or more than 24 below its 32
    //      tokens' maximum, is 0; the fp32 product kept it while P' >= 2^-24, P being up to
    //      2^SLACK.)
    //      Two copies behind a CTA-uniform branch: a step with a visible V byte 255 (NaN)
    //      selects 0 for masked tokens (in fp32), so that their NaN cannot reach a row; other
    //      steps need no select (every factor is finite) ----
    auto make_p = [&](auto nan_path) {
      constexpr bool kNan = decltype(nan_path)::value;
      // P' of block j from P (fp32) and the factors vf0, vf1 of its two tokens; (wgmma) vfh:
      // the same as an fp16 pair
      auto put = [&](int j, float vf0, float vf1, uint32_t vfh) {
        if constexpr (kNan) {
          const int2 vb = *reinterpret_cast<const int2*>(sb + L::SB_VB + 8 * j + 2 * t4);
          if (vb.x == 255) vf0 = __int_as_float(0x7fc00000);
          if (vb.y == 255) vf1 = __int_as_float(0x7fc00000);
        }
        float pr[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          pr[i] = fast_exp2(y[j][i]);
          l_run[i >> 1] += pr[i];
          if constexpr (kNan) pr[i] = y[j][i] == -INFINITY ? 0.f : pr[i] * ((i & 1) ? vf1 : vf0);
          else if constexpr (!kWG) pr[i] *= (i & 1) ? vf1 : vf0;  // masked: pr = 0
        }
        uint32_t lo = pack_f16x2(pr[0], pr[1]), hi = pack_f16x2(pr[2], pr[3]);  // rows g, g + 8
        if constexpr (kWG && !kNan) {
          lo = mul_f16x2(lo, vfh);
          hi = mul_f16x2(hi, vfh);
        }
        pa[j >> 1][(j & 1) * 2] = lo;
        pa[j >> 1][(j & 1) * 2 + 1] = hi;
      };
      if constexpr (kWG) {
#pragma unroll
        for (int q = 0; q < NJ / 4; ++q) {  // blocks j = 4 q .. 4 q + 3: one word of factors, one vmax
          const uint4 w = kOv ? vg_pre[q] : vg_word(sb, q);
          const uint32_t vgh[4] = {w.x, w.y, w.z, w.w};
          const float vh = p_vscale((uint32_t)(kOv ? vmax_pre[q] : sb[L::SB_VMAX + q]), VM);
          const uint32_t vhh = pack_f16x2(vh, vh);
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            const uint32_t vfh = mul_f16x2(vgh[h], vhh);
            if constexpr (kNan) {
              const __half2 f = *reinterpret_cast<const __half2*>(&vfh);
              put(4 * q + h, __low2float(f), __high2float(f), vfh);
            } else {
              put(4 * q + h, 0.f, 0.f, vfh);
            }
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < TK / 8; ++j) {
          const float vh = p_vscale((uint32_t)sb[L::SB_VMAX + j / 4], VM);
          const float2 vg = *reinterpret_cast<const float2*>(sbf + L::SB_VG + L::sb_pair(t4, j));
          put(j, vg.x * vh, vg.y * vh, 0u);
        }
      }
    };
    bool nan_step = kOv && nan_pre;
    if constexpr (!kOv) {
#pragma unroll
      for (int i = 0; i < TK / 32; ++i) nan_step |= sb[L::SB_VNAN + i] != 0;
    }
    if (nan_step) make_p(BoolConst<true>{}); else make_p(BoolConst<false>{});
  };
  auto next_buf = [](uint32_t buf) { return buf + L::DEC == L::NDEC * L::DEC ? 0u : buf + L::DEC; };

  if constexpr (kWG) {
    // Two step orders, below: with the workspace (kOv) softmax under the previous O += P' V,
    // else softmax, then O += P' V. (Issuing S (k + 1) before step k's softmax instead, two S
    // accumulators, was slower with every warp also decoding: H100, 1 x 2048 @ 16k, 2437 vs
    // 2150 us.) Descriptors of decode buffer 0's K and V tiles; a k16 slice and another buffer
    // are byte offsets added to them (wgmma_desc_advance)
    const uint64_t kdesc = wgmma_desc_sw128(dec_s, 16, 1024);
    const uint64_t vdesc = wgmma_desc_sw128(dec_s + L::DEC_K, L::DPANEL, 1024);
    // Ping-pong (FA3's order between the two warpgroups): a warpgroup issues step k - 1's
    // O += P' V and step k's S only in its turn, then gives the turn to the other, so that the
    // tensor cores run one warpgroup's MMAs while the other does its softmax (without it both
    // issue together and run the softmax together). Each waits for its tiles on its own FULL
    // barrier: with one FULL for both, a warpgroup waiting for its turn would hold the other at
    // the tile (a deadlock). Warpgroup 0 goes first; warpgroup 1 waits for its first turn
    // before the loop, warpgroup 0 gives one turn more after it (each waits once per step plus
    // that once, each gives one per step). (One warpgroup of rows, PREFILL_WARPS 4: no turns.)
    constexpr bool kTurns = L::WGS == 2;
    const int wg = cw / 4;
    auto turn_wait = [&] { if constexpr (kTurns) named_barrier_sync(L::BAR_TURN + wg, 2 * 128); };
    auto turn_give = [&] { if constexpr (kTurns) named_barrier_arrive(L::BAR_TURN + (wg ^ 1), 2 * 128); };
    uint32_t pa[NJ / 2][4];  // P' of a step: read by its O += P' V until a later wait
    uint32_t buf = 0, b = 0, b_prev = L::NDEC - 1;
    auto issue_s = [&](uint32_t sbuf, float (&sacc)[NJ][4]) {  // S = Q K^T from buffer sbuf
      float(&s1)[NJ * 4] = reinterpret_cast<float(&)[NJ * 4]>(sacc);
      if constexpr (L::S8) {  // Q1 K then Q2 K, k32 slices of the 128-byte rows
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          const uint64_t kd = wgmma_desc_advance(kdesc, sbuf + (ks % (D / 32)) * 32);
          if constexpr (kE4m3) wgmma_m64n64k32_e4m3_e4m3(s1, qa[ks], kd, ks > 0);
          else wgmma_m64n64k32_e4m3_e5m2(s1, qa[ks], kd, ks > 0);
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)
          wgmma_m64n64k16_f16<0>(s1, qa[ks], wgmma_desc_advance(kdesc, sbuf + (ks >> 2) * L::DPANEL + (ks & 3) * 32), ks > 0);
      }
    };
    auto issue_pv = [&](uint32_t pbuf, const uint32_t (&pf)[NJ / 2][4]) {  // O += P' V, buffer pbuf, P' pf
#pragma unroll
      for (int u = 0; u < NJ / 2; ++u)  // 16-token blocks
        wgmma_n<D, 1>(reinterpret_cast<float(&)[D / 2]>(acc), pf[u], wgmma_desc_advance(vdesc, pbuf + u * 16 * 128));
    };
    auto advance = [&] {
      b_prev = b;
      b = b + 1 == L::NDEC ? 0 : b + 1;
      buf = next_buf(buf);
    };
    if (wg == 1) turn_wait();
    if constexpr (kOv) {
      // Step k issues S (k) and step k - 1's O += P' V in one turn, waits for S only (the older
      // group), runs its softmax under that O += P' V, then waits for it (its tile goes back, O
      // takes a waiting rescale). Every step issues both MMAs, also where the warpgroup's rows
      // see none of the step's keys (masked: P' = 0): wgmma under a branch, or a wait that
      // depends on one, makes ptxas serialize every wgmma (C7514 / C7520), and so does one P'
      // array copied into the other after each step (C7513: ptxas gives both the same registers):
      // hence the unrolling by two. Step 0 has no O += P' V before it, the last one's comes
      // after the loop.
      uint32_t pn[NJ / 2][4];  // P' of every other step (pa: the others'), unrolled by two
      if (nsteps > 0) {
        named_barrier_sync(L::BAR_FULL + wg * L::NDEC + b, L::NT + 128);
        load_scales(buf);
        float sacc[NJ][4];
        wgmma_fence();
        issue_s(buf, sacc);
        wgmma_commit();
        turn_give();
        wgmma_wait<0>();
        reg_fence(reinterpret_cast<float(&)[NJ * 4]>(sacc));
        softmax_p(0, buf, sacc, pa);
        o_pend[0] = o_pend[1] = 1.f;  // (O is still zero)
        o_pend_any = false;
        turn_wait();
        advance();
      }
      // step k: pin, the previous step's P' (read by its O += P' V), pout this step's
      auto step = [&](int k, uint32_t (&pin)[NJ / 2][4], uint32_t (&pout)[NJ / 2][4]) {
        named_barrier_sync(L::BAR_FULL + wg * L::NDEC + b, L::NT + 128);
        load_scales(buf);
        float sacc[NJ][4];
        wgmma_fence();
        issue_s(buf, sacc);
        wgmma_commit();
        issue_pv(b_prev * L::DEC, pin);
        wgmma_commit();
        turn_give();
        wgmma_wait<1>();
        reg_fence(reinterpret_cast<float(&)[NJ * 4]>(sacc));
        softmax_p(k, buf, sacc, pout);
        wgmma_wait<0>();
        if (k - 1 + L::NDEC < nsteps) named_barrier_arrive(L::BAR_EMPTY + b_prev, L::NTH);
        reg_fence(reinterpret_cast<float(&)[D / 2]>(acc));
        reg_fence(pin);
        if (o_pend_any) {
          scale_rows(acc, o_pend);
          o_pend[0] = o_pend[1] = 1.f;
          o_pend_any = false;
        }
        turn_wait();
        advance();
      };
      int k = 1;
#pragma unroll 1
      for (; k + 1 < nsteps; k += 2) {
        step(k, pa, pn);
        step(k + 1, pn, pa);
      }
      if (k < nsteps) {
        step(k, pa, pn);
#pragma unroll
        for (int u = 0; u < NJ / 2; ++u)
#pragma unroll
          for (int i = 0; i < 4; ++i) pa[u][i] = pn[u][i];
      }
      if (nsteps > 0) {  // the last step's O += P' V
        wgmma_fence();
        issue_pv(b_prev * L::DEC, pa);
        wgmma_commit();
      }
    } else {
      // Per step k: wait for its tile (FULL), S, the wait (for S and for step k - 1's O += P' V,
      // whose tile is then handed back: EMPTY), softmax, the turn, O += P' V issued (it runs
      // into the next step).
#pragma unroll 1
      for (int k = 0; k < nsteps; ++k) {
        named_barrier_sync(L::BAR_FULL + wg * L::NDEC + b, L::NT + 128);
        const bool wdo = unit_does(k);
        float sacc[NJ][4];  // written whole by the first MMAs (no accumulate), read only if wdo
        if (wdo) {
          wgmma_fence();
          issue_s(buf, sacc);
          wgmma_commit();
        }
        turn_give();
        wgmma_wait<0>();  // every unit: the barrier hands its tiles back
        if (k > 0 && k - 1 + L::NDEC < nsteps) named_barrier_arrive(L::BAR_EMPTY + b_prev, L::NTH);
        reg_fence(reinterpret_cast<float(&)[NJ * 4]>(sacc));
        reg_fence(reinterpret_cast<float(&)[D / 2]>(acc));
        reg_fence(pa);
        if (wdo) softmax_p(k, buf, sacc, pa);
        turn_wait();
        if (wdo) {
          wgmma_fence();
          issue_pv(buf, pa);
          wgmma_commit();
        }
        advance();
      }
    }
    if (wg == 0) turn_give();
    wgmma_wait<0>();
    reg_fence(reinterpret_cast<float(&)[D / 2]>(acc));
  } else {
    // Per step k (one barrier): S = Q K^T, decode step k + 1 (one warp's integer work overlaps
    // another's MMAs), softmax, O += P' V. Two tiles.
    uint32_t buf = 0;
#pragma unroll 1
    for (int k = 0; k < nsteps; ++k, buf = next_buf(buf)) {
      const bool wdo = unit_does(k);
      const uint32_t kdec = dec_s + buf, vdec = kdec + L::DEC_K;
      float sacc[TK / 8][4];
#pragma unroll
      for (int j = 0; j < TK / 8; ++j) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.f;
      if (wdo) {
#pragma unroll
        for (int j = 0; j < TK / 8; ++j) {
          const int r = 8 * j + (lane & 7);
#pragma unroll
          for (int kk = 0; kk < D / 32; ++kk) {  // two k-steps (32 head-dim elements) per load
            uint32_t bf[4];
            ldmatrix_x4(bf, kdec + dec_off<TK>(r, 4 * kk + (lane >> 3)));
            mma_m16n8k16_f16(sacc[j], qa[2 * kk], bf[0], bf[1]);
            mma_m16n8k16_f16(sacc[j], qa[2 * kk + 1], bf[2], bf[3]);
          }
        }
      }
      decode_next(k + 1);
      if (wdo) {
        uint32_t pa[TK / 16][4];
        softmax_p(k, buf, sacc, pa);
#pragma unroll
        for (int u = 0; u < TK / 16; ++u) {
          const int r = 16 * u + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
          for (int n2 = 0; n2 < D / 16; ++n2) {
            uint32_t bf[4];
            ldmatrix_x4_trans(bf, vdec + dec_off<TK>(r, 2 * n2 + (lane >> 4)));
            mma_m16n8k16_f16(acc[2 * n2], pa[u], bf[0], bf[1]);
            mma_m16n8k16_f16(acc[2 * n2 + 1], pa[u], bf[2], bf[3]);
          }
        }
      }
      __syncthreads();  // step k's tile is free; step k + 1's is complete
    }
  }
  cp_async_wait<0>();  // (wgmma: from here on the consumer warps only)

  // ---- epilogue: per row, O / l, the sink, the un-rotation, the store ----
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    l_run[rh] += __shfl_xor_sync(0xffffffffu, l_run[rh], 1);
    l_run[rh] += __shfl_xor_sync(0xffffffffu, l_run[rh], 2);
  }
  // the barrier (wgmma: DONE, which the producers reach after their loop) also: every warp is
  // done with the decode buffers, which the O rows alias; true: a needed block id was out of range
  if (kWG ? named_barrier_or(L::BAR_DONE, L::NTH, bad) : __syncthreads_or(bad)) {
    write_const_rows(__int_as_float(0x7fc00000), 0.f);
    return;
  }
  if (!wactive) return;
  float* ob = reinterpret_cast<float*>(smem + L::OFF_DEC) + cw * 16 * L::OPITCH;
  {
    const float osc = pow2i(VM - 142 + TQ_SLACK + TQ_DEC_EXP);  // undo P's and the decode's powers of two
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<float2*>(ob + g * L::OPITCH + 8 * j + 2 * t4) = make_float2(acc[j][0] * osc, acc[j][1] * osc);
      *reinterpret_cast<float2*>(ob + (g + 8) * L::OPITCH + 8 * j + 2 * t4) =
          make_float2(acc[j][2] * osc, acc[j][3] * osc);
    }
    if (t4 == 0) {
      mS[16 * cw + g] = m_run[0];
      mS[16 * cw + g + 8] = m_run[1];
      lS[16 * cw + g] = l_run[0];
      lS[16 * cw + g + 8] = l_run[1];
    }
  }
  __syncwarp();
  constexpr int N = D / 4;  // 4 lanes per row, 8 rows per pass
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    const int r = 8 * pass + (lane >> 2), d0 = (lane & 3) * N, R = wrow0 + r;
    const bool valid = R < nrows;  // rows past the sequence still join the shuffles
    float M = mS[16 * cw + r], Ls = lS[16 * cw + r];
    const float inv = (Ls == 0.f) ? 0.f : 1.f / Ls;  // NaN stays NaN
    float a[N];
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(ob + r * L::OPITCH + d0 + i);
      a[i] = v.x * inv; a[i + 1] = v.y * inv; a[i + 2] = v.z * inv; a[i + 3] = v.w * inv;
    }
    if (sink_here && valid && row_lo(R / G) == 0 && row_hi(R / G) >= 0) {
      float sv[N];
      load_sink_value<D, false>(p, slot, kvh, d0, sv);
      merge_sink<N>(sink_logit(p, sinkS[16 * cw + r], cap_state ? qmS[16 * cw + r] : 0.f), sv, M, Ls, a);
    }
    const int tok = q0 + R / G, head = kvh * G + R % G;
    if constexpr (kStates) {  // the learned sink and the lse (true logits), as the general kernel
      M = true_logit_max(p, needs_q_dot_center<kStates>(p) ? qmS[16 * cw + r] : 0.f, M);
      if (valid) finish_whole_row<N>(p, head, (size_t)tok * p.num_heads + head, (lane & 3) == 0, M, Ls, a);
    }
    if (p.rot_signs != nullptr) unrotate_row<N, 4>(p, a, d0, lane);
    if (!valid) continue;
    store_row(reinterpret_cast<T*>(p.out) + tok * p.o_stride_tok + head * p.o_stride_head + d0, a);
  }
}
#undef TQ_PREFILL_KWG

// The prefill kernel on a device of compute capability `major` is the wgmma one (producer and
// row warps, four decode buffers) on SM 9.x, for which the extension is built as sm_90a
// (turboquant/_backends/cuda.py), else the warp-MMA one (SM80-SM89 and later GPUs, whose plain
// sm_XY build has no wgmma; and every GPU with -DTQ_PREFILL_MMA_SYNC).
inline bool prefill_uses_wgmma(int major) {
#ifdef TQ_PREFILL_MMA_SYNC
  return false;
#else
  return major == 9;
#endif
}
// Its dynamic shared memory (kWs: without the raw-code ring) and its threads per CTA (the wgmma
// build adds the producer warps).
template <int D, bool kE4m3, bool kWs>
int prefill_smem_bytes(int major) {
  return prefill_uses_wgmma(major) ? PrefillLayout<D, kE4m3, true, kWs>::TOTAL : PrefillLayout<D, kE4m3, false>::TOTAL;
}
// ... the larger of the two forms (the plan's check against the device's limit)
template <int D, bool kE4m3>
int prefill_smem_bytes(int major) {
  const int plain = prefill_smem_bytes<D, kE4m3, false>(major), ws = prefill_smem_bytes<D, kE4m3, true>(major);
  return plain > ws ? plain : ws;
}
template <bool kWs>
int prefill_threads(int major) {
  return prefill_uses_wgmma(major) ? PrefillLayout<128, false, true, kWs>::NTH : PrefillLayout<128, false, false>::NTH;
}

// The prefill kernel's launch (torch-free). grid_x = row groups (plan_attention).
template <int D, typename T, bool kStates, bool kE4m3, bool kWs>
cudaError_t launch_prefill_attention(const AttnParams& p, int grid_x, cudaStream_t stream) {
  auto kern = paged_attention_fp4_prefill_kernel<D, T, kStates, kE4m3, kWs>;
  static bool attr_set[kMaxDevices] = {};  // per instantiation and device
  int dev = 0, major = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e != cudaSuccess) return e;
  const int smem = prefill_smem_bytes<D, kE4m3, kWs>(major);  // the layout follows the device (wgmma on SM 9.x)
  e = set_smem_attributes_once(kern, smem, attr_set);
  if (e != cudaSuccess) return e;
  // CTA x = row group * num_kv_heads + kv head, as the other kernels
  return launch_programmatic(kern, dim3(grid_x * p.num_kv_heads, 1), dim3(prefill_threads<kWs>(major)), smem, stream, p);
}

}  // namespace cuda_fp4
}  // namespace turboquant
