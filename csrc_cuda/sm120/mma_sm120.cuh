// Warp-level block-scaled MMA on the SM120 family (sm_120a / sm_121a), one wrapper per PTX
// instruction, and a software model of each instruction for the emulation build.
//
// Which body a wrapper gets:
//   - sm_120a / sm_121a (or the sm_120f / sm_121f family targets): the real inline PTX;
//   - any other device target with TQ_SM120_EMULATE defined (the sm_90a emulation build):
//     the software model below, fed by warp shuffles along the documented layouts;
//   - any other device target: a compile error.
// The lane-layout functions and the model are __host__ __device__, so a host program can run
// 32 simulated lanes through the very same code (csrc_cuda/sm120/tests/layout_host_test.cpp).
//
// Sources: PTX ISA 9.0, sections "warp-level block scaling" (9.7.14.3) and the m16n8k32 /
// m16n8k64 fragment layouts (9.7.14.5.10-11); CUTLASS cute/atom/mma_traits_sm120.hpp for the
// split of the A scale between the two lanes of a lane pair (drawn only in a PTX figure).
// Notation: lane = 4*g + t, g = groupID (lane / 4), t = threadID_in_group (lane % 4).
// Torch-free.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define TQ_HD __host__ __device__ __forceinline__
#else
#define TQ_HD inline
#endif

#if defined(__CUDA_ARCH__) && !defined(TQ_SM120_EMULATE)
#if defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL) || \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) &&                                   \
     (__CUDA_ARCH_FAMILY_SPECIFIC__ == 1200 || __CUDA_ARCH_FAMILY_SPECIFIC__ == 1210))
#define TQ_SM120_PTX 1
#else
#error "the SM120 MMA wrappers need sm_120a/sm_121a (or -DTQ_SM120_EMULATE for the model)"
#endif
#endif

namespace tq {
namespace sm120 {

// ---------------------------------------------------------------------------------------
// Lane layouts (PTX ISA 9.7.14.5.10 / 9.7.14.5.11).
//
// m16n8k32, kind::mxf8f6f4 (every A/B type sits in one 8-bit container per element; e4m3
// fills the byte, e2m1 sits in bits 5..2 with the rest zero; the layout is the same whatever
// the types of A and B):
//   A (16x32, row-major): register r (0..3), byte j (0..3) of lane (g,t) holds
//       row g + 8*(r & 1), k = 4*t + j + 16*(r >> 1).
//   B (32x8, each column K-major): register r (0..1), byte j holds column g, k = 4*t + j + 16*r.
// m16n8k64, kind::mxf4 (two e2m1 per byte, the lower k in the low nibble):
//   A: register r, nibble i (0..7) holds row g + 8*(r & 1), k = 8*t + i + 32*(r >> 1).
//   B: register r, nibble i holds column g, k = 8*t + i + 32*r.
// C/D (16x8 f32, both shapes): element i (0..3) of lane (g,t) is row g + 8*(i >> 1),
//   column 2*t + (i & 1).
// Scale factors (9.7.14.3): the scale of A row m comes from lane 4*(m % 8) + 2*thread-id-a
//   + m / 8 (thread-id-a 0: lanes with lane%4 in {0,1}; 1: {2,3}; the even lane of a pair
//   carries rows 0..7, the odd lane rows 8..15); the scale of B column n from lane
//   4*n + thread-id-b. Byte used: scale_vec::1X (k32): byte byte-id; scale_vec::2X (k64):
//   byte byte-id + k/32 (byte-id is 0 or 2). E8M0 byte b is 2^(b-127); 255 is NaN.
// ---------------------------------------------------------------------------------------
TQ_HD int k32_a_row(int lane, int r) { return (lane >> 2) + 8 * (r & 1); }
TQ_HD int k32_a_k(int lane, int r, int j) { return 4 * (lane & 3) + j + 16 * (r >> 1); }
TQ_HD int k32_b_col(int lane) { return lane >> 2; }
TQ_HD int k32_b_k(int lane, int r, int j) { return 4 * (lane & 3) + j + 16 * r; }
TQ_HD int k64_a_row(int lane, int r) { return (lane >> 2) + 8 * (r & 1); }
TQ_HD int k64_a_k(int lane, int r, int i) { return 8 * (lane & 3) + i + 32 * (r >> 1); }
TQ_HD int k64_b_col(int lane) { return lane >> 2; }
TQ_HD int k64_b_k(int lane, int r, int i) { return 8 * (lane & 3) + i + 32 * r; }
TQ_HD int cd_row(int lane, int i) { return (lane >> 2) + 8 * (i >> 1); }
TQ_HD int cd_col(int lane, int i) { return 2 * (lane & 3) + (i & 1); }
TQ_HD int sfa_lane(int row, int tid_a) { return 4 * (row & 7) + 2 * tid_a + (row >> 3); }
TQ_HD int sfb_lane(int col, int tid_b) { return 4 * col + tid_b; }

// ---------------------------------------------------------------------------------------
// Exact decoders.
// ---------------------------------------------------------------------------------------
TQ_HD float e2m1_value(uint32_t code) {
  // codes 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign
  const uint32_t mag = code & 7u;
  const float v = mag < 2u ? 0.5f * float(mag) : ldexpf(1.0f + 0.5f * float(mag & 1u), int(mag >> 1) - 1);
  return (code & 8u) ? -v : v;
}

TQ_HD float e4m3_value(uint32_t byte) {
  // OCP E4M3 (fn): bias 7, no inf, S.1111.111 is NaN
  const uint32_t exp = (byte >> 3) & 15u, man = byte & 7u;
  float v;
  if ((byte & 0x7Fu) == 0x7Fu) {
    v = NAN;
  } else if (exp == 0u) {
    v = ldexpf(float(man), -9);
  } else {
    v = ldexpf(float(8u + man), int(exp) - 10);
  }
  return (byte & 0x80u) ? -v : v;
}

TQ_HD float ue8m0_value(uint32_t byte) { return byte == 255u ? NAN : ldexpf(1.0f, int(byte) - 127); }

TQ_HD uint32_t byte_of(uint32_t word, int index) { return (word >> (8 * index)) & 0xFFu; }

// ---------------------------------------------------------------------------------------
// Software model of each instruction, for one lane. `f` fetches another lane's operand
// registers: f.a(r, src), f.b(r, src), f.sfa(src), f.sfb(src). The fetch sequence depends
// only on the loop indices, so on the device every lane issues the same shuffles.
// The products of the decoded elements are exact in fp32; they are summed in k order, scaled
// by the two E8M0 factors, and added to c.
// ---------------------------------------------------------------------------------------

// The B element types of kind::mxf8f6f4 the kernels use (A is always e4m3).
enum class BType { kE2m1, kE4m3 };

// The value of one B container byte: e2m1 in bits 5..2, or e4m3 (the whole byte).
TQ_HD float b_container_value(BType type, uint32_t byte) {
  return type == BType::kE4m3 ? e4m3_value(byte) : e2m1_value(byte >> 2);
}

// mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.<b>.f32.ue8m0
// with <b> = e2m1 or e4m3 (kB): the two forms differ only in how a B byte is decoded.
template <BType kB, class Fetch>
TQ_HD void model_mxf8f6f4_e4m3(int lane, const Fetch& f, int bid_a, int tid_a, int bid_b, int tid_b,
                               const float c[4], float d[4]) {
  const int g = lane >> 2, t = lane & 3;
  float a_rows[2][32];  // rows g and g+8
  float b_cols[2][32];  // columns 2t and 2t+1
  for (int r = 0; r < 4; ++r) {
    for (int src_t = 0; src_t < 4; ++src_t) {
      const int src = 4 * g + src_t;
      const uint32_t w = f.a(r, src);
      for (int j = 0; j < 4; ++j) a_rows[r & 1][k32_a_k(src, r, j)] = e4m3_value(byte_of(w, j));
    }
  }
  for (int col = 0; col < 2; ++col) {
    for (int r = 0; r < 2; ++r) {
      for (int src_t = 0; src_t < 4; ++src_t) {
        const int src = 4 * (2 * t + col) + src_t;
        const uint32_t w = f.b(r, src);
        for (int j = 0; j < 4; ++j) b_cols[col][k32_b_k(src, r, j)] = b_container_value(kB, byte_of(w, j));
      }
    }
  }
  float sa[2], sb[2];
  for (int h = 0; h < 2; ++h) sa[h] = ue8m0_value(byte_of(f.sfa(sfa_lane(g + 8 * h, tid_a)), bid_a));
  for (int col = 0; col < 2; ++col) sb[col] = ue8m0_value(byte_of(f.sfb(sfb_lane(2 * t + col, tid_b)), bid_b));
  for (int i = 0; i < 4; ++i) {
    float acc = 0.0f;
    for (int k = 0; k < 32; ++k) acc += a_rows[i >> 1][k] * b_cols[i & 1][k];
    d[i] = c[i] + acc * sa[i >> 1] * sb[i & 1];
  }
}

// mma.sync.aligned.m16n8k64.row.col.kind::mxf4.block_scale.scale_vec::2X.f32.e2m1.e2m1.f32.ue8m0
template <class Fetch>
TQ_HD void model_mxf4_e2m1_e2m1(int lane, const Fetch& f, int bid_a, int tid_a, int bid_b, int tid_b,
                                const float c[4], float d[4]) {
  const int g = lane >> 2, t = lane & 3;
  float a_rows[2][64];
  float b_cols[2][64];
  for (int r = 0; r < 4; ++r) {
    for (int src_t = 0; src_t < 4; ++src_t) {
      const int src = 4 * g + src_t;
      const uint32_t w = f.a(r, src);
      for (int i = 0; i < 8; ++i) a_rows[r & 1][k64_a_k(src, r, i)] = e2m1_value((w >> (4 * i)) & 15u);
    }
  }
  for (int col = 0; col < 2; ++col) {
    for (int r = 0; r < 2; ++r) {
      for (int src_t = 0; src_t < 4; ++src_t) {
        const int src = 4 * (2 * t + col) + src_t;
        const uint32_t w = f.b(r, src);
        for (int i = 0; i < 8; ++i) b_cols[col][k64_b_k(src, r, i)] = e2m1_value((w >> (4 * i)) & 15u);
      }
    }
  }
  uint32_t sfa_word[2], sfb_word[2];
  for (int h = 0; h < 2; ++h) sfa_word[h] = f.sfa(sfa_lane(g + 8 * h, tid_a));
  for (int col = 0; col < 2; ++col) sfb_word[col] = f.sfb(sfb_lane(2 * t + col, tid_b));
  for (int i = 0; i < 4; ++i) {
    float acc = c[i];
    for (int half = 0; half < 2; ++half) {  // scale_vec::2X: one scale per 32 k
      float part = 0.0f;
      for (int k = 32 * half; k < 32 * half + 32; ++k) part += a_rows[i >> 1][k] * b_cols[i & 1][k];
      acc += part * ue8m0_value(byte_of(sfa_word[i >> 1], bid_a + half)) *
             ue8m0_value(byte_of(sfb_word[i & 1], bid_b + half));
    }
    d[i] = acc;
  }
}

#if defined(__CUDACC__) && !defined(TQ_SM120_PTX)
// The emulation build. Operand fetch for the model on the device: every lane shuffles the
// same register index from its chosen source lane.
struct ShuffleFetch {
  const uint32_t* a_regs;
  const uint32_t* b_regs;
  uint32_t sfa_reg, sfb_reg;
  __device__ __forceinline__ uint32_t a(int r, int src) const { return __shfl_sync(0xffffffffu, a_regs[r], src); }
  __device__ __forceinline__ uint32_t b(int r, int src) const { return __shfl_sync(0xffffffffu, b_regs[r], src); }
  __device__ __forceinline__ uint32_t sfa(int src) const { return __shfl_sync(0xffffffffu, sfa_reg, src); }
  __device__ __forceinline__ uint32_t sfb(int src) const { return __shfl_sync(0xffffffffu, sfb_reg, src); }
};

// The instruction bodies, kept out of line so each call site stays small.
static __device__ __noinline__ void emulate_mxf8f6f4_e4m3_e2m1(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                      const float c[4], uint32_t sfa, uint32_t sfb, int bid_a,
                                                      int tid_a, int bid_b, int tid_b) {
  model_mxf8f6f4_e4m3<BType::kE2m1>(int(threadIdx.x & 31u), ShuffleFetch{a, b, sfa, sfb}, bid_a, tid_a, bid_b, tid_b,
                                    c, d);
}

static __device__ __noinline__ void emulate_mxf8f6f4_e4m3_e4m3(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                      const float c[4], uint32_t sfa, uint32_t sfb, int bid_a,
                                                      int tid_a, int bid_b, int tid_b) {
  model_mxf8f6f4_e4m3<BType::kE4m3>(int(threadIdx.x & 31u), ShuffleFetch{a, b, sfa, sfb}, bid_a, tid_a, bid_b, tid_b,
                                    c, d);
}

static __device__ __noinline__ void emulate_mxf4_e2m1_e2m1(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                  const float c[4], uint32_t sfa, uint32_t sfb, int bid_a, int tid_a,
                                                  int bid_b, int tid_b) {
  model_mxf4_e2m1_e2m1(int(threadIdx.x & 31u), ShuffleFetch{a, b, sfa, sfb}, bid_a, tid_a, bid_b, tid_b, c, d);
}
#endif  // __CUDACC__ && !TQ_SM120_PTX

// ---------------------------------------------------------------------------------------
// The wrappers. Selectors are template arguments, so they are immediates (warp-uniform):
// a per-lane selector would make ptxas wrap the MMA in a waterfall loop.
// ---------------------------------------------------------------------------------------
#if defined(__CUDACC__)

// d = c + (A * SF_A) x (B * SF_B): A 16x32 e4m3, B 32x8 e2m1 (bits 5..2 of each byte),
// one ue8m0 scale per row of A and per column of B (scale_vec::1X). SASS: QMMA.SF.16832.F32.E4M3.E2M1.E8
template <int kBidA, int kTidA, int kBidB, int kTidB>
__device__ __forceinline__ void mma_mxf8f6f4_e4m3_e2m1_m16n8k32(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                                const float c[4], uint32_t sfa, uint32_t sfb) {
  static_assert(kBidA >= 0 && kBidA < 4 && kTidA >= 0 && kTidA < 2, "1X: byte-id-a 0..3, thread-id-a 0..1");
  static_assert(kBidB >= 0 && kBidB < 4 && kTidB >= 0 && kTidB < 4, "1X: byte-id-b 0..3, thread-id-b 0..3");
#if defined(TQ_SM120_PTX)
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.e2m1.f32.ue8m0 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13}, "
      "%14, {%16, %17}, %15, {%18, %19};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]), "r"(sfa), "r"(sfb), "n"(kBidA), "n"(kTidA), "n"(kBidB), "n"(kTidB));
#else
  float out[4];  // d may alias c
  emulate_mxf8f6f4_e4m3_e2m1(out, a, b, c, sfa, sfb, kBidA, kTidA, kBidB, kTidB);
  for (int i = 0; i < 4; ++i) d[i] = out[i];
#endif
}

// d = c + (A * SF_A) x (B * SF_B): A 16x32 e4m3, B 32x8 e4m3 (one element per byte), one ue8m0
// scale per row of A and per column of B (scale_vec::1X). Same lane layouts as the e2m1-B form
// above (k32_a_*, k32_b_*, sfa_lane, sfb_lane); only B's element type differs.
// SASS: QMMA.SF.16832.F32.E4M3.E4M3.E8
template <int kBidA, int kTidA, int kBidB, int kTidB>
__device__ __forceinline__ void mma_mxf8f6f4_e4m3_e4m3_m16n8k32(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                                const float c[4], uint32_t sfa, uint32_t sfb) {
  static_assert(kBidA >= 0 && kBidA < 4 && kTidA >= 0 && kTidA < 2, "1X: byte-id-a 0..3, thread-id-a 0..1");
  static_assert(kBidB >= 0 && kBidB < 4 && kTidB >= 0 && kTidB < 4, "1X: byte-id-b 0..3, thread-id-b 0..3");
#if defined(TQ_SM120_PTX)
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.e4m3.f32.ue8m0 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13}, "
      "%14, {%16, %17}, %15, {%18, %19};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]), "r"(sfa), "r"(sfb), "n"(kBidA), "n"(kTidA), "n"(kBidB), "n"(kTidB));
#else
  float out[4];  // d may alias c
  emulate_mxf8f6f4_e4m3_e4m3(out, a, b, c, sfa, sfb, kBidA, kTidA, kBidB, kTidB);
  for (int i = 0; i < 4; ++i) d[i] = out[i];
#endif
}

// d = c + (A * SF_A) x (B * SF_B): A 16x64 e2m1, B 64x8 e2m1 (packed, low nibble = lower k),
// two ue8m0 scales per row / column, for k 0..31 and 32..63 (scale_vec::2X).
// SASS: OMMA.SF.16864.F32.E2M1.E2M1.E8
template <int kBidA, int kTidA, int kBidB, int kTidB>
__device__ __forceinline__ void mma_mxf4_e2m1_e2m1_m16n8k64(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                            const float c[4], uint32_t sfa, uint32_t sfb) {
  static_assert((kBidA == 0 || kBidA == 2) && kTidA >= 0 && kTidA < 2, "2X: byte-id-a 0 or 2, thread-id-a 0..1");
  static_assert((kBidB == 0 || kBidB == 2) && kTidB >= 0 && kTidB < 4, "2X: byte-id-b 0 or 2, thread-id-b 0..3");
#if defined(TQ_SM120_PTX)
  asm volatile(
      "mma.sync.aligned.m16n8k64.row.col.kind::mxf4.block_scale.scale_vec::2X.f32.e2m1.e2m1.f32.ue8m0 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13}, "
      "%14, {%16, %17}, %15, {%18, %19};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]), "r"(sfa), "r"(sfb), "n"(kBidA), "n"(kTidA), "n"(kBidB), "n"(kTidB));
#else
  float out[4];  // d may alias c
  emulate_mxf4_e2m1_e2m1(out, a, b, c, sfa, sfb, kBidA, kTidA, kBidB, kTidB);
  for (int i = 0; i < 4; ++i) d[i] = out[i];
#endif
}

#endif  // __CUDACC__

}  // namespace sm120
}  // namespace tq
