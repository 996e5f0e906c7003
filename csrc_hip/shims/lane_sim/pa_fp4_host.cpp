// Host build of the rendered AITER attention launcher (pa_fp4.cpp.jinja, gfx950) over the lane
// simulation, for tests/test_aiter_routing.py: the lane simulation first (copied into the AITER
// build's include directory as sim/tq_fp4_lane_sim.cpp, so its "../tq_fp4_gfx950_attention.cuh"
// is the header the patch shipped, the same file the rendered unit includes), then the rendered
// unit (TQ_PA_FP4_TU), whose <hip/hip_runtime.h> is hip/hip_runtime.h beside this file. Compile
// with -DTQ_HOST_SIM. The library's entry point is the rendered one, called through ctypes by
// AITER's run_lib as on a GPU; hipGetLastError reports a launch that deadlocked.
#include "sim/tq_fp4_lane_sim.cpp"

#include TQ_PA_FP4_TU

extern "C" int tq_lane_host_last_error() { return hipGetLastError(); }
