// What the cuda backend's attention kernels share (torch-free): the key formats' row layout and
// decode, the accuracy transforms applied to Q and O, the shared-memory layouts, the softmax and
// merge helpers, the multi-token row-tile search, and the launch helpers (shared-memory
// attributes, programmatic dependent launch).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <utility>

#include "attention_params.cuh"
#include "fp4_common.cuh"
#include "limits.cuh"
#include "shared_state.cuh"
#include "tuning.cuh"

namespace turboquant {
namespace cuda_fp4 {


// P's fp16 scale leaves room for the lazy-rescaling slack (tuning.cuh RESCALE_SLACK)
#define TQ_SLACK (tuning::RESCALE_SLACK)
// power of two folded out of the decoded values (fp4x8_to_f16hi8: value * 2^-14)
#define TQ_DEC_EXP 14

// ---- key formats: FP4 (E2M1 codes, D/2 bytes per row) or E4M3 (K8V4, D bytes per row) ----
// Values are FP4 in both; kE4m3 is a template parameter of every attention kernel.
template <int D, bool kE4m3> struct KeyRow {
  static constexpr int BYTES = kE4m3 ? D : D / 2;      // bytes of one key row
  static constexpr int WORDS8 = kE4m3 ? 2 : 1;         // 32-bit words holding 8 elements
  static constexpr int DEC_EXP = kE4m3 ? 8 : TQ_DEC_EXP;  // decoded value = code value * 2^-DEC_EXP
};
// E4M3 bytes placed in the high byte of each fp16 half -> the fp16 of the E4M3 value times 2^-8:
// the sign stays at bit 15, the 7 magnitude bits move to bits 13..7 (exponent bias 7 -> 15, the
// E4M3 subnormals onto fp16 subnormals, exactly). A NaN byte never reaches a kernel (a group
// with NaN or Inf is stored as zero bytes with scale 255).
__device__ __forceinline__ uint32_t e4m3hi_to_f16x2(uint32_t t) {
  return (t & 0x80008000u) | ((t >> 1) & 0x3f803f80u);
}
// 8 key elements e0..e7 (one FP4 word, or two E4M3 words) -> 4 fp16x2 MMA fragment words
// (e0,e2) (e4,e6) (e1,e3) (e5,e7): 11 integer ops for FP4, 12 for E4M3.
template <bool kE4m3>
__device__ __forceinline__ void decode_key8(const uint32_t* w, uint32_t (&h)[4]) {
  if constexpr (kE4m3) {
    h[0] = e4m3hi_to_f16x2(prmt(w[0], 0, 0x2404u));  // bytes e0, e2 -> high bytes
    h[1] = e4m3hi_to_f16x2(prmt(w[1], 0, 0x2404u));
    h[2] = e4m3hi_to_f16x2(prmt(w[0], 0, 0x3414u));  // bytes e1, e3
    h[3] = e4m3hi_to_f16x2(prmt(w[1], 0, 0x3414u));
  } else {
    uint32_t lo, hi;
    fp4x8_to_f16hi8(w[0], lo, hi);
    f16hi4_to_f16x2x2(lo, h[0], h[1]);
    f16hi4_to_f16x2x2(hi, h[2], h[3]);
  }
}
// Key rows in shared memory: 16-byte chunk c of row r is stored at chunk k_chunk(r, c). Lane
// 4g + t reads the t-th quarter of rows g and g+8 (KROW/4 bytes, in 16-byte loads for
// KROW >= 64; an 8-lane phase covers rows g, g+1 x t = 0..3):
//   KROW <= 64: rows of 32 / 64 bytes: the phase's 128 bytes are distinct banks as stored.
//   KROW 128 (8 chunks, all banks): odd rows swap chunk pairs, so rows g, g+1 split the banks.
//   KROW 256 (16 chunks): also XOR 2 into the upper 8 chunks: load i of lane t reads chunk
//     4t + i, whose bank groups i, 4 + i, i ^ 2, (4 + i) ^ 2 (and ^ 1 on odd rows) are distinct.
template <int KROW> __host__ __device__ __forceinline__ constexpr int k_chunk(int r, int c) {
  return KROW == 128 ? (c ^ (r & 1)) : KROW == 256 ? (c ^ (r & 1) ^ (((c >> 3) & 1) << 1)) : c;
}
// The t-th quarter of a key row (row index r, for the swizzle) as KROW/16 words.
template <int KROW>
__device__ __forceinline__ void load_key_quarter(const uint8_t* row, int r, int t, uint32_t (&w)[KROW / 16]) {
  if constexpr (KROW == 32) {
    const uint2 a = *reinterpret_cast<const uint2*>(row + t * 8);
    w[0] = a.x; w[1] = a.y;
  } else {
    constexpr int N = KROW / 64;  // 16-byte chunks per quarter
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint4 a = *reinterpret_cast<const uint4*>(row + k_chunk<KROW>(r, N * t + i) * 16);
      w[4 * i] = a.x; w[4 * i + 1] = a.y; w[4 * i + 2] = a.z; w[4 * i + 3] = a.w;
    }
  }
}
// head-dim element (within a thread's 8) -> n-tile slot of the P.V product: the decode
// produces elements in the order 0,2,4,6,1,3,5,7
__host__ __device__ constexpr int pv_slot(int jj) {
  return 8 * (jj >> 3) + ((jj & 1) ? 4 + ((jj & 7) >> 1) : ((jj & 7) >> 1));
}

// ---- accuracy transforms (turboquant/rotation.py, turboquant/smoothing.py) ---------------

// Whether the prologue computes scale * q.m (q.m: the original query and the key center). With
// key smoothing the kernels' logits lack it (softmax does not depend on it), so the logits under
// a soft cap need it, and without a cap the log-sum-exp output and learned sinks do: both are
// defined on the true logits (only in the kStates instantiations, see the general kernel).
template <bool kStates>
__device__ __forceinline__ bool needs_q_dot_center(const AttnParams& p) {
  return p.seq_state != nullptr && (p.soft_cap > 0.f || (kStates && (p.lse != nullptr || p.sinks != nullptr)));
}

// The slot of sequence s's state record (0 without records or with the layer's one record;
// read once, early in the prologue).
__device__ __forceinline__ int state_slot(const AttnParams& p, int s) {
  return p.state_ids != nullptr ? __ldg(p.state_ids + s) : 0;
}

// ---- the sink's rows -----------------------------------------------------------------------
// With per-sequence records they are rows 2, 3 of the sequence's record. With the layer's sink
// table (p.sink_tags, turboquant/shared_state.py) the CTA that merges the sink finds them as
// tq_shared_records_kernel finds a record's (shared_state.cuh): the entry whose tag equals the
// fingerprint of block 0, slot 0's bytes, else position 0 decoded from those bytes (NaN rows
// when block 0 is no block of the cache). sink_ref says where they are, in three round trips of
// the prologue (the block id, the bytes, the tag), and a kernel keeps that in place of its
// slot (every sequence reads the layer's record, slot 0): the prologue's Q chunk and the
// epilogue read the sink's elements from there (sink_elements). The warp-MMA decode kernel
// finds it after its first KV copies are issued; the SM90a FP8 decode kernel fingerprints its
// first step's ring copy of position 0 and compares the tags in its epilogue, where it also
// forms q'.k0'; the general and prefill kernels read records (reads_sink_table,
// attention_launch.cuh).
// With the table, a slot where the CTA merges the sink: a table entry (>= 0), SINK_NAN, or
// -2 - blk: decoded from block blk
constexpr int SINK_NAN = -2147483647 - 1;

// The fingerprint of block blk, slot 0, kv head kvh (shared_fingerprint's, for the attention
// kernels' one scale per (token, head) and 4-byte aligned rows: the key row's words, the value
// row's, then the two scale bytes as one word), by a whole warp.
template <int D>
__device__ __forceinline__ int64_t sink_fingerprint(const AttnParams& p, int blk, int kvh) {
  constexpr int N = (D + D / 2 + 4 + 127) / 128;  // words per lane at most (E4M3 keys)
  const int kw = p.key_e4m3 ? D / 4 : D / 8, vw = kw + D / 8;  // key words, key + value words
  const int lane = threadIdx.x & 31;
  const uint32_t* krow = reinterpret_cast<const uint32_t*>(p.key_cache + blk * p.kc_stride_blk + kvh * p.kc_stride_head);
  const uint32_t* vrow = reinterpret_cast<const uint32_t*>(p.value_cache + blk * p.vc_stride_blk + kvh * p.vc_stride_head);
  const int64_t sidx = ((int64_t)blk << p.log2_block_size) * p.num_kv_heads + kvh;
  uint32_t w[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int k = lane + 32 * i;
    w[i] = k < kw ? __ldg(krow + k)
           : k < vw ? __ldg(vrow + (k - kw))
           : k == vw ? (uint32_t)__ldg(p.key_scales + sidx) | (uint32_t)__ldg(p.value_scales + sidx) << 8 : 0u;
  }
  return fingerprint_mix(w, vw + 1);
}

// The slot for block blk >= 0 whose slot 0 has fingerprint tag, the table's entry for it holding
// entry_tag: that entry where the tags match, else -2 - blk (position 0 decoded from the block).
__device__ __forceinline__ int sink_slot(int64_t tag, int64_t entry_tag, int entry, int blk) {
  return entry_tag == tag ? entry : -2 - blk;
}

// The CTA's slot from here on: with the table, where sequence s's sink rows for kv head kvh
// are (here: the CTA's sink_here); else slot. Called by every thread of the CTA (whole warps:
// the fingerprint shuffles).
template <int D>
__device__ __forceinline__ int sink_ref(const AttnParams& p, int s, int kvh, bool here, int slot) {
  if (!here || p.sink_tags == nullptr) return slot;
  const int blk = BlockRow(p, s).id(0);
  const int64_t tag = sink_fingerprint<D>(p, blk < 0 ? 0 : blk, kvh);
  const int entry = (int)sink_entry(tag, p.sink_entries);
  if (blk < 0) return SINK_NAN;
  return sink_slot(tag, __ldg(p.sink_tags + (int64_t)entry * p.num_kv_heads + kvh), entry, blk);
}

// Elements [d0, d0 + N) of the sink's key (kKey) or value row where sref (sink_ref, with the
// table) says: the table entry's bf16, or position 0 of block blk decoded (code x scale, as
// the definition; exact in bf16 either way).
template <int D, int N, bool kKey>
__device__ __forceinline__ void sink_elements(const AttnParams& p, int sref, int kvh, int d0, float (&v)[N]) {
  if (sref >= 0) {
    const uint16_t* src = p.sink_kv + ((int64_t)sref * p.num_kv_heads + kvh) * 2 * D + (kKey ? 0 : D) + d0;
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = bf16_bits_float(__ldg(src + i));
  } else if (sref == SINK_NAN) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = __int_as_float(0x7fc00000);
  } else {
    const int blk = -2 - sref;
    const int64_t sidx = ((int64_t)blk << p.log2_block_size) * p.num_kv_heads + kvh;
    const float scale = e8m0_value(__ldg((kKey ? p.key_scales : p.value_scales) + sidx));
    const uint8_t* row = kKey ? p.key_cache + blk * p.kc_stride_blk + kvh * p.kc_stride_head
                              : p.value_cache + blk * p.vc_stride_blk + kvh * p.vc_stride_head;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int e = d0 + i;
      if (kKey && p.key_e4m3) {
        v[i] = e4m3_value(__ldg(row + e)) * scale;
      } else {
        const uint32_t byte = __ldg(row + e / 2);
        v[i] = e2m1_value((e & 1) ? (byte >> 4) : (byte & 15u)) * scale;
      }
    }
  }
}

// What the transforms need for one thread's 8-element Q chunk [col, col + 8) of kv head kvh:
// lam, the rotation signs and the sink key (each only where used; with the table the record is
// slot 0's and the kernel loads the sink key after sink_ref). Loaded early in the prologue, so
// the latency of the slot -> record chain hides under the first KV copies.
struct QChunk {
  float lam[8], sg[8], sk[8], m[8];  // m: the key center, read only where needs_q_dot_center
  bool bad;  // the slot is outside [0, num_slots): the rows become NaN
};
template <int D, bool kStates>
__device__ __forceinline__ void load_q_chunk(const AttnParams& p, int slot, int kvh, int col, bool sink,
                                             QChunk& c) {
  c.bad = false;
  if (p.seq_state != nullptr) {
    c.bad = slot < 0 || slot >= p.num_slots;
    const float* rec = p.seq_state + ((size_t)(c.bad ? 0 : slot) * p.num_kv_heads + kvh) * STATE_ROWS * D + col;
    load_floats(rec + STATE_SCALE * D, c.lam);
    if (sink && p.sink_tags == nullptr) load_floats(rec + STATE_SINK_K * D, c.sk);
    if (needs_q_dot_center<kStates>(p)) load_floats(rec, c.m);
  }
  if (p.rot_signs != nullptr) load_floats(p.rot_signs + col, c.sg);
}

// The sink value row's N elements at d0 (the epilogue of partition 0): the record's (NaN for a
// bad slot) or, with the table, where the slot (sink_ref) says. kTable: the kernel reads the
// table (reads_sink_table); the others' code holds no table path.
template <int D, bool kTable, int N>
__device__ __forceinline__ void load_sink_value(const AttnParams& p, int slot, int kvh, int d0, float (&v)[N]) {
  if constexpr (kTable) {
    if (p.sink_tags != nullptr) {
      sink_elements<D, N, false>(p, slot, kvh, d0, v);
      return;
    }
  }
  const bool bad = slot < 0 || slot >= p.num_slots;
  load_floats(p.seq_state + ((size_t)(bad ? 0 : slot) * p.num_kv_heads + kvh) * STATE_ROWS * D + STATE_SINK_V * D + d0, v);
  if (bad) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = __int_as_float(0x7fc00000);
  }
}

// The chunk's share of q.m where needs_q_dot_center (else 0): softmax is unchanged by m only
// without a cap, so the capped logit adds q.m back, and so do the lse and learned sinks.
template <bool kStates>
__device__ __forceinline__ float q_dot_center(const AttnParams& p, const QChunk& c, const float (&f)[8]) {
  float dot = 0.f;
  if (needs_q_dot_center<kStates>(p)) {
#pragma unroll
    for (int i = 0; i < 8; ++i) dot += f[i] * c.m[i];
  }
  return dot;
}

// Logits run in the exp2 domain: natural-log units times LOG2E.
constexpr float LOG2E = 1.4426950408889634f;

// 1 / soft_cap, and 1 where no cap is set: the divisor is never 0. The IEEE reciprocal of 0
// (or of a denormal) calls a slow path placed at the kernel's end, and ptxas hoists a step
// loop's `if (cap) ... 1 / cap` above the test, so calls without a cap took that call: an
// instruction-cache miss per warp, 11 % of the SM90a decode kernel's ncu stall samples at 16 x
// 4k (H200; benchmarks/results/2026-11-29-h200-decode-wgmma-fixed-costs.json). The divisor is
// opaque: under a caller's `if (cap)` ptxas knows it is soft_cap and hoisted 1 / soft_cap
// again. Call it outside step loops (inside, the opaque divisor is formed again each step).
__device__ __forceinline__ float soft_cap_reciprocal(const AttnParams& p) {
  return 1.f / __uint_as_float(opaque(__float_as_uint(p.soft_cap > 0.f ? p.soft_cap : 1.f)));
}

// The sink's logit in the exp2 domain from q'.k0' and scale * q.m (0 without a cap).
__device__ __forceinline__ float sink_logit(const AttnParams& p, float q_k0, float qm) {
  const float x = p.scale * q_k0 + qm;
  return (p.soft_cap > 0.f ? p.soft_cap * tanhf(x / p.soft_cap) : x) * LOG2E;
}

// A chunk's share of q'.k0': 8 transformed query elements f, the sink key's k (every kernel's
// sink logit sums it over the row's lanes, row_sum).
__device__ __forceinline__ float sink_dot8(const float (&f)[8], const float (&k)[8]) {
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) dot += f[i] * k[i];
  return dot;
}

// Query transform of the 8 elements f of row chunk c (D/8 lanes per row): q * lam (with a
// record), then rotate (x * s, fwht, * norm). Returns q'.k0' of the chunk (0 without sink).
template <int D>
__device__ __forceinline__ float transform_q8(const AttnParams& p, const QChunk& c, bool sink, float (&f)[8],
                                              int lane) {
  if (p.seq_state != nullptr) {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = c.bad ? __int_as_float(0x7fc00000) : f[i] * c.lam[i];
  }
  if (p.rot_signs != nullptr) {  // uniform: every lane shuffles
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] *= c.sg[i];
    fwht_row<8, D / 8>(f, lane);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] *= p.rot_norm;
  }
  return sink ? sink_dot8(f, c.sk) : 0.f;
}

// The Q-chunk stage both attention kernels share: the thread's 8 query elements (raw, of row
// chunk [col, col + 8)) in fp32, q.m where needs_q_dot_center, the transforms, and the row's
// sink dot and scale * q.m reduced over the row's D/8 lanes; the row's first lane (store_row)
// writes them to sink_dst / qm_dst. sink is CTA-uniform (the reductions shuffle).
template <int D, typename T, bool kStates>
__device__ __forceinline__ void prepare_q8(const AttnParams& p, const QChunk& qc, const uint4& raw, bool sink,
                                           bool store_row, float* sink_dst, float* qm_dst,
                                           float (&qv)[8], int lane) {
#pragma unroll
  for (int i = 0; i < 8; ++i) qv[i] = to_float(reinterpret_cast<const T*>(&raw)[i]);
  const float qm = q_dot_center<kStates>(p, qc, qv);
  const float dot = transform_q8<D>(p, qc, sink, qv, lane);
  if (sink) {
    const float q_k0 = row_sum<D / 8>(dot);
    if (store_row) *sink_dst = q_k0;
  }
  if (needs_q_dot_center<kStates>(p)) {
    const float q_m = row_sum<D / 8>(qm);
    if (store_row) *qm_dst = p.scale * q_m;
  }
}

// Output un-rotation of the N consecutive elements [d0, d0 + N) of a row held by LANES lanes:
// o = fwht(o') * norm * s (turboquant.rotation.unrotate).
template <int N, int LANES>
__device__ __forceinline__ void unrotate_row(const AttnParams& p, float (&o)[N], int d0, int lane) {
  float sg[N];
  load_floats(p.rot_signs + d0, sg);
  fwht_row<N, LANES>(o, lane);
#pragma unroll
  for (int i = 0; i < N; ++i) o[i] = o[i] * p.rot_norm * sg[i];
}


// Per-thread cp.async addresses, the same for every KV tile: thread copies 16-byte chunks
// c = lane + 32i of a tile's K and V (source and ring-slot offsets) and one scale word. Kept in
// shared memory (each thread reads only the entry it wrote) and re-read at each tile issue:
// 4-6 shared loads instead of recomputing ~50 instructions of lane offsets and 64-bit bases,
// which the register allocator (128 registers for 16 warps per SM) would not keep in registers.
template <int NK, int NV>
struct LaneCopy {
  const uint8_t* k_src[NK];  // key_cache + kv-head offset + chunk offset (block 0)
  const uint8_t* v_src[NV];
  const uint8_t* s_src;       // scale byte of token row lane%16 (K: lanes 0-15, V: 16-31)
  uint32_t k_dst[NK], v_dst[NV], s_dst;  // byte offsets inside a ring slot
};

// One ring slot of a warp's cp.async pipeline (both kernels): a 16-token K tile, a V tile and
// 32 scale words.
template <int D, bool kE4m3>
struct KVSlot {
  static constexpr int ROW = D / 2;             // bytes of one V row
  static constexpr int CPR = ROW / 16;          // 16-byte chunks per V row
  static constexpr int KROW = KeyRow<D, kE4m3>::BYTES;  // bytes of one K row (D/2, or D: E4M3)
  static constexpr int KCPR = KROW / 16;
  static constexpr int K_TILE = 16 * KROW;      // bytes of one 16-token K tile
  static constexpr int V_TILE = 16 * ROW;
  static constexpr int STAGE = K_TILE + V_TILE + 128;
  static constexpr int NI_K = 16 * KCPR / 32;   // 16-byte chunks per lane per K tile
  static constexpr int NI_V = 16 * CPR / 32;    // per V tile
};

template <int D, bool kE4m3>
struct AttnLayout : KVSlot<D, kE4m3> {
  using S = KVSlot<D, kE4m3>;
  static constexpr int W = tuning::ATTN_WARPS;
  static constexpr int ST = tuning::AttnStages<D>::value;
  static constexpr int PIPE = W * ST * S::STAGE;
  static constexpr int MROW = D + 8;            // merge row pitch (floats): conflict-free
  static constexpr int MERGE = W * 16 * MROW * 4;  // per-warp O in fp32
  static constexpr int QRAW = 16 * D * 4;       // Q rows in fp32, after the transforms
  // the KV ring and the Q staging area are live together (the first tiles are copied while Q
  // is prepared); the merge buffer reuses both at the end
  static constexpr int OFF_QRAW = PIPE;
  static constexpr int BIG = (PIPE + QRAW) > MERGE ? (PIPE + QRAW) : MERGE;
  static constexpr int QFRAG = (D / 16) * 32 * 16;
  static constexpr int OFF_QFRAG = BIG;
  static constexpr int OFF_M = OFF_QFRAG + QFRAG;
  static constexpr int OFF_L = OFF_M + W * 16 * 4;
  static constexpr int OFF_MISC = OFF_L + W * 16 * 4;
  // Rows of <= 64 bytes: chunk i of a lane is chunk 0 moved by 8*i token rows in global memory
  // and in the ring (logical K rows; V rows), so one address each plus immediates; longer rows
  // keep per-chunk addresses (their logical K rows are not a shift of each other).
  static constexpr bool LINEAR_K = S::KROW <= 64, LINEAR_V = S::ROW <= 64;
  static constexpr int NIO_K = LINEAR_K ? 1 : S::NI_K, NIO_V = LINEAR_V ? 1 : S::NI_V;
  static constexpr int OFF_SINK = OFF_MISC + 16;  // 16 floats: q'.k0' of each row (sink)
  static constexpr int OFF_QM = OFF_SINK + 16 * 4;  // 16 floats: scale * q.m of each row (soft cap)
  static constexpr int OFF_LANE = (OFF_QM + 16 * 4 + 15) / 16 * 16;
  static constexpr int LANE_SZ = (sizeof(LaneCopy<NIO_K, NIO_V>) + 15) / 16 * 16;
  static constexpr int TOTAL = OFF_LANE + W * 32 * LANE_SZ;
  static constexpr bool QREG = D <= tuning::QREG_MAX_D;  // Q fragments live in registers
};

// Shared-memory chunk swizzles (16-byte chunk index XOR), chosen so the per-lane shared loads
// of a warp are bank-conflict free (see the read patterns in the kernel).
// Rows of 64 bytes (FP4 D=128, E4M3 keys D=64): the 16 rows of a tile are copied in the order
// 0,4,1,5,2,6,3,7,8,12,... (8 lanes of a 16-byte store phase write tokens r and r+4, logical K
// rows 2(r&3) and 2(r&3)+1) and V row r (D=128) is stored at row r ^ ((r>>2)&1), so that both
// the cp.async writes and the per-lane reads hit 32 distinct banks.
template <int ROWB> __device__ __forceinline__ int copy_token(int q) {
  return ROWB == 64 ? 8 * (q >> 3) + ((q & 7) >> 1) + 4 * (q & 1) : q;
}
template <int D> __device__ __forceinline__ int v_row(int r) { return D == 128 ? r ^ ((r >> 2) & 1) : r; }
template <int D> __device__ __forceinline__ int v_swz(int row) {
  return D == 128 ? (((row >> 1) & 1) << 1) : (D == 256 ? ((row & 3) << 1) : 0);
}

template <bool B> struct BoolConst { static constexpr bool value = B; };
// f(std::integral_constant<int, i>{}) for i = 0 .. N - 1 (an index that must be a constant)
template <typename F, int... I>
__device__ __forceinline__ void static_for_seq(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_seq(f, std::make_integer_sequence<int, N>{});
}

// ex2.approx.ftz.f32: 2^x, results below 2^-126 flushed to 0 (a probability that small is 0
// after the fp16 rounding of P anyway). The non-ftz form costs 3 more instructions per call
// (a range test and two fix-up multiplies around MUFU.EX2).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
// a * b on two fp16 lanes, rounded to nearest (never contracted into an FMA)
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Folds the sink (logit ls in the exp2 domain, value row v of N elements at d0) into a row's
// merged state (M, Ls, a = O / Ls) as one more key: the two-way log-sum-exp merge.
template <int N>
__device__ __forceinline__ void merge_sink(float ls, const float (&v)[N], float& M, float& Ls, float (&a)[N]) {
  const float M2 = fmaxf(M, ls);
  const float f_old = (M == -INFINITY) ? 0.f : fast_exp2(M - M2), f_s = fast_exp2(ls - M2);
  const float L2 = Ls * f_old + f_s;
  const float inv = 1.f / L2;
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = (a[i] * Ls * f_old + v[i] * f_s) * inv;
  M = M2;
  Ls = L2;
}

// A row's merged state (M, Ls, M in the exp2 domain of the kernel's logits) moved to the true
// logits: without a soft cap, key smoothing's logits lack scale * q.m (qm: 0 unless
// needs_q_dot_center). Partials and whole rows alike, so that partials merge and the learned
// sink and the lse see the true logits. -inf and NaN stay.
__device__ __forceinline__ float true_logit_max(const AttnParams& p, float qm, float M) {
  return p.soft_cap <= 0.f ? M + qm * LOG2E : M;
}

// A whole row's state (M, Ls) joined by the learned sink of `head` (gpt-oss: one more logit,
// no value; none when sinks is nullptr). Returns the factor that turns O / Ls into O / Ls'.
// A row that sees nothing next to a sink of -inf stays (-inf, 0).
__device__ __forceinline__ float add_learned_sink(const AttnParams& p, int head, float& M, float& Ls) {
  if (p.sinks == nullptr) return 1.f;
  const float ls = __ldg(p.sinks + head) * LOG2E;
  const float M2 = fmaxf(M, ls);
  if (M2 == -INFINITY) return 1.f;
  const float f_old = (M == -INFINITY) ? 0.f : fast_exp2(M - M2);
  const float f_s = (ls == -INFINITY) ? 0.f : fast_exp2(ls - M2);
  const float L2 = Ls * f_old + f_s;
  const float k = (Ls == 0.f) ? 0.f : Ls * f_old / L2;  // NaN stays NaN
  M = M2;
  Ls = L2;
  return k;
}

// Natural-log log-sum-exp of a final state (M in the exp2 domain): -inf for Ls = 0, NaN stays.
__device__ __forceinline__ float state_lse(float M, float Ls) {
  return (M + log2f(Ls)) * 0.6931471805599453f;
}

// The lse of a row whose output element o the lse's writer holds: NaN where o is (a visible
// token's V scale 255 makes the whole row NaN through P' while its logits, and so M and Ls,
// stay finite; the contract's NaN row has a NaN lse).
__device__ __forceinline__ float row_lse(float M, float Ls, float o) {
  return o == o ? state_lse(M, Ls) : o;
}

// A row complete in one partition (both kernels' epilogues): the learned sink joins its state
// (M, Ls, a = O / Ls, N elements of the row in this thread) and the row's `writer` thread
// stores its lse at lse[row].
template <int N>
__device__ __forceinline__ void finish_whole_row(const AttnParams& p, int head, size_t row, bool writer, float M,
                                                 float Ls, float (&a)[N]) {
  const float k = add_learned_sink(p, head, M, Ls);
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] *= k;
  if (p.lse != nullptr && writer) p.lse[row] = row_lse(M, Ls, a[0]);
}

// The end of a decode kernel's row (query token tok, head), EPL = D / 32 consecutive elements
// a per lane at lane * EPL, merged and normalized (O / Ls, the sink in): with kStates the state
// moved to the true logits (qm: scale * q.m where needs_q_dot_center, else 0) and, for a whole
// row, the learned sink and the lse; then the row, un-rotated, to out, or partition part's
// partial (O / l, m, l) for the reduce pass (which un-rotates the sum).
template <int D, typename T, bool kStates, int EPL>
__device__ __forceinline__ void store_decode_row(const AttnParams& p, int tok, int head, int part, int nparts,
                                                 float qm, float M, float Ls, float (&a)[EPL], int lane) {
  const int d0 = lane * EPL;
  if constexpr (kStates) {
    M = true_logit_max(p, qm, M);
    if (nparts == 1) finish_whole_row<EPL>(p, head, (size_t)tok * p.num_heads + head, lane == 0, M, Ls, a);
  }
  if (p.rot_signs != nullptr && nparts == 1) unrotate_row<EPL, 32>(p, a, d0, lane);
  if (nparts == 1) {
    T* o = reinterpret_cast<T*>(p.out) + tok * p.o_stride_tok + head * p.o_stride_head + d0;
#pragma unroll
    for (int e = 0; e < EPL; ++e) o[e] = from_float<T>(a[e]);
  } else {
    const size_t idx = ((size_t)tok * p.num_heads + head) * nparts + part;
    float* o = p.tmp_out + idx * D + d0;
#pragma unroll
    for (int e = 0; e < EPL; ++e) o[e] = a[e];
    if (lane == 0) p.tmp_ml[idx] = make_float2(M, Ls);
  }
}

// The lse of a constant row of a whole-row launch: a row with nothing visible (mval = -inf) has
// only its learned sink, if any; a NaN row (bad block id) is NaN.
__device__ __forceinline__ float const_row_lse(const AttnParams& p, int head, float mval) {
  if (mval != -INFINITY) return __int_as_float(0x7fc00000);
  return p.sinks != nullptr ? __ldg(p.sinks + head) : -INFINITY;
}

// Element d of a constant row (query token tok, head): with one partition the output (and, with
// kStates, the row's lse at d = 0), else partition part's partial (O, unless the partition is
// empty, mval = -inf: the reduce skips it; (m, l) at d = 0). The kernels' write_const_rows.
template <int D, typename T, bool kStates>
__device__ __forceinline__ void write_const_element(const AttnParams& p, int tok, int head, int d,
                                                    int nparts, int part, float oval, float mval,
                                                    float lval) {
  if (nparts == 1) {
    T* o = reinterpret_cast<T*>(p.out) + tok * p.o_stride_tok + head * p.o_stride_head;
    o[d] = from_float<T>(oval);
    if constexpr (kStates) {
      if (d == 0 && p.lse != nullptr) p.lse[(size_t)tok * p.num_heads + head] = const_row_lse(p, head, mval);
    }
  } else {
    const size_t idx = ((size_t)tok * p.num_heads + head) * nparts + part;
    if (mval != -INFINITY) p.tmp_out[idx * D + d] = oval;
    if (d == 0) p.tmp_ml[idx] = make_float2(mval, lval);
  }
}

// Power of two 2^n as float for n in [-149, 127] (exact; below -149 gives 0).
__device__ __forceinline__ float pow2i(int n) {
  if (n >= -126) return __int_as_float((n + 127) << 23);
  if (n >= -149) return __int_as_float(1 << (n + 149));
  return 0.f;
}

// Largest |x| of the 8 elements of a 16-byte chunk, as float bits (monotonic for |x|).
template <typename T>
__device__ __forceinline__ unsigned amax8_bits(const uint4& v) {
  const T* e = reinterpret_cast<const T*>(&v);
  unsigned m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = max(m, __float_as_uint(fabsf(to_float(e[i]))));
  return m;
}

// Q prescale: e such that the largest |q| (amax_bits: its float bits) times 2^e lies in
// [2^14, 2^15) (fp16 with headroom; 0 for an all-zero or non-finite Q).
__device__ __forceinline__ int prescale_exponent(unsigned amax_bits) {
  if (amax_bits == 0 || amax_bits >= 0x7f800000u) return 0;
  int E;
  frexpf(__uint_as_float(amax_bits), &E);
  return min(max(15 - E, -100), 100);
}
// The same, CTA-wide, from each thread's amax bits. word: a shared word set to 0 before the
// first barrier of the kernel. Two barriers: cta_sync(), every thread of the CTA (__syncthreads
// by default; a named barrier where the CTA's warps reach it from different code, as the
// prefill kernel's producer and consumer warps do).
template <typename Sync>
__device__ __forceinline__ int q_prescale_exponent(unsigned amax_bits, unsigned* word, Sync cta_sync) {
#pragma unroll
  for (int o = 16; o; o >>= 1) amax_bits = max(amax_bits, __shfl_xor_sync(0xffffffffu, amax_bits, o));
  cta_sync();
  if ((threadIdx.x & 31) == 0) atomicMax(word, amax_bits);
  cta_sync();
  return prescale_exponent(*word);
}
__device__ __forceinline__ int q_prescale_exponent(unsigned amax_bits, unsigned* word) {
  return q_prescale_exponent(amax_bits, word, [] { __syncthreads(); });
}

// Merge weights of W per-warp softmax states (m, l) of one row (m[w * stride], l[w * stride]):
// M = the largest m, wt[w] = 2^(m_w - M); returns the merged l. A warp with nothing visible
// (m = -inf) weighs 0, but a NaN l (all its logits NaN) is kept.
template <int W>
__device__ __forceinline__ float merge_weights(const float* m, const float* l, int stride, float (&wt)[W],
                                               float& M) {
  M = -INFINITY;
#pragma unroll
  for (int w = 0; w < W; ++w) M = fmaxf(M, m[w * stride]);
  float Ls = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const float mw = m[w * stride];
    wt[w] = (mw == -INFINITY) ? 0.f : fast_exp2(mw - M);
    Ls += (mw == -INFINITY) ? l[w * stride] * 0.f : wt[w] * l[w * stride];
  }
  return Ls;
}

// sum over w of wt[w] * x[w * stride], skipping warps of weight 0 (their rows may hold 0 * inf)
// but not a NaN weight.
template <int W>
__device__ __forceinline__ float merge_sum(const float (&wt)[W], const float* x, int stride) {
  float v = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w)
    if (wt[w] != 0.f || !(wt[w] == wt[w])) v += wt[w] * x[w * stride];
  return v;
}

// V-scale factor folded into P for scale byte b < 255: 2^(b - VM + 15 - SLACK) (with the
// decode's 2^DEC and 2^-(127 + DEC) applied at the end), 0 below 2^-127; VM is the warp's running
// maximum scale byte, so P' = p * factor <= 2^15 for p <= 2^SLACK.
__device__ __forceinline__ float p_vscale(uint32_t b, int VM) {
  return __int_as_float(max((int)b - VM + 142 - TQ_SLACK, 0) << 23);
}

// N consecutive output elements (N % 8 == 0, 16-byte aligned destination) as 16-byte stores.
template <typename T, int N>
__device__ __forceinline__ void store_row(T* o, const float (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; i += 8) {
    T ov[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) ov[e] = from_float<T>(a[i + e]);
    *reinterpret_cast<uint4*>(o + i) = *reinterpret_cast<uint4*>(ov);
  }
}

// Rescale of a warp's softmax state, rows g and g + 8 of the m16n8 C layout (acc[j][0..1] row
// g, acc[j][2..3] row g + 8; the general and the prefill kernel): to the row maxima m_new (>=
// m_run) and the V-scale maximum VM_new (>= VM).
// rescale_factors: the state's part (m, l, VM), and f, the factors O's rows g, g + 8 take;
// scale_rows: O's part (the prefill kernel's workspace form applies it later, once the
// asynchronous O += P' V that still writes O is done).
__device__ __forceinline__ void rescale_factors(const float (&m_new)[2], int VM_new, float (&m_run)[2],
                                                float (&l_run)[2], int& VM, float (&f)[2]) {
  const float vr = pow2i(VM - VM_new);
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const float alpha = (m_new[rh] == -INFINITY) ? 1.f : fast_exp2(m_run[rh] - m_new[rh]);
    l_run[rh] *= alpha;
    f[rh] = alpha * vr;
    m_run[rh] = m_new[rh];
  }
  VM = VM_new;
}
template <int NJ>
__device__ __forceinline__ void scale_rows(float (&acc)[NJ][4], const float (&f)[2]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    acc[j][0] *= f[0]; acc[j][1] *= f[0]; acc[j][2] *= f[1]; acc[j][3] *= f[1];
  }
}
template <int NJ>
__device__ __forceinline__ void rescale_state(const float (&m_new)[2], int VM_new, float (&m_run)[2], float (&l_run)[2],
                                              int& VM, float (&acc)[NJ][4]) {
  float f[2];
  rescale_factors(m_new, VM_new, m_run, l_run, VM, f);
  scale_rows(acc, f);
}
// The maximum a row's logits are taken relative to (exp2 domain): its running maximum, 0 while
// it has none.
__device__ __forceinline__ float max_offset(float m_run) { return m_run == -INFINITY ? 0.f : m_run; }

// Lazy rescaling (the general kernel): a stale row maximum is kept while the new one m_new
// exceeds it by at most RESCALE_SLACK (exp2 domain), so p <= 2^SLACK relative to it (see
// tuning.cuh); the V-scale maximum VM is kept exact (VM_new). One vote per warp decides. ms:
// the maxima to subtract from the logits (max_offset).
template <int NJ>
__device__ __forceinline__ void lazy_rescale(const float (&m_new)[2], int VM_new, float (&m_run)[2], float (&l_run)[2],
                                             int& VM, float (&acc)[NJ][4], float (&ms)[2]) {
  constexpr float SLACK = (float)tuning::RESCALE_SLACK;
  const bool changed = (m_new[0] > m_run[0] + SLACK) || (m_new[1] > m_run[1] + SLACK) || (VM_new != VM);
  if (__any_sync(0xffffffffu, changed)) rescale_state(m_new, VM_new, m_run, l_run, VM, acc);
  ms[0] = max_offset(m_run[0]);
  ms[1] = max_offset(m_run[1]);
}

// Multi-token queries: row tile `tile` of TR (query token, head) rows (16 here; the decode
// kernel's short multi-token forms use their 8 or 16 columns), numbered base(s) + i with
// base(s) = s + floor(cu[s] * G / TR) (strictly increasing, room for every sequence's tiles).
// Returns its sequence s (a search over cu_query_lens, no host sync) and sets the sequence's
// first query token q0, its token count qn and the tile's index lt within it; -1 for a spare
// tile. Every thread of a warp calls it (a ballot): s is the last sequence with base(s) <= tile
// (0 if none), found by a 32-way search: lane l probes lo + l * step of [lo, hi) and one ballot
// keeps the last probe at or below the tile (base increases, so those probes are a prefix):
// ceil(log32 num_seqs) rounds of one load (2 up to 1024 sequences) where a binary search takes
// log2 num_seqs dependent loads (6 at 64 sequences). Measured (H100, same call, against the
// binary search): 128 x 2 @ 4k 213.1-213.3 vs 220.3 us, 64 x 4 @ 4k 141.5 vs 144.5-144.6,
// 16 x 16 @ 4k (general kernel) 141.3 vs 143.3-143.5.
template <int TR>
__device__ __forceinline__ int find_row_tile(const AttnParams& p, int tile, int& q0, int& qn, int& lt) {
  const int* cu = p.cu_query_lens;
  const int G = p.group_size;
  const int lane = threadIdx.x & 31;
  int lo = 0, hi = p.num_seqs;  // s in [lo, hi)
  while (hi - lo > 1) {
    const int step = (hi - lo + 31) >> 5, idx = lo + lane * step;
    const bool ok = idx < hi && idx + ((long long)max(__ldg(cu + idx), 0) * G) / TR <= tile;
    const unsigned m = __ballot_sync(0xffffffffu, ok);
    lo += m ? (31 - __clz(m)) * step : 0;
    hi = min(hi, lo + step);
  }
  q0 = max(__ldg(cu + lo), 0);
  qn = min(__ldg(cu + lo + 1), p.num_tokens) - q0;
  lt = tile - (lo + (int)(((long long)q0 * G) / TR));
  return (lo >= p.num_seqs || qn <= 0 || lt < 0 || lt * TR >= qn * G) ? -1 : lo;
}

// Dynamic shared memory above 48 KB, and the largest shared-memory carveout so that registers,
// not the L1/shared split, bound the CTAs per SM (the default split allows only 3 CTAs of
// 44 KB on H100).
template <typename Kernel>
cudaError_t set_smem_attributes(Kernel kern, int bytes) {
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
}

// set_smem_attributes once per device: cudaFuncSetAttribute applies to the current device only,
// so a process that drives several GPUs sets it on each. `done`: the caller's per-instantiation
// flags.
constexpr int kMaxDevices = 64;
template <typename Kernel>
cudaError_t set_smem_attributes_once(Kernel kern, int bytes, bool (&done)[kMaxDevices]) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool tracked = dev >= 0 && dev < kMaxDevices;
  if (tracked && done[dev]) return cudaSuccess;
  e = set_smem_attributes(kern, bytes);
  if (e == cudaSuccess && tracked) done[dev] = true;
  return e;
}

// kern(p) on grid (grid_x * num_kv_heads, num_partitions) of 32 * warps threads and smem bytes
// of dynamic shared memory, its attributes set once per device (`attr_set`: the caller's
// per-instantiation flags), as a programmatic dependent launch.
template <typename Kernel>
cudaError_t launch_kv_grid(Kernel kern, bool (&attr_set)[kMaxDevices], int grid_x, int warps, int smem,
                           const AttnParams& p, cudaStream_t stream) {
  const cudaError_t e = set_smem_attributes_once(kern, smem, attr_set);
  if (e != cudaSuccess) return e;
  return launch_programmatic(kern, dim3(grid_x * p.num_kv_heads, p.num_partitions), dim3(32 * warps), smem, stream,
                             p);
}

}  // namespace cuda_fp4
}  // namespace turboquant
