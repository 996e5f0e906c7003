// turboquant cuda backend, SM90a: the decode kernel on FP8 warpgroup MMAs. One query token per
// sequence, at most 8 query heads per kv head, FP4 keys and values, D 128 (use_decode_wgmma in
// attention_launch.cuh; other calls run attention_decode.cuh's kernel). Torch-free. Shares the
// parameters, the transforms and the epilogue helpers (attention_common.cuh) and the reduce pass.
//
// ============================== design note ==============================================
// Why a third decode kernel: on the H200 the warp-MMA decode kernel is bound by its
//   instructions (59-69 % of the read bandwidth), ~240 of its 387 per 16-token tile spent
//   decoding E2M1 to fp16. Here the codes become E4M3 bytes (E2M1 x 2^-6 is exact in E4M3: 7
//   integer ops per 8 codes) and FP8 wgmma takes the products. benchmarks/wgmma_decode_probe.cu
//   measured the form before it was built (docs/cuda-kernels.md, "An FP8 warpgroup decode").
// Grid (num_seqs x num_kv_heads, num_partitions), one warpgroup (4 warps) per CTA; the CTA walks
//   its partition's keys in 64-token steps through a DECODE_WGMMA_STAGES-deep cp.async ring of
//   raw codes. The MMAs are swapped, a wgmma's 64 rows being tokens or head-dim rows and its
//   columns the query heads of the group (padded to 8):
//   S^T [64 x 16] = K [64 x 128] Q^T [128 x 16]: m64n16k32 E4M3 x 4. Q^T's columns 0-7 hold the
//     heads' hi terms, 8-15 their lo terms (q 2^qe = hi + lo, each E4M3; qe per head puts its
//     largest |q| in [128, 256)): one MMA chain, and the thread holding a head's hi sum holds
//     its lo sum (d[i] + d[4 + i]). One term would cost KLD 0.0036 in a model, two 0.0002.
//   O^T [128 x 8] += V^T [128 x 64] P^T [64 x 8]: m64n8k32 E4M3 x 2 x 2; P' in one E4M3 term.
//   K and V^T are A fragments from registers; Q^T and P^T are B tiles in shared memory
//   (128-byte swizzle, K-major, the only layout FP8 wgmma reads).
//   K: thread (w, g, t)'s A rows are tokens 16w + 2g, +1 (A row 16w + g <-> token 16w + 2g, row
//     + 8 <-> token + 1), its k slots a permutation of D that the E4M3 decode leaves (word c's
//     even codes at 32c + 4t.., odd ones at 32c + 16 + 4t..); Q^T is stored in the same
//     permutation, so the sums are unchanged. One 16-byte shared load per token; the ring's K
//     rows swap tokens 2 and 3 of every 4 (no bank conflict).
//   V^T: ldmatrix.trans on the codes seen as 16-bit units (4 codes of a token) gives a thread
//     one unit of two adjacent tokens; two byte permutes make words of 4 tokens x 2 codes whose
//     decode is 4 tokens of one D row, the A fragment's 4 consecutive k slots. O^T's rows are D
//     in the order 4u + {0, 1, 2, 3} (u = 8w + g), undone at the store. The ring's V rows XOR
//     their 16-byte chunks with (token / 2) % 4.
// Softmax per column in the exp2 domain, V's per-token exponent e_v in the logit: P' =
//   2^(x + e_v - m + 8) <= 256 fits E4M3, m the running maximum of x + e_v; l sums P' 2^-e_v,
//   so (M = m - 8, l) is the usual state (the kernel keeps M) and O^T 2^6 / l the output. The
//   maxima are exchanged lazily: P' is written with the running maximum, and one bar.red.or of
//   each thread's "an exponent of my P' exceeds 8 + DECODE_WGMMA_REDO_MARGIN" (below it P'
//   still fits E4M3) says whether the warps must butterfly, exchange their maxima in shared memory,
//   rescale O and l and rewrite P' (the first step always; then whenever a column's maximum
//   grows by more than the margin). Otherwise a step has that one CTA barrier.
// Copies: each warp copies the K rows and scale words of its own 16 tokens (it alone reads
//   them), V is copied by all four and read after the step's barrier; the ring slot is refilled
//   after that barrier. The block ids of 32 steps sit in a warp's lanes (one batch of table
//   loads per 32 steps, a shuffle per id and step) and each copy's address is one mad.wide
//   below 128-token blocks: with ids loaded per step and addresses built from 64-bit strides
//   the copies took 84 instructions per warp and step against the probe's 35, and the kernel
//   read at 74 % instead of 89 % (H200, 64 x 32k). A 16-token group with no visible key reads
//   block 0 instead (its logits are masked; no predicated copies); a visible group's block id
//   out of range makes the sequence's rows NaN and reads block 0, never out of bounds.
// Masking and NaN as the other kernels: keys outside [r_lo, r_hi) get logit -inf and weight 0
//   (what a skipped copy left in the ring never counts); a visible key's scale byte 255 makes
//   its kv head's rows NaN. The epilogue is the decode kernel's: the sink, the learned sink and
//   the lse, the un-rotation, the row or the partition's partial for the reduce pass.
// The sink with the layer's table: warp 0 fingerprints position 0 from the first ring stage,
//   all of whose bytes it copied, once the stage lands (after the Q^T work), and the table's
//   tag and sink rows for it ride the next copy group; the epilogue compares the tags and
//   forms q'.k0' from q' kept in shared memory (a miss reads the rows as sink_elements does).
//   sink_ref's chain (block id, bytes, tag, sink key: four round trips before the first step)
//   cost 1-2 us per call at batch 1 (benchmarks/results/2026-11-29-h200-decode-wgmma-sink-cost.json).
// Registers: 96 per thread for 5 CTAs per SM (tuning.cuh), no spills (tests/test_cuda_compile.py).
// ===========================================================================================
#pragma once

#include "attention_common.cuh"

namespace turboquant {
namespace cuda_fp4 {

struct DecodeWgmmaLayout {
  static constexpr int D = 128, STEP = 64, W = 4;
  static constexpr int CODES = STEP * D / 2;                  // bytes of K (or V) codes per step
  static constexpr int STAGES = tuning::DECODE_WGMMA_STAGES;
  static constexpr int STAGE = 2 * CODES + 2 * STEP * 4;      // K, V codes; K, V scale words
  static constexpr int OFF_Q = 0;                // Q^T [16 columns][128 B], swizzled
  static constexpr int OFF_P = 2048;             // P^T [8 columns][128 B] (64 token bytes used)
  static constexpr int OFF_RED = 3072;           // [W][8] float: the maxima exchange, then l
  static constexpr int OFF_M = OFF_RED + 128;    // [8] float: each column's final b = m - 8
  static constexpr int OFF_CF = OFF_M + 32;      // [8] float: each column's logit factor
  static constexpr int OFF_SINK = OFF_CF + 32;   // [8] float: q'.k0' (sink)
  static constexpr int OFF_QM = OFF_SINK + 32;   // [8] float: scale * q.m (soft cap, states)
  static constexpr int OFF_MISC = OFF_QM + 32;   // int: a block id was out of range
  static constexpr int OFF_SREF = OFF_MISC + 8;  // int64 fingerprint, int64 entry's tag, int entry, blk
  static constexpr int OFF_RING = 4096;          // STAGES x STAGE; the epilogue's O rows after
  static constexpr int OFF_QF = OFF_RING + STAGES * STAGE;  // [8 columns][D] float: q' (sink table)
  static constexpr int MROW = D + 4;             // an O row in the epilogue (floats)
  static constexpr int OFF_SKV = OFF_QF + 8 * D * 4;  // [2][D] bf16: the entry's sink rows (a hit)
  static constexpr int TOTAL = OFF_SKV + 2 * D * 2 + 1024;  // + the 1024-byte alignment
  static_assert(8 * MROW * 4 <= STAGES * STAGE, "the epilogue's O rows fit the ring");
};

// block 128, dynamic smem DecodeWgmmaLayout::TOTAL bytes; requires group_size <= 8, FP4 keys,
// D 128, partition_size % 64 == 0. kStates as for the other kernels.
template <typename T, bool kStates>
__global__ void __launch_bounds__(128, tuning::DECODE_WGMMA_MIN_BLOCKS)
    paged_attention_fp4_decode_wgmma_kernel(const AttnParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = DecodeWgmmaLayout;
  constexpr int D = L::D, STEP = L::STEP, ST = L::STAGES, CODES = L::CODES;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* sm = smem_raw + ((1024u - ((uint32_t)__cvta_generic_to_shared(smem_raw) & 1023u)) & 1023u);
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
  const uint32_t qt = base + L::OFF_Q, pt = base + L::OFF_P, red = base + L::OFF_RED;
  const uint32_t ring = base + L::OFF_RING;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int Hkv = p.num_kv_heads, G = p.group_size;
  const int s = blockIdx.x / Hkv, kvh = blockIdx.x - s * Hkv, part = blockIdx.y;
  pdl_wait();  // launched as a programmatic dependent (launch_programmatic)
  // the reduce pass, where one follows, may be scheduled once every CTA has started. With one
  // partition the dependent is the next call's kernel: its CTAs placed while this grid still
  // runs spread unevenly over the SMs (H200, 64 x 4k, a one-wave grid: 91.0 us with the
  // trigger, 78.2 without; record 2026-11-29-h200-sink-lookup.json)
  if (p.num_partitions > 1) pdl_launch_dependents();
  const int seq_len = __ldg(p.seq_lens + s);
  const int slot = state_slot(p, s);
  const int P = p.partition_size, nparts = p.num_partitions;
  // Q: column n = tid / 16 (head kvh G + n; padding columns n >= G are zero), its elements
  // dc .. dc + 7
  const int n = tid >> 4, dc = (tid & 15) * 8;
  uint4 q_v = make_uint4(0, 0, 0, 0);
  if (n < G)
    q_v = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(p.query) + s * p.q_stride_tok +
                                          (kvh * G + n) * p.q_stride_head + dc);
  // the query (position seq_len - 1) sees keys [key_lo, seq_len); with the sink, position 0
  // comes from the state record, merged in by partition 0
  const int key_lo = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
  const bool sink_here = p.sink && part == 0 && key_lo == 0 && seq_len > 0;
  // with the sink table the CTA fingerprints position 0 from its first ring stage and finds the
  // sink's rows and q'.k0' in the epilogue (no round trips before its first step)
  const bool sink_table = sink_here && p.sink_tags != nullptr;
  const int r_lo = max(p.sink ? max(key_lo, 1) : key_lo, part * P), r_hi = min(seq_len, part * P + P);
  auto write_const_rows = [&](float oval, float mval, float lval) {
    for (int i = tid; i < G * D; i += 128)
      write_const_element<D, T, kStates>(p, s, kvh * G + i / D, i % D, nparts, part, oval, mval, lval);
  };
  if (r_lo >= r_hi && !sink_here) {
    write_const_rows(0.f, -INFINITY, 0.f);
    return;
  }
  QChunk qc;
  load_q_chunk<D, kStates>(p, slot, kvh, dc, sink_here, qc);

  // ---- copies: steps [s_lo, s_hi) of 64 keys; step sp's 16-token group j is in one block ----
  const int s_lo = r_lo < r_hi ? r_lo / STEP : 0, s_hi = r_lo < r_hi ? (r_hi + STEP - 1) / STEP : 0;
  const int bmask = (1 << p.log2_block_size) - 1;
  const BlockRow blocks(p, s);
  // V: chunk tid % 4 of tokens tv and tv + 32 (groups jv, jv + 2); K: chunk lane % 4 of tokens
  // 16w + lane / 4 and + 8 (group w); the scale word of token 16w + lane % 16 (K for lanes
  // < 16, V above). Ring offsets as the design note says; sources in block 0 at a group's
  // first row in its block (16 j % block_size; blocks above 64 tokens add the step's row,
  // kv_row), kept in registers (opaque).
  const int jv = tid >> 6, tv = 16 * jv + ((tid & 63) >> 2), tk = 16 * w + (lane >> 2), ts = 16 * w + (lane & 15);
  const uint32_t dv = opaque(CODES + 64 * tv + 16 * ((tid & 3) ^ ((tv >> 1) & 3)));  // token tv + 32: + 2048
  const uint32_t dk = opaque(64 * (tk ^ ((tk >> 1) & 1)) + 16 * (lane & 3));          // token tk + 8: + 512
  const uint32_t ds = opaque(2 * CODES + (lane >= 16 ? STEP * 4 : 0) + 4 * ts);
  const uint8_t* vc_a = opaque(p.value_cache + kvh * p.vc_stride_head +
                               (((16 * jv) & bmask) + (tv & 15)) * 64 + 16 * (tid & 3));
  const uint8_t* vc_b = opaque(p.value_cache + kvh * p.vc_stride_head +
                               (((16 * jv + 32) & bmask) + (tv & 15)) * 64 + 16 * (tid & 3));
  const uint8_t* kc_t = opaque(p.key_cache + kvh * p.kc_stride_head +
                               (((16 * w) & bmask) + (tk & 15)) * 64 + 16 * (lane & 3));
  const uint8_t* sc_t = opaque((lane >= 16 ? p.value_scales : p.key_scales) +
                               (((16 * w) & bmask) + (ts & 15)) * Hkv + kvh);
  // the block stride of K and V (equal for FP4 keys; the binding keeps it below 2^31 bytes) and
  // a block's scale bytes, bs * Hkv
  const uint32_t kstride = opaque((uint32_t)p.vc_stride_blk);
  const uint32_t sstride = opaque((uint32_t)(bmask + 1) * (uint32_t)Hkv);
  // The block ids of the warp's groups jv, jv + 2 and w, for 32 steps at a time: lane l holds
  // those of step sb + l (one batch of loads per 32 steps, a shuffle per id and step), each a
  // valid block: a group with no visible key (only in a step on the range's edge) reads block
  // 0, its logits masked; an id out of range sets `bad` (NaN rows) and reads block 0. Group j's
  // table entry is (64 sp >> log2 bs) + (16 j >> log2 bs) for blocks of 16 to 256 tokens; the
  // range's last entry is checked once (a sequence longer than its table row: NaN rows), so no
  // load reads past the row.
  const int lbs = p.log2_block_size;
  const int* row = opaque(blocks.row);
  bool bad = r_lo < r_hi && ((r_hi - 1) >> lbs) >= p.max_blocks_per_seq;
  int ia_l = 0, ib_l = 0, is_l = 0, sb = s_lo - 32;
  auto load_ids = [&]() {  // steps sb .. sb + 31
    const int sp = sb + lane, t0 = STEP * sp;
    ia_l = ib_l = is_l = 0;
    if (sp >= s_hi || bad) return;
    const int* rp = row + (t0 >> lbs);
    auto seen = [&](int j) { return t0 + 16 * j + 16 > r_lo && t0 + 16 * j < r_hi; };
    if (seen(jv)) ia_l = __ldg(rp + ((16 * jv) >> lbs));
    if (seen(jv + 2)) ib_l = __ldg(rp + ((16 * jv + 32) >> lbs));
    if (seen(w)) is_l = __ldg(rp + ((16 * w) >> lbs));
    const uint32_t nb = (uint32_t)p.num_blocks;
    if ((uint32_t)ia_l >= nb || (uint32_t)ib_l >= nb || (uint32_t)is_l >= nb) bad = true, ia_l = ib_l = is_l = 0;
  };
  // a step's copies; kBig: blocks above 64 tokens, where a step starts inside its block
  auto copy = [&](int sp, auto kBig) {
    const uint32_t st = ring + ((uint32_t)sp % ST) * L::STAGE;
    const int ia = __shfl_sync(0xffffffffu, ia_l, sp - sb), ib = __shfl_sync(0xffffffffu, ib_l, sp - sb);
    const int is = __shfl_sync(0xffffffffu, is_l, sp - sb);
    uint32_t kv_row = 0, s_row = 0;  // the step's first row in its block: code and scale bytes
    if constexpr (decltype(kBig)::value) {
      const uint32_t r = (uint32_t)(STEP * sp) & (uint32_t)bmask;
      kv_row = r * 64u, s_row = r * (uint32_t)Hkv;
    }
    // address = base + id x stride (+ the step's row, above 64-token blocks), the product and
    // sum one mad.wide: written as C++, ptxas merged the two forms and kept the big form's
    // zero row in the small one (4 more instructions per step)
    auto at = [](const uint8_t* base, int id, uint32_t stride, uint32_t extra) {
      uint64_t a64;
      asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(a64) : "r"((uint32_t)id), "r"(stride), "l"(base));
      const uint8_t* a = reinterpret_cast<const uint8_t*>(a64);
      if constexpr (decltype(kBig)::value) return a + extra;
      else return a;
    };
    const uint8_t* k = at(kc_t, is, kstride, kv_row);
    cp_async_16(st + dk, k);
    cp_async_16(st + dk + 512, k + 8 * 64);
    cp_async_4(st + ds, reinterpret_cast<const void*>((uintptr_t)at(sc_t, is, sstride, s_row) & ~(uintptr_t)3));
    cp_async_16(st + dv, at(vc_a, ia, kstride, kv_row));
    cp_async_16(st + dv + 2048, at(vc_b, ib, kstride, kv_row));
  };
  const bool big_blocks = bmask >= STEP;
  auto issue = [&](int sp) {
    if (sp < s_hi) {
      if (sp - sb >= 32) {  // the next 32 steps' ids (warp-uniform)
        sb += 32;
        load_ids();
      }
      if (big_blocks) copy(sp, std::true_type{});
      else copy(sp, std::false_type{});
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < ST - 1; ++i) issue(s_lo + i);

  // ---- Q^T: the transforms in fp32 (prepare_q8: 16 lanes per column), then per column the
  //      power of two qs, the two E4M3 terms at the K decode's k slots, the logit factor ----
  float* cfS = reinterpret_cast<float*>(sm + L::OFF_CF);
  float* sinkS = reinterpret_cast<float*>(sm + L::OFF_SINK);
  float* qmS = reinterpret_cast<float*>(sm + L::OFF_QM);
  int* misc = reinterpret_cast<int*>(sm + L::OFF_MISC);
  const bool cap = p.soft_cap > 0.f, cap_state = cap && p.seq_state != nullptr;
  {
    float qv[8];
    prepare_q8<D, T, kStates>(p, qc, q_v, sink_here && !sink_table, (tid & 15) == 0, sinkS + n, qmS + n, qv,
                              lane);
    if (sink_table) {  // q' for the epilogue's q'.k0'
      float* qf = reinterpret_cast<float*>(sm + L::OFF_QF) + n * D + dc;
      *reinterpret_cast<float4*>(qf) = make_float4(qv[0], qv[1], qv[2], qv[3]);
      *reinterpret_cast<float4*>(qf + 4) = make_float4(qv[4], qv[5], qv[6], qv[7]);
    }
    float mx = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) mx = fmaxf(mx, fabsf(qv[i]));
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    // 2^(7 - e) puts the largest |q| in [128, 256) (fmaxf drops NaN: an all-NaN or zero column
    // keeps 1); an infinite q makes the column NaN, as it makes the reference's logits
    const int e = mx > 0.f ? (int)((__float_as_uint(mx) >> 23) & 255u) - 127 : 7;
    const float nan = __int_as_float(0x7fc00000);
    const float qs = mx == INFINITY ? nan : pow2i(min(7 - e, 127));
    const int j = dc / 8, c = j & 3, tt = j >> 2;
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 8; i += 2) e4m3x2_split(qv[i] * qs, qv[i + 1] * qs, hi[i / 2], lo[i / 2]);
    // element i + b (byte b of pair i / 2) goes to k slot 32 c + 16 b + 4 tt + i / 2: per b
    // and term, 4 consecutive bytes of one 16-byte chunk, one 32-bit store (column n + 8: lo)
    auto store4 = [&](const uint32_t (&pair)[4], uint32_t off) {
      const uint32_t ab = prmt(pair[0], pair[1], 0x5140u), cd = prmt(pair[2], pair[3], 0x5140u);  // [x0 y0 x1 y1]
      sts32(qt + off + sw128_offset(n, 32 * c + 4 * tt), prmt(ab, cd, 0x5410u));
      sts32(qt + off + sw128_offset(n, 32 * c + 16 + 4 * tt), prmt(ab, cd, 0x7632u));
    };
    store4(hi, 0);
    store4(lo, 1024);
    // logit = S 2^6 / qs * scale * K's scale (natural units, then exp2 units unless capped);
    // 2^6 / qs = 2^(max(e - 1, -121)) exactly, a product rather than a division
    if ((tid & 15) == 0)
      cfS[n] = p.scale * (mx == INFINITY ? nan : pow2i(max(e - 1, -121))) * (cap ? 1.f : LOG2E);
    if (tid == 0) misc[0] = 0;
    fence_proxy_async();  // Q^T to the MMAs, after the barrier below
  }
  // a token's scale byte in its word (prmt selector; the blocks' and groups' rows are
  // multiples of 16 tokens, so only the token in its group moves the byte)
  auto sel = [&](const uint8_t* scales, int tok) {
    return 0x4440u | (uint32_t)(((uintptr_t)scales + tok * Hkv + kvh) & 3);
  };
  // The sink's slot (sink_ref's) for the epilogue, in OFF_SREF as (fingerprint, the entry's
  // tag, entry, blk) for sink_slot. With a step, the fingerprint (sink_fingerprint's words)
  // from the ring's copy of position 0, all of whose bytes warp 0 copied (step 0: the sink's
  // partition starts there); the entry's tag and its sink rows (used where the tags match)
  // come with step ST - 1's copies. With no step (position 0 the only key), sink_ref's round
  // trips here, the slot stored as an entry and blk -1 (no rows in shared memory).
  int64_t* sref_words = reinterpret_cast<int64_t*>(sm + L::OFF_SREF);
  if (sink_table && r_lo >= r_hi) {
    const int sref = sink_ref<D>(p, s, kvh, true, slot);
    if (tid == 0) {
      sref_words[0] = sref_words[1] = 0;
      reinterpret_cast<int*>(sref_words + 2)[0] = sref, reinterpret_cast<int*>(sref_words + 2)[1] = -1;
    }
  } else if (sink_table && w == 0) {
    cp_async_wait<ST - 2>();
    __syncwarp();
    const uint32_t kb = prmt(lds32(ring + 2 * CODES), 0u, sel(p.key_scales, 0));
    const uint32_t vb = prmt(lds32(ring + 2 * CODES + STEP * 4), 0u, sel(p.value_scales, 0));
    const uint32_t fw[2] = {lds32(ring + (lane < 16 ? 4 * lane : CODES + 4 * (lane - 16))), kb | vb << 8};
    const int64_t tag = fingerprint_mix(fw, D / 4 + 1);
    const int blk = __shfl_sync(0xffffffffu, is_l, 0);  // group 0's block in step 0
    const int entry = (int)sink_entry(tag, p.sink_entries);
    cp_async_16(base + L::OFF_SKV + 16 * lane, p.sink_kv + ((int64_t)entry * Hkv + kvh) * 2 * D + 8 * lane);
    if (lane == 0) {
      sref_words[0] = tag;
      reinterpret_cast<int*>(sref_words + 2)[0] = entry, reinterpret_cast<int*>(sref_words + 2)[1] = blk;
      cp_async_8(base + L::OFF_SREF + 8, p.sink_tags + (int64_t)entry * Hkv + kvh);
    }
  }

  const uint64_t qdesc = wgmma_desc_sw128(qt, 16, 1024), pdesc = wgmma_desc_sw128(pt, 16, 1024);
  const int tau0 = 16 * w + 2 * g;  // this thread's S rows: tokens tau0, tau0 + 1
  const uint32_t kofs0 = opaque(64 * (tau0 ^ ((tau0 >> 1) & 1)) + 16 * t);
  // token tau0 + 1's K row (tau0 is even: its swap bit is tau0's, the row index flips bit 0)
  // and the two tokens' scale words, each offset in a register: formed per step they took 15
  // instructions per warp and step (ptxas rebuilt them from the thread index)
  const uint32_t kofs1 = opaque(kofs0 ^ 64u);
  const uint32_t sofs0 = opaque(2 * CODES + 4 * tau0);
  // ldmatrix rows: lane 8m + r -> token 8 (m + 4 x) + r, unit block w
  const int lt = 8 * (lane >> 3) + (lane & 7);
  const uint32_t vofs0 = opaque(CODES + 64 * lt + 16 * (w ^ ((lt >> 1) & 3)));
  // P^T bytes (tokens tau0, tau0 + 1) of column n at k = 16 w + 4 (g % 4) + 2 (g / 4)
  const int pk = 16 * w + 4 * (g & 3) + 2 * (g >> 2);
  const uint32_t p_c0 = opaque(pt + sw128_offset(2 * t, pk)), p_c1 = opaque(pt + sw128_offset(2 * t + 1, pk));
  const uint32_t red_t = red + 8 * t, red_w = red + 32 * w + 8 * t;  // (the rare exchange)
  // the scale bytes of tokens tau0, tau0 + 1 (a tensor's two selectors in one register: prmt
  // reads the low 16 bits)
  const uint32_t ksel = opaque(sel(p.key_scales, 2 * g) | sel(p.key_scales, 2 * g + 1) << 16);
  const uint32_t vsel = opaque(sel(p.value_scales, 2 * g) | sel(p.value_scales, 2 * g + 1) << 16);
  float b0 = -INFINITY, b1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // columns 2t, 2t + 1: b = M = m - 8
  float o[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  uint32_t va[2][2][4];  // V^T fragments [half][32-token chunk]
  // (reg_fence views: the fragments and accumulators stay in their registers across the waits)
  auto& va_words = reinterpret_cast<uint32_t(&)[4][4]>(va);
  auto& o_words = reinterpret_cast<float(&)[8]>(o);
  __syncthreads();  // Q^T, the column factors, misc
  const float c0 = cfS[2 * t], c1 = cfS[2 * t + 1];
  const int sf_lo = (r_lo + STEP - 1) / STEP, sf_hi = r_hi / STEP;  // the steps whose keys are all visible
  const float inv_cap = soft_cap_reciprocal(p);

#pragma unroll 1
  for (int sp = s_lo; sp < s_hi; ++sp) {
    cp_async_wait<ST - 2>();
    __syncwarp();  // this warp's K rows and scale words; V after the barrier below
    const uint32_t st = ring + ((uint32_t)sp % ST) * L::STAGE;
    const uint4 k0 = lds128(st + kofs0), k1 = lds128(st + kofs1);
    uint32_t ka[4][4];
    {
      const uint32_t w0[4] = {k0.x, k0.y, k0.z, k0.w}, w1[4] = {k1.x, k1.y, k1.z, k1.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        e2m1x8_to_e4m3(w0[c], ka[c][0], ka[c][2]);
        e2m1x8_to_e4m3(w1[c], ka[c][1], ka[c][3]);
      }
    }
    float sacc[8];  // the chain's first MMA does not accumulate: no zeroing
    reg_fence(ka);
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < 4; ++c) wgmma_m64n16k32_e4m3(sacc, ka[c], wgmma_desc_advance(qdesc, 32 * c), c != 0);
    wgmma_commit();
    const uint2 ksw = lds64(st + sofs0);
    const uint2 vsw = lds64(st + sofs0 + STEP * 4);
    wgmma_wait<0>();
    reg_fence(ka);
    reg_fence(va_words);
    reg_fence(sacc);
    reg_fence(o_words);
    // logits in the exp2 domain, V's exponent added: L = S x (K's scale x the column's factor)
    // + e_v, one FFMA each
    const uint32_t kb0 = prmt(ksw.x, 0u, ksel), kb1 = prmt(ksw.y, 0u, ksel >> 16);
    const uint32_t vb0 = prmt(vsw.x, 0u, vsel), vb1 = prmt(vsw.y, 0u, vsel >> 16);
    float ev0 = vb0 == 255u ? __int_as_float(0x7fc00000) : (float)((int)vb0 - 127);
    float ev1 = vb1 == 255u ? __int_as_float(0x7fc00000) : (float)((int)vb1 - 127);
    const float kf0 = e8m0_to_float(kb0), kf1 = e8m0_to_float(kb1);
    const float sum[4] = {sacc[0] + sacc[4], sacc[1] + sacc[5], sacc[2] + sacc[6], sacc[3] + sacc[7]};
    const float fac[4] = {kf0 * c0, kf0 * c1, kf1 * c0, kf1 * c1};
    float L0, L1, L2, L3;
    if (cap) {  // uniform; q.m of columns 2t, 2t + 1 back in (records)
      float x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float qm = cap_state ? qmS[2 * t + (i & 1)] : 0.f;
        x[i] = p.soft_cap * tanhf((sum[i] * fac[i] + qm) * inv_cap) * LOG2E;
      }
      L0 = x[0] + ev0, L1 = x[1] + ev0, L2 = x[2] + ev1, L3 = x[3] + ev1;
    } else {
      L0 = fmaf(sum[0], fac[0], ev0), L1 = fmaf(sum[1], fac[1], ev0);
      L2 = fmaf(sum[2], fac[2], ev1), L3 = fmaf(sum[3], fac[3], ev1);
    }
    if (sp < sf_lo || sp >= sf_hi) {  // a step some key of is not visible
      const int tok = STEP * sp + tau0;
      if (tok < r_lo || tok >= r_hi) L0 = L1 = -INFINITY, ev0 = 0.f;
      if (tok + 1 < r_lo || tok + 1 >= r_hi) L2 = L3 = -INFINITY, ev1 = 0.f;
    }
    float x0, x1;  // this thread's maxima per column (the exchange only)
    auto exchange = [&]() {  // the step's maxima of the CTA, per column
      x0 = fmaxf(L0, L2), x1 = fmaxf(L1, L3);
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
      }
      if (g == 0) sts64(red_w, __float_as_uint(x0), __float_as_uint(x1));
      named_barrier_sync(1, 128);
#pragma unroll
      for (int ww = 0; ww < 4; ++ww) {
        const uint2 mm = lds64(red_t + 32 * ww);
        x0 = fmaxf(x0, __uint_as_float(mm.x));
        x1 = fmaxf(x1, __uint_as_float(mm.y));
      }
    };
    float p0, p1, p2, p3, e0, e1;
    auto write_p = [&]() {  // P' = 2^(L - b) from the running b = m - 8, to P^T
      const float a0 = L0 - b0, a1 = L1 - b1, a2 = L2 - b0, a3 = L3 - b1;
      e0 = fmaxf(a0, a2), e1 = fmaxf(a1, a3);
      p0 = fast_exp2(a0), p1 = fast_exp2(a1), p2 = fast_exp2(a2), p3 = fast_exp2(a3);
      sts16(p_c0, cvt_e4m3x2(p0, p2));
      sts16(p_c1, cvt_e4m3x2(p1, p3));
      fence_proxy_async();
    };
    write_p();
    // a logit above m + MARGIN: P' above 2^(8 + MARGIN) (NaN compares false, as fmaxf drops it)
    constexpr float LIMIT = 8.f + tuning::DECODE_WGMMA_REDO_MARGIN;
    const bool redo = named_barrier_or(2, 128, e0 > LIMIT || e1 > LIMIT);
    // every warp is past the last step's V reads only here: its ring slot is refilled now
    issue(sp + ST - 1);
    if (redo) exchange();
    uint32_t r[8];  // V^T units (every thread's copies of this stage are visible after barrier 2)
    {
      uint32_t ra[4], rb[4];
      ldmatrix_x4_trans(ra, st + vofs0);
      ldmatrix_x4_trans(rb, st + vofs0 + 2048);  // tokens + 32: the same chunk swap
#pragma unroll
      for (int i = 0; i < 4; ++i) r[i] = ra[i], r[4 + i] = rb[i];
    }
    e2m1_units_to_vt_e4m3(r, va);
    if (redo) {  // a step whose maximum grew: rescale to it, P' rewritten after barrier 2's reads
      const float n0 = fmaxf(b0, x0 - 8.f), n1 = fmaxf(b1, x1 - 8.f);
      const float a0 = n0 == -INFINITY ? 1.f : fast_exp2(b0 - n0), a1 = n1 == -INFINITY ? 1.f : fast_exp2(b1 - n1);
      b0 = n0, b1 = n1;
      l0 *= a0, l1 *= a1;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) o[hh][0] *= a0, o[hh][1] *= a1, o[hh][2] *= a0, o[hh][3] *= a1;
      write_p();
    }
    const float r0 = fast_exp2(-ev0), r1 = fast_exp2(-ev1);
    l0 = fmaf(p2, r1, fmaf(p0, r0, l0));
    l1 = fmaf(p3, r1, fmaf(p1, r0, l1));
    reg_fence(va_words);
    reg_fence(o_words);
    if (redo) named_barrier_sync(2, 128);
    wgmma_fence();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int c = 0; c < 2; ++c) wgmma_m64n8k32_e4m3(o[hh], va[hh][c], wgmma_desc_advance(pdesc, 32 * c));
    wgmma_commit();
  }
  wgmma_wait<0>();
  reg_fence(o_words);
  cp_async_wait<0>();

  // ---- epilogue: l over the CTA, O^T rows to shared memory in D order, then per column ----
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  const bool any_bad = __any_sync(0xffffffffu, bad);
  constexpr int EPL = D / 32;  // elements per lane of a row
  __syncthreads();  // every warp is done with the ring and the exchange words; the sink's tags
  float* lS = reinterpret_cast<float*>(sm + L::OFF_RED);
  float* mS = reinterpret_cast<float*>(sm + L::OFF_M);
  if (any_bad && lane == 0) misc[0] = 1;
  if (g == 0) {
    lS[8 * w + 2 * t] = l0, lS[8 * w + 2 * t + 1] = l1;
    if (w == 0) mS[2 * t] = b0, mS[2 * t + 1] = b1;
  }
  float* mo = reinterpret_cast<float*>(sm + L::OFF_RING);  // [8 columns][MROW]
  {
    const int u = 8 * w + g;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int k = 0; k < 4; ++k) mo[(2 * t + (k & 1)) * L::MROW + 4 * u + 2 * hh + (k >> 1)] = o[hh][k] * 64.f;
  }
  float sv[EPL];
  if (sink_here) {
    // (the slot and kv head computed again rather than kept in registers through the loop)
    const int kvh_e = (int)opaque(blockIdx.x) - s * Hkv;
    int sref = state_slot(p, s);
    if (sink_table) {
      const int64_t* sr = reinterpret_cast<const int64_t*>(sm + L::OFF_SREF);
      const int* ids = reinterpret_cast<const int*>(sr + 2);
      sref = sink_slot(sr[0], sr[1], ids[0], ids[1]);
      const bool rows_here = sref >= 0 && ids[1] >= 0;  // a hit whose rows came with the copies
      const uint16_t* skv = reinterpret_cast<const uint16_t*>(sm + L::OFF_SKV);
      // q'.k0' of column n_e (the prologue's q', elements dc_e ..) to sinkS
      const int n_e = (int)opaque(threadIdx.x) >> 4, dc_e = (tid & 15) * 8;
      const float* qf = reinterpret_cast<const float*>(sm + L::OFF_QF) + n_e * D + dc_e;
      float qv[8], sk[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) qv[i] = qf[i];
      if (rows_here) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sk[i] = bf16_bits_float(skv[dc_e + i]);
      } else {
        sink_elements<D, 8, true>(p, sref, kvh_e, dc_e, sk);
      }
      const float q_k0 = row_sum<D / 8>(sink_dot8(qv, sk));
      if ((tid & 15) == 0) sinkS[n_e] = q_k0;
      if (rows_here) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) sv[e] = bf16_bits_float(skv[D + lane * EPL + e]);
      } else {
        load_sink_value<D, true>(p, sref, kvh_e, lane * EPL, sv);
      }
    } else {
      load_sink_value<D, true>(p, sref, kvh_e, lane * EPL, sv);
    }
  }
  __syncthreads();
  if (misc[0]) {
    write_const_rows(__int_as_float(0x7fc00000), 0.f, __int_as_float(0x7fc00000));
    return;
  }
  const int d0 = lane * EPL;
  for (int r = w; r < G; r += 4) {  // warp w writes columns w, w + 4
    const int head = kvh * G + r;
    float M = mS[r];  // the state (M, Ls) of O 2^6 / l (see the design note)
    float Ls = lS[r] + lS[8 + r] + lS[16 + r] + lS[24 + r];
    const float inv = (Ls == 0.f) ? 0.f : 1.f / Ls;  // NaN stays NaN
    float a[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) a[e] = mo[r * L::MROW + d0 + e] * inv;
    if (sink_here) merge_sink<EPL>(sink_logit(p, sinkS[r], cap_state ? qmS[r] : 0.f), sv, M, Ls, a);
    store_decode_row<D, T, kStates>(p, s, head, part, nparts, needs_q_dot_center<kStates>(p) ? qmS[r] : 0.f,
                                    M, Ls, a, lane);
  }
#else
  __trap();  // SM90a only (use_decode_wgmma)
#endif
}

// The kernel on grid (num_seqs * num_kv_heads, num_partitions); the kv heads of a sequence are
// consecutive CTAs, so the scale sectors they share come from DRAM once (launch_decode_kernel).
template <typename T, bool kStates>
cudaError_t launch_decode_wgmma(const AttnParams& p, cudaStream_t stream) {
  static bool attr_set[kMaxDevices] = {};  // per instantiation and device
  return launch_kv_grid(paged_attention_fp4_decode_wgmma_kernel<T, kStates>, attr_set, p.num_seqs,
                        DecodeWgmmaLayout::W, DecodeWgmmaLayout::TOTAL, p, stream);
}

}  // namespace cuda_fp4
}  // namespace turboquant
