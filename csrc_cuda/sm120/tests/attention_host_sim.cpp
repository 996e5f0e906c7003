// Host simulation of the SM120 attention kernels (tests/test_sm120_backend.py): the kernel source
// of paged_attention_sm120.cuh, with the MMA wrappers' software model (as in the sm_90a
// emulation build), run on the CPU one CTA at a time. Each of the 128 threads is a ucontext
// coroutine; __syncthreads, __syncwarp and the warp shuffles / ballot are barriers between them.
// The test compiles a copy of the kernel header in which the two inline-asm statements without a
// host meaning are replaced: cvt.rn.satfinite.e4m3x2.f32 by sim_e4m3 (below) and opaque()'s empty
// asm by nothing; the CUDA headers the kernel includes are empty files. Not a performance model.
// Built with -D__CUDACC__ -DTQ_SM120_EMULATE; exports sim_attention (plain C arguments, below).
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct uint3s { unsigned x, y, z; };
struct SimThread { ucontext_t ctx; uint3s tid; bool done; };
extern SimThread* g_cur;
extern uint3s g_blockIdx, g_gridDim, g_blockDim;
#define threadIdx (g_cur->tid)
#define blockIdx g_blockIdx
#define gridDim g_gridDim
#define blockDim g_blockDim
void sim_yield();
struct SimBarrier {
  int n = 0, count = 0, gen = 0;
  void wait() { int g = gen; if (++count == n) { count = 0; ++gen; } else { while (gen == g) sim_yield(); } }
};
extern SimBarrier g_block_bar, g_warp_bar[32];
extern uint64_t g_xchg[32][32];
inline void __syncthreads() { g_block_bar.wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_warp_bar[threadIdx.x >> 5].wait(); }
template <class T> inline T __shfl_sync(unsigned, T v, int src) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint64_t bits = 0; std::memcpy(&bits, &v, sizeof(T));
  g_xchg[w][lane] = bits; g_warp_bar[w].wait();
  uint64_t r = g_xchg[w][src & 31]; g_warp_bar[w].wait();
  T out; std::memcpy(&out, &r, sizeof(T)); return out;
}
template <class T> inline T __shfl_xor_sync(unsigned m, T v, int x) { return __shfl_sync(m, v, int(threadIdx.x & 31) ^ x); }
inline unsigned __ballot_sync(unsigned, int pred) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  g_xchg[w][lane] = pred ? 1 : 0; g_warp_bar[w].wait();
  unsigned r = 0; for (int i = 0; i < 32; ++i) r |= unsigned(g_xchg[w][i] != 0) << i;
  g_warp_bar[w].wait(); return r;
}
template <class T> inline T __ldg(const T* p) { return *p; }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  uint64_t v = (uint64_t(y) << 32) | x; unsigned r = 0;
  for (int i = 0; i < 4; ++i) { unsigned sel = (s >> (4 * i)) & 7u; r |= unsigned((v >> (8 * sel)) & 0xFF) << (8 * i); }
  return r;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
using std::isfinite;
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct __nv_bfloat16 { uint16_t b; };
inline float __bfloat162float(__nv_bfloat16 x) { uint32_t u = uint32_t(x.b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return {uint16_t(0x7FC0)};
  u += 0x7FFFu + ((u >> 16) & 1u); return {uint16_t(u >> 16)};
}
struct __half { _Float16 h; };
inline float __half2float(__half x) { return float(x.h); }
inline __half __float2half_rn(float f) { return {(_Float16)f}; }
typedef int cudaError_t; typedef void* cudaStream_t;

// Round to nearest even, saturating to +-448; NaN -> 0x7F (cvt.rn.satfinite.e4m3x2.f32).
inline uint32_t sim_e4m3(float x) {
  if (std::isnan(x)) return 0x7Fu;
  const uint32_t sign = std::signbit(x) ? 0x80u : 0u;
  float a = std::fabs(x);
  if (a >= 448.f) return sign | 0x7Eu;
  uint32_t code;
  if (a < std::ldexp(1.f, -6)) {
    code = uint32_t(std::nearbyint(std::ldexp(a, 9)));
  } else {
    int k; std::frexp(a, &k); int e = k - 1;
    float q = std::nearbyint(std::ldexp(a, 3 - e));
    if (q >= 16.f) { e += 1; q = 8.f; }
    code = uint32_t((e + 7) << 3) | (uint32_t(q) - 8u);
    if (code > 0x7Eu) code = 0x7Eu;
  }
  return sign | code;
}
#include "paged_attention_sm120.cuh"

SimThread* g_cur; uint3s g_blockIdx, g_gridDim, g_blockDim; SimBarrier g_block_bar, g_warp_bar[32]; uint64_t g_xchg[32][32];
static ucontext_t sched_ctx;
void sim_yield() { swapcontext(&g_cur->ctx, &sched_ctx); }
static void (*g_body)(void*); static void* g_arg;
static void entry() { g_body(g_arg); g_cur->done = true; swapcontext(&g_cur->ctx, &sched_ctx); }
static std::vector<SimThread> threads(128);
static std::vector<std::vector<char>> stacks(128, std::vector<char>(1 << 20));

template <class K> static void run_block(int n, K& kernel) {
  g_block_bar = SimBarrier{n, 0, 0};
  for (int w = 0; w < 32; ++w) g_warp_bar[w] = SimBarrier{32, 0, 0};
  g_body = [](void* a) { (*static_cast<K*>(a))(); };
  g_arg = &kernel;
  for (int i = 0; i < n; ++i) {
    getcontext(&threads[i].ctx);
    threads[i].ctx.uc_stack.ss_sp = stacks[i].data();
    threads[i].ctx.uc_stack.ss_size = stacks[i].size();
    threads[i].ctx.uc_link = nullptr;
    makecontext(&threads[i].ctx, entry, 0);
    threads[i].tid = {unsigned(i), 0, 0};
    threads[i].done = false;
  }
  for (bool any = true; any;) {
    any = false;
    for (int i = 0; i < n; ++i)
      if (!threads[i].done) { any = true; g_cur = &threads[i]; swapcontext(&sched_ctx, &threads[i].ctx); }
  }
}

using namespace tq::sm120;
template <int D, bool P32, bool K8>
static void run_grid(const AttentionParams& p, int tile_stride) {
  g_gridDim = {unsigned(p.num_seqs * p.num_kv_heads), unsigned(p.num_splits), unsigned(tile_stride)};
  g_blockDim = {128, 1, 1};
  for (unsigned z = 0; z < g_gridDim.z; ++z)
    for (unsigned y = 0; y < g_gridDim.y; ++y)
      for (unsigned x = 0; x < g_gridDim.x; ++x) {
        g_blockIdx = {x, y, z};
        auto k = [&]() { paged_attention_sm120_kernel<__nv_bfloat16, D, P32, K8>(p); };
        run_block(128, k);
      }
  g_gridDim = {unsigned(p.num_tokens), unsigned(p.num_heads), 1};
  for (unsigned y = 0; y < g_gridDim.y; ++y)
    for (unsigned x = 0; x < g_gridDim.x; ++x) {
      g_blockIdx = {x, y, 0};
      auto k = [&]() { combine_splits_sm120_kernel<__nv_bfloat16, D>(p); };
      run_block(128, k);
    }
}

extern "C" int sim_attention(void* out, const void* query, const uint8_t* kc, const uint8_t* vc, const uint8_t* ks,
                             const uint8_t* vs, const int32_t* bt, const int32_t* sl, const int32_t* cu, int num_seqs,
                             int num_tokens, int num_heads, int num_kv_heads, int block_size, int max_blocks,
                             int num_blocks, int head_dim, int per32, int key_e4m3, float scale, float cap,
                             int window, int max_seq_len, const float* signs, const float* state,
                             const int32_t* ids, int num_slots, int sink, int sm_count) {
  LaunchPlan plan = plan_attention(num_seqs, num_kv_heads, num_heads, num_tokens, cu != nullptr, max_seq_len, sm_count);
  const long long rows = (long long)plan.num_splits * num_tokens * num_heads;
  std::vector<float> ws(rows * (head_dim + 2), std::nanf(""));
  AttentionParams p{};
  p.out = out; p.query = query; p.key_cache = kc; p.value_cache = vc; p.key_scales = ks; p.value_scales = vs;
  p.block_tables = bt; p.seq_lens = sl; p.cu_query_lens = cu;
  p.part_out = ws.data(); p.part_max = p.part_out + rows * head_dim; p.part_sum = p.part_max + rows;
  p.num_seqs = num_seqs; p.num_tokens = num_tokens; p.num_heads = num_heads; p.num_kv_heads = num_kv_heads;
  p.block_size = block_size; p.max_blocks_per_seq = max_blocks; p.num_blocks = num_blocks;
  p.num_splits = plan.num_splits; p.partition_size = plan.partition_size;
  p.scale = scale; p.logits_soft_cap = cap; p.sliding_window = window;
  p.rotation_signs = signs; p.seq_state = state; p.state_ids = ids; p.num_slots = num_slots;
  p.rotation_norm = float(std::pow(double(head_dim), -0.5)); p.sink = sink != 0;
  if (num_seqs == 0 || num_tokens == 0) return plan.num_splits;
  switch (head_dim * 4 + per32 * 2 + key_e4m3) {  // K8V4 (key_e4m3): one scale per (token, head)
    case 256: run_grid<64, false, false>(p, plan.tile_stride); break;
    case 257: run_grid<64, false, true>(p, plan.tile_stride); break;
    case 258: run_grid<64, true, false>(p, plan.tile_stride); break;
    case 512: run_grid<128, false, false>(p, plan.tile_stride); break;
    case 513: run_grid<128, false, true>(p, plan.tile_stride); break;
    case 514: run_grid<128, true, false>(p, plan.tile_stride); break;
    case 1024: run_grid<256, false, false>(p, plan.tile_stride); break;
    case 1025: run_grid<256, false, true>(p, plan.tile_stride); break;
    case 1026: run_grid<256, true, false>(p, plan.tile_stride); break;
    default: return -1;
  }
  return plan.num_splits;
}
