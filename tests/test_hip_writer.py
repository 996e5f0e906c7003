"""The HIP cache writer: csrc_cuda's writer hipified (turboquant/hip_writer.py), compiled for
gfx950 and gfx942 with clang-22, and run on the host against the reference writer.

- hipify-torch produces the HIP sources with no CUDA-only name left;
- clang-22 compiles them for gfx950 and gfx942: every writer kernel is in the ISA, with no
  scratch and no spills;
- the same hipified translation unit, built for the host with csrc_hip/shims/host (each
  workgroup's work-items as fibers in 64-lane wavefronts, HIP's shuffle semantics), writes the
  reference writer's bytes exactly: random and awkward inputs, every input dtype, D 64/128/256,
  both scale groups, the transforms on and off, K8V4 keys.
"""
from __future__ import annotations

import dataclasses
import re
import shutil

import pytest
import torch

import turboquant
from turboquant import hip_writer, registry
from turboquant.cache import allocate_cache
from turboquant.config import PLAIN, QuantConfig
from turboquant.smoothing import allocate_state

from _tools import CLANG_MISSING, find_clang

CONFIGS = {"plain": PLAIN, "default": QuantConfig(), "rotation": QuantConfig.parse("rotation"),
           "smooth": QuantConfig.parse("smooth")}
# every launcher (3 dtypes x 3 head dims) has 4 transform variants of 3 key/group forms
NUM_KERNELS = 3 * 3 * 4 * 3


@pytest.fixture(scope="module")
def hip_tu(tmp_path_factory):
    return hip_writer.hipify_writer(tmp_path_factory.mktemp("hip_writer"))


def test_hipify_translates_the_writer(hip_tu):
    files = {f.name: f.read_text() for f in hip_tu.parent.iterdir()}
    assert set(files) == {"cache_writer_hip.cuh", "fp4_portable_hip.cuh", "tuning.cuh",
                          "cache_writer_instances.hip"}
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


@pytest.mark.parametrize("arch", hip_writer.ARCHS)
def test_device_build(device_asm, arch):
    asm = device_asm[arch]
    assert f"amdgcn-amd-amdhsa--{arch}" in asm
    ks = _kernels(asm)
    assert len(ks) == NUM_KERNELS == len(hip_writer.kernel_names(asm))
    for name, k in ks.items():
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
    ids = (torch.arange(n) % 3).to(torch.int32)  # three interleaved sequences
    kw = {}
    if cfg.uses_state:  # the records are filled once (a first write); then both writers read them
        state = allocate_state(4, hkv, d)
        c0 = allocate_cache(nb, hkv, 16, d, scale_group=group, key_format=key_format)
        turboquant.reshape_and_cache_fp4(key, val, *c0, slots, config=cfg, seq_state=state,
                                         state_ids=ids, positions=torch.arange(n) // 3,
                                         backend="reference")
        kw = dict(seq_state=state, state_ids=ids)
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
def test_bit_exact_plain_and_default(host, monkeypatch, d, dtype):
    _check(host, monkeypatch, d, dtype, "plain", seed=d)
    _check(host, monkeypatch, d, dtype, "default", seed=d + 1, slots32=True)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("config", ["plain", "rotation", "smooth", "default"])
def test_bit_exact_per32_scales(host, monkeypatch, d, config):
    _check(host, monkeypatch, d, torch.bfloat16, config, group=32, seed=d + 2)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("config", ["rotation", "smooth"])
def test_bit_exact_one_transform(host, monkeypatch, d, config):
    _check(host, monkeypatch, d, torch.float16, config, seed=d + 3)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype,config", [(torch.bfloat16, "plain"), (torch.float32, "default"),
                                          (torch.float16, "rotation"), (torch.bfloat16, "smooth")])
def test_bit_exact_k8v4(host, monkeypatch, d, dtype, config):
    _check(host, monkeypatch, d, dtype, config, key_format="fp8_e4m3", seed=d + 4)


def test_bit_exact_many_tokens(host, monkeypatch):
    """Several workgroups and a partial last one (300 tokens x 2 heads x 8 lanes at D 128)."""
    _check(host, monkeypatch, 128, torch.bfloat16, "default", n=300, hkv=2, seed=7)


def test_a_wrong_byte_is_caught(host, monkeypatch):
    """The comparison sees one changed code byte and one changed scale byte."""
    ref, hip = _check(host, monkeypatch, 64, torch.bfloat16, "default", seed=11)
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
