"""The cuda backend's kernels compile standalone (no torch) for SM80 and SM90a with nvcc, with
no register spills. Runs on CPU-only CI machines that have nvcc (a CUDA toolkit's, or the
nvidia-cuda-nvcc wheel's that .ci/install gets from PyPI); skipped where nvcc is absent."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from _tools import find_nvcc, find_tool, nvcc_link_flags

CSRC = Path(__file__).resolve().parents[1] / "csrc_cuda"
NVCC = find_nvcc()

pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (looked on PATH, in $CUDA_HOME "
                                "and the nvidia wheels; bash .ci/install gets it from PyPI) and g++")

TARGETS = {
    "sm_80": ["-gencode=arch=compute_80,code=sm_80"],
    "sm_90a": ["-gencode=arch=compute_90a,code=sm_90a"],
}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def built(request, tmp_path_factory):
    """compile_check.cu built for one target: (target, ptxas log, object file)."""
    obj = tmp_path_factory.mktemp(request.param) / "compile_check.o"
    cmd = [NVCC, "-std=c++17", "-O3", *TARGETS[request.param], "-c", str(CSRC / "compile_check.cu"),
           "-o", str(obj), "-Xptxas", "-v"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    return request.param, log, obj


def test_kernels_compile_without_spills(built):
    _, log, _ = built
    kernels = re.findall(r"Compiling entry function '(\w+)'", log)
    assert any("paged_attention_fp4_kernel" in k for k in kernels), log[-2000:]
    assert any("paged_attention_reduce_kernel" in k for k in kernels), log[-2000:]
    assert any("reshape_and_cache_fp4_kernel" in k for k in kernels), log[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(a == "0" and b == "0" for a, b in spills), log[-4000:]
    assert "serialized" not in log, log[-4000:]  # ptxas: wgmma.mma_async serialized (a register hazard)


def test_prefill_kernel_mma_instructions(built):
    """SASS of every prefill-kernel instantiation (kStates, kE4m3, kWs: 32): on sm_90a the
    warpgroup MMAs (S: D / 16 QGMMA 64x64x32 (FP8 S), E4M3 x E5M2 with FP4 keys and E4M3 x E4M3
    with K8V4 keys, Q's two terms in registers and K-major K; P V: 4 HGMMA 64xDx16 with P' in
    registers and V transposed, .tnspB), no warp MMA, and the register split of its producer and
    consumer warps (one USETMAXREG down, one up), the workspace instantiations (kWs) as the
    others but with four copies of each (tuning::PREFILL_WS_OVERLAP: S in step 0, in the two
    steps of the loop unrolled by two and in an odd last step; P V in those three and after the
    loop); on sm_80 warp MMAs (HMMA.16816) only, and the workspace instantiations a trap (the
    plan never launches them there)."""
    target, _, obj = built
    cuobj = find_tool("cuobjdump")
    if cuobj is None:
        pytest.skip("needs cuobjdump (tests/_tools.py; bash .ci/install gets it)")
    sass = subprocess.run([cuobj, "-sass", str(obj)], capture_output=True, text=True, timeout=600).stdout
    funcs = re.split(r"\n\s*Function : ", sass)[1:]
    prefill = [f for f in funcs if "paged_attention_fp4_prefill_kernel" in f.split("\n", 1)[0]]
    assert len(prefill) == 32, [f.split("\n", 1)[0] for f in funcs]
    for f in prefill:
        name, d = f.split("\n", 1)[0], int(re.search(r"prefill_kernelILi(\d+)E", f).group(1))
        _states, e4m3, ws = re.search(r"Lb([01])ELb([01])ELb([01])EEEv", name).groups()
        if target != "sm_90a" and ws == "1":
            assert "BPT.TRAP" in f and "HMMA" not in f, name
            continue
        hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32 R\d+, (R\d+, )?gdesc\[UR\d+\](\.tnspB)?", f)
        qgmma = re.findall(r"QGMMA\.64x64x32\.F32\.E4M3\.(E5M2|E4M3) R\d+, R\d+, gdesc\[UR\d+\]", f)
        if target == "sm_90a":
            key_type = "E5M2" if e4m3 == "0" else "E4M3"  # FP4 keys (kE4m3 false) or K8V4
            assert all(k == key_type for k in qgmma), (name, qgmma)
            s_mmas = qgmma
            pv_mmas = [h for h in hgmma if h[0] == str(d) and h[1] and h[2] == ".tnspB"]
            copies = 4 if ws == "1" else 1
            assert len(s_mmas) == copies * d // 16 and len(pv_mmas) == copies * 4, (name, hgmma, qgmma)
            assert len(hgmma) + len(qgmma) == copies * (d // 16 + 4), (name, hgmma, qgmma)
            assert "HMMA" not in f.replace("HGMMA", ""), name
            assert len(re.findall(r"USETMAXREG\.DEALLOC", f)) == 1, name
            assert len(re.findall(r"USETMAXREG\.TRY_ALLOC", f)) == 1, name
        else:
            assert not hgmma and "HMMA.16816.F32" in f, name


def test_wgmma_layout_probe_compiles(tmp_path):
    """The GPU probe of the wgmma wrappers (tests/gpu/wgmma_layout_check.cu) builds from the
    kernel headers as they are (it runs on an SM90 GPU only)."""
    src = Path(__file__).resolve().parent / "gpu" / "wgmma_layout_check.cu"
    r = subprocess.run([NVCC, "-std=c++17", "-O2", *TARGETS["sm_90a"], f"-I{CSRC}", "-c", str(src),
                        "-o", str(tmp_path / "probe.o")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_wgmma_rate_benchmark_compiles_unserialized(tmp_path):
    """benchmarks/wgmma_rate.cu (the tensor rate of the prefill kernel's MMA forms, run on the
    device) builds from the kernel headers, and ptxas keeps its MMA chains asynchronous: a
    serialized wgmma would make it time the hazard instead of the tensor cores."""
    src = CSRC.parent / "benchmarks" / "wgmma_rate.cu"
    r = subprocess.run([NVCC, "-std=c++17", "-O3", *TARGETS["sm_90a"], f"-I{CSRC}", "-c", str(src),
                        "-o", str(tmp_path / "rate.o"), "-Xptxas", "-v"], capture_output=True, text=True,
                       timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert len(re.findall(r"Compiling entry function '\w*rate_kernel", log)) == 6, log[-3000:]
    assert "serialized" not in log, log[-3000:]


def test_wgmma_decode_probe_compiles(tmp_path):
    """benchmarks/wgmma_decode_probe.cu (issue 43's FP8 warpgroup decode, run on the device)
    builds from the kernel headers, and ptxas keeps the MMA chains of its two-term builds (QT 2,
    and QT 4: 16 columns) asynchronous (a zeroed S accumulator once serialized every MMA of the
    kernel). The one-chain builds (QT 1 and 3) are serialized, as docs/cuda-kernels.md says."""
    src = CSRC.parent / "benchmarks" / "wgmma_decode_probe.cu"
    r = subprocess.run([NVCC, "-std=c++17", "-O3", *TARGETS["sm_90a"], f"-I{CSRC}", "-c", str(src),
                        "-o", str(tmp_path / "probe.o"), "-Xptxas", "-v"], capture_output=True,
                       text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    builds = re.findall(r"Compiling entry function '(\w*probe_kernel\w*)'", log)
    serialized = set(re.findall(r"serialized [^']* in the function '(\w+)'", log))
    two_term = [b for b in builds if "probe_kernelILi2E" in b or "probe_kernelILi4E" in b]
    assert len(builds) == 16 and len(two_term) == 8, builds
    assert not serialized & set(two_term), sorted(serialized & set(two_term))
    assert serialized <= set(builds) - set(two_term), log[-3000:]


def test_kernel_headers_are_torch_free():
    for f in CSRC.glob("*.cuh"):
        text = f.read_text()
        assert "torch" not in re.sub(r"//.*", "", text).lower().replace("torch-free", ""), f


ENCODE_CHECK = r"""
#include <cstdio>
#include "cache_writer.cuh"
using namespace turboquant::cuda_fp4;
// Nearest E2M1 magnitude code by search, ties to the even code (format.py encode_e2m1).
static unsigned nearest_even(double y) {
  static const double grid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  unsigned best = 0;
  for (unsigned c = 1; c < 8; ++c) {
    const double d = y - grid[c], db = y - grid[best];
    if (d * d < db * db || (d * d == db * db && c % 2 == 0)) best = c;
  }
  return best;
}
int main() {
  unsigned long long bad = 0;
  const unsigned last = 0x40C00000u;  // 6.0f: the scale rule keeps every |q| <= 6
  for (unsigned u = 0; u <= last; ++u) {
    float y;
    memcpy(&y, &u, 4);
    if (e2m1_magnitude_magic(y) - E2M1_MAGIC != nearest_even(y) && bad++ < 5)
      printf("mismatch at %a: %u vs %u\n", y, e2m1_magnitude_magic(y) - E2M1_MAGIC, nearest_even(y));
  }
  printf("checked %u magnitudes, %llu mismatches\n", last + 1, bad);
  return bad != 0;
}
"""


def test_e2m1_encode_matches_nearest_even_for_every_float(tmp_path):
    """The writer's compare-free E2M1 magnitude (cache_writer.cuh, host build of the same
    function) against a nearest-even search of the grid, for every float32 in [0, 6]."""
    _run_host_check(ENCODE_CHECK, tmp_path / "encode_check")


def _run_host_check(source: str, exe: Path) -> None:
    """Build a host program over the writer's header with nvcc and run it: it prints
    'N mismatches' and exits non-zero on any."""
    src = exe.with_suffix(".cu")
    src.write_text(source)
    r = subprocess.run([NVCC, "-std=c++17", "-O2", "-I", str(CSRC), str(src), "-o", str(exe),
                        *nvcc_link_flags(NVCC)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "0 mismatches" in r.stdout, r.stdout[-2000:]


E4M3_CHECK = r"""
#include <cstdio>
#include "cache_writer.cuh"
using namespace turboquant::cuda_fp4;
// E4M3 magnitude of code c (0..126): c * 2^-9 below 8, else (8 + c % 8) * 2^(c / 8 - 10).
static double e4m3_value(unsigned c) {
  return c < 8 ? c / 512.0 : (8 + (c & 7)) * __builtin_ldexp(1.0, (int)(c >> 3) - 10);
}
int main() {
  unsigned long long bad = 0;
  const unsigned last = 0x43E00000u;  // 448.0f: the scale rule keeps every |q| <= 448
  unsigned c = 0;  // nearest code so far: the magnitudes come in increasing order
  for (unsigned u = 0; u <= last; ++u) {
    float y;
    memcpy(&y, &u, 4);
    // move up while y is past the midpoint to the next code, or on it and the next is even
    while (c < 126) {
      const double mid = 0.5 * (e4m3_value(c) + e4m3_value(c + 1));
      if (y > mid || (y == mid && (c + 1) % 2 == 0)) ++c; else break;
    }
    const unsigned pos = e4m3_byte(y), neg = e4m3_byte(-y);
    if ((pos != c || neg != (c | 0x80u)) && bad++ < 5)
      printf("mismatch at %a: %u / %u vs %u\n", y, pos, neg, c);
  }
  printf("checked %u magnitudes, %llu mismatches\n", last + 1, bad);
  return bad != 0;
}
"""


def test_e4m3_encode_matches_nearest_even_for_every_float(tmp_path):
    """The K8V4 writer's software E4M3 encode (cache_writer.cuh e4m3_byte, SM80's path; host
    build) against a nearest-even search of the E4M3 grid, for every float32 in [0, 448] and
    its negative (sign from the sign bit: -0.0 gives 0x80)."""
    _run_host_check(E4M3_CHECK, tmp_path / "e4m3_check")


PLAN_CHECK = r"""
#include <cstdio>
#include "attention_plan.cuh"
using namespace turboquant::cuda_fp4;
int main() {
  struct Case { bool multi; int d, t, s, g; bool e4m3; int major; };
  const Case cases[] = {
    {false, 128, 64, 64, 4, false, 9},   // decode
    {true, 128, 256, 64, 4, true, 8},    // 64 x 4 tokens, K8V4: 16 columns
    {true, 128, 1024, 16, 4, true, 8},   // 16 x 64 tokens, K8V4: prefill's 109 KB too large: general
    {true, 128, 256, 128, 4, true, 8},   // 128 x 2 tokens, K8V4: 8 columns
    {true, 256, 256, 64, 4, false, 8},   // D 256 multi-token: general
    {false, 256, 64, 64, 4, true, 8},    // D 256 decode, K8V4
    {true, 128, 2048, 1, 4, false, 9},   // prefill on SM90 (wgmma layout)
    {true, 128, 2048, 1, 4, false, 8},   // prefill below SM90
    {false, 128, 64, 64, 4, true, 9},    // decode on SM90 with K8V4 keys: the warp-MMA kernel
    {false, 128, 64, 64, 8, false, 8},   // decode below SM90, G 8
  };
  for (const Case& c : cases) {  // 8 kv heads, 4096 keys, 132 SMs; per CTA SM90's 227 KB, SM8x's 99 KB
    const int optin = c.major == 9 ? 232448 : 101376;
    const AttnPlan p = plan_attention(c.d, c.e4m3, c.multi, c.t, c.s, 8, c.g, 4096, 132, c.major, optin);
    printf("%s|%d %lld %d %d %d %d %lld\n", p.name, p.smem_bytes, p.grid_x, p.tiles_per_seq,
           p.partition_size, p.num_partitions, p.ws_steps, p.ws_bytes);
  }
  // the decode-once workspace: one row group per sequence (16 x 128 rows) by the rule and
  // forced on; two sequences of 64 groups, forced off; the rule's threshold (tuning.cuh's
  // PREFILL_WS_MIN_GROUPS): one sequence of 16 groups (512 tokens, G 4) takes it, of 15 not
  const AttnPlan at = plan_attention(128, false, true, 512, 1, 8, 4, 4096, 132, 9, 232448);
  const AttnPlan below = plan_attention(128, false, true, 480, 1, 8, 4, 4096, 132, 9, 232448);
  printf("WSMIN %d %d\n", at.ws_steps, below.ws_steps);
  const AttnPlan one = plan_attention(128, false, true, 512, 16, 8, 4, 4096, 132, 9, 232448);
  const AttnPlan on = plan_attention(128, false, true, 512, 16, 8, 4, 4096, 132, 9, 232448, kWsOn);
  const AttnPlan off = plan_attention(128, false, true, 4096, 2, 8, 4, 4096, 132, 9, 232448, kWsOff);
  printf("WS %d %d %lld %d\n", one.ws_steps, on.ws_steps, on.ws_bytes, off.ws_steps);
  // the caller's workspace bounds it: exactly the call's bytes, a byte fewer, none; one larger
  // than the per-call bound (a call allocating its own stays within 1 GiB)
  const long long need = prefill_workspace_bytes(128, false, 1, 8, 4096);
  const AttnPlan fit = plan_attention(128, false, true, 2048, 1, 8, 4, 4096, 132, 9, 232448, kWsAuto, need);
  const AttnPlan shy = plan_attention(128, false, true, 2048, 1, 8, 4, 4096, 132, 9, 232448, kWsAuto, need - 1);
  const AttnPlan none = plan_attention(128, false, true, 2048, 1, 8, 4, 4096, 132, 9, 232448, kWsAuto, 0);
  const int big_len = (int)((2 * turboquant::tuning::PREFILL_WS_MAX_BYTES) / (8 * 24832) * 64);
  const long long big = prefill_workspace_bytes(128, false, 1, 8, big_len);
  const AttnPlan own = plan_attention(128, false, true, 65536, 1, 8, 4, big_len, 132, 9, 232448);
  const AttnPlan given = plan_attention(128, false, true, 65536, 1, 8, 4, big_len, 132, 9, 232448, kWsAuto, big);
  printf("CAP %lld %lld %lld %lld %lld %d %d\n", need, fit.ws_bytes, shy.ws_bytes, none.ws_bytes, big,
         own.ws_steps, given.ws_steps);
  printf("PREFILL_ROWS %d\n", turboquant::tuning::PREFILL_ROWS);
  return 0;
}
"""


def test_the_launch_plan_names_the_kernel_its_size_grid_and_splits(tmp_path):
    """plan_attention (the binding's one call; the launcher runs what it chose): the kernel a
    call runs and its shared memory (the binding's check against the device's opt-in limit): the
    16-column kernel fits SM86 / SM89's 99 KB (101376 bytes) at D 128 with K8V4 keys, the general
    kernel there does not, nor does the D 256 general kernel fit SM80's 163 KB (166912 bytes);
    the 8-column form (one draft token per sequence) has the decode kernel's layout; the prefill
    kernel's layout follows the device (wgmma on SM 9.x). Its grid: one tile per sequence in
    decode, sequences + row tiles of the form's columns for multi-token queries, sequences + row
    groups for prefill (one partition); every split covers the 4096 keys."""
    src = tmp_path / "plan_check.cu"
    src.write_text(PLAN_CHECK)
    exe = tmp_path / "plan_check"
    r = subprocess.run([NVCC, "-std=c++17", "-O2", "-I", str(CSRC), str(src), "-o", str(exe),
                        *nvcc_link_flags(NVCC)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.splitlines()
    prefill_rows = int(out.pop().split()[1])
    need, fit, shy, none, big, own, given = map(int, out.pop().split()[1:])
    ws_one, ws_on, ws_on_bytes, ws_off = map(int, out.pop().split()[1:])
    ws_at, ws_below = map(int, out.pop().split()[1:])
    rows = [(line.split("|")[0], *map(int, line.split("|")[1].split())) for line in out]
    print(rows)
    kernels = [r[0] for r in rows]
    assert kernels == ["decode (wgmma)", "short multi-token (16-column decode)", "general",
                       "short multi-token (8-column decode)", "general", "decode", "prefill", "prefill",
                       "decode", "decode"]
    size = [r[1] for r in rows]
    assert size[1] <= 101376 < size[2]     # SM86 / SM89: 16 columns fit, the general kernel not
    assert size[3] < size[1]               # 8 columns: the decode kernel's layout, smaller
    assert size[4] > 166912                # SM80: the D 256 general kernel does not fit
    assert size[6] > size[7] > 0           # the wgmma layout holds three fp16 tiles, the warp-MMA one two
    assert all(b > 0 for b in size)
    assert 5 * size[0] <= 232448           # SM90: 5 FP8 decode CTAs per SM (tuning.cuh)
    grid = [r[2] for r in rows]
    assert grid[0] == grid[5] == grid[8] == grid[9] == 64     # decode: a tile per sequence (G <= 8)
    assert grid[1] == 64 + 256 * 4 // 16 and grid[3] == 128 + 256 * 4 // 8
    assert grid[2] == 16 + 1024 * 4 // 16
    assert grid[6] == 1 + 2048 * 4 // prefill_rows
    for _, _, _, _, part, nparts, _, _ in rows:
        assert nparts == -(-4096 // part) and part * nparts >= 4096
    assert rows[6][5] == rows[7][5] == 1                      # prefill: one partition
    # the decode-once workspace: SM90's prefill of 64 row groups per sequence takes it, 4096 keys
    # in 64 steps of 64 per kv head, 24832 bytes a tile at D 128 (8 KB K, 16 KB V, scales);
    # below SM90 and for the other kernels none; one group per sequence only when forced
    ws = [(r[6], r[7]) for r in rows]
    assert ws[6] == (64, 64 * 8 * 24832)
    assert all(w == (0, 0) for i, w in enumerate(ws) if i != 6)
    assert (ws_one, ws_on, ws_on_bytes, ws_off) == (0, 64, 16 * 64 * 8 * 24832, 0)
    assert (ws_at, ws_below) == (64, 0)
    # a caller's workspace: taken where the call's bytes fit it, also past the per-call bound
    assert need == 64 * 8 * 24832 and (fit, shy, none) == (need, 0, 0)
    assert big > 2 ** 30 and own == 0 and given == -(-big // (8 * 24832))


def test_the_head_dim_list_is_the_one_the_code_builds_and_rejects_others(tmp_path):
    """limits.cuh's head dims are what the backend reads (turboquant.sources.cuda_limits), what
    compile_check.cu instantiates, and a launcher for any other D fails to compile naming
    limits.cuh (its static_assert)."""
    from turboquant._backends import cuda
    from turboquant.sources import cuda_limits

    dims, lo, hi = cuda_limits()
    assert (cuda.HEAD_DIMS, cuda.MIN_BLOCK_SIZE, cuda.MAX_BLOCK_SIZE) == (dims, lo, hi)
    assert dims == (64, 128, 256) and (lo, hi) == (16, 256)
    probe = tmp_path / "probe.cu"
    probe.write_text('#include "cache_writer.cuh"\n'
                     "namespace turboquant { namespace cuda_fp4 {\n"
                     "static_assert(supported_head_dim<128>() && !supported_head_dim<96>());\n"
                     "template cudaError_t launch_reshape_and_cache<float, 96>("
                     "const CacheWriteParams&, cudaStream_t);\n} }\n")
    r = subprocess.run([NVCC, "-std=c++17", *TARGETS["sm_90a"], "-I", str(CSRC), "-c",
                        str(probe), "-o", str(tmp_path / "probe.o")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "not in limits.cuh's HeadDims" in r.stdout + r.stderr
