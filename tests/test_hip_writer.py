"""The HIP cache writer: csrc_cuda's writer hipified (turboquant/hip_writer.py), compiled for
gfx950 and gfx942 with clang-22, and run on the host against the reference writer.

- hipify-torch produces the HIP sources with no CUDA-only name left;
- clang-22 compiles them for gfx950 and gfx942: every writer kernel is in the ISA, with no
  scratch and no spills;
- the same hipified translation unit, built for the host with csrc_hip/shims/host (each
  workgroup's work-items as fibers in 64-lane wavefronts, HIP's shuffle semantics), writes the
  reference writer's bytes exactly: random and awkward inputs, every input dtype, D 64/128/256,
  both scale groups, the transforms on and off, K8V4 keys;
- the AITER op (aiter.reshape_and_cache_fp4): the AITER patch's launcher
  (integration/aiter/files/cache_fp4.py) over a stand-in for AITER's JIT, its template rendered
  with the hipified sources the patch ships, runs every bit-exact case above too (built for the
  host), and every (dtype, head dim) library it renders compiles for gfx950 and gfx942 under
  AITER's compile flags with every writer kernel, no scratch, no spills, and fp32 subnormals
  kept (AITER's -fgpu-flush-denormals-to-zero would flush them: the launcher's flag undoes it).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

import turboquant
from turboquant import hip_writer, registry
from turboquant.cache import allocate_cache
from turboquant.config import PER_SEQUENCE, PLAIN, QuantConfig
from turboquant.integration.aiter import patch

from conftest import first_write_state

from _tools import CLANG_MISSING, find_clang

CONFIGS = {"plain": PLAIN, "default": QuantConfig(), "rotation": QuantConfig.parse("rotation"),
           "smooth": QuantConfig.parse("smooth"), "per-sequence": PER_SEQUENCE}
# every launcher (3 dtypes x 3 head dims) has 4 transform variants of 3 key/group forms
NUM_KERNELS = 3 * 3 * 4 * 3


@pytest.fixture(scope="module")
def hip_tu(tmp_path_factory):
    return hip_writer.hipify_writer(tmp_path_factory.mktemp("hip_writer"))


def test_hipify_translates_the_writer(hip_tu):
    files = {f.name: f.read_text() for f in hip_tu.parent.iterdir()}
    assert set(files) == {"cache_writer_hip.cuh", "fp4_portable_hip.cuh", "limits.cuh",
                          "tuning.cuh", "cache_writer_instances.hip"}
    writer = files["cache_writer_hip.cuh"]
    assert "#include <hip/hip_runtime.h>" in writer and '#include "fp4_portable_hip.cuh"' in writer
    assert "hipLaunchKernelGGL(( kernel), dim3(blocks), dim3(threads), 0, stream, p)" in writer
    assert "hipError_t launch_reshape_and_cache" in writer
    assert "<hip/hip_bf16.h>" in files["fp4_portable_hip.cuh"]
    assert "__hip_bfloat16" in files["cache_writer_instances.hip"]
    # the PTX of the attention kernels never reaches the writer
    assert not any("asm volatile" in t or "mma.sync" in t for t in files.values())


def test_check_translation_names_what_is_left():
    hip_writer.check_translation("#if defined(__CUDA_ARCH__)\nasm(\"cvt\");\n__nv_x y;\n#endif\n"
                                 "#if defined(__HIP_PLATFORM_AMD__)\nx\n#else\n__shfl_xor_sync(a)\n"
                                 "#endif\n// cudaStream_t in a comment\n", "ok.cuh")
    with pytest.raises(RuntimeError, match=r"bad\.cuh: __shfl_xor_sync, cudaStream_t"):
        hip_writer.check_translation("cudaStream_t s;\n#if X\n__shfl_xor_sync(a)\n#endif\n", "bad.cuh")


# ---- the device build ----------------------------------------------------------------------

def _clang():
    clang = find_clang()
    if clang is None:
        pytest.skip(CLANG_MISSING)
    return clang


def _kernels(asm: str) -> dict:
    """Writer kernel name -> its code ('body'), the '; Name: value' statistics after it and
    the .amdhsa metadata fields (spill counts, segment sizes)."""
    stats = {}
    for m in re.finditer(r"\t\.type\t(\S+),@function\n(.*?)(?=\t\.type\t|\Z)", asm, re.S):
        name, chunk = m.group(1), m.group(2)
        if hip_writer.KERNEL in name:
            stats[name] = {"body": chunk.split(f"\t.size\t{name}, ", 1)[0]}
            stats[name].update({k: int(v) for k, v in re.findall(r"^; (\w+): (\d+)", chunk, re.M)})
    for block in re.split(r"\n  - ", asm.split("amdhsa.kernels:", 1)[1]):
        name = re.search(r"\.name:\s+(\S+)", block)
        if name and name.group(1) in stats:
            stats[name.group(1)].update({k: int(v) for k, v in
                                         re.findall(r"\.(\w+):\s+(\d+)\s*$", block, re.M)})
    return stats


@pytest.fixture(scope="module")
def device_asm(hip_tu):
    return hip_writer.compile_device(hip_tu, hip_writer.ARCHS, hip_tu.parent, clang=_clang())


def _check_kernel_isa(name, k):
    """The writer kernels' machine-code facts (hipified unit and AITER libraries alike)."""
    assert k["ScratchSize"] == 0, name
    assert k["vgpr_spill_count"] == 0 and k["sgpr_spill_count"] == 0, name
    assert k["private_segment_fixed_size"] == 0, name
    assert "scratch_" not in k["body"] and "s_swappc" not in k["body"], name
    assert k["Occupancy"] >= 4, name
    # the group max and the FWHT cross lanes with ds_bpermute (no LDS array, no barrier)
    assert "ds_bpermute_b32" in k["body"] and "s_barrier" not in k["body"], name
    assert k["group_segment_fixed_size"] == 0, name
    assert k["wavefront_size"] == 64 and k["max_flat_workgroup_size"] == 256, name
    # round to nearest even and fp32 subnormals kept (the scale 2^-127 is one): FloatMode
    # 0xF0; the reference's bytes depend on both
    assert k["FloatMode"] == 0xF0, name


@pytest.mark.parametrize("arch", hip_writer.ARCHS)
def test_device_build(device_asm, arch):
    asm = device_asm[arch]
    assert f"amdgcn-amd-amdhsa--{arch}" in asm
    ks = _kernels(asm)
    assert len(ks) == NUM_KERNELS == len(hip_writer.kernel_names(asm))
    for name, k in ks.items():
        _check_kernel_isa(name, k)
    worst = max(ks.values(), key=lambda k: k["NumVgprs"])
    print(f"{arch}: {len(ks)} kernels, VGPRs {min(k['NumVgprs'] for k in ks.values())}.."
          f"{worst['NumVgprs']}, occupancy >= {min(k['Occupancy'] for k in ks.values())} waves/SIMD")


# ---- the host build: bit-exact with the reference -------------------------------------------

@pytest.fixture(scope="module")
def host(hip_tu):
    if shutil.which("g++") is None and shutil.which("clang++") is None:
        pytest.skip("no host C++ compiler (g++ or clang++)")
    return hip_writer.HostWriter(hip_writer.build_host_library(
        hip_tu, hip_tu.parent / "libtq_hip_writer_host.so"))


# ---- the AITER op's launcher over a stand-in for AITER's JIT ---------------------------------

LAUNCHER = "cache_fp4.py"  # what the patch puts in csrc/cpp_itfs/pa/ (from integration/aiter/files)


class FakeAiterJit:
    """Stands in for AITER's csrc.cpp_itfs.utils where the patch's launcher imports it:
    AITER_CORE_DIR holds csrc/cpp_itfs/pa/ with the files the patch adds there
    (patch.new_files); compile_template_op renders the template as AITER's does (the function
    named by AITER's rule from the module name and the template arguments), keeps the source,
    includes and flags, and hands back a function that builds that source for the host on its
    first call (the headers copied into the build's include directory, as AITER's compile_lib
    does) and runs it."""

    def __init__(self, root: Path):
        self.root = root
        self.pa = root / "csrc" / "cpp_itfs" / "pa"
        self.pa.mkdir(parents=True)
        layout = patch.Layout(root, root, "git checkout")
        for path, data in patch.new_files(layout).items():
            if path.parent == self.pa:
                path.write_bytes(data)
        self.builds = {}  # func_name -> {"src", "includes", "cxxflags", "template"}
        self.libs = {}

    def compile_template_op(self, src_template, md_name, includes=None, sources=None,
                            cxxflags=None, func_name=None, folder=None, **kwargs):
        signature = "_".join(str(v).lower() for v in kwargs.values())
        func_name = func_name or f"{md_name}_{hashlib.md5(signature.encode()).hexdigest()}"
        self.builds[func_name] = {"src": src_template.render(func_name=func_name, **kwargs),
                                  "includes": list(includes or []),
                                  "cxxflags": list(cxxflags or []), "template": kwargs}
        self.last = func_name
        return lambda *args: self._lib(func_name)(*args)

    def _lib(self, func_name):
        if func_name not in self.libs:
            build = self.root / "build" / func_name
            (build / "include").mkdir(parents=True)
            for header in self.builds[func_name]["includes"]:
                shutil.copy(header, build / "include")
            (build / f"{func_name}.cpp").write_text(self.builds[func_name]["src"])
            lib = hip_writer.build_host_tu(build / f"{func_name}.cpp", [build / "include"],
                                           build / "lib.so")
            self.libs[func_name] = getattr(ctypes.CDLL(str(lib)), func_name)
        return self.libs[func_name]

    def import_launcher(self):
        """The launcher module, imported with this stand-in as csrc.cpp_itfs.utils (sys.modules
        restored afterwards: nothing else in this process sees a fake csrc)."""
        fake = {"csrc": types.ModuleType("csrc"), "csrc.cpp_itfs": types.ModuleType("csrc.cpp_itfs"),
                "csrc.cpp_itfs.utils": types.ModuleType("csrc.cpp_itfs.utils")}
        fake["csrc.cpp_itfs.utils"].AITER_CORE_DIR = str(self.root)
        fake["csrc.cpp_itfs.utils"].compile_template_op = self.compile_template_op
        saved = {k: sys.modules.get(k) for k in fake}
        sys.modules.update(fake)
        try:
            spec = importlib.util.spec_from_file_location("tq_aiter_cache_fp4", self.pa / LAUNCHER)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        finally:
            for k, v in saved.items():
                sys.modules.pop(k) if v is None else sys.modules.__setitem__(k, v)


@contextlib.contextmanager
def fake_device(arch="gfx950"):
    """torch.cuda's device queries as the launcher asks them, answering `arch`."""
    props = types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-")
    with mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: props), \
            mock.patch.object(torch.cuda, "current_stream",
                              lambda device=None: types.SimpleNamespace(cuda_stream=0)):
        yield


class AiterWriter:
    """aiter.reshape_and_cache_fp4's launcher (what the op calls), on CPU tensors."""

    def __init__(self, jit: FakeAiterJit):
        self.jit = jit
        self.launcher = jit.import_launcher()

    def write(self, write) -> int:
        with fake_device():
            self.launcher.reshape_and_cache_fp4_launch(
                write.key, write.value, write.key_cache, write.value_cache, write.key_scales,
                write.value_scales, write.slot_mapping, write.rotation_signs, write.seq_state,
                write.state_ids)
        return 0


@pytest.fixture(scope="module")
def aiter_jit(tmp_path_factory):
    return FakeAiterJit(tmp_path_factory.mktemp("aiter_writer"))


@pytest.fixture(scope="module")
def aiter_writer(aiter_jit):
    if shutil.which("g++") is None and shutil.which("clang++") is None:
        pytest.skip("no host C++ compiler (g++ or clang++)")
    return AiterWriter(aiter_jit)


# ---- the AITER op's libraries on the device --------------------------------------------------
# The flags of AITER's compile_lib (pinned wheel and upstream alike) that decide this device
# code; tests/test_aiter_routing.py compiles with the whole set AITER writes into its Makefile.
AITER_FLAGS = ("-O3", "-std=c++20", "-D__HIP_PLATFORM_AMD__=1", "-fgpu-flush-denormals-to-zero")
# <dtype, D, GROUP, ...>: the mangled template arguments of one library's kernels
MANGLED = {"Bf16": "I14__hip_bfloat16Li", "Fp16": "I6__halfLi", "Fp32": "IfLi"}


def _aiter_compile(clang, src: Path, pa: Path, arch: str, flags, out: Path, host=False):
    return [clang, "-x", "hip", f"--offload-arch={arch}", "-nogpulib", "-nogpuinc", *AITER_FLAGS,
            *(f for flag in flags for f in flag.split()), f"-I{hip_writer.DEVICE_SHIMS}", f"-I{pa}",
            *(("--offload-host-only", "-c") if host else ("--offload-device-only", "-S")),
            "-o", str(out), str(src)]


@pytest.fixture(scope="module")
def aiter_libs(aiter_jit, tmp_path_factory):
    """Every library the AITER op builds ((arch, scalar, D): the launcher's compile() renders
    each), compiled for its arch as AITER's JIT would: AITER's flags and the launcher's own
    (CXXFLAGS); side by side. Also, as controls: one without the launcher's flags, and the
    host launch code of each arch's first library."""
    clang = _clang()
    launcher = aiter_jit.import_launcher()
    out = tmp_path_factory.mktemp("aiter_writer_asm")
    procs, asm = {}, {}
    for arch in hip_writer.ARCHS:
        for scalar in launcher.SCALARS.values():
            for d in launcher.HEAD_SIZES:
                launcher.compile(scalar, d, arch)
                build = aiter_jit.builds[aiter_jit.last]
                assert build["template"]["arch"] == arch and build["cxxflags"] == launcher.CXXFLAGS
                src = out / f"{arch}_{scalar}_{d}.cpp"
                src.write_text(build["src"])
                asm[arch, scalar, d] = src.with_suffix(".s")
                procs[arch, scalar, d] = subprocess.Popen(_aiter_compile(
                    clang, src, aiter_jit.pa, arch, build["cxxflags"], asm[arch, scalar, d]))
        first = out / f"{arch}_Bf16_64.cpp"
        asm[arch, "no launcher flags"] = out / f"{arch}_noflags.s"
        procs[arch, "no launcher flags"] = subprocess.Popen(_aiter_compile(
            clang, first, aiter_jit.pa, arch, [], asm[arch, "no launcher flags"]))
        procs[arch, "host"] = subprocess.Popen(_aiter_compile(
            clang, first, aiter_jit.pa, arch, launcher.CXXFLAGS, out / f"{arch}_host.o", host=True))
    failed = [k for k, p in procs.items() if p.wait() != 0]
    assert not failed, f"clang failed for {failed}"
    return {k: v.read_text() for k, v in asm.items()}


@pytest.mark.parametrize("arch", hip_writer.ARCHS)
def test_aiter_libraries_compile(aiter_libs, device_asm, arch):
    """Each (dtype, D) library holds its 12 kernels (4 transform sets x 3 key/scale forms), and
    together the 9 hold every kernel of the hipified unit: each with no scratch, no spills and
    fp32 subnormals kept under AITER's -fgpu-flush-denormals-to-zero."""
    seen = set()
    for key, asm in aiter_libs.items():
        if len(key) != 3 or key[0] != arch:
            continue
        _, scalar, d = key
        assert f"amdgcn-amd-amdhsa--{arch}" in asm
        ks = _kernels(asm)
        assert len(ks) == NUM_KERNELS // 9 == len(hip_writer.kernel_names(asm)), (scalar, d)
        for name, k in ks.items():
            assert f"{MANGLED[scalar]}{d}E" in name, (scalar, d, name)
            _check_kernel_isa(name, k)
        seen |= set(ks)
    assert seen == set(hip_writer.kernel_names(device_asm[arch]))


@pytest.mark.parametrize("arch", hip_writer.ARCHS)
def test_aiter_flags_flush_subnormals_without_the_launchers(aiter_libs, arch):
    """The control: the same library under AITER's flags alone flushes fp32 subnormals
    (FloatMode 0xC0), which would change the bytes of groups with subnormal inputs or the
    scale 2^-127; the launcher's CXXFLAGS is what keeps them (0xF0 above)."""
    ks = _kernels(aiter_libs[arch, "no launcher flags"])
    assert ks and all(k["FloatMode"] == 0xC0 for k in ks.values())


@pytest.fixture(scope="module", params=["hipified unit", "aiter op"])
def writer(request):
    """Each bit-exact case runs on the hipified unit's host build (its driver) and on the AITER
    op's launcher with the library AITER's JIT would build from the patch's template."""
    return request.getfixturevalue("host" if request.param == "hipified unit" else "aiter_writer")


class _Capture:
    """Stands in for a backend: keeps the CacheWrite the API would hand to one."""

    def __init__(self):
        self.writes = []

    def reshape_and_cache(self, write):
        self.writes.append(write)


def _hip_write(host, monkeypatch, *args, **kwargs):
    """reshape_and_cache_fp4 through the API's checks and transforms, with the write itself
    done by the host build of the hipified writer."""
    cap = _Capture()
    with monkeypatch.context() as m:
        m.setattr(registry, "select", lambda name, kind, arg: cap)
        turboquant.reshape_and_cache_fp4(*args, **kwargs)
    (write,) = cap.writes
    assert host.write(write) == 0


def _inputs(n, hkv, d, dtype, seed):
    """Random keys and values with awkward rows (as the cuda writer's GPU tests use)."""
    g = torch.Generator().manual_seed(seed)
    key = (torch.randn(n, hkv, d, generator=g) * torch.rand(n, hkv, 1, generator=g) * 8).to(dtype)
    val = torch.randn(n, hkv, d, generator=g).to(dtype)
    key[0, 0] = 0
    key[1, 0] = -0.0
    val[1, 1] = -0.0
    key[2, 0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0])  # exact ties
    val[2, 0, :8] = torch.tensor([-0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0])
    key[3, 0, 5] = float("nan")
    val[3, 1, 7] = float("inf")
    key[4] = key[4] * 1e-30 if dtype == torch.float32 else key[4] * 1e-3
    val[5] = val[5] * (1e30 if dtype == torch.float32 else 1e3)
    key[7, hkv - 1] = key[7, hkv - 1] * 2.0 ** -20  # E4M3 subnormals after the scale
    nb = n // 16 + 3
    slots = torch.randperm(nb * 16, generator=g)[:n]  # shuffled slots
    slots[6] = -1
    slots[n - 1] = -1
    return key, val, nb, slots


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _check(host, monkeypatch, d, dtype, config, group=None, key_format="fp4", n=61, hkv=3,
           slots32=False, seed=0):
    cfg = dataclasses.replace(CONFIGS[config], scale_group=group)
    key, val, nb, slots = _inputs(n, hkv, d, dtype, seed)
    if slots32:
        slots = slots.int()
    kw = first_write_state(cfg, key, val, slots, nb, scale_group=group, key_format=key_format)
    ref = allocate_cache(nb, hkv, 16, d, scale_group=group, fill=0xAB, key_format=key_format)
    hip = allocate_cache(nb, hkv, 16, d, scale_group=group, fill=0xAB, key_format=key_format)
    turboquant.reshape_and_cache_fp4(key, val, *ref, slots, config=cfg, backend="reference", **kw)
    _hip_write(host, monkeypatch, key, val, *hip, slots, config=cfg, **kw)
    for name, a, b in zip(("key_cache", "value_cache", "key_scales", "value_scales"), ref, hip):
        a, b = _bytes(a), _bytes(b)
        bad = (a != b).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}"
    assert (_bytes(hip.key_cache) == 0xAB).any()  # slot -1 and unused slots keep the fill
    return ref, hip


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bit_exact_plain_and_default(writer, monkeypatch, d, dtype):
    _check(writer, monkeypatch, d, dtype, "plain", seed=d)
    _check(writer, monkeypatch, d, dtype, "default", seed=d + 1, slots32=True)
    _check(writer, monkeypatch, d, dtype, "per-sequence", seed=d + 5)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("config", ["plain", "rotation", "smooth", "default", "per-sequence"])
def test_bit_exact_per32_scales(writer, monkeypatch, d, config):
    _check(writer, monkeypatch, d, torch.bfloat16, config, group=32, seed=d + 2)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("config", ["rotation", "smooth"])
def test_bit_exact_one_transform(writer, monkeypatch, d, config):
    _check(writer, monkeypatch, d, torch.float16, config, seed=d + 3)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype,config", [(torch.bfloat16, "plain"), (torch.float32, "default"),
                                          (torch.float16, "rotation"), (torch.bfloat16, "smooth")])
def test_bit_exact_k8v4(writer, monkeypatch, d, dtype, config):
    _check(writer, monkeypatch, d, dtype, config, key_format="fp8_e4m3", seed=d + 4)


def test_bit_exact_many_tokens(writer, monkeypatch):
    """Several workgroups and a partial last one (300 tokens x 2 heads x 8 lanes at D 128)."""
    _check(writer, monkeypatch, 128, torch.bfloat16, "default", n=300, hkv=2, seed=7)


def test_a_wrong_byte_is_caught(writer, monkeypatch):
    """The comparison sees one changed code byte and one changed scale byte."""
    ref, hip = _check(writer, monkeypatch, 64, torch.bfloat16, "default", seed=11)
    for t in (hip.value_cache, hip.key_scales):
        written = (t != 0xAB).nonzero()[0].tolist()
        t[tuple(written)] ^= 1
    assert not torch.equal(ref.value_cache, hip.value_cache)
    assert not torch.equal(ref.key_scales, hip.key_scales)


@pytest.mark.parametrize("threads,width,mask", [(256, 64, 33), (256, 32, 5), (128, 16, 17),
                                                 (64, 8, 12)])
def test_host_shuffle_semantics(host, threads, width, mask):
    """The host runtime's shuffle gives HIP's __shfl_xor: lane (l ^ mask) of the caller's
    64-lane wavefront, or the caller's own value where that partner is past its width-lane
    segment."""
    out = torch.zeros(threads, dtype=torch.int32)
    assert host.shuffle_probe(out, width, mask) == 0
    lane = torch.arange(threads) % 64
    base = torch.arange(threads) - lane
    partner = lane ^ mask
    seg_end = (lane + width) & ~(width - 1)
    want = base + torch.where(partner >= seg_end, lane, partner)
    assert torch.equal(out, want.to(torch.int32))


def test_host_shuffle_needs_a_full_wavefront(host):
    """A wavefront with lanes missing (a 32-thread workgroup) never completes a shuffle: the
    launch is reported as failed instead of reading lanes that do not exist."""
    out = torch.zeros(32, dtype=torch.int32)
    assert host.shuffle_probe(out, 32, 1) == 719  # hipErrorLaunchFailure
