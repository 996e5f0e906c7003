// Host lane simulation of the AMD FP4 paged-attention kernels.
//
// The kernel sources (csrc_hip/tq_fp4_gfx950_attention.cuh, and with -DTQ_SIM_GFX942
// tq_fp4_paged_attention.cuh) are compiled unchanged for the host with -DTQ_HOST_SIM. Each
// thread of a workgroup runs the kernel as a cooperative fiber (ucontext); barriers, wave
// shuffles, the transposing LDS reads and the MFMA are rendezvous points where every lane of
// the wave (or workgroup) has arrived before any continues. The MFMA is replaced by a software
// model of v_mfma_scale_f32_16x16x128_f8f6f4 written from the instruction's documented operand
// layouts (not from the kernel's layout helpers), so a lane that loads the wrong bytes or scale
// gives a wrong result here; ds_read_b64_tr_b4 / _b8 likewise from the CDNA4 ISA's description.
//
// Built with -DTQ_SIM_GFX942 it simulates the gfx942 (MI300X) build instead: its LUT kernel
// with FP8 = E4M3FNUZ (table, conversions) on v_mfma_f32_16x16x32_fp8_fp8, modelled here from
// that instruction's documented layout (8 bytes per lane, K 8 (l / 16) + j, FNUZ decode, no
// scale operand).
//
// Built as a shared library by tests/test_aiter_lane_sim.py and driven through ctypes.
#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "../tq_fp4_gfx950_attention.cuh"
#include "../tq_fp4_paged_attention.cuh"

namespace {

constexpr int kStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
};

struct Sim {
  int nthreads = 0;
  int block[3] = {0, 0, 0};
  int current = -1;
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  long progress = 0;
  // Rendezvous: per scope (0..3 = waves, 4 = workgroup), arrivals and a generation count.
  int arrived[5] = {0, 0, 0, 0, 0};
  long generation[5] = {0, 0, 0, 0, 0};
  float shfl_slot[tq::kThreads];
  struct MfmaSlot { int fmt_a, fmt_b; tq::i32x8 a, b; int sa, sb; } mfma_slot[tq::kThreads];
  struct Mfma8Slot { uint64_t a, b; } mfma8_slot[tq::kThreads];  // v_mfma_f32_16x16x32_fp8_fp8
  const unsigned char* tr_slot[tq::kThreads];  // ds_read_b64_tr_b*: each lane's LDS address
  std::vector<unsigned char> lds;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
};

Sim* g_sim = nullptr;

// Order in which the scheduler resumes the fibers in each round: 0 ascending thread id,
// 1 descending, 2 a fresh pseudo-random permutation per round. A read of LDS (or of any
// shared state) that is not separated from the write by a barrier sees different values
// under different orders, so equal results across orders are evidence of no such race.
int g_schedule = 0;
unsigned g_seed = 1;

void fiber_entry() {
  g_sim->body(g_sim->body_arg);
  g_sim->fibers[g_sim->current].done = true;
  ++g_sim->progress;
  swapcontext(&g_sim->fibers[g_sim->current].ctx, &g_sim->scheduler);
}

void yield() { swapcontext(&g_sim->fibers[g_sim->current].ctx, &g_sim->scheduler); }

// Wait until every member of the scope (its wave, or the workgroup) has arrived.
void rendezvous(int scope) {
  const int members = scope == 4 ? g_sim->nthreads : tq::kWaveSize;
  const long gen = g_sim->generation[scope];
  ++g_sim->progress;
  if (++g_sim->arrived[scope] == members) {
    g_sim->arrived[scope] = 0;
    ++g_sim->generation[scope];
    return;
  }
  while (g_sim->generation[scope] == gen) yield();
}

// Runs body(arg) as one workgroup of 256 fibers. Returns 0, or -1 on a barrier deadlock
// (a barrier or MFMA reached by some lanes of its scope only).
int run_workgroup(int bx, int by, int bz, void (*body)(void*), void* arg,
                  int nthreads = tq::kThreads) {
  Sim& s = *g_sim;
  s.nthreads = nthreads;
  s.block[0] = bx; s.block[1] = by; s.block[2] = bz;
  s.body = body; s.body_arg = arg;
  for (int i = 0; i < 5; ++i) s.arrived[i] = 0;
  std::fill(s.lds.begin(), s.lds.end(), 0xA5);  // LDS starts as garbage
  s.fibers.assign(s.nthreads, Fiber());
  for (int t = 0; t < s.nthreads; ++t) {
    Fiber& f = s.fibers[t];
    f.stack.resize(kStackBytes);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  std::vector<int> order(s.nthreads);
  for (int t = 0; t < s.nthreads; ++t) order[t] = g_schedule == 1 ? s.nthreads - 1 - t : t;
  for (;;) {
    bool all_done = true;
    const long before = s.progress;
    if (g_schedule == 2)
      for (int i = s.nthreads - 1; i > 0; --i) {
        g_seed = g_seed * 1103515245u + 12345u;
        std::swap(order[i], order[(g_seed >> 8) % unsigned(i + 1)]);
      }
    for (int t : order) {
      if (s.fibers[t].done) continue;
      all_done = false;
      s.current = t;
      swapcontext(&s.scheduler, &s.fibers[t].ctx);
    }
    if (all_done) return 0;
    // A round in which some generation moved counts as progress too.
    if (s.progress == before) {
      bool waiting_on_partial = false;
      for (int i = 0; i < 5; ++i) waiting_on_partial |= s.arrived[i] != 0;
      if (waiting_on_partial) return -1;
    }
  }
}

// Software model of one E4M3 (OCP) or E2M1 value.
double e4m3_value(unsigned b) {
  const int sign = (b >> 7) & 1, exp = (b >> 3) & 15, man = b & 7;
  if (exp == 15 && man == 7) return NAN;
  const double mag = exp == 0 ? std::ldexp(man, -9) : std::ldexp(8 + man, exp - 10);
  return sign ? -mag : mag;
}
double e2m1_value(unsigned c) {
  static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (c & 8) ? -mag[c & 7] : mag[c & 7];
}
// E4M3FNUZ (gfx942): bias 8, no infinities, no -0, 0x80 the only NaN.
double e4m3fnuz_value(unsigned b) {
  if (b == 0x80) return NAN;
  const int sign = (b >> 7) & 1, exp = (b >> 3) & 15, man = b & 7;
  const double mag = exp == 0 ? std::ldexp(man, -10) : std::ldexp(8 + man, exp - 11);
  return sign ? -mag : mag;
}
double e8m0_value(int b) { return (b & 0xFF) == 255 ? NAN : std::ldexp(1.0, (b & 0xFF) - 127); }

unsigned byte_of(const tq::i32x8& v, int j) { return (unsigned(v[j / 4]) >> (8 * (j % 4))) & 0xFF; }

// Element k (0..127) of row/column r of an operand, from the 64 lanes' registers:
// format 4 (E2M1): lane r + 16 * (k / 32), byte (k % 32) / 2, low nibble for even k;
// format 0 (E4M3): lane r + 16 * ((k % 64) / 16), byte k % 16 (+ 16 for k >= 64).
double operand_element(int fmt, const Sim::MfmaSlot* wave, bool is_a, int r, int k) {
  if (fmt == 4) {
    const int lane = r + 16 * (k / 32);
    const tq::i32x8& v = is_a ? wave[lane].a : wave[lane].b;
    const unsigned byte = byte_of(v, (k % 32) / 2);
    return e2m1_value((k & 1) ? byte >> 4 : byte & 15);
  }
  const int lane = r + 16 * ((k % 64) / 16);
  const tq::i32x8& v = is_a ? wave[lane].a : wave[lane].b;
  return e4m3_value(byte_of(v, k % 16 + (k >= 64 ? 16 : 0)));
}

}  // namespace

namespace tq {
namespace sim {

int thread_id() { return g_sim->current; }
int block_id(int dim) { return g_sim->block[dim]; }
void block_barrier() { rendezvous(4); }
void* lds(unsigned long bytes) {
  if (g_sim->lds.size() < bytes) {
    std::fprintf(stderr, "lane sim: LDS request of %lu bytes over the simulated %zu\n", bytes,
                 g_sim->lds.size());
    std::abort();
  }
  return g_sim->lds.data();
}

float shfl_xor(float v, int mask) {
  const int t = g_sim->current, wave = t / kWaveSize, lane = t % kWaveSize;
  g_sim->shfl_slot[t] = v;
  rendezvous(wave);
  const float r = g_sim->shfl_slot[wave * kWaveSize + (lane ^ mask)];
  rendezvous(wave);
  return r;
}

// v_mfma_scale_f32_16x16x128_f8f6f4, op_sel 0: D = C + sum over K blocks b of 32 of
// scale_a(row, b) * scale_b(col, b) * sum_{k in b} A[row][k] * B[col][k]; the scale of
// (row r, block b) is byte 0 of lane r + 16 b's scale operand. Lane l returns
// D[4 * (l / 16) + i][l % 16], i = 0..3.
f32x4 mfma_scale_16x16x128(int fmt_a, int fmt_b, i32x8 a, i32x8 b, f32x4 c, int scale_a,
                           int scale_b) {
  const int t = g_sim->current, wave = t / kWaveSize, lane = t % kWaveSize;
  g_sim->mfma_slot[t] = {fmt_a, fmt_b, a, b, scale_a, scale_b};
  rendezvous(wave);
  const Sim::MfmaSlot* w = &g_sim->mfma_slot[wave * kWaveSize];
  for (int l = 0; l < kWaveSize; ++l)
    if (w[l].fmt_a != fmt_a || w[l].fmt_b != fmt_b) {
      std::fprintf(stderr, "lane sim: lanes of one MFMA disagree on the operand formats\n");
      std::abort();
    }
  f32x4 d;
  const int col = lane % 16;
  for (int i = 0; i < 4; ++i) {
    const int row = 4 * (lane / 16) + i;
    double sum = 0.0;
    for (int blk = 0; blk < 4; ++blk) {
      double dot = 0.0;
      for (int k = 32 * blk; k < 32 * blk + 32; ++k)
        dot += operand_element(fmt_a, w, true, row, k) * operand_element(fmt_b, w, false, col, k);
      sum += e8m0_value(w[row + 16 * blk].sa) * e8m0_value(w[col + 16 * blk].sb) * dot;
    }
    d[i] = float(double(c[i]) + sum);
  }
  rendezvous(wave);
  return d;
}

// v_readfirstlane_b32: lane 0's value of the wave, in every lane.
uint32_t first_lane(uint32_t v) {
  const int t = g_sim->current, wave = t / kWaveSize;
  g_sim->shfl_slot[t] = __builtin_bit_cast(float, v);
  rendezvous(wave);
  const uint32_t r = __builtin_bit_cast(uint32_t, g_sim->shfl_slot[wave * kWaveSize]);
  rendezvous(wave);
  return r;
}

// ds_read_b64_tr_b4 / ds_read_b64_tr_b8 (gfx950), from the CDNA4 ISA's description of the LDS
// transpose loads: each lane reads the 8 bytes at its own address; within each group of 16
// lanes the 16 chunks, concatenated in lane order, are read as N rows x 16 columns of
// N = 64 / bits elements, and lane m of the group receives column m from top to bottom:
// element k of lane m = element (16 k + m) % N of the chunk of the group's lane (16 k + m) / N.
// tr4 (N = 16): nibble k of lane m = nibble m of lane k's chunk; tr8 (N = 8): byte k of lane m =
// byte m % 8 of lane 2 k + m / 8's chunk. A nibble n of a chunk is byte n / 2, low nibble first.
uint64_t lds_read_tr_b64(const void* p, int bits) {
  const int t = g_sim->current, wave = t / kWaveSize, lane = t % kWaveSize;
  const unsigned char* lds = g_sim->lds.data();
  const unsigned char* a = static_cast<const unsigned char*>(p);
  if (a < lds || a + 8 > lds + g_sim->lds.size() || (a - lds) % 8 != 0) {
    std::fprintf(stderr, "lane sim: ds_read_b64_tr_b%d address outside LDS or not 8-byte aligned\n", bits);
    std::abort();
  }
  g_sim->tr_slot[t] = a;
  rendezvous(wave);
  const int n = 64 / bits, group = wave * kWaveSize + 16 * (lane / 16), m = lane % 16;
  uint64_t r = 0;
  for (int k = 0; k < n; ++k) {
    const int src = (16 * k + m) / n, el = (16 * k + m) % n;
    const unsigned char* c = g_sim->tr_slot[group + src];
    const uint64_t v = bits == 4 ? uint64_t((c[el / 2] >> (4 * (el % 2))) & 15)
                                 : uint64_t(c[el]);
    r |= v << (bits * k);
  }
  rendezvous(wave);
  return r;
}

// v_mfma_f32_16x16x32_fp8_fp8 (gfx942, wave64, both operands E4M3FNUZ, no scale):
// D = C + A B with A 16 x 32 and B 32 x 16. Lane l supplies 8 bytes of row (A) / column (B)
// l % 16 for K 8 (l / 16) .. + 7, byte j of the 64-bit operand = K 8 (l / 16) + j.
// Lane l returns D[4 * (l / 16) + i][l % 16], i = 0..3 (the 16x16 accumulator layout).
f32x4 mfma_16x16x32_fp8_fnuz(uint64_t a, uint64_t b, f32x4 c) {
  const int t = g_sim->current, wave = t / kWaveSize, lane = t % kWaveSize;
  g_sim->mfma8_slot[t] = {a, b};
  rendezvous(wave);
  const Sim::Mfma8Slot* w = &g_sim->mfma8_slot[wave * kWaveSize];
  auto elem = [&](bool is_a, int rc, int k) {
    const uint64_t v = is_a ? w[rc + 16 * (k / 8)].a : w[rc + 16 * (k / 8)].b;
    return e4m3fnuz_value(unsigned(v >> (8 * (k % 8))) & 0xFF);
  };
  f32x4 d;
  const int col = lane % 16;
  for (int i = 0; i < 4; ++i) {
    const int row = 4 * (lane / 16) + i;
    double dot = 0.0;
    for (int k = 0; k < 32; ++k) dot += elem(true, row, k) * elem(false, col, k);
    d[i] = float(double(c[i]) + dot);
  }
  rendezvous(wave);
  return d;
}

}  // namespace sim
}  // namespace tq

namespace {

struct Args {
  const uint16_t* query;
  const uint8_t *key_cache, *value_cache, *key_scales, *value_scales;
  const int *block_tables, *seq_lens, *cu_query_lens;  // cu_query_lens nullptr: decode
  float *exp_sums, *max_logits;
  uint16_t *tmp_out, *out;
  float scale, soft_cap;
  int sliding_window, num_seqs, num_tokens, num_kv_heads, max_blocks_per_seq, max_num_partitions,
      q_stride;
  long kv_block_stride;  // value_cache's byte strides (the key cache's: times 2 with E4M3 keys)
  int kv_head_stride, kv_seq_stride;
  const float *rotation_signs, *seq_state;  // nullptr: transform off
  const int* state_ids;
  int num_slots, sink;
  const float* sinks;  // [num_heads] learned sink logits, or nullptr
  float* lse;          // [num_tokens, num_heads], or nullptr
  int num_blocks;      // the caches' first dimension
};

#if TQ_GFX942
// The gfx942 kernel (tq_fp4_paged_attention.cuh): partition kernel, then its reduce.
template <class Scalar, int HEAD, int BS, int GQA, bool MULTI>
void partition_body(void* p) {
  const Args& a = *static_cast<const Args*>(p);
  tq::tq_fp4_pa_partition_kernel<Scalar, HEAD, BS, GQA, MULTI>(
      a.query, a.key_cache, a.value_cache, a.key_scales, a.value_scales, a.block_tables,
      a.seq_lens, a.cu_query_lens, a.exp_sums, a.max_logits, a.tmp_out, a.scale, a.soft_cap,
      a.sliding_window, a.max_blocks_per_seq, a.max_num_partitions, a.num_seqs, a.num_tokens,
      a.num_kv_heads, a.q_stride, a.num_blocks, a.kv_block_stride, a.kv_head_stride,
      a.kv_seq_stride, a.rotation_signs, a.seq_state, a.state_ids, a.num_slots, a.sink,
      a.sinks != nullptr || a.lse != nullptr);
}

// The grid of the launcher (pa_fp4.cpp.jinja), one workgroup at a time, then the reduce.
template <class Scalar, int HEAD, int BS, int GQA, bool MULTI>
int run_all(const Args& a) {
  const int row_tiles = MULTI ? a.num_seqs + (a.num_tokens * GQA + tq::kTile - 1) / tq::kTile
                              : a.num_seqs;
  for (int tile = 0; tile < row_tiles; ++tile)
    for (int part = 0; part < a.max_num_partitions; ++part)
      for (int kvh = 0; kvh < a.num_kv_heads; ++kvh)
        if (run_workgroup(tile, part, kvh, partition_body<Scalar, HEAD, BS, GQA, MULTI>,
                          const_cast<Args*>(&a)) != 0)
          return -1;
  const int num_heads = a.num_kv_heads * GQA;
  for (int token = 0; token < a.num_tokens; ++token) {
    const tq::PartRange parts = tq::token_partitions<MULTI>(
        token, a.seq_lens, a.cu_query_lens, a.num_seqs, a.sliding_window, a.max_num_partitions);
    for (int h = 0; h < num_heads; ++h)
      for (int d = 0; d < HEAD; ++d)
        tq::reduce_one<Scalar, HEAD>(int64_t(token) * num_heads + h, d, parts,
                                     a.max_num_partitions, a.exp_sums, a.max_logits, a.tmp_out,
                                     a.sinks != nullptr ? a.sinks[h] : -INFINITY, a.out, a.lse);
  }
  return 0;
}
#endif


// The gfx950 kernel (tq_fp4_gfx950_attention.cuh): one wave per workgroup, the last partition
// of each row tile reducing it, in the launcher's grid order.
struct Args950 {
  Args a;
  int partition_len;
  std::vector<uint32_t> tickets;  // [row tiles, num_kv_heads]
  float* tmp_out;  // [num_tokens, num_heads, max_num_partitions, HEAD] fp32 partials
};

template <class Scalar, int HEAD, int BS, int GQA, bool NATIVE, bool MULTI, bool KEY8>
void partition950_body(void* p) {
  Args950& x = *static_cast<Args950*>(p);
  const Args& a = x.a;
  tq::gfx950::tq_fp4_pa_gfx950_kernel<Scalar, HEAD, BS, GQA, NATIVE, MULTI, KEY8>(
      a.query, a.key_cache, a.value_cache, a.key_scales, a.value_scales,
      a.block_tables, a.seq_lens, a.cu_query_lens, a.exp_sums, a.max_logits, x.tmp_out,
      a.scale, a.soft_cap, a.sliding_window, a.max_blocks_per_seq, a.max_num_partitions,
      x.partition_len, a.num_seqs, a.num_tokens, a.num_kv_heads, a.q_stride, a.num_blocks,
      a.kv_block_stride, a.kv_head_stride, a.kv_seq_stride, a.sink,
      a.seq_state != nullptr && a.soft_cap > 0.0f, a.out, a.lse, a.sinks, a.rotation_signs,
      a.seq_state, a.state_ids, a.num_slots, x.tickets.data());
}

// The launcher's grid (pa_fp4.cpp.jinja), one workgroup at a time.
template <class Scalar, int HEAD, int BS, int GQA, bool NATIVE, bool MULTI, bool KEY8>
int run_all_950(Args950& x) {
  const Args& a = x.a;
  const int row_tiles = MULTI ? a.num_seqs + (a.num_tokens * GQA + tq::kTile - 1) / tq::kTile
                              : a.num_seqs;
  x.tickets.assign(size_t(row_tiles) * a.num_kv_heads, 0u);
  for (int tile = 0; tile < row_tiles; ++tile)
    for (int part = 0; part < a.max_num_partitions; ++part)
      for (int kvh = 0; kvh < a.num_kv_heads; ++kvh)
        if (run_workgroup(tile, part, kvh, partition950_body<Scalar, HEAD, BS, GQA, NATIVE, MULTI, KEY8>,
                          &x, tq::gfx950::kWave) != 0)
          return -1;
  for (uint32_t t : x.tickets)
    if (t != 0) return -4;  // a ticket left set: the next call's reduce would never run
  return 0;
}

}  // namespace

// The instantiations the tests use, per (dtype, head, block, gqa): the gfx950 build's kernels
// {LUT, native} x {decode, multi-token} x {FP4, E4M3 keys}; the gfx942 build's kernel, the LUT
// path with FP4 keys, decode and multi-token, for a few shapes.
#if TQ_GFX942
#define TQ_SIM_CONFIGS(X)      \
  X(tq::Bf16, 1, 128, 16, 4)   \
  X(tq::Bf16, 1, 64, 16, 4)    \
  X(tq::Bf16, 1, 64, 16, 8)    \
  X(tq::Bf16, 1, 256, 32, 2)   \
  X(tq::Fp16, 0, 128, 16, 16)  \
  X(tq::Bf16, 1, 64, 16, 3)
#else
#define TQ_SIM_CONFIGS(X)      \
  X(tq::Bf16, 1, 128, 16, 4)   \
  X(tq::Bf16, 1, 128, 16, 8)   \
  X(tq::Bf16, 1, 64, 16, 4)    \
  X(tq::Bf16, 1, 256, 32, 2)   \
  X(tq::Fp16, 0, 128, 16, 4)   \
  X(tq::Bf16, 1, 128, 256, 1)  \
  X(tq::Bf16, 1, 128, 16, 16)  \
  X(tq::Bf16, 1, 64, 16, 8)    \
  X(tq::Fp16, 0, 128, 16, 16)  \
  X(tq::Bf16, 1, 64, 16, 3)
// GQA above 16: the multi-token instantiation only (decode calls pass cu_query_lens 0, 1, ..).
#define TQ_SIM_MULTI_ONLY_CONFIGS(X) \
  X(tq::Bf16, 1, 64, 16, 32)
#endif

extern "C" int tq_sim_paged_attention(
    int is_bf16, int head, int block_size, int gqa, int native, int key_e4m3,
    const uint16_t* query, const uint8_t* key_cache, const uint8_t* value_cache,
    const uint8_t* key_scales, const uint8_t* value_scales, const int* block_tables,
    const int* seq_lens, const int* cu_query_lens, float* exp_sums, float* max_logits,
    uint16_t* tmp_out, uint16_t* out, float scale, float soft_cap, int sliding_window,
    int num_seqs, int num_tokens, int num_kv_heads, int max_blocks_per_seq,
    int max_num_partitions, int num_blocks, int q_stride, long kv_block_stride, int kv_head_stride,
    int kv_seq_stride, const float* rotation_signs, const float* seq_state, const int* state_ids,
    int num_slots, int sink, const float* sinks, float* lse) {
  Sim sim;
  sim.lds.resize(160 * 1024);  // gfx950 LDS per workgroup
  g_sim = &sim;
  const Args a = {query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens,
                  cu_query_lens, exp_sums, max_logits, tmp_out, out, scale, soft_cap,
                  sliding_window, num_seqs, num_tokens, num_kv_heads, max_blocks_per_seq,
                  max_num_partitions, q_stride, kv_block_stride, kv_head_stride, kv_seq_stride,
                  rotation_signs, seq_state, state_ids, num_slots, sink, sinks, lse, num_blocks};
  int rc = -3;  // not in this build: the gfx950 build has the gfx950 kernels' entry below
#if TQ_GFX942
  const bool multi = cu_query_lens != nullptr;
  if (native || key_e4m3) return -3;  // gfx942: the LUT path with FP4 keys only
  rc = -2;  // no such instantiation
#define TQ_SIM_DISPATCH(S, BF, H, BS, G)                                         \
  if (is_bf16 == BF && head == H && block_size == BS && gqa == G)                \
    rc = multi ? run_all<S, H, BS, G, true>(a) : run_all<S, H, BS, G, false>(a);
  TQ_SIM_CONFIGS(TQ_SIM_DISPATCH)
#undef TQ_SIM_DISPATCH
#else
  (void)a;
#endif
  g_sim = nullptr;
  return rc;
}

// The gfx950 kernel (partitions with their fused reduce) with partitions of partition_len
// tokens (tmp_out: fp32 partials) over caches of num_blocks blocks (exp_sums, max_logits,
// tmp_out sized for max_num_partitions of them); arguments as above.
extern "C" int tq_sim_paged_attention_gfx950(
    int is_bf16, int head, int block_size, int gqa, int native, int key_e4m3,
    const uint16_t* query, const uint8_t* key_cache, const uint8_t* value_cache,
    const uint8_t* key_scales, const uint8_t* value_scales, const int* block_tables,
    const int* seq_lens, const int* cu_query_lens, float* exp_sums, float* max_logits,
    float* tmp_out, uint16_t* out, float scale, float soft_cap, int sliding_window,
    int num_seqs, int num_tokens, int num_kv_heads, int max_blocks_per_seq,
    int max_num_partitions, int partition_len, int num_blocks, int q_stride, long kv_block_stride,
    int kv_head_stride, int kv_seq_stride, const float* rotation_signs, const float* seq_state,
    const int* state_ids, int num_slots, int sink, const float* sinks, float* lse) {
  if (tq::kGfx942) return -3;
  Sim sim;
  sim.lds.resize(160 * 1024);
  g_sim = &sim;
  Args950 x;
  x.tmp_out = tmp_out;
  x.a = {query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens,
         cu_query_lens, exp_sums, max_logits, nullptr, out, scale, soft_cap, sliding_window,
         num_seqs, num_tokens, num_kv_heads, max_blocks_per_seq, max_num_partitions, q_stride,
         kv_block_stride, kv_head_stride, kv_seq_stride, rotation_signs, seq_state, state_ids,
         num_slots, sink, sinks, lse, num_blocks};
  x.partition_len = partition_len;
  const bool multi = cu_query_lens != nullptr;
  int rc = -2;
#define TQ_SIM950_RUN(S, H, BS, G, N, K8) \
  (multi ? run_all_950<S, H, BS, G, N, true, K8>(x) : run_all_950<S, H, BS, G, N, false, K8>(x))
#define TQ_SIM950_DISPATCH(S, BF, H, BS, G)                                       \
  if (is_bf16 == BF && head == H && block_size == BS && gqa == G) {               \
    if (key_e4m3) rc = native ? TQ_SIM950_RUN(S, H, BS, G, true, true)            \
                              : TQ_SIM950_RUN(S, H, BS, G, false, true);          \
    else rc = native ? TQ_SIM950_RUN(S, H, BS, G, true, false)                    \
                     : TQ_SIM950_RUN(S, H, BS, G, false, false);                  \
  }
#if !TQ_GFX942
  TQ_SIM_CONFIGS(TQ_SIM950_DISPATCH)
#endif
#undef TQ_SIM950_DISPATCH
#define TQ_SIM950_DISPATCH_MULTI(S, BF, H, BS, G)                                         \
  if (multi && is_bf16 == BF && head == H && block_size == BS && gqa == G)              \
    rc = key_e4m3 ? (native ? run_all_950<S, H, BS, G, true, true, true>(x)             \
                            : run_all_950<S, H, BS, G, false, true, true>(x))           \
                  : (native ? run_all_950<S, H, BS, G, true, true, false>(x)            \
                            : run_all_950<S, H, BS, G, false, true, false>(x));
#if !TQ_GFX942
  TQ_SIM_MULTI_ONLY_CONFIGS(TQ_SIM950_DISPATCH_MULTI)
#endif
#undef TQ_SIM950_DISPATCH_MULTI
#undef TQ_SIM950_RUN
  g_sim = nullptr;
  return rc;
}

extern "C" void tq_sim_set_schedule(int mode, unsigned seed) {
  g_schedule = mode;
  g_seed = seed;
}

// The conversion models, for the tests: FP4 byte pairs -> E4M3 through the kernel's decode,
// and float -> E4M3 as the kernel converts Q and P.
extern "C" void tq_sim_decode_fp4x8(uint32_t codes, uint32_t* lo, uint32_t* hi) {
  const tq::E4m3x8 d = tq::fp4x8_to_e4m3x8(codes);
  *lo = d.lo;
  *hi = d.hi;
}
extern "C" uint32_t tq_sim_f32_to_e4m3(float x) { return tq::f32_to_e4m3(x); }
extern "C" uint32_t tq_sim_f32_to_e4m3fnuz(float x) { return tq::f32_to_e4m3fnuz(x); }
// The kernel's conversion of this build (pack_e4m3x4's first byte): OCP, or FNUZ for gfx942.
extern "C" uint32_t tq_sim_f32_to_fp8(float x) { return tq::pack_e4m3x4(x, 0.0f, 0.0f, 0.0f) & 0xFF; }
extern "C" int tq_sim_is_gfx942() { return tq::kGfx942 ? 1 : 0; }
extern "C" int tq_sim_q_scale_byte(float amax) { return tq::q_scale_byte(amax); }
// The kernel's rotation constant HEAD^-0.5, for the test against turboquant.rotation_norm.
extern "C" float tq_sim_rotation_norm(int head) {
  return head == 64 ? tq::rotation_norm<64>() : head == 128 ? tq::rotation_norm<128>()
       : head == 256 ? tq::rotation_norm<256>() : 0.0f;
}
