// Stand-in for <hip/hip_runtime.h> that runs hipified kernels on the host CPU, for the host
// build of the hipified cache writer (turboquant/hip_writer.py, tests/test_hip_writer.py).
//
// A launch runs the grid's workgroups one after another. Each work-item of a workgroup is a
// cooperative fiber (started with ucontext, switched with _setjmp/_longjmp, which unlike
// swapcontext make no system call: a shuffle costs each lane one switch out and back), and the
// workgroup is cut into 64-lane wavefronts, as on gfx9 (CDNA). __shfl_xor is a rendezvous of the
// caller's wavefront: every lane posts its value and waits until all 64 have posted, then reads
// its partner's, with HIP's width rule (the wavefront acts as segments of `width` lanes; a
// partner past the caller's segment gives the caller's own value). A wavefront whose lanes do not
// all reach a shuffle (a lane returned early) deadlocks: the launch stops and hipGetLastError
// reports hipErrorLaunchFailure, where hardware would have read a stale register. Everything else
// is plain C++ with HIP's meaning (fp32 arithmetic with round to nearest, the conversions of
// hip_fp16.h / hip_bf16.h here).
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#define __HIP_PLATFORM_AMD__ 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(max_threads)

typedef int hipError_t;
constexpr hipError_t hipSuccess = 0;
constexpr hipError_t hipErrorInvalidValue = 1;
constexpr hipError_t hipErrorLaunchFailure = 719;
typedef struct ihipStream_t* hipStream_t;
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

template <typename To, typename From>
inline To tq_host_bit_cast(From x) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To y;
  std::memcpy(&y, &x, sizeof(To));
  return y;
}
inline unsigned __float_as_uint(float x) { return tq_host_bit_cast<unsigned>(x); }
inline int __float_as_int(float x) { return tq_host_bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return tq_host_bit_cast<float>(x); }
inline float __int_as_float(int x) { return tq_host_bit_cast<float>(x); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }

namespace tq_host {

constexpr int kWaveSize = 64;
constexpr size_t kStackBytes = 64 * 1024;

struct Uint3 { unsigned x, y, z; };
struct JmpBuf { jmp_buf buf; };

struct Runtime {
  Uint3 block_dim{1, 1, 1}, block_idx{0, 0, 0};
  int nthreads = 0, current = 0;
  jmp_buf scheduler;
  std::vector<ucontext_t> start;  // each fiber's entry, used once
  std::vector<JmpBuf> resume;    // where each started fiber continues
  std::vector<std::vector<char>> stacks;
  std::vector<char> started, done;
  std::vector<uint32_t> slots[2];  // posted shuffle values, by round parity
  std::vector<int> arrived;        // per wavefront, lanes posted in this round
  std::vector<long> round;         // per wavefront, completed rounds
  long progress = 0;
  hipError_t last_error = hipSuccess;
  std::function<void()> body;
};

inline Runtime& rt() {
  static Runtime r;
  return r;
}

inline Uint3 thread_idx() {
  const Runtime& r = rt();
  const unsigned t = (unsigned)r.current;
  return Uint3{t % r.block_dim.x, t / r.block_dim.x % r.block_dim.y, t / (r.block_dim.x * r.block_dim.y)};
}

// Back to the scheduler; returns when the scheduler resumes this fiber.
inline void yield() {
  Runtime& r = rt();
  if (!_setjmp(r.resume[r.current].buf)) _longjmp(r.scheduler, 1);
}

inline void fiber_entry() {
  Runtime& r = rt();
  r.body();
  r.done[r.current] = 1;
  ++r.progress;
  _longjmp(r.scheduler, 1);
}

// One workgroup: every work-item a fiber, resumed in ascending order until all have returned.
// Returns false on a deadlock (a wavefront waiting on a shuffle that some lane never reaches).
inline bool run_workgroup() {
  Runtime& r = rt();
  const int n = r.nthreads, waves = (n + kWaveSize - 1) / kWaveSize;
  r.start.resize(n);
  r.resume.resize(n);
  r.stacks.resize(n);
  r.started.assign(n, 0);
  r.done.assign(n, 0);
  for (int p = 0; p < 2; ++p) r.slots[p].assign((size_t)waves * kWaveSize, 0);
  r.arrived.assign(waves, 0);
  r.round.assign(waves, 0);
  for (int t = 0; t < n; ++t) {
    r.stacks[t].resize(kStackBytes);
    getcontext(&r.start[t]);
    r.start[t].uc_stack.ss_sp = r.stacks[t].data();
    r.start[t].uc_stack.ss_size = kStackBytes;
    r.start[t].uc_link = nullptr;
    makecontext(&r.start[t], fiber_entry, 0);
  }
  for (;;) {
    const long before = r.progress;
    bool all_done = true;
    for (int t = 0; t < n; ++t) {
      if (r.done[t]) continue;
      all_done = false;
      r.current = t;
      if (!_setjmp(r.scheduler)) {
        if (r.started[t]) _longjmp(r.resume[t].buf, 1);
        r.started[t] = 1;
        setcontext(&r.start[t]);
      }
    }
    if (all_done) return true;
    if (r.progress == before) return false;
  }
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t /*shared_mem*/,
            hipStream_t /*stream*/, Args... args) {
  Runtime& r = rt();
  r.block_dim = Uint3{block.x, block.y, block.z};
  r.nthreads = (int)(block.x * block.y * block.z);
  r.body = [&] { kernel(args...); };
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        r.block_idx = Uint3{x, y, z};
        if (!run_workgroup()) {
          r.last_error = hipErrorLaunchFailure;
          return;
        }
      }
}

}  // namespace tq_host

#define threadIdx (::tq_host::thread_idx())
#define blockIdx (::tq_host::rt().block_idx)
#define blockDim (::tq_host::rt().block_dim)

#define hipLaunchKernelGGL(kernel, grid, block, shared_mem, stream, ...) \
  ::tq_host::launch(kernel, grid, block, shared_mem, stream, __VA_ARGS__)

inline hipError_t hipGetLastError() {
  const hipError_t e = ::tq_host::rt().last_error;
  ::tq_host::rt().last_error = hipSuccess;
  return e;
}

// HIP's __shfl_xor (see the top of this file). 32-bit types, as ds_bpermute moves a dword.
template <typename T>
T __shfl_xor(T var, int lane_mask, int width = ::tq_host::kWaveSize) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  ::tq_host::Runtime& r = ::tq_host::rt();
  const int t = r.current, wave = t / ::tq_host::kWaveSize, lane = t % ::tq_host::kWaveSize;
  int index = lane ^ lane_mask;
  index = index >= ((lane + width) & ~(width - 1)) ? lane : index;
  const long round = r.round[wave];
  std::vector<uint32_t>& slot = r.slots[round & 1];
  slot[t] = tq_host_bit_cast<uint32_t>(var);
  ++r.progress;
  if (++r.arrived[wave] == ::tq_host::kWaveSize) {
    r.arrived[wave] = 0;
    ++r.round[wave];
  } else {
    while (r.round[wave] == round) ::tq_host::yield();
  }
  return tq_host_bit_cast<T>(slot[wave * ::tq_host::kWaveSize + index]);
}
