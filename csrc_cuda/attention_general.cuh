// turboquant cuda backend (SM80-SM90): the general attention kernel, fused split-KV paged
// attention over an FP4 cache. Torch-free: plain CUDA C++ (the binding in torch_binding.cu is the
// only torch code).
//
// ============================== design note ==============================================
// Decode with at most 8 heads per kv head, and short multi-token queries (speculative decoding,
// tuning::use_spec_kernel), run the swapped kernel of attention_decode.cuh instead; long
// chunks run the prefill kernel; this kernel serves the rest (larger groups, D 256, mid-size
// multi-token queries).
// Grid: x = row tile (16 MMA rows each) x kv head, kv head fastest; y = KV partition
//   (flash-decoding split).
//   A row tile holds 16 (query token, head-in-GQA-group) pairs of ONE sequence, query-token
//   major: row R -> query token R / G, head kvh*G + R % G (G = num_heads / num_kv_heads).
//   Decode (G <= 16): one tile per sequence, G real rows padded to 16; every K/V tile load is
//   shared by all heads of the group. Multi-token (cu_query_lens): a sequence with q tokens has
//   ceil(q*G/16) tiles; tiles are numbered base(s) + i with base(s) = s + floor(cu[s]*G/16)
//   (strictly increasing, and leaves room for every sequence's tiles), so a CTA finds its
//   sequence by a 32-way warp search over cu_query_lens (find_row_tile), with no host sync;
//   spare tiles exit.
//   Causality/sliding window are per-row key ranges applied by selection (logit = -inf).
// CTA: ATTN_WARPS = 8 warps (tuning.cuh). Every warp uses the same 16 rows of Q (fp16
//   A-fragments, built once per CTA in shared memory; kept in registers for D=64) and walks its
//   own 16-token KV tiles of the partition (tile k of warp w = tile w + 8k);
//   per warp: cp.async (16 B per lane, coalesced) of K codes, V codes and the 32 scale words of
//   a tile into a private STAGES-deep shared-memory ring, so STAGES-1 tiles are in flight while
//   one is decoded and multiplied. At the end the warps' (m, l, O) are merged in shared
//   memory; with one partition the CTA writes the output, else a partial (O/l, m, l) that
//   paged_attention_reduce_kernel combines.
// Math per tile and warp: S[16x16] = Q[16xD] K^T via mma.m16n8k16 (fp16 in, fp32 acc), online
//   softmax in fp32 (exp2 domain), P[16x16] (fp16) x V[16xD] via mma.m16n8k16.
// FP4 decode in registers (fp4_common.cuh, the same on every SM80+): 7 integer ops per 8
//   codes give the high bytes of fp16 values worth E2M1 * 2^-14, one prmt per pair places them
//   in fp16x2 words (11 ops per 8 elements). K8V4 keys (E4M3 bytes, D per row) decode with 12
//   integer ops per 8 elements into fp16 worth E4M3 * 2^-8 (decode_key8); the rest of the
//   kernel does not change. The power of two and the per-token E8M0 scales are applied in
//   fp32: the K scale is a per-column factor of S (multiplied after the MMA), the V
//   scale a per-row factor of P (multiplied into P before it is rounded to fp16). To keep P in
//   fp16 range whatever the scales, P is scaled by 2^(b - VM + 15 - SLACK) where VM is the
//   running maximum V-scale byte of the warp (a scalar, rescaled like the softmax max), so
//   P' <= 2^15. Lazy rescaling: a warp rescales O and l only when a row maximum grows by more
//   than SLACK (tuning.cuh), so p = 2^(x - m) <= 2^SLACK against the stale maximum m.
// Per-thread cp.async addresses live in shared memory (LaneCopy), re-read at each tile issue.
// Reduction-dimension permutation: Q.K^T is invariant under a permutation of D, so lane t of a
//   quad reads a CONTIGUOUS D/8-byte slice of a key row (one 16-byte shared load for D=128)
//   and Q's A-fragments are built with the same permutation; likewise the 16 tokens of a tile
//   are permuted so that a thread's 4 S-columns are the 4 tokens whose V rows it reads for the
//   P.V B-fragment (PV's k dim = tokens) and whose scales it needs (one 16-byte load each).
// Q is converted to fp16 after multiplying by a power of two 2^e (per CTA, from the tile's
//   amax, so amax*2^e in [2^14, 2^15)); 2^-e is folded into the fp32 logit scale. Exact for
//   bf16 inputs within 2^-24 of the tile max.
// Safety: every block id is range-checked before its tile is copied; a bad id makes the
//   sequence's rows NaN (never a read). Tokens past seq_len / outside the window never reach
//   the output: their logits are set to -inf and their P entries to 0 by selection, and they
//   do not enter the V-scale maximum. A NaN scale byte (255) in a visible token gives NaN.
// No host synchronization; the partition size comes from the host bound max_seq_len.
// ===========================================================================================
#pragma once

#include "attention_common.cuh"

namespace turboquant {
namespace cuda_fp4 {

// grid (row_tiles * num_kv_heads, num_partitions), block 32 * ATTN_WARPS (256), dynamic smem
// AttnLayout<D, kE4m3>::TOTAL bytes. kStates: the lse output or learned sinks are asked for
// (their code is compiled out of the other instantiation, which every plain call runs).
// kE4m3: K8V4 keys (E4M3 bytes, decoded like FP4 in registers by decode_key8).
template <int D, typename T, bool kStates, bool kE4m3>
__global__ void __launch_bounds__(32 * tuning::ATTN_WARPS, tuning::AttnMinBlocks<D>::value)
    paged_attention_fp4_kernel(const AttnParams p) {
  using L = AttnLayout<D, kE4m3>;
  constexpr int ST = L::ST, ROW = L::ROW, CPR = L::CPR, KROW = L::KROW, KCPR = L::KCPR;
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int G = p.group_size;
  // the kv heads of a row tile are consecutive CTAs (launch_general_attention)
  const int tile = blockIdx.x / p.num_kv_heads, kvh = blockIdx.x - tile * p.num_kv_heads, part = blockIdx.y;
  // launched as a programmatic dependent of the previous kernel in the stream (sm_90): wait
  // until its writes are visible before reading anything
  pdl_wait();
  // the reduce pass (launched as a programmatic dependent) may be scheduled once every CTA of
  // this grid has started; it waits for this grid's completion before reading the partials
  pdl_launch_dependents();

  // ---- which sequence / rows ----
  int s, lt, q0, qn;
  if (p.cu_query_lens == nullptr) {
    s = tile / p.tiles_per_seq;
    lt = tile - s * p.tiles_per_seq;
    q0 = s;
    qn = 1;
  } else {
    s = find_row_tile<16>(p, tile, q0, qn, lt);
    if (s < 0) return;
  }
  const int nrows = qn * G;
  const int seq_len = __ldg(p.seq_lens + s);
  const int slot = state_slot(p, s);
  const int W = p.sliding_window;
  const int P = p.partition_size;
  const int nparts = p.num_partitions;

  // key range of query token qi: [lo, hi]
  auto row_hi = [&](int qi) { return seq_len - qn + qi; };
  auto row_lo = [&](int qi) { return W > 0 ? max(0, seq_len - qn + qi - W + 1) : 0; };
  const int qi_min = (lt * 16) / G;
  const int qi_max = min(lt * 16 + 15, nrows - 1) / G;
  const int lo_min = row_lo(qi_min), lo_max = row_lo(qi_max);
  const int hi_min = row_hi(qi_min), hi_max = row_hi(qi_max);
  const int part_lo = part * P;
  // with the sink, position 0 comes from the state record (merged in by partition 0's CTA for
  // the rows whose window holds it): the FP4 stream starts at 1
  const bool sink_here = p.sink && part == 0 && lo_min == 0 && seq_len > 0;
  const int r_lo = max(max(lo_min, part_lo), p.sink ? 1 : 0);
  const int r_hi = min(min(hi_max + 1, seq_len), part_lo + P);  // exclusive

  int* misc = reinterpret_cast<int*>(smem + L::OFF_MISC);
  float* sinkS = reinterpret_cast<float*>(smem + L::OFF_SINK);
  float* qmS = reinterpret_cast<float*>(smem + L::OFF_QM);
  const bool cap_state = p.soft_cap > 0.f && p.seq_state != nullptr;
  float* mS = reinterpret_cast<float*>(smem + L::OFF_M);
  float* lS = reinterpret_cast<float*>(smem + L::OFF_L);

  // output helpers (row r of the tile)
  auto row_out = [&](int r, int& tok, int& head) -> bool {
    int R = lt * 16 + r;
    if (R >= nrows) return false;
    tok = q0 + R / G;
    head = kvh * G + R % G;
    return tok < p.num_tokens;
  };
  // write a constant row value (empty partition: 0 / (-inf, 0); bad block: NaN)
  auto write_const_rows = [&](float oval, float mval, float lval) {
    for (int i = tid; i < 16 * D; i += blockDim.x) {
      int r = i / D, d = i % D, tok, head;
      if (row_out(r, tok, head)) write_const_element<D, T, kStates>(p, tok, head, d, nparts, part, oval, mval, lval);
    }
  };

  if (r_lo >= r_hi && !sink_here) {  // nothing visible in this partition
    write_const_rows(0.f, -INFINITY, 0.f);
    return;
  }
  if (tid == 0) {
    misc[0] = 0;  // Q amax bits
    misc[1] = 0;  // a block id was out of range
  }

  // this thread's two rows (g, g+8): visible key range [lo, hi]
  int rlo[2], rhi[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    int R = lt * 16 + g + 8 * rh;
    if (R < nrows) {
      rlo[rh] = max(row_lo(R / G), p.sink ? 1 : 0);
      rhi[rh] = row_hi(R / G);
    } else {
      rlo[rh] = 0;
      rhi[rh] = -1;
    }
  }

  // ---- tiles of this warp ----
  const int lbs = p.log2_block_size;
  const int bs_mask = (1 << lbs) - 1;
  const int tile_first = r_lo >> 4;
  const int ntiles = ((r_hi - 1) >> 4) - tile_first + 1;
  const int my_n = ntiles > warp ? (ntiles - warp + L::W - 1) / L::W : 0;
  const int Hkv = p.num_kv_heads;
  const BlockRow blocks(p, s);
  // block id of this warp's tile k (lane-parallel, 32 tiles per register): -1 if invalid
  auto load_bid = [&](int k) -> int { return k >= my_n ? 0 : blocks.id((tile_first + warp + L::W * k) * 16); };
  int kc = 0;
  int bid_cur = load_bid(lane), bid_nxt = load_bid(32 + lane);
  bool bad = false;
  // scale byte position inside its aligned word: the same for all 4 tokens of a thread
  const uint32_t k_sel = 0x4440u | (uint32_t)(((uintptr_t)p.key_scales + kvh + t4 * Hkv) & 3);
  const uint32_t v_sel = 0x4440u | (uint32_t)(((uintptr_t)p.value_scales + kvh + t4 * Hkv) & 3);

  uint8_t* pipe = smem + warp * ST * L::STAGE;
  // per-thread copy addresses, identical for every tile (see LaneCopy): token row
  // r = copy_token(c / CPR), chunk j = c % CPR of chunk c = lane + 32i (K: KCPR, KROW)
  constexpr int NIO_K = L::NIO_K, NIO_V = L::NIO_V;
  volatile LaneCopy<NIO_K, NIO_V>* lcp =
      reinterpret_cast<LaneCopy<NIO_K, NIO_V>*>(smem + L::OFF_LANE + tid * L::LANE_SZ);
  {
    const uint8_t* kc_base = p.key_cache + kvh * p.kc_stride_head;
    const uint8_t* vc_base = p.value_cache + kvh * p.vc_stride_head;
#pragma unroll
    for (int i = 0; i < NIO_K; ++i) {
      const int c = lane + 32 * i, r = copy_token<KROW>(c / KCPR), j = c % KCPR;
      const int lc = 2 * (r & 3) + ((r >> 2) & 1) + 8 * (r >> 3);  // logical K row of token r
      lcp->k_dst[i] = lc * KROW + k_chunk<KROW>(lc, j) * 16;
      lcp->k_src[i] = kc_base + r * KROW + j * 16;
    }
#pragma unroll
    for (int i = 0; i < NIO_V; ++i) {
      const int c = lane + 32 * i, r = copy_token<ROW>(c / CPR), j = c % CPR;
      const int vr = v_row<D>(r);
      lcp->v_dst[i] = L::K_TILE + vr * ROW + ((j ^ v_swz<D>(vr)) * 16);
      lcp->v_src[i] = vc_base + r * ROW + j * 16;
    }
    const int s_r = lane & 15;
    lcp->s_dst = L::K_TILE + L::V_TILE + (lane & 16) * 4 + ((s_r & 3) * 4 + (s_r >> 2)) * 4;
    lcp->s_src = (lane < 16 ? p.key_scales : p.value_scales) + (long long)s_r * Hkv + kvh;
  }
  const uint32_t blk_stride = (uint32_t)p.vc_stride_blk;  // K: KROW / ROW times it (binding checks)
  const uint32_t pipe_s = (uint32_t)__cvta_generic_to_shared(pipe);
  uint32_t st_issue = 0;  // ring slot of the next issue
  auto issue = [&](int k) {
    if (k >= kc + 32) { kc += 32; bid_cur = bid_nxt; bid_nxt = load_bid(kc + 32 + lane); }
    const int phys = __shfl_sync(0xffffffffu, bid_cur, k - kc);
    const uint32_t st = pipe_s + st_issue * L::STAGE;
    st_issue = (st_issue + 1 == ST) ? 0 : st_issue + 1;
    if (phys < 0) { bad = true; return; }
    const int t0 = (tile_first + warp + L::W * k) * 16;
    const int off = t0 & bs_mask;
    // the V tile's offset in the kv head's cache; the K tile's is KROW / ROW times it
    const unsigned long long tile_off = (unsigned long long)(uint32_t)phys * blk_stride + (uint32_t)(off * ROW);
#pragma unroll
    for (int i = 0; i < NIO_K; ++i) {
      const uint32_t kd = st + lcp->k_dst[i];
      const uint8_t* ks = lcp->k_src[i] + tile_off * (KROW / ROW);
#pragma unroll
      for (int h = 0; h < (L::LINEAR_K ? L::NI_K : 1); ++h)  // LINEAR: chunk h is 8*h rows further on
        cp_async_16(kd + h * 8 * KROW, ks + h * 8 * KROW);
    }
#pragma unroll
    for (int i = 0; i < NIO_V; ++i) {
      const uint32_t vd = st + lcp->v_dst[i];
      const uint8_t* vs = lcp->v_src[i] + tile_off;
#pragma unroll
      for (int h = 0; h < (L::LINEAR_V ? L::NI_V : 1); ++h)
        cp_async_16(vd + h * 8 * ROW, vs + h * 8 * ROW);
    }
    const unsigned long long srow = ((unsigned long long)(uint32_t)phys << lbs) + (uint32_t)off;
    cp_async_4(st + lcp->s_dst,
               reinterpret_cast<const void*>((uintptr_t)(lcp->s_src + srow * (uint32_t)Hkv) & ~(uintptr_t)3));
  };

  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  int VM = 0;

#pragma unroll
  for (int k = 0; k < ST - 1; ++k) {
    if (k < my_n) issue(k);
    cp_async_commit();
  }

  // ---- Q: load 16 rows, the transforms in fp32 (q * lam, rotation; D/8 lanes per row), the
  //      sink's logits, tile amax, power-of-two prescale, fp16 fragments ----
  float* qraw = reinterpret_cast<float*>(smem + L::OFF_QRAW);
  unsigned amax_bits = 0;
  for (int c = tid; c < 16 * D / 8; c += blockDim.x) {  // warp-uniform trip count
    int r = c / (D / 8), col = (c % (D / 8)) * 8, tok, head;
    QChunk qc;
    load_q_chunk<D, kStates>(p, slot, kvh, col, sink_here, qc);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row_out(r, tok, head)) {
      v = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(p.query) +
                                          tok * p.q_stride_tok + head * p.q_stride_head + col);
    }
    float qv[8];
    prepare_q8<D, T, kStates>(p, qc, v, sink_here, col == 0, sinkS + r, qmS + r, qv, lane);
    *reinterpret_cast<float4*>(qraw + r * D + col) = make_float4(qv[0], qv[1], qv[2], qv[3]);
    *reinterpret_cast<float4*>(qraw + r * D + col + 4) = make_float4(qv[4], qv[5], qv[6], qv[7]);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax_bits = max(amax_bits, __float_as_uint(fabsf(qv[i])));
  }
  const int qexp = q_prescale_exponent(amax_bits, reinterpret_cast<unsigned*>(misc));
  const float qmul = pow2i(qexp);
  uint4* qf = reinterpret_cast<uint4*>(smem + L::OFF_QFRAG);
  for (int idx = tid; idx < (D / 16) * 32; idx += blockDim.x) {
    int ks = idx >> 5, ln = idx & 31, gg = ln >> 2, tt = ln & 3;
    // the same head-dim permutation as the K decode: pairs (0,2) (4,6) (1,3) (5,7) of a word
    const int E0 = tt * (D / 4) + 8 * (ks >> 1) + (ks & 1);
    const int A1 = 2;  // partner of E0 in reg 0 / 1
    const int B0 = 4;  // first element of reg 2 / 3
    auto q = [&](int r, int d) { return qraw[r * D + d] * qmul; };
    uint4 f;
    f.x = pack_f16x2(q(gg, E0), q(gg, E0 + A1));
    f.y = pack_f16x2(q(gg + 8, E0), q(gg + 8, E0 + A1));
    f.z = pack_f16x2(q(gg, E0 + B0), q(gg, E0 + B0 + A1));
    f.w = pack_f16x2(q(gg + 8, E0 + B0), q(gg + 8, E0 + B0 + A1));
    qf[idx] = f;
  }
  __syncthreads();

  uint32_t qa[L::QREG ? D / 16 : 1][4];
  if constexpr (L::QREG) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint4 f = qf[ks * 32 + lane];
      qa[ks][0] = f.x; qa[ks][1] = f.y; qa[ks][2] = f.z; qa[ks][3] = f.w;
    }
  }

  const bool cap = p.soft_cap > 0.f;
  // logit = acc * 2^(b-127) * kmul ; kmul folds 2^14 (decode), 2^-qexp (Q prescale), scale
  // and, without soft cap, log2(e) (the softmax runs in the exp2 domain).
  const float kmul = p.scale * pow2i(KeyRow<D, kE4m3>::DEC_EXP - qexp) * (cap ? 1.f : LOG2E);
  const float cap_v = p.soft_cap, inv_cap = soft_cap_reciprocal(p);
  const float qm_row[2] = {cap_state ? qmS[g] : 0.f, cap_state ? qmS[g + 8] : 0.f};

  uint32_t st_comp = 0;  // ring slot being computed
  for (int k = 0; k < my_n; ++k) {
    if (k + ST - 1 < my_n) issue(k + ST - 1);
    cp_async_commit();
    cp_async_wait<ST - 1>();
    __syncwarp();
    const uint8_t* st = pipe + st_comp * L::STAGE;
    st_comp = (st_comp + 1 == ST) ? 0 : st_comp + 1;
    const int t0 = (tile_first + warp + L::W * k) * 16;
    const bool need_mask = (t0 < lo_max) || (t0 + 15 > hi_min) || (t0 < r_lo) || (t0 + 15 >= r_hi);

    // scales of this thread's 4 tokens t0 + t4 + 4u + 8v, index u + 2v
    const uint4 kw = *reinterpret_cast<const uint4*>(st + L::K_TILE + L::V_TILE + t4 * 16);
    const uint4 vw = *reinterpret_cast<const uint4*>(st + L::K_TILE + L::V_TILE + 64 + t4 * 16);
    uint32_t kb[4] = {prmt(kw.x, 0, k_sel), prmt(kw.y, 0, k_sel), prmt(kw.z, 0, k_sel), prmt(kw.w, 0, k_sel)};
    uint32_t vb[4] = {prmt(vw.x, 0, v_sel), prmt(vw.y, 0, v_sel), prmt(vw.z, 0, v_sel), prmt(vw.w, 0, v_sel)};

    // ---- S = Q K^T (two n-tiles of 8 logical tokens) ----
    float sacc[2][4], sacc2[2][4];  // two accumulation chains per n-tile (even/odd words)
#pragma unroll
    for (int v = 0; v < 2; ++v) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sacc[v][i] = sacc2[v][i] = 0.f;
      const int lc = g + 8 * v;
      uint32_t kx[KROW / 16];
      load_key_quarter<KROW>(st + lc * KROW, lc, t4, kx);
#pragma unroll
      for (int w = 0; w < D / 32; ++w) {  // 8 elements: (e0,e2) (e4,e6) (e1,e3) (e5,e7)
        uint32_t h[4];
        decode_key8<kE4m3>(kx + w * KeyRow<D, kE4m3>::WORDS8, h);
        uint32_t a0[4], a1[4];
        if constexpr (L::QREG) {
#pragma unroll
          for (int i = 0; i < 4; ++i) { a0[i] = qa[2 * w][i]; a1[i] = qa[2 * w + 1][i]; }
        } else {
          uint4 f0 = qf[(2 * w) * 32 + lane], f1 = qf[(2 * w + 1) * 32 + lane];
          a0[0] = f0.x; a0[1] = f0.y; a0[2] = f0.z; a0[3] = f0.w;
          a1[0] = f1.x; a1[1] = f1.y; a1[2] = f1.z; a1[3] = f1.w;
        }
        float (&sc)[4] = (w & 1) ? sacc2[v] : sacc[v];
        mma_m16n8k16_f16(sc, a0, h[0], h[1]);
        mma_m16n8k16_f16(sc, a1, h[2], h[3]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) sacc[v][i] += sacc2[v][i];
    }

    // ---- logits (exp2 domain), masking by selection ----
    float x[2][4];  // [v][rh*2+u]
#pragma unroll
    for (int v = 0; v < 2; ++v) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float kf = e8m0_to_float(kb[u + 2 * v]) * kmul;
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) x[v][rh * 2 + u] = sacc[v][rh * 2 + u] * kf;
      }
    }
    if (cap) {  // one warp-uniform branch for the tile; q.m of rows g, g+8 back in (records)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        x[i >> 2][i & 3] = cap_v * tanhf((x[i >> 2][i & 3] + qm_row[(i & 3) >> 1]) * inv_cap) * LOG2E;
    }
    if (need_mask) {
#pragma unroll
      for (int v = 0; v < 2; ++v)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int tok = t0 + t4 + 4 * u + 8 * v;
#pragma unroll
          for (int rh = 0; rh < 2; ++rh)
            if (tok < rlo[rh] || tok > rhi[rh]) x[v][rh * 2 + u] = -INFINITY;
          // tokens outside the CTA's range never raise the V-scale maximum
          if (tok < r_lo || tok >= r_hi) vb[u + 2 * v] = 0u;
        }
    }
    // ---- online softmax state ----
    float m_new[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float mx = fmaxf(fmaxf(x[0][rh * 2], x[0][rh * 2 + 1]), fmaxf(x[1][rh * 2], x[1][rh * 2 + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      m_new[rh] = fmaxf(m_run[rh], mx);
    }
    int vmax = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) vmax = max(vmax, vb[i] == 255u ? 0 : (int)vb[i]);
    vmax = max(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1));
    vmax = max(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2));
    const int VM_new = max(VM, vmax);
    float ms[2];
    lazy_rescale(m_new, VM_new, m_run, l_run, VM, acc, ms);
    float pv[2][4];
    // P for one tile; the masked variant zeroes P where the logit is -inf (a masked token with
    // a NaN V scale must not reach the row). Two copies behind one warp-uniform branch, so
    // unmasked tiles skip the 16 compare/selects.
    auto make_p = [&](auto masked) {
#pragma unroll
      for (int v = 0; v < 2; ++v)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const uint32_t b = vb[u + 2 * v];
          const float vf = b == 255u ? __int_as_float(0x7fc00000) : p_vscale(b, VM);  // 255 -> NaN
#pragma unroll
          for (int rh = 0; rh < 2; ++rh) {
            const float xx = x[v][rh * 2 + u];
            const float pr = fast_exp2(xx - ms[rh]);
            l_run[rh] += pr;
            float pp = pr * vf;
            if constexpr (decltype(masked)::value) {
              if (xx == -INFINITY) pp = 0.f;
            }
            pv[v][rh * 2 + u] = pp;
          }
        }
    };
    if (need_mask) make_p(BoolConst<true>{}); else make_p(BoolConst<false>{});
    uint32_t pa[4];
    pa[0] = pack_f16x2(pv[0][0], pv[0][1]);
    pa[1] = pack_f16x2(pv[0][2], pv[0][3]);
    pa[2] = pack_f16x2(pv[1][0], pv[1][1]);
    pa[3] = pack_f16x2(pv[1][2], pv[1][3]);

    // ---- O += P V : V rows t4, t4+4 (b0 pair) and t4+8, t4+12 (b1 pair), d = g*D/8 + j ----
    {
      constexpr int NW = D / 64;  // 32-bit words per thread per token row
      uint32_t xv[4][NW];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = v_row<D>(t4 + 4 * q);
        const uint8_t* vrow = st + L::K_TILE + r * ROW;
        const int byte = g * (D / 16);
        const int chunk = (byte >> 4) ^ v_swz<D>(r);
        const uint8_t* src = vrow + chunk * 16 + (byte & 15);
        if constexpr (NW == 1) {
          xv[q][0] = *reinterpret_cast<const uint32_t*>(src);
        } else if constexpr (NW == 2) {
          uint2 a = *reinterpret_cast<const uint2*>(src);
          xv[q][0] = a.x; xv[q][1] = a.y;
        } else {
          uint4 a = *reinterpret_cast<const uint4*>(src);
          xv[q][0] = a.x; xv[q][1] = a.y; xv[q][2] = a.z; xv[q][3] = a.w;
        }
      }
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        // interleave the bytes of two rows first (a0 a1 b0 b1 a2 a3 b2 b3 as nibbles), then one
        // decode yields the (row a, row b) pairs: 2 prmt + 2 decodes per 16 elements
        uint32_t L0, H0, L1, H1, L2, H2, L3, H3;
        fp4x8_to_f16hi8(prmt(xv[0][w], xv[1][w], 0x5140u), L0, H0);  // elems 0,2 | 1,3
        fp4x8_to_f16hi8(prmt(xv[0][w], xv[1][w], 0x7362u), L1, H1);  // elems 4,6 | 5,7
        fp4x8_to_f16hi8(prmt(xv[2][w], xv[3][w], 0x5140u), L2, H2);
        fp4x8_to_f16hi8(prmt(xv[2][w], xv[3][w], 0x7362u), L3, H3);
        uint32_t h0[8], h1[8];  // slot i <-> element pv order 0,2,4,6,1,3,5,7
        f16hi4_to_f16x2x2(L0, h0[0], h0[1]);
        f16hi4_to_f16x2x2(L1, h0[2], h0[3]);
        f16hi4_to_f16x2x2(H0, h0[4], h0[5]);
        f16hi4_to_f16x2x2(H1, h0[6], h0[7]);
        f16hi4_to_f16x2x2(L2, h1[0], h1[1]);
        f16hi4_to_f16x2x2(L3, h1[2], h1[3]);
        f16hi4_to_f16x2x2(H2, h1[4], h1[5]);
        f16hi4_to_f16x2x2(H3, h1[6], h1[7]);
#pragma unroll
        for (int i = 0; i < 8; ++i) mma_m16n8k16_f16(acc[8 * w + i], pa, h0[i], h1[i]);
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();

  // ---- merge the warps ----
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    l_run[rh] += __shfl_xor_sync(0xffffffffu, l_run[rh], 1);
    l_run[rh] += __shfl_xor_sync(0xffffffffu, l_run[rh], 2);
  }
  const bool any_bad = __any_sync(0xffffffffu, bad);
  __syncthreads();  // every warp is done with its pipeline buffers
  if (any_bad && lane == 0) misc[1] = 1;
  if (t4 == 0) {
    mS[warp * 16 + g] = m_run[0];
    mS[warp * 16 + g + 8] = m_run[1];
    lS[warp * 16 + g] = l_run[0];
    lS[warp * 16 + g + 8] = l_run[1];
  }
  {
    // [W][16][MROW]: element (n-tile j, column c = 2*t4 + u) at 8*j + c; its head-dim index
    // is d = c * D/8 + j (the P.V B-fragment map), so a merging thread with fixed c reads the
    // contiguous d range c*D/8 .. c*D/8 + D/8 - 1. float2 stores and reads are conflict-free.
    float* mo = reinterpret_cast<float*>(smem);
    const float osc = pow2i(VM - 142 + TQ_SLACK + TQ_DEC_EXP);  // undo 2^(142-SLACK-DEC-VM) of P' * V-decode
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<float2*>(mo + (warp * 16 + g) * L::MROW + 8 * j + 2 * t4) =
          make_float2(acc[j][0] * osc, acc[j][1] * osc);
      *reinterpret_cast<float2*>(mo + (warp * 16 + g + 8) * L::MROW + 8 * j + 2 * t4) =
          make_float2(acc[j][2] * osc, acc[j][3] * osc);
    }
  }
  __syncthreads();
  if (misc[1]) {
    write_const_rows(__int_as_float(0x7fc00000), 0.f, __int_as_float(0x7fc00000));
    return;
  }
  {
    const float* mo = reinterpret_cast<const float*>(smem);
    constexpr int TPR = 8;        // threads per row: one per P.V column c (the merge layout)
    constexpr int DPT = D / TPR;  // contiguous elements per thread
    const int r = tid / TPR, c8 = tid % TPR, d0 = c8 * DPT;
    if (r >= 16) return;  // threads 128.. idle (ATTN_WARPS > 4): whole warps
    int tok, head;
    const bool valid = row_out(r, tok, head);  // rows past the tile still join the shuffles
    float wt[L::W], M;
    float Ls = merge_weights(mS + r, lS + r, 16, wt, M);
    const float inv = (Ls == 0.f) ? 0.f : 1.f / Ls;  // NaN stays NaN
    float a[DPT];
#pragma unroll
    for (int i = 0; i < DPT; ++i) a[i] = merge_sum(wt, mo + r * L::MROW + 8 * pv_slot(i) + c8, 16 * L::MROW) * inv;
    // the sink joins rows whose window holds position 0 as one more key (exp2 domain)
    if (sink_here && valid && row_lo((lt * 16 + r) / G) == 0 && row_hi((lt * 16 + r) / G) >= 0) {
      float sv[DPT];
      load_sink_value<D, false>(p, slot, kvh, d0, sv);
      merge_sink<DPT>(sink_logit(p, sinkS[r], cap_state ? qmS[r] : 0.f), sv, M, Ls, a);
    }
    if constexpr (kStates) {
      M = true_logit_max(p, needs_q_dot_center<kStates>(p) ? qmS[r] : 0.f, M);
      // a whole row: the learned sink and the lse here, else in the reduce
      if (nparts == 1 && valid) finish_whole_row<DPT>(p, head, (size_t)tok * p.num_heads + head, c8 == 0, M, Ls, a);
    }
    // rotated partials are combined as they are; the reduce pass un-rotates the sum
    if (p.rot_signs != nullptr && nparts == 1) unrotate_row<DPT, TPR>(p, a, d0, lane);
    if (!valid) return;
    if (nparts == 1) {
      store_row(reinterpret_cast<T*>(p.out) + tok * p.o_stride_tok + head * p.o_stride_head + d0, a);
    } else {
      const size_t idx = ((size_t)tok * p.num_heads + head) * nparts + part;
      float* o = p.tmp_out + idx * D + d0;
#pragma unroll
      for (int i = 0; i < DPT; i += 4) *reinterpret_cast<float4*>(o + i) = make_float4(a[i], a[i + 1], a[i + 2], a[i + 3]);
      if (d0 == 0) p.tmp_ml[idx] = make_float2(M, Ls);
    }
  }
}

// The general kernel alone (torch-free). grid_x = row tiles (see the design note).
template <int D, typename T, bool kStates, bool kE4m3>
cudaError_t launch_general_attention(const AttnParams& p, int grid_x, cudaStream_t stream) {
  using L = AttnLayout<D, kE4m3>;
  auto kern = paged_attention_fp4_kernel<D, T, kStates, kE4m3>;
  static bool attr_set[kMaxDevices] = {};  // per instantiation and device
  // CTA x = row tile * num_kv_heads + kv head, as the decode kernel (see its launch)
  return launch_kv_grid(kern, attr_set, grid_x, L::W, L::TOTAL, p, stream);
}

}  // namespace cuda_fp4
}  // namespace turboquant
