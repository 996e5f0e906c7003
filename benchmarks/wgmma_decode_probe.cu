// Can an FP8 warpgroup-MMA decode kernel read an FP4 cache at the H200's bandwidth (issue 43,
// item 1)? A measurement of the design's core loop before it is built into the library: plain
// attention (no transforms, no sinks), D 128, HND paged FP4 keys and values with one
// E8M0 scale per (token, kv head), block 16, 4 query heads per kv head; timed against a read of
// 2 GiB in the same process, checked against a float64 host reference; beside it, on the same
// cache, the library's two decode kernels (warp-MMA, and the SM90a one built from this probe,
// attention_decode_wgmma.cuh). What it measured, and what holds it: docs/cuda-kernels.md, "An
// FP8 warpgroup decode, probed".
//
// The design. One CTA = one warpgroup = one (sequence, kv head); 64-token steps, each copied by
// cp.async into a ring of raw codes (block ids loaded one step ahead). The MMAs are "swapped" so
// that the 64 rows of a wgmma are tokens (keys) or head-dim rows and the 8 columns query heads:
//   S^T [64 tokens x 8] = K [64 x 128] Q^T [128 x 8]   m64n8k32 E4M3 x 4 (x Q's terms)
//   O^T [128 x 8]      += V^T [128 x 64] P^T [64 x 8]  m64n8k32 E4M3 x 4 (x P's terms)
// K and V^T are A operands from registers, decoded from the codes straight into E4M3 bytes
// (E2M1 x 2^-6 is exact in E4M3: 7 integer ops per 8 codes, no fp16 pairs to place); Q^T and
// P^T are B operands in shared memory (128-byte swizzle, K-major, as every FP8 wgmma needs).
//   - K: a thread's A rows are two adjacent tokens, its k slots a permutation of D that the
//     E4M3 decode leaves (word j's even codes at slots 4t.., odd ones at 16 + 4t..); Q^T is
//     stored in the same permutation, so the sum is unchanged. One 16-byte shared load per token
//     (token rows 2 and 3 of every 4 swapped in the ring: no bank conflict).
//   - V^T: ldmatrix.trans on the codes seen as 16-bit units (4 codes of one token) gives a
//     thread one unit of two adjacent tokens; two byte permutes make words of 4 tokens x 2 codes,
//     whose E4M3 decode yields 4 tokens of one D row: the A fragment's 4 consecutive k slots.
//     O^T's rows are then D in the order 4u + {0, 1, 2, 3} (u = the thread's unit), undone at
//     the store. (The ring's V rows XOR their 16-byte chunks with (token / 2) % 4.)
//   - Softmax per column (query head) over the step's 64 tokens: a thread holds 2 tokens x 2
//     columns of S^T; the step maximum is a warp butterfly and one exchange of 4 warps' maxima
//     in shared memory. V's per-token scale goes into the logit (exponent added), so P' =
//     2^(logit + e_v - m + 8) <= 256 fits E4M3 and l sums P' 2^-e_v.
// Variants (template): QT / PT, Q (x 2^qe per head, its maximum in [128, 256)) and P' as E4M3
// in one or two terms (hi, and lo = x - hi); 3, two terms packed into the 4 spare columns (rows
// 4-7 of Q^T, and of P^T with PT 3, hold the lo terms of heads 0-3: one MMA chain each, S summed
// across lanes t, t ^ 2; PT 3 needs QT 3); QT 4, Q's two terms in 16 columns (m64n16k32: hi
// in 0-7, lo in 8-15, summed in the thread that holds both, for any G <= 8); PT 0, P' and V
// in fp16 (m64n8k16, V^T fragments by fp4x8_to_f16hi8). WO, "warp-owned": each warp copies the
// K rows and scale words it alone reads, so that only V waits at a CTA barrier. LAZY: the four
// warps' maxima are exchanged only in steps where one of them exceeds the running maximum;
// otherwise a step has one CTA barrier (a bar.red.or that says whether to redo P'). SPLIT:
// --splits CTAs per (sequence, kv head), each a contiguous range of steps, their unnormalized
// O, m and l merged by combine_kernel (the probe's stand-in for the library's reduce). STAGES /
// MINB: the ring's depth and the CTAs per SM the registers are capped for.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I csrc_cuda \
//        benchmarks/wgmma_decode_probe.cu -o wgmma_decode_probe
//   ./wgmma_decode_probe [--reps=N] [--splits=S] [BATCHxCONTEXT ...]   (default 64x32768
//       128x32768 128x4096 17x97; contexts below 1024 ragged; S CTAs per (sequence, kv head),
//       each a contiguous range of steps, merged by combine_kernel, which the time includes)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "attention_decode.cuh"
#include "attention_decode_wgmma.cuh"

using namespace turboquant::cuda_fp4;

namespace {

constexpr int D = 128, BS = 16, STEP = 64, HKV = 8, G = 4;
constexpr int CODES = STEP * D / 2;                    // bytes of K (or V) codes per step
constexpr int STAGE_BYTES = 2 * CODES + 2 * STEP * 4;  // K, V, K scale words, V scale words

// The fp16 form (PT = 0): A [64 x 16] fp16 from registers (mma.m16n8k16's A layout per warp),
// B [16 x 8] K-major from shared memory.
__device__ __forceinline__ void wgmma_m64n8k16_f16(float (&d)[4], const uint32_t (&a)[4], uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b)
      : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void sts32(uint32_t a, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(v));
}

template <int QT, int PT, int STAGES, int MINB, bool WO, bool LAZY = false, bool SPLIT = false>
__global__ void __launch_bounds__(128, MINB)
    probe_kernel(const float* __restrict__ q,        // [B, HKV * G, D]
                 const uint8_t* __restrict__ kc,     // [blocks, HKV, BS, D / 2]
                 const uint8_t* __restrict__ vc,     // [blocks, HKV, BS, D / 2]
                 const uint8_t* __restrict__ ks,     // [blocks, BS, HKV]
                 const uint8_t* __restrict__ vs,     // [blocks, BS, HKV]
                 const int* __restrict__ table,      // [B, max_blocks]
                 const int* __restrict__ lens,       // [B]
                 float* __restrict__ out,            // [B, HKV * G, D]
                 float* __restrict__ part,           // [B * HKV * splits, 8, D + 2] (splits > 1)
                 int max_blocks, float sm_scale, int splits) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = smem_raw + ((1024u - ((uint32_t)__cvta_generic_to_shared(smem_raw) & 1023u)) & 1023u);
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
  const uint32_t qt = base, pt = base + 2048, red = base + 4096;
  const uint32_t ring = base + 4608;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int pair = SPLIT ? blockIdx.x / splits : blockIdx.x;
  const int seq = pair / HKV, h = pair % HKV;
  const int len = lens[seq];
  if (len <= 0) return;
  const int nsteps = (len + STEP - 1) / STEP, nblk = (len + BS - 1) / BS;
  // SPLIT (split-KV): this CTA's steps [s_lo, s_hi); an empty range leaves a partial of weight
  // 0. A template flag: the registers it takes made the two-term builds spill.
  int s_lo = 0, s_hi = nsteps;
  if constexpr (SPLIT) {
    const int per = (nsteps + splits - 1) / splits;
    s_lo = (blockIdx.x % splits) * per, s_hi = min(nsteps, s_lo + per);
    if (s_lo >= s_hi) {
      if (tid < 8) part[((size_t)blockIdx.x * 8 + tid) * (D + 2) + D] = -INFINITY;
      return;
    }
  }
  const int* tab = table + (size_t)seq * max_blocks;

  // Q^T: row n = tid / 16 (head n; packed, PT 3: head n % 4, its hi term in rows 0-3 and its
  // lo term in rows 4-7), elements dc .. dc+7; E4M3 terms at the permuted k of the K decode.
  constexpr bool kPackQ = QT == 3, kWideQ = QT == 4, kPackP = PT == 3;
  static_assert(!kPackQ || 2 * G <= 8, "packed terms need 2 G <= 8 columns");
  static_assert(!kPackP || kPackQ, "P's packed lo terms use the columns Q's fill");
  {
    const int n = tid >> 4, dc = (tid & 15) * 8, head = kPackQ ? (n & 3) : n;
    float v[8];
    float mx = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = head < G ? q[((size_t)seq * HKV * G + h * G + head) * D + dc + i] : 0.f;
      mx = fmaxf(mx, fabsf(v[i]));
    }
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const int e = mx > 0.f ? (int)((__float_as_uint(mx) >> 23) & 255u) - 127 : 0;
    const float qs = exp2f((float)(7 - e));
    const int j = dc / 8, c = j & 3, tt = j >> 2;
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      uint32_t hi, lo;
      e4m3x2_split(v[i] * qs, v[i + 1] * qs, hi, lo);
#pragma unroll
      for (int b = 0; b < 2; ++b) {  // element i + b: even -> slot 4tt + i/2, odd -> 16 + ...
        const int k = 32 * c + 16 * b + 4 * tt + i / 2;
        if constexpr (kPackQ) {
          sm[sw128_offset(n, k)] = (uint8_t)((n < 4 ? hi : lo) >> (8 * b));
        } else {  // QT 2 and 4: the lo terms in rows 8-15 (row n + 8 at 1024 + sw128_offset(n, k))
          sm[sw128_offset(n, k)] = (uint8_t)(hi >> (8 * b));
          sm[1024 + sw128_offset(n, k)] = QT >= 2 ? (uint8_t)(lo >> (8 * b)) : 0;
        }
      }
    }
    if ((tid & 15) == 0)
      reinterpret_cast<float*>(sm + 4096 + 256)[n] = 64.f * sm_scale * 1.4426950408889634f / qs;
    fence_proxy_async();  // Q^T to the MMAs, after the loop's first barrier
  }

  // Copies of step sp. V: chunks qq = tid, tid + 128 (16 bytes; block qq / 64 of the step,
  // token (qq % 64) / 4, chunk qq % 4). K and the scale words: WO false, K as V, the scale word
  // (4 heads) of token tid % 64 (K for tid < 64, V above); WO true ("warp-owned"), warp w copies
  // what it alone reads, its tokens 16w .. 16w+15 (block w of the step): K chunks lane, lane + 32,
  // the scale word of token 16w + lane % 16 (K for lane < 16), so that only V needs a barrier.
  // Everything but the block ids is fixed per thread.
  constexpr uint32_t kBlockBytes = HKV * BS * D / 2;
  const int tok_c = (tid & 63) >> 2, ch = tid & 3;
  const uint32_t src_c = (uint32_t)((h * BS + tok_c) * (D / 2) + 16 * ch);
  const int tau_a = 16 * (tid >> 6) + tok_c, tau_b = tau_a + 32;
  const int tau_k = WO ? 16 * w + (lane >> 2) : tau_a, tau_k2 = WO ? tau_k + 8 : tau_b;
  const int chk = WO ? (lane & 3) : ch;
  const uint32_t dk_a = opaque(64 * (tau_k ^ ((tau_k >> 1) & 1)) + 16 * chk);
  const uint32_t dk_b = opaque(64 * (tau_k2 ^ ((tau_k2 >> 1) & 1)) + 16 * chk);
  const uint32_t dv_a = opaque(CODES + 64 * tau_a + 16 * (ch ^ ((tau_a >> 1) & 3)));
  const uint32_t dv_b = opaque(CODES + 64 * tau_b + 16 * (ch ^ ((tau_b >> 1) & 3)));
  const int tau_s = WO ? 16 * w + (lane & 15) : tid & 63;
  const bool s_is_v = WO ? lane >= 16 : tid >= 64;
  const uint32_t ds = opaque(2 * CODES + (s_is_v ? STEP * 4 : 0) + 4 * tau_s);
  const uint8_t* kc_t = opaque(WO ? kc + (h * BS + (lane >> 2)) * (D / 2) + 16 * (lane & 3) : kc + src_c);
  const uint8_t* vc_t = opaque(vc + src_c);
  const uint8_t* sc_t = opaque((s_is_v ? vs : ks) + (tau_s & 15) * HKV + (h & ~3));
  const int blk_a = tid >> 6, blk_s = tau_s >> 4;  // the step's blocks this thread reads
  const int* tab_a = opaque(tab + blk_a);
  const int* tab_s = opaque(tab + blk_s);
  // The block ids of step sp, loaded one issue ahead (a table load right before the copies
  // that need it was the kernel's top stall, ncu).
  int ia = 0, ib = 0, is = 0;
  auto load_ids = [&](int sp) {
    if (sp >= s_hi) return;
    if (4 * sp + 4 <= nblk) {
      ia = tab_a[4 * sp], ib = tab_a[4 * sp + 2], is = tab_s[4 * sp];
    } else {  // blocks past the sequence: its last block instead (read, then masked)
      ia = tab[min(4 * sp + blk_a, nblk - 1)], ib = tab[min(4 * sp + blk_a + 2, nblk - 1)];
      is = tab[min(4 * sp + blk_s, nblk - 1)];
    }
  };
  load_ids(s_lo);
  auto issue = [&](int sp) {
    if (sp < s_hi) {
      const uint32_t st = ring + (sp % STAGES) * STAGE_BYTES;
      if constexpr (WO) {
        cp_async_16(st + dk_a, kc_t + (size_t)(uint32_t)is * kBlockBytes);
        cp_async_16(st + dk_b, kc_t + (size_t)(uint32_t)is * kBlockBytes + 8 * (D / 2));
      } else {
        cp_async_16(st + dk_a, kc_t + (size_t)(uint32_t)ia * kBlockBytes);
        cp_async_16(st + dk_b, kc_t + (size_t)(uint32_t)ib * kBlockBytes);
      }
      cp_async_16(st + dv_a, vc_t + (size_t)(uint32_t)ia * kBlockBytes);
      cp_async_16(st + dv_b, vc_t + (size_t)(uint32_t)ib * kBlockBytes);
      cp_async_4(st + ds, sc_t + (size_t)(uint32_t)is * (BS * HKV));
      load_ids(sp + 1);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s_lo + s);

  const float* cf = reinterpret_cast<const float*>(sm + 4096 + 256);
  const uint64_t qdesc = wgmma_desc_sw128(qt, 16, 1024), pdesc = wgmma_desc_sw128(pt, 16, 1024);
  const int tau0 = 16 * w + 2 * g;  // this thread's S rows: tokens tau0, tau0 + 1
  const uint32_t kofs0 = opaque(64 * (tau0 ^ ((tau0 >> 1) & 1)) + 16 * t);
  const uint32_t kofs1 = opaque(64 * ((tau0 + 1) ^ (((tau0 + 1) >> 1) & 1)) + 16 * t);
  // ldmatrix rows: lane 8m + r -> token 8 (m + 4 x) + r, unit block w
  const int lt = 8 * (lane >> 3) + (lane & 7);
  const uint32_t vofs0 = opaque(CODES + 64 * lt + 16 * (w ^ ((lt >> 1) & 3)));
  const uint32_t vofs1 = opaque(CODES + 64 * (lt + 32) + 16 * (w ^ (((lt + 32) >> 1) & 3)));
  // P^T bytes (tau0, tau0 + 1) of column n at k = 16 w + 4 (g % 4) + 2 (g / 4)
  const int pk = 16 * w + 4 * (g & 3) + 2 * (g >> 2);
  const uint32_t p_c0 = opaque(pt + sw128_offset(2 * t, pk)), p_c1 = opaque(pt + sw128_offset(2 * t + 1, pk));
  const uint32_t p16_c0 = opaque(pt + sw128_offset(2 * t, 2 * tau0)), p16_c1 = opaque(pt + sw128_offset(2 * t + 1, 2 * tau0));
  const uint32_t red_t = opaque(red + 8 * t), red_w = opaque(red + 32 * w + 8 * t);
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  float o[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  const uint32_t hsel = 0x4440u | (h & 3);  // prmt: byte h % 4 of a scale word, zeros above

  auto load_v = [&](uint32_t (&r)[8], uint32_t st) {
    uint32_t ra[4], rb[4];
    ldmatrix_x4_trans(ra, st + vofs0);
    ldmatrix_x4_trans(rb, st + vofs1);
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = ra[i], r[4 + i] = rb[i];
  };
  // V^T fragments. PT > 0: E4M3 [half][chunk of 32 tokens] (chunk c = token groups 4c ..
  // 4c+3); PT = 0: fp16 [half][k16 step] (step kk = tokens 16 kk + slot, groups 2kk, 2kk+1).
  // Declared here and fenced after the next step's wait, meant to keep them live until the P V
  // MMAs are done: ptxas still reuses the A registers of one-chain builds (QT 1 or 3) and then
  // serializes their MMAs (C7513); the two-term builds are not serialized.
  uint32_t va[2][PT > 0 ? 2 : 4][4];
  __syncthreads();  // Q^T and the column factors
  const float c0 = cf[2 * t], c1 = cf[2 * t + 1];
#pragma unroll 1
  for (int s = s_lo; s < s_hi; ++s) {
    cp_async_wait<STAGES - 2>();
    if constexpr (WO) __syncwarp();  // this warp's K rows and scale words; V after barrier 1
    else __syncthreads();
    if constexpr (!LAZY) issue(s + STAGES - 1);
    const uint32_t st = ring + (s % STAGES) * STAGE_BYTES;
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
    // the chain's first MMA does not accumulate: no zeroing (zeroed, ptxas serialized every
    // MMA of the kernel, C7513)
    float sacc[kWideQ ? 8 : 4];
    reg_fence(ka);
    wgmma_fence();
    if constexpr (kWideQ) {
#pragma unroll
      for (int c = 0; c < 4; ++c) wgmma_m64n16k32_e4m3(sacc, ka[c], wgmma_desc_advance(qdesc, 32 * c), c != 0);
    } else {
#pragma unroll
      for (int term = 0; term < (kPackQ ? 1 : QT); ++term)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          wgmma_m64n8k32_e4m3(sacc, ka[c], wgmma_desc_advance(qdesc, 1024 * term + 32 * c),
                              (term | c) != 0);
    }
    wgmma_commit();
    uint32_t r[8];
    if constexpr (!WO) load_v(r, st);
    const uint2 ksw = lds64(st + 2 * CODES + 4 * tau0);
    const uint2 vsw = lds64(st + 2 * CODES + STEP * 4 + 4 * tau0);
    wgmma_wait<0>();
    reg_fence(ka);
    reg_fence(va[0]);
    reg_fence(va[1]);
    reg_fence(sacc);
    reg_fence(o[0]);
    reg_fence(o[1]);
    if constexpr (kPackQ) {  // columns n and n + 4 hold head n's two terms: lanes t, t ^ 2
#pragma unroll
      for (int i = 0; i < 4; ++i) sacc[i] += __shfl_xor_sync(0xffffffffu, sacc[i], 2);
    }
    if constexpr (kWideQ) {  // columns n and n + 8: the same thread
#pragma unroll
      for (int i = 0; i < 4; ++i) sacc[i] += sacc[4 + i];
    }
    // softmax: logits in the exp2 domain with V's exponent added
    const uint32_t kb0 = prmt(ksw.x, 0u, hsel), kb1 = prmt(ksw.y, 0u, hsel);
    const uint32_t vb0 = prmt(vsw.x, 0u, hsel), vb1 = prmt(vsw.y, 0u, hsel);
    float ev0 = vb0 == 255u ? __int_as_float(0x7fc00000) : (float)((int)vb0 - 127);
    float ev1 = vb1 == 255u ? __int_as_float(0x7fc00000) : (float)((int)vb1 - 127);
    const float kf0 = e8m0_to_float(kb0), kf1 = e8m0_to_float(kb1);
    float L[4] = {fmaf(sacc[0], kf0 * c0, ev0), fmaf(sacc[1], kf0 * c1, ev0),
                  fmaf(sacc[2], kf1 * c0, ev1), fmaf(sacc[3], kf1 * c1, ev1)};
    if (SPLIT ? STEP * (s + 1) > len : s == nsteps - 1) {  // the sequence's last step
      const bool ok0 = STEP * s + tau0 < len, ok1 = STEP * s + tau0 + 1 < len;
      if (!ok0) L[0] = L[1] = -INFINITY, ev0 = 0.f;
      if (!ok1) L[2] = L[3] = -INFINITY, ev1 = 0.f;
    }
    float x0 = fmaxf(L[0], L[2]), x1 = fmaxf(L[1], L[3]);  // this thread's, per column
    // The step's maxima: a butterfly over the warp's rows, then the four warps' exchanged in
    // shared memory (barrier 1). LAZY: only in a step where some thread's logit exceeds the
    // running maximum (the first step, then rarely: ln(steps) times for independent logits);
    // P' is written with the running maximum first, and barrier 2, a bar.red.or of the
    // threads' comparisons, tells every warp whether it must be redone. The output is the same.
    auto exchange = [&]() {
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
    float p0, p1, p2, p3;
    auto write_p = [&]() {  // P' from the running maxima m0, m1, to P^T
      const float b0 = m0 - 8.f, b1 = m1 - 8.f;
      p0 = fast_exp2(L[0] - b0), p1 = fast_exp2(L[1] - b1);
      p2 = fast_exp2(L[2] - b0), p3 = fast_exp2(L[3] - b1);
      if constexpr (PT == 0) {  // fp16 pairs (tokens tau0, tau0 + 1) at k = 2 tau0
        sts32(p16_c0, pack_f16x2(p0, p2));
        sts32(p16_c1, pack_f16x2(p1, p3));
      } else {
        uint32_t h0, lo0, h1, lo1;
        if constexpr (kPackP) {  // lanes t < 2 write the hi term's rows, t >= 2 the lo term's
          e4m3x2_split(p0, p2, h0, lo0);
          e4m3x2_split(p1, p3, h1, lo1);
          if (t >= 2) h0 = lo0, h1 = lo1;
        } else if constexpr (PT == 2) {
          e4m3x2_split(p0, p2, h0, lo0);
          e4m3x2_split(p1, p3, h1, lo1);
        } else {
          h0 = cvt_e4m3x2(p0, p2), h1 = cvt_e4m3x2(p1, p3), lo0 = lo1 = 0u;
        }
        sts16(p_c0, h0);
        sts16(p_c1, h1);
        if constexpr (PT == 2) {
          sts16(p_c0 + 1024, lo0);
          sts16(p_c1 + 1024, lo1);
        }
      }
      fence_proxy_async();
    };
    auto rescale = [&]() {  // to the maxima n0 = max(m0, x0), n1
      const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
      const float a0 = fast_exp2(m0 - n0), a1 = fast_exp2(m1 - n1);  // 0 at the first step (m = -inf)
      m0 = n0, m1 = n1;
      l0 *= a0, l1 *= a1;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) o[hh][0] *= a0, o[hh][1] *= a1, o[hh][2] *= a0, o[hh][3] *= a1;
    };
    bool redo = true;
    if constexpr (LAZY) {
      write_p();
      redo = named_barrier_or(2, 128, x0 > m0 || x1 > m1);
      // Every warp is past the last step's V reads only here (no barrier after them in a fast
      // step): the ring slot they read is refilled now, not at the step's start.
      issue(s + STAGES - 1);
      if (redo) exchange();
      if constexpr (WO) load_v(r, st);  // after barrier 2 every thread's copies are visible
    } else {
      exchange();
      if constexpr (WO) load_v(r, st);  // every thread's copies of this stage waited for: visible
    }
    if constexpr (PT > 0) {
      e2m1_units_to_vt_e4m3(r, va);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {  // r[i]: tokens 8i + 2t, +1 of unit u; lo = D0, D2, hi = D1, D3
        uint32_t lo, hi;
        fp4x8_to_f16hi8(r[i], lo, hi);
        va[0][i >> 1][2 * (i & 1)] = prmt(lo, 0u, 0x2404u);
        va[0][i >> 1][2 * (i & 1) + 1] = prmt(hi, 0u, 0x2404u);
        va[1][i >> 1][2 * (i & 1)] = prmt(lo, 0u, 0x3414u);
        va[1][i >> 1][2 * (i & 1) + 1] = prmt(hi, 0u, 0x3414u);
      }
    }
    if (redo) {  // LAZY: a step whose maximum grew (P' rewritten after barrier 2's reads)
      rescale();
      write_p();
    }
    const float r0 = fast_exp2(-ev0), r1 = fast_exp2(-ev1);
    l0 = fmaf(p2, r1, fmaf(p0, r0, l0));
    l1 = fmaf(p3, r1, fmaf(p1, r0, l1));
    reg_fence(va[0]);
    reg_fence(va[1]);
    reg_fence(o[0]);
    reg_fence(o[1]);
    if (!LAZY || redo) named_barrier_sync(2, 128);
    wgmma_fence();
    if constexpr (PT == 0) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_m64n8k16_f16(o[hh], va[hh][kk], wgmma_desc_advance(pdesc, 32 * kk));
    } else {
#pragma unroll
      for (int term = 0; term < (kPackP ? 1 : PT); ++term)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            wgmma_m64n8k32_e4m3(o[hh], va[hh][c], wgmma_desc_advance(pdesc, 1024 * term + 32 * c), 1);
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
  reg_fence(o[0]);
  reg_fence(o[1]);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  __syncthreads();
  if (g == 0) {
    reinterpret_cast<float*>(sm + 4096)[8 * w + 2 * t] = l0;
    reinterpret_cast<float*>(sm + 4096)[8 * w + 2 * t + 1] = l1;
  }
  __syncthreads();
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int ww = 0; ww < 4; ++ww) {
    s0 += reinterpret_cast<const float*>(sm + 4096)[8 * ww + 2 * t];
    s1 += reinterpret_cast<const float*>(sm + 4096)[8 * ww + 2 * t + 1];
  }
  if constexpr (kPackP) {  // O of head n = columns n and n + 4; l from the hi lanes
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int k = 0; k < 4; ++k) o[hh][k] += __shfl_xor_sync(0xffffffffu, o[hh][k], 2);
  }
  const int u = 8 * w + g;
  constexpr float kOut = PT > 0 ? 64.f : 16384.f;  // V's codes were E2M1 x 2^-6 (x 2^-14)
  if (SPLIT) {  // unnormalized O, and m, l per column: combine_kernel merges the splits
    float* pp = part + (size_t)blockIdx.x * 8 * (D + 2);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int n = 2 * t + (k & 1), d = 4 * u + 2 * hh + (k >> 1);
        if (n < G) pp[n * (D + 2) + d] = o[hh][k] * kOut;
      }
    if (u == 0 && 2 * t < G) {
      pp[2 * t * (D + 2) + D] = m0, pp[2 * t * (D + 2) + D + 1] = s0;
      pp[(2 * t + 1) * (D + 2) + D] = m1, pp[(2 * t + 1) * (D + 2) + D + 1] = s1;
    }
    return;
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int n = 2 * t + (k & 1), d = 4 * u + 2 * hh + (k >> 1);
      if (n < G) out[((size_t)seq * HKV * G + h * G + n) * D + d] = o[hh][k] * kOut / (k & 1 ? s1 : s0);  // packed: t < 2
    }
}

// The splits of one (sequence, kv head, column): O = sum_p 2^(m_p - M) O_p / sum_p 2^(m_p - M) l_p.
// grid B * HKV * G, block D.
__global__ void combine_kernel(const float* __restrict__ part, float* __restrict__ out, int splits) {
  const int pair = blockIdx.x / G, n = blockIdx.x % G, d = threadIdx.x;
  const float* pp = part + ((size_t)pair * splits * 8 + n) * (D + 2);
  float mx = -INFINITY;
  for (int p = 0; p < splits; ++p) mx = fmaxf(mx, pp[(size_t)p * 8 * (D + 2) + D]);
  float num = 0.f, den = 0.f;
  for (int p = 0; p < splits; ++p) {
    const float* q = pp + (size_t)p * 8 * (D + 2);
    if (q[D] == -INFINITY) continue;  // an empty split
    const float wgt = exp2f(q[D] - mx);
    num += wgt * q[d], den += wgt * q[D + 1];
  }
  out[((size_t)pair * G + n) * D + d] = num / den;
}

__global__ void read_kernel(const uint4* __restrict__ p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

const double kE2M1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};

struct Problem {
  int B, L, max_blocks, blocks;
  std::vector<float> q;
  std::vector<uint8_t> kc, vc, ks, vs;
  std::vector<int> table, lens;
};

Problem make(int B, int L, uint32_t seed, bool ragged) {
  Problem p;
  p.B = B, p.L = L, p.max_blocks = (L + BS - 1) / BS, p.blocks = B * p.max_blocks + 1;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  p.q.resize((size_t)B * HKV * G * D);
  for (auto& x : p.q) x = nd(rng);
  p.kc.resize((size_t)p.blocks * HKV * BS * D / 2);
  p.vc.resize(p.kc.size());
  for (auto& x : p.kc) x = (uint8_t)rng();
  for (auto& x : p.vc) x = (uint8_t)rng();
  p.ks.resize((size_t)p.blocks * BS * HKV);
  p.vs.resize(p.ks.size());
  for (auto& x : p.ks) x = (uint8_t)(120 + rng() % 6);  // 2^-7 .. 2^-2: logits of a few units
  for (auto& x : p.vs) x = (uint8_t)(118 + rng() % 12);
  std::vector<int> perm(p.blocks - 1);
  for (int i = 0; i < (int)perm.size(); ++i) perm[i] = i + 1;
  std::shuffle(perm.begin(), perm.end(), rng);  // block 0 unused (its scales poisoned below)
  for (int i = 0; i < BS * HKV; ++i) p.ks[i] = p.vs[i] = 255;
  p.table.assign((size_t)B * p.max_blocks, 0);
  for (int i = 0; i < B * p.max_blocks; ++i) p.table[i] = perm[i];
  const int some[5] = {1, 54, 97, 64, 63};
  for (int b = 0; b < B; ++b) p.lens.push_back(ragged ? std::min(L, some[b % 5] + 64 * (b / 5)) : L);
  return p;
}

// float64 attention of (seq, kv head): out[G][D]
void reference(const Problem& p, int b, int h, double* o) {
  const int len = p.lens[b];
  std::vector<double> lg(len);
  for (int n = 0; n < G; ++n) {
    const float* qq = &p.q[((size_t)b * HKV * G + h * G + n) * D];
    double mx = -1e300;
    for (int j = 0; j < len; ++j) {
      const int blk = p.table[(size_t)b * p.max_blocks + j / BS], tok = j % BS;
      const uint8_t* row = &p.kc[(((size_t)blk * HKV + h) * BS + tok) * D / 2];
      const double sc = std::ldexp(1.0, (int)p.ks[((size_t)blk * BS + tok) * HKV + h] - 127);
      double acc = 0;
      for (int d = 0; d < D; ++d) acc += qq[d] * kE2M1[(row[d / 2] >> (4 * (d & 1))) & 15];
      lg[j] = acc * sc / std::sqrt((double)D);
      mx = std::max(mx, lg[j]);
    }
    double l = 0;
    std::vector<double> acc(D, 0.0);
    for (int j = 0; j < len; ++j) {
      const int blk = p.table[(size_t)b * p.max_blocks + j / BS], tok = j % BS;
      const uint8_t* row = &p.vc[(((size_t)blk * HKV + h) * BS + tok) * D / 2];
      const double sc = std::ldexp(1.0, (int)p.vs[((size_t)blk * BS + tok) * HKV + h] - 127);
      const double e = std::exp(lg[j] - mx);
      l += e;
      for (int d = 0; d < D; ++d) acc[d] += e * sc * kE2M1[(row[d / 2] >> (4 * (d & 1))) & 15];
    }
    for (int d = 0; d < D; ++d) o[n * D + d] = acc[d] / l;
  }
}

struct Dev {
  float *q, *out, *part;
  uint8_t *kc, *vc, *ks, *vs;
  int *table, *lens;
  int splits;  // CTAs per (sequence, kv head); above 1, combine_kernel merges their partials
};

template <int QT, int PT, int STAGES, int MINB, bool WO, bool LAZY = false, bool SPLIT = false>
void launch(const Problem& p, const Dev& d, cudaStream_t st) {
  const int smem = 4608 + STAGES * STAGE_BYTES + 1024;
  probe_kernel<QT, PT, STAGES, MINB, WO, LAZY, SPLIT><<<p.B * HKV * (SPLIT ? d.splits : 1), 128, smem, st>>>(
      d.q, d.kc, d.vc, d.ks, d.vs, d.table, d.lens, d.out, d.part, p.max_blocks,
      1.f / std::sqrt((float)D), d.splits);
  if (SPLIT) combine_kernel<<<p.B * HKV * G, D, 0, st>>>(d.part, d.out, d.splits);
}

// the (sequence, kv head) pairs checked, about 48 spread over the batch, and their references
struct Checked {
  std::vector<int> pairs;
  std::vector<double> ref;
};
Checked references(const Problem& p) {
  Checked c;
  const int step = std::max(1, p.B * HKV / 48);
  for (int x = 0; x < p.B * HKV; x += step) c.pairs.push_back(x);
  c.ref.resize(c.pairs.size() * G * D);
  for (size_t i = 0; i < c.pairs.size(); ++i)
    reference(p, c.pairs[i] / HKV, c.pairs[i] % HKV, &c.ref[i * G * D]);
  return c;
}

// Runs launch() once, checks d.out (fetch() puts the output there as float) against the
// reference, times launch() in 5 rounds of reps and prints one line.
template <class Launch, class Fetch>
void report(const Problem& p, const Dev& d, int reps, double bw, const Checked& chk, const char* label,
            int per_sm, Launch launch, Fetch fetch) {
  launch();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  fetch();
  double err2 = 0, ref2 = 0, maxrel = 0;
  int checked = 0, nan_rows = 0;
  {
    std::vector<float> got((size_t)p.B * HKV * G * D);
    CK(cudaMemcpy(got.data(), d.out, got.size() * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < chk.pairs.size(); ++i) {
      const int b = chk.pairs[i] / HKV, h = chk.pairs[i] % HKV;
      const double* ref = &chk.ref[i * G * D];
      for (int n = 0; n < G; ++n) {
        double e2 = 0, r2 = 0;
        bool nan = false;
        for (int dd = 0; dd < D; ++dd) {
          const double gv = got[((size_t)b * HKV * G + h * G + n) * D + dd], rv = ref[n * D + dd];
          nan |= std::isnan(gv);
          e2 += (gv - rv) * (gv - rv), r2 += rv * rv;
        }
        nan_rows += nan;
        err2 += e2, ref2 += r2;
        maxrel = std::max(maxrel, std::sqrt(e2 / r2));
        ++checked;
      }
    }
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  double best = 1e30, sum = 0;
  for (int round = 0; round < 5; ++round) {  // each round: reps launches back to back
    CK(cudaEventRecord(e0));
    for (int r = 0; r < reps; ++r) launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, (double)ms * 1e3 / reps), sum += ms * 1e3 / reps;
  }
  double tokens = 0;
  for (int b = 0; b < p.B; ++b) tokens += p.lens[b];
  const double bytes = tokens * HKV * (D + 2);  // K and V codes and their scale bytes
  const double mean = sum / 5;
  printf("%s: %d CTAs/SM | mean %.1f us, best %.1f us (5 rounds of %d) | %.1f %% of the read bandwidth (mean) | "
         "rel RMS err %.3f %% (worst row %.3f %%, %d rows checked, %d NaN)\n",
         label, per_sm, mean, best, reps, 100.0 * bytes / (mean * 1e-6) / bw,
         100.0 * std::sqrt(err2 / std::max(ref2, 1e-300)), 100.0 * maxrel, checked, nan_rows);
}

template <int QT, int PT, int STAGES, int MINB, bool WO, bool LAZY = false, bool SPLIT = false>
void run(const Problem& p, const Dev& d, int reps, double bw, const Checked& chk) {
  const int smem = 4608 + STAGES * STAGE_BYTES + 1024;
  CK(cudaFuncSetAttribute(probe_kernel<QT, PT, STAGES, MINB, WO, LAZY, SPLIT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, probe_kernel<QT, PT, STAGES, MINB, WO, LAZY, SPLIT>, 128, smem));
  char label[256];
  snprintf(label, sizeof label, "Q %d term(s)%s, P %s, %d stages, %s%s%s", QT >= 3 ? 2 : QT,
           QT == 3 ? " packed" : QT == 4 ? " in 16 columns" : "",
           PT == 0 ? "fp16 (V fp16)" : PT == 1 ? "1 E4M3 term" : PT == 2 ? "2 E4M3 terms" : "2 E4M3 terms packed",
           STAGES, WO ? "warp-owned K" : "shared ring", LAZY ? ", maxima exchanged when they grow" : "",
           SPLIT ? ", split" : "");
  report(p, d, reps, bw, chk, label, per_sm, [&] { launch<QT, PT, STAGES, MINB, WO, LAZY, SPLIT>(p, d, 0); }, [] {});
}

__global__ void to_bf16(const float* x, __nv_bfloat16* y, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    y[i] = __float2bfloat16(x[i]);
}
__global__ void to_float(const __nv_bfloat16* x, float* y, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    y[i] = __bfloat162float(x[i]);
}

// The library's decode kernels on the same cache, plain attention, one partition per
// sequence, bf16 query and output (the query rounded to bf16: part of their error against the
// float reference): the SM90a one (attention_decode_wgmma.cuh, wgmma) or the warp-MMA one.
void run_library(const Problem& p, const Dev& d, int reps, double bw, const Checked& chk, bool wgmma) {
  using namespace turboquant::cuda_fp4;
  const size_t nq = p.q.size();
  __nv_bfloat16 *qb, *ob;
  CK(cudaMalloc(&qb, nq * 2));
  CK(cudaMalloc(&ob, nq * 2));
  to_bf16<<<256, 256>>>(d.q, qb, nq);
  AttnParams a{};
  a.out = ob, a.query = qb;
  a.q_stride_tok = a.o_stride_tok = HKV * G * D, a.q_stride_head = a.o_stride_head = D;
  a.key_cache = d.kc, a.value_cache = d.vc;
  a.kc_stride_blk = a.vc_stride_blk = HKV * BS * D / 2, a.kc_stride_head = a.vc_stride_head = BS * D / 2;
  a.key_scales = d.ks, a.value_scales = d.vs;
  a.block_tables = d.table, a.bt_stride = p.max_blocks, a.seq_lens = d.lens;
  a.num_seqs = a.num_tokens = p.B, a.num_heads = HKV * G, a.num_kv_heads = HKV, a.group_size = G;
  a.log2_block_size = 4, a.num_blocks = p.blocks, a.max_blocks_per_seq = p.max_blocks;
  a.partition_size = (p.L + 127) / 128 * 128, a.num_partitions = 1, a.tiles_per_seq = 1;
  a.scale = 1.f / std::sqrt((float)D);
  int per_sm = 0;
  auto fetch = [&] { to_float<<<256, 256>>>(ob, d.out, nq); };
  if (wgmma) {
    auto k = paged_attention_fp4_decode_wgmma_kernel<__nv_bfloat16, false>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, DecodeWgmmaLayout::TOTAL));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 128, DecodeWgmmaLayout::TOTAL));
    report(p, d, reps, bw, chk, "library decode kernel, SM90a wgmma (bf16 Q and output)", per_sm,
           [&] { CK((launch_decode_wgmma<__nv_bfloat16, false>(a, 0))); }, fetch);
  } else {
    using DL = DecodeLayout<128, false, 1>;
    auto k = paged_attention_fp4_decode_kernel<128, __nv_bfloat16, false, false, 1, false>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, DL::TOTAL));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 32 * DL::W, DL::TOTAL));
    report(p, d, reps, bw, chk, "library decode kernel, warp-MMA (bf16 Q and output)", per_sm,
           [&] { CK((launch_decode_kernel<128, __nv_bfloat16, false, false, 1, false>(a, p.B, 0))); }, fetch);
  }
  cudaFree(qb), cudaFree(ob);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::pair<int, int>> shapes;
  int reps = 20, splits = 1;
  for (int i = 1; i < argc; ++i) {
    int b, l;
    if (!strncmp(argv[i], "--reps=", 7)) reps = atoi(argv[i] + 7);
    else if (!strncmp(argv[i], "--splits=", 9)) splits = std::max(1, atoi(argv[i] + 9));
    else if (sscanf(argv[i], "%dx%d", &b, &l) == 2) shapes.push_back({b, l});
  }
  if (shapes.empty()) shapes = {{64, 32768}, {128, 32768}, {128, 4096}, {17, 97}};
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  // the read bandwidth: 2 GiB read once per launch, best of 10
  const size_t nb = (size_t)2 << 30;
  uint4* buf;
  uint32_t* sink;
  CK(cudaMalloc(&buf, nb));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(buf, 1, nb));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  double bw = 0;
  for (int r = 0; r < 10; ++r) {
    CK(cudaEventRecord(e0));
    read_kernel<<<prop.multiProcessorCount * 8, 512>>>(buf, nb / 16, sink);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    bw = std::max(bw, nb / (ms * 1e-3));
  }
  CK(cudaFree(buf));
  printf("%s, %d SMs: read bandwidth %.0f GB/s (2 GiB, best of 10)\n", prop.name, prop.multiProcessorCount, bw / 1e9);
  for (auto [B, L] : shapes) {
    const bool ragged = L < 1024;
    Problem p = make(B, L, 1234u + B * 7 + L, ragged);
    Dev d;
    CK(cudaMalloc(&d.q, p.q.size() * 4));
    CK(cudaMalloc(&d.out, p.q.size() * 4));
    d.splits = splits;
    CK(cudaMalloc(&d.part, std::max<size_t>(1, (size_t)B * HKV * splits * 8 * (D + 2) * 4)));
    CK(cudaMalloc(&d.kc, p.kc.size()));
    CK(cudaMalloc(&d.vc, p.vc.size()));
    CK(cudaMalloc(&d.ks, p.ks.size()));
    CK(cudaMalloc(&d.vs, p.vs.size()));
    CK(cudaMalloc(&d.table, p.table.size() * 4));
    CK(cudaMalloc(&d.lens, p.lens.size() * 4));
    CK(cudaMemcpy(d.q, p.q.data(), p.q.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.kc, p.kc.data(), p.kc.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.vc, p.vc.data(), p.vc.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.ks, p.ks.data(), p.ks.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.vs, p.vs.data(), p.vs.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.table, p.table.data(), p.table.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.lens, p.lens.data(), p.lens.size() * 4, cudaMemcpyHostToDevice));
    printf("%d x %d%s (32 query / 8 kv heads, D 128, block 16; %d split(s) per sequence and head):\n",
           B, L, ragged ? " (ragged lengths 1, 54, 97, 64, 63 + 64 i)" : "", splits);
    const Checked chk = references(p);
    run_library(p, d, reps, bw, chk, false);
    run_library(p, d, reps, bw, chk, true);
    if (splits > 1) {  // the split-KV builds of the one-chain forms
      run<1, 1, 4, 5, true, false, true>(p, d, reps, bw, chk);
      run<3, 1, 4, 5, true, false, true>(p, d, reps, bw, chk);
      run<3, 1, 4, 5, true, true, true>(p, d, reps, bw, chk);
      run<4, 1, 4, 5, true, true, true>(p, d, reps, bw, chk);
    } else {
      run<1, 1, 4, 5, true>(p, d, reps, bw, chk);
      run<2, 2, 4, 5, true>(p, d, reps, bw, chk);
      run<2, 2, 4, 5, false>(p, d, reps, bw, chk);
      run<3, 3, 4, 5, true>(p, d, reps, bw, chk);
      run<3, 1, 4, 5, true>(p, d, reps, bw, chk);
      run<2, 1, 4, 5, true>(p, d, reps, bw, chk);
      run<2, 0, 4, 5, true>(p, d, reps, bw, chk);
      run<1, 1, 4, 5, true, true>(p, d, reps, bw, chk);
      run<3, 1, 4, 5, true, true>(p, d, reps, bw, chk);
      run<4, 1, 4, 5, true>(p, d, reps, bw, chk);
      run<4, 1, 4, 5, true, true>(p, d, reps, bw, chk);
      run<2, 2, 4, 5, true, true>(p, d, reps, bw, chk);
    }
    cudaFree(d.q), cudaFree(d.out), cudaFree(d.part), cudaFree(d.kc), cudaFree(d.vc), cudaFree(d.ks), cudaFree(d.vs);
    cudaFree(d.table), cudaFree(d.lens);
  }
  return 0;
}
