// turboquant AMD kernels (gfx950, gfx942): the few machine primitives the kernels use, in one
// place.
//
// Two builds see this header:
//   - the device build (clang-22 / hipcc, `-x hip --offload-arch=gfx950`): every primitive is
//     a gfx950 instruction through a clang builtin. No HIP header is needed.
//   - the host lane simulation (`-DTQ_HOST_SIM`, any C++20 compiler): the same kernel source
//     runs with each of the 256 threads of a workgroup as a cooperative fiber; the cross-lane
//     primitives and the MFMA are implemented by csrc_hip/sim/tq_fp4_lane_sim.cpp, the
//     conversions by the software models below.
#pragma once

#include <stdint.h>

// The target architecture, at compile time (one template source, one instruction set per
// target; the gfx950 code is the same whether or not the gfx942 path exists):
//   TQ_GFX942 1: MI300X (gfx942). FP8 MFMA without a scale operand
//     (v_mfma_f32_16x16x32_fp8_fp8) and FP8 = E4M3FNUZ (bias 8, no negative zero, 0x80 is
//     NaN): the kernel's LUT path, with the E8M0 scales applied in fp32. The device build for
//     gfx942, or the lane simulation built with -DTQ_SIM_GFX942.
//   TQ_GFX942 0: gfx950 (MI350X/MI355X; OCP E4M3, the scaled MFMA), and every other build.
#if (defined(TQ_HOST_SIM) && defined(TQ_SIM_GFX942)) || \
    (!defined(TQ_HOST_SIM) && defined(__HIP_DEVICE_COMPILE__) && defined(__gfx942__))
#define TQ_GFX942 1
#else
#define TQ_GFX942 0
#endif

namespace tq {

constexpr bool kGfx942 = TQ_GFX942 != 0;

typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef int i32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x2 __attribute__((vector_size(8)));

// The 16 FP4 E2M1 codes as FP8 E4M3 (OCP, bias 7) bytes: 0,0.5,1,1.5,2,3,4,6, then negatives.
constexpr uint8_t kFp4ToE4m3[16] = {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C,
                                    0x80, 0xB0, 0xB8, 0xBC, 0xC0, 0xC4, 0xC8, 0xCC};
// The table's positive half as the two v_perm_b32 sources (codes 0..3 and 4..7); the
// negative half is the same bytes with bit 7 set.
// The same codes as E4M3FNUZ (gfx942: bias 8, so each nonzero byte is the OCP byte + 0x08),
// with code 8 (-0) as 0x00: FNUZ has no negative zero and 0x80 is its NaN.
constexpr uint8_t kFp4ToE4m3Fnuz[16] = {0x00, 0x38, 0x40, 0x44, 0x48, 0x4C, 0x50, 0x54,
                                        0x00, 0xB8, 0xC0, 0xC4, 0xC8, 0xCC, 0xD0, 0xD4};
constexpr uint32_t table_word(const uint8_t (&table)[16], int first) {
  return uint32_t(table[first]) | uint32_t(table[first + 1]) << 8 |
         uint32_t(table[first + 2]) << 16 | uint32_t(table[first + 3]) << 24;
}
constexpr uint32_t kE4m3MagLo = table_word(kFp4ToE4m3, 0);
constexpr uint32_t kE4m3MagHi = table_word(kFp4ToE4m3, 4);
static_assert(kE4m3MagLo == 0x3C383000u && kE4m3MagHi == 0x4C484440u, "E4M3 of 0..1.5, 2..6");
constexpr uint32_t kFnuzMagLo = table_word(kFp4ToE4m3Fnuz, 0);
constexpr uint32_t kFnuzMagHi = table_word(kFp4ToE4m3Fnuz, 4);
static_assert(kFnuzMagLo == 0x44403800u && kFnuzMagHi == 0x54504C48u, "FNUZ of 0..1.5, 2..6");
constexpr bool negatives_are_sign_bit(const uint8_t (&table)[16], bool fnuz) {
  for (int i = 0; i < 8; ++i) {
    const uint8_t neg = (fnuz && table[i] == 0) ? 0x00 : uint8_t(table[i] | 0x80);
    if (table[i + 8] != neg) return false;
  }
  return true;
}
static_assert(negatives_are_sign_bit(kFp4ToE4m3, false), "codes 8..15 are codes 0..7 with the sign bit");
static_assert(negatives_are_sign_bit(kFp4ToE4m3Fnuz, true),
              "FNUZ: codes 9..15 are codes 1..7 with the sign bit, code 8 is +0");
// The largest finite FP8 E4M3 magnitude of the target: 448 (OCP), 240 (FNUZ).
constexpr float kFp8Max = kGfx942 ? 240.0f : 448.0f;

}  // namespace tq

#if defined(TQ_HOST_SIM)

#include <math.h>
#include <string.h>

#define TQ_HD inline
#define TQ_KERNEL(MIN_THREADS, MAX_THREADS)
#define TQ_LDS(Type, name) Type* name = static_cast<Type*>(::tq::sim::lds(sizeof(Type)))

namespace tq {
namespace sim {
// Provided by the lane simulation (csrc_hip/sim/tq_fp4_lane_sim.cpp).
int thread_id();
int block_id(int dim);
void block_barrier();
float shfl_xor(float v, int mask);
void* lds(unsigned long bytes);
f32x4 mfma_scale_16x16x128(int fmt_a, int fmt_b, i32x8 a, i32x8 b, f32x4 c, int scale_a,
                           int scale_b);
f32x4 mfma_16x16x32_fp8_fnuz(uint64_t a, uint64_t b, f32x4 c);
uint64_t lds_read_tr_b64(const void* p, int bits);
uint32_t first_lane(uint32_t v);
}  // namespace sim

inline int thread_id() { return sim::thread_id(); }
inline int block_id_x() { return sim::block_id(0); }
inline int block_id_y() { return sim::block_id(1); }
inline int block_id_z() { return sim::block_id(2); }
inline void block_barrier() { sim::block_barrier(); }
inline float wave_shfl_xor(float v, int mask) { return sim::shfl_xor(v, mask); }
inline uint32_t wave_first_lane(uint32_t v) { return sim::first_lane(v); }
// Device-scope ordering and the tickets' atomic: the simulation runs one workgroup at a time.
inline void fence_release_device() {}
inline void fence_acquire_device() {}
inline uint32_t atomic_add_device(uint32_t* p, uint32_t v) { const uint32_t old = *p; *p = old + v; return old; }

inline u32x4 load_u32x4(const uint8_t* p) { u32x4 v; memcpy(&v, p, 16); return v; }
inline uint32_t load_u32(const uint8_t* p) { uint32_t v; memcpy(&v, p, 4); return v; }
inline uint64_t load_u64(const uint8_t* p) { uint64_t v; memcpy(&v, p, 8); return v; }
inline void sched_barrier() {}

// v_perm_b32 for selector bytes 0..7: byte k of the 64-bit value {src0:src1}.
inline uint32_t perm_b32(uint32_t src0, uint32_t src1, uint32_t sel) {
  const uint64_t both = (uint64_t(src0) << 32) | src1;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((both >> (8 * ((sel >> (8 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}

// float -> OCP FP8 E4M3, round to nearest even, as v_cvt_pk_fp8_f32 does on gfx950.
// NaN and values beyond the largest finite (448, after rounding) give the NaN byte 0x7F.
inline uint32_t f32_to_e4m3(float x) {
  uint32_t bits; memcpy(&bits, &x, 4);
  const uint32_t sign = (bits >> 24) & 0x80;
  const float a = fabsf(x);
  if (!(a == a)) return 0x7F;
  if (a >= 464.0f) return sign | 0x7F;
  // Spacing of E4M3 near a: 2^(e-3) for normals (e >= -6), 2^-9 for subnormals.
  int e; frexpf(a, &e); e -= 1;  // a = m * 2^e, m in [1, 2)
  if (e < -6) e = -6;
  const float step = ldexpf(1.0f, e - 3);
  const float q = nearbyintf(a / step) * step;  // ties to even under the default rounding mode
  if (q == 0.0f) return sign;
  int qe; frexpf(q, &qe); qe -= 1;
  if (qe < -6) return sign | uint32_t(q / ldexpf(1.0f, -9));  // subnormal: mantissa in units of 2^-9
  const uint32_t mant = uint32_t(q / ldexpf(1.0f, qe) * 8.0f) - 8;
  return sign | (uint32_t(qe + 7) << 3) | mant;
}

// float -> E4M3FNUZ (gfx942's v_cvt_pk_fp8_f32), round to nearest even: bias 8, largest
// finite 240, subnormals in units of 2^-10, zero of either sign -> 0x00 (FNUZ has no -0;
// 0x80 is its only NaN). NaN and values that round beyond 240 give 0x80 (the kernel's
// operands are scaled to stay within 240).
inline uint32_t f32_to_e4m3fnuz(float x) {
  uint32_t bits; memcpy(&bits, &x, 4);
  const uint32_t sign = (bits >> 24) & 0x80;
  const float a = fabsf(x);
  if (!(a == a) || a >= 248.0f) return 0x80;
  int e; frexpf(a, &e); e -= 1;
  if (e < -7) e = -7;
  const float step = ldexpf(1.0f, e - 3);
  const float q = nearbyintf(a / step) * step;
  if (q == 0.0f) return 0x00;
  int qe; frexpf(q, &qe); qe -= 1;
  if (qe < -7) return sign | uint32_t(q / ldexpf(1.0f, -10));
  const uint32_t mant = uint32_t(q / ldexpf(1.0f, qe) * 8.0f) - 8;
  return sign | (uint32_t(qe + 8) << 3) | mant;
}

// v_cvt_pk_fp8_f32 twice: four floats -> four FP8 bytes of the target (OCP E4M3, or FNUZ on
// gfx942), first in the low byte.
inline uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  uint32_t (*cvt)(float) = kGfx942 ? f32_to_e4m3fnuz : f32_to_e4m3;
  return cvt(a) | (cvt(b) << 8) | (cvt(c) << 16) | (cvt(d) << 24);
}

// v_cvt_f32_fp8: E4M3 byte -> float (exact).
inline float e4m3_to_f32(uint32_t byte) {
  const uint32_t e = (byte >> 3) & 15, m = byte & 7;
  if (e == 15 && m == 7) return NAN;
  const float mag = e == 0 ? ldexpf(float(m), -9) : ldexpf(float(8 + m), int(e) - 10);
  return (byte & 0x80) ? -mag : mag;
}
// The same for E4M3FNUZ (gfx942): 0x80 is NaN, no infinities.
inline float e4m3fnuz_to_f32(uint32_t byte) {
  if ((byte & 0xFF) == 0x80) return NAN;
  const uint32_t e = (byte >> 3) & 15, m = byte & 7;
  const float mag = e == 0 ? ldexpf(float(m), -10) : ldexpf(float(8 + m), int(e) - 11);
  return (byte & 0x80) ? -mag : mag;
}
inline void unpack_e4m3x4(uint32_t w, float out[4]) {
  for (int i = 0; i < 4; ++i)
    out[i] = kGfx942 ? e4m3fnuz_to_f32((w >> (8 * i)) & 0xFF) : e4m3_to_f32((w >> (8 * i)) & 0xFF);
}

// ds_read_b64_tr_b4 / _b8: the transposing LDS reads (the lane simulation's wave model).
inline uint64_t lds_read_tr4_b64(const uint8_t* p) { return sim::lds_read_tr_b64(p, 4); }
inline uint64_t lds_read_tr8_b64(const uint8_t* p) { return sim::lds_read_tr_b64(p, 8); }

// v_cvt_scalef32_pk_fp8_f32: two floats divided by 2^(e8 - 127) (exact exponent arithmetic),
// rounded to E4M3 (NaN and |x| > 464 give sign | 0x7F), into the low or high half of old.
inline uint32_t cvt_scaled_pk_e4m3(float a, float b, int e8, uint32_t old, bool hi) {
  const uint32_t w = f32_to_e4m3(ldexpf(a, 127 - e8)) | (f32_to_e4m3(ldexpf(b, 127 - e8)) << 8);
  return hi ? (old & 0xFFFFu) | (w << 16) : (old & 0xFFFF0000u) | w;
}
// v_cvt_scalef32_pk_f32_fp8: the low (hi = false) or high two E4M3 bytes of src times 2^(e8 - 127).
inline void cvt_scaled_pk_f32_e4m3(uint32_t src, int e8, bool hi, f32x2& out) {
  const uint32_t h = hi ? src >> 16 : src;
  out[0] = ldexpf(e4m3_to_f32(h & 0xFF), e8 - 127);
  out[1] = ldexpf(e4m3_to_f32((h >> 8) & 0xFF), e8 - 127);
}

inline float exp2_f32(float x) { return exp2f(x); }
inline float exp2_fast(float x) { return exp2f(x); }
inline float log2_f32(float x) { return log2f(x); }
inline float ldexp_f32(float x, int e) { return ldexpf(x, e); }
inline float floor_f32(float x) { return floorf(x); }
inline float ceil_f32(float x) { return ceilf(x); }
inline float fmax_f32(float a, float b) { return fmaxf(a, b); }
inline float fabs_f32(float x) { return fabsf(x); }
inline int frexp_exp_f32(float x) { int e; frexpf(x, &e); return e; }

}  // namespace tq

#else  // device build

// The scaled MFMA and the FP8 conversions exist on gfx950 only. A build that also targets
// other architectures (AITER compiles for every arch in GPU_ARCHS) gets kernels that trap
// there; the Python launcher refuses to launch them on anything but gfx950.
#if defined(__HIP_DEVICE_COMPILE__) && !defined(__gfx950__)
#define TQ_GFX950 0
#else
#define TQ_GFX950 1
#endif

#define TQ_HD __attribute__((device)) inline
#define TQ_KERNEL(MIN_THREADS, MAX_THREADS) \
  __attribute__((global)) __attribute__((amdgpu_flat_work_group_size(MIN_THREADS, MAX_THREADS)))
#define TQ_LDS(Type, name)                        \
  __attribute__((shared)) Type name##_storage;    \
  Type* name = &name##_storage

namespace tq {

TQ_HD int thread_id() { return __builtin_amdgcn_workitem_id_x(); }
TQ_HD int block_id_x() { return __builtin_amdgcn_workgroup_id_x(); }
TQ_HD int block_id_y() { return __builtin_amdgcn_workgroup_id_y(); }
TQ_HD int block_id_z() { return __builtin_amdgcn_workgroup_id_z(); }

// __syncthreads(): LDS writes before the barrier are visible to every wave after it.
TQ_HD void block_barrier() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

// Value of lane (lane ^ mask) of the same wavefront (ds_bpermute_b32 addresses bytes).
TQ_HD float wave_shfl_xor(float v, int mask) {
  const int lane = __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
  return __builtin_bit_cast(
      float, __builtin_amdgcn_ds_bpermute((lane ^ mask) << 2, __builtin_bit_cast(int, v)));
}

// Lane 0's value in every lane (v_readfirstlane_b32; lane 0 is active where it is used).
TQ_HD uint32_t wave_first_lane(uint32_t v) { return __builtin_amdgcn_readfirstlane(v); }
// Ordering across workgroups: every lane's stores before the fence are visible device-wide
// before anything after it; loads after the acquire fence see what was released before.
TQ_HD void fence_release_device() { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "agent"); }
TQ_HD void fence_acquire_device() { __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "agent"); }
TQ_HD uint32_t atomic_add_device(uint32_t* p, uint32_t v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}

TQ_HD u32x4 load_u32x4(const uint8_t* p) { return *reinterpret_cast<const u32x4*>(p); }
TQ_HD uint32_t load_u32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
TQ_HD uint64_t load_u64(const uint8_t* p) { return *reinterpret_cast<const uint64_t*>(p); }

// The machine scheduler moves nothing across this point (s_sched_barrier 0 emits no code):
// loads above it are all issued before the instructions below it start waiting on any of them.
TQ_HD void sched_barrier() { __builtin_amdgcn_sched_barrier(0); }

TQ_HD uint32_t perm_b32(uint32_t src0, uint32_t src1, uint32_t sel) {
  return __builtin_amdgcn_perm(src0, src1, sel);
}

// FP8 bytes of the target: OCP E4M3 on gfx950, E4M3FNUZ on gfx942 (the same instruction;
// gfx942 adds +0.0f first so that a -0 input can never become 0x80, FNUZ's NaN).
TQ_HD uint32_t pack_e4m3x4(float a, float b, float c, float d) {
#if TQ_GFX942
  int w = __builtin_amdgcn_cvt_pk_fp8_f32(a + 0.0f, b + 0.0f, 0, false);
  w = __builtin_amdgcn_cvt_pk_fp8_f32(c + 0.0f, d + 0.0f, w, true);
  return uint32_t(w);
#elif TQ_GFX950
  int w = __builtin_amdgcn_cvt_pk_fp8_f32(a, b, 0, false);
  w = __builtin_amdgcn_cvt_pk_fp8_f32(c, d, w, true);
  return uint32_t(w);
#else
  __builtin_trap();
#endif
}

TQ_HD void unpack_e4m3x4(uint32_t w, float out[4]) {
#if TQ_GFX950 || TQ_GFX942
  out[0] = __builtin_amdgcn_cvt_f32_fp8(int(w), 0);
  out[1] = __builtin_amdgcn_cvt_f32_fp8(int(w), 1);
  out[2] = __builtin_amdgcn_cvt_f32_fp8(int(w), 2);
  out[3] = __builtin_amdgcn_cvt_f32_fp8(int(w), 3);
#else
  __builtin_trap();
#endif
}

// ds_read_b64_tr_b4 / _b8 (gfx950): in each group of 16 lanes, the 16 lanes' 8-byte chunks
// read as a matrix and transposed: tr4 gives lane m of the group nibble m of every chunk (nibble
// k of the result from the group's lane k); tr8 gives lane m byte m % 8 of the chunks of the
// group's lanes 2 k + m / 8 (result byte k). CDNA4 ISA, LDS transpose loads.
typedef int i32x2 __attribute__((vector_size(8)));
TQ_HD uint64_t lds_read_tr4_b64(const uint8_t* p) {
#if TQ_GFX950
  const i32x2 v = __builtin_amdgcn_ds_read_tr4_b64_v2i32(
      (__attribute__((address_space(3))) i32x2*)(p));
  return uint64_t(uint32_t(v[0])) | uint64_t(uint32_t(v[1])) << 32;
#else
  __builtin_trap();
#endif
}
TQ_HD uint64_t lds_read_tr8_b64(const uint8_t* p) {
#if TQ_GFX950
  const i32x2 v = __builtin_amdgcn_ds_read_tr8_b64_v2i32(
      (__attribute__((address_space(3))) i32x2*)(p));
  return uint64_t(uint32_t(v[0])) | uint64_t(uint32_t(v[1])) << 32;
#else
  __builtin_trap();
#endif
}

// v_cvt_scalef32_pk_fp8_f32 / v_cvt_scalef32_pk_f32_fp8 (gfx950): the scale operand is a float
// whose exponent field alone counts (the E8M0 byte e8 in bits 23..30); the conversion to E4M3
// divides by 2^(e8 - 127), the conversion back multiplies. CDNA4 ISA.
typedef short i16x2 __attribute__((vector_size(4)));
TQ_HD uint32_t cvt_scaled_pk_e4m3(float a, float b, int e8, uint32_t old, bool hi) {
#if TQ_GFX950
  const float sc = __builtin_bit_cast(float, uint32_t(e8) << 23);
  const i16x2 r = hi ? __builtin_amdgcn_cvt_scalef32_pk_fp8_f32(__builtin_bit_cast(i16x2, old), a, b, sc, true)
                     : __builtin_amdgcn_cvt_scalef32_pk_fp8_f32(__builtin_bit_cast(i16x2, old), a, b, sc, false);
  return __builtin_bit_cast(uint32_t, r);
#else
  __builtin_trap();
#endif
}
TQ_HD void cvt_scaled_pk_f32_e4m3(uint32_t src, int e8, bool hi, f32x2& out) {
#if TQ_GFX950
  typedef float f32x2v __attribute__((ext_vector_type(2)));
  const float sc = __builtin_bit_cast(float, uint32_t(e8) << 23);
  const f32x2v r = hi ? __builtin_amdgcn_cvt_scalef32_pk_f32_fp8(src, sc, true)
                      : __builtin_amdgcn_cvt_scalef32_pk_f32_fp8(src, sc, false);
  out = f32x2{r.x, r.y};
#else
  __builtin_trap();
#endif
}

TQ_HD float exp2_f32(float x) { return __builtin_exp2f(x); }
// v_exp_f32 alone (exp2_f32 adds the denormal range fix-up around it): the inputs here are
// differences x - max <= 0, whose results below 2^-126 may flush to 0 without harm.
TQ_HD float exp2_fast(float x) { return __builtin_amdgcn_exp2f(x); }
TQ_HD float log2_f32(float x) { return __builtin_log2f(x); }
TQ_HD float ldexp_f32(float x, int e) { return __builtin_ldexpf(x, e); }
TQ_HD float floor_f32(float x) { return __builtin_floorf(x); }
TQ_HD float ceil_f32(float x) { return __builtin_ceilf(x); }
TQ_HD float fmax_f32(float a, float b) { return __builtin_fmaxf(a, b); }
TQ_HD float fabs_f32(float x) { return __builtin_fabsf(x); }
TQ_HD int frexp_exp_f32(float x) { int e; __builtin_frexpf(x, &e); return e; }

}  // namespace tq

#endif

namespace tq {

// v_mfma_f32_16x16x32_fp8_fp8 on gfx942 (the only caller: the gfx942 LUT path). No scale
// operand; FP8 is E4M3FNUZ there. Lane l supplies 8 bytes of row (A) / column (B) l % 16,
// K [8 (l / 16), 8 (l / 16) + 8), byte j = K 8 (l / 16) + j; the accumulator is laid out as
// the 16x16x128 one: element i is D[row 4 (l / 16) + i][column l % 16]. Builtin (clang-22):
// v4f32 (i64 a, i64 b, v4f32 c, cbsz, abid, blgp), all three immediates 0 here.
TQ_HD f32x4 mfma_16x16x32_fp8_fnuz(uint64_t a, uint64_t b, f32x4 c) {
#if defined(TQ_HOST_SIM)
  return sim::mfma_16x16x32_fp8_fnuz(a, b, c);
#elif TQ_GFX942
  return __builtin_amdgcn_mfma_f32_16x16x32_fp8_fp8(static_cast<long>(a), static_cast<long>(b), c,
                                                    0, 0, 0);
#else
  __builtin_trap();
#endif
}

}  // namespace tq
