// Stand-in for <hip/hip_runtime.h> in the host build of the rendered AITER attention launcher
// (pa_fp4.cpp.jinja through AITER's JIT, tests/test_aiter_routing.py): a launch runs the grid's
// workgroups one after another on the host lane simulation (csrc_hip/sim/tq_fp4_lane_sim.cpp:
// every work-item a fiber; its barriers, wave shuffles, MFMA and LDS transpose-read models).
// The translation unit (pa_fp4_host.cpp beside this directory) includes the lane simulation
// before the rendered source, so its Sim, g_sim and run_workgroup are in scope here; the kernel
// headers are compiled with -DTQ_HOST_SIM. Only what the gfx950 launch code uses: dim3,
// hipStream_t and hipLaunchKernelGGL (kernel name parenthesized, as ROCm's macro takes it).
#pragma once

#include <stddef.h>

#include <functional>

#ifndef TQ_HOST_SIM
#error "the lane-simulation launch stand-in needs -DTQ_HOST_SIM"
#endif

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef struct ihipStream_t* hipStream_t;
typedef int hipError_t;
constexpr hipError_t hipSuccess = 0;
constexpr hipError_t hipErrorLaunchFailure = 719;

namespace tq_lane_host {

inline hipError_t& last_error() {
  static hipError_t e = hipSuccess;
  return e;
}

// The grid's workgroups in x, y, z order, each of block.x * block.y * block.z fibers over a fresh
// simulated LDS (gfx950: 160 KiB per workgroup). A barrier or wave operation that some lanes
// never reach stops the launch with hipErrorLaunchFailure (hipGetLastError).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t /*shared_mem*/,
            hipStream_t /*stream*/, Args... args) {
  Sim sim;
  sim.lds.resize(160 * 1024);
  Sim* const outer = g_sim;
  g_sim = &sim;
  std::function<void()> body = [&] { kernel(args...); };
  void (*const entry)(void*) = [](void* f) { (*static_cast<std::function<void()>*>(f))(); };
  const int threads = int(block.x * block.y * block.z);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x)
        if (run_workgroup(int(x), int(y), int(z), entry, &body, threads) != 0) {
          last_error() = hipErrorLaunchFailure;
          g_sim = outer;
          return;
        }
  g_sim = outer;
}

}  // namespace tq_lane_host

#define hipLaunchKernelGGL(kernel_name, grid, block, shared_mem, stream, ...) \
  ::tq_lane_host::launch((kernel_name), (grid), (block), (shared_mem), (stream), __VA_ARGS__)

inline hipError_t hipGetLastError() {
  const hipError_t e = ::tq_lane_host::last_error();
  ::tq_lane_host::last_error() = hipSuccess;
  return e;
}
