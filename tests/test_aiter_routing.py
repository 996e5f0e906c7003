"""Where a call reaches in a patched AITER: driven on CPU, on the pinned amd-aiter wheel and on
the upstream ROCm/aiter snapshot (see test_aiter_patch.py for where each comes from; a missing
one skips).

Each tree is patched in a temporary directory and imported in its own Python process (the two
trees' `csrc` and `aiter` packages, and the torch op each registers, cannot share one), with
what needs ROCm replaced:

- `chip_info` (upstream's csrc/cpp_itfs/utils.py imports it and asks rocminfo for the GPU,
  raising "ROCm version file not found" without ROCm): a module that answers gfx950;
- `aiter` and `aiter.ops`: bare packages over the tree's directories (their __init__ imports
  all of AITER: triton, compiled modules); `aiter.paged_attention_fp4` is then bound the way
  the real chain binds it, from the import statement the patch put in aiter/ops/attention.py
  (aiter/__init__.py star-imports that module: checked);
- torch.cuda's device properties (gcnArchName gfx950:sramecc+:xnack-, or what a case's
  environment puts in TQ_TEST_GCN_ARCH: the gfx942 cases), current stream and Stream type;
- AITER's compile_template_op runs for real (its compile key, the rendered source) but
  compile_lib builds nothing and run_lib hands back a function that records the ctypes call;
- AITER's direct_register_custom_op registers the op for CPU instead of CUDA.

The cache writer (aiter.reshape_and_cache_fp4) goes further: its calls come from turboquant's
aiter backend (its op, registered for CPU here too, over a CacheWrite the API made), and AITER's
JIT builds its library for real (compile_template_op, compile_lib copying the headers into the
build directory and writing the Makefile with AITER's flags, run_lib loading lib.so), with only
AITER's lock, hipconfig, hipcc flag probe and `make` replaced: the Makefile's unit is built for
the host with csrc_hip/shims/host (the hipified writer's grid run on the CPU), so the bytes it
writes are compared with the reference writer's, and the unit is compiled for gfx950 and gfx942
with the flags AITER wrote into the Makefile.

The attention launcher (pa_v1_fp4) is built the same way for the `host ...` cases: AITER's JIT
renders pa_fp4.cpp.jinja and writes its build directory, and `make` becomes a host build of the
rendered unit over the lane simulation (csrc_hip/sim/tq_fp4_lane_sim.cpp copied beside the shipped
headers, csrc_hip/shims/lane_sim for <hip/hip_runtime.h>: each launch's grid run workgroup by
workgroup, every lane a fiber, the MFMA and the LDS transposing reads modelled); the call comes
from turboquant's aiter backend (its op registered for CPU) and the output is compared with
turboquant's reference attention. The stubbed device's compute units come from TQ_TEST_CUS
(default 256), so a case can pick the plan's partition length.

A record says which module compile_template_op was asked for (pa_v1_fp4: turboquant's kernel;
pa_v1: AITER's own), its template arguments, and the runtime arguments by the names of the
rendered entry point's C parameters (tensors by their names in the call).
"""
from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import test_aiter_patch as tp
from _tools import CLANG_MISSING, find_clang
from turboquant.integration.aiter import patch

ROOT = Path(__file__).resolve().parents[1]
MFMA = "v_mfma_scale_f32_16x16x128_f8f6f4"
MFMA_942 = "v_mfma_f32_16x16x32_fp8_fp8"
ARCH_ENV = "TQ_TEST_GCN_ARCH"  # the stubbed device's gcnArchName, per case
CUS_ENV = "TQ_TEST_CUS"  # the stubbed device's multi_processor_count, per case (default 256)
GFX942 = {ARCH_ENV: "gfx942:sramecc+:xnack-"}
CAPTURING_ENV = "TQ_TEST_CAPTURING"  # "1": the stubbed stream is capturing a graph, per case


# ---------------------------------------------------------------- the driver (child process)

def _c_value(arg):
    import ctypes

    if isinstance(arg, ctypes._Pointer):
        return ctypes.cast(arg, ctypes.c_void_p).value
    if isinstance(arg, ctypes._SimpleCData):
        return arg.value
    return repr(arg)


def _entry_point_params(src: str) -> list[str]:
    """The parameter names of the rendered extern "C" function, in order."""
    m = re.search(r'extern "C"\s*\{\s*(?:void|int)\s+\w+\s*\(([^)]*)\)\s*;', src)
    if m is None:
        raise AssertionError("the rendered source declares no extern \"C\" entry point")
    return [re.findall(r"\w+", p)[-1] for p in m.group(1).split(",")]


WRITER_MODULE = "reshape_and_cache_fp4"  # files/cache_fp4.py's MD_NAME
ATTENTION_MODULE = "pa_v1_fp4"  # files/pa_fp4.py's MD_NAME
# Set while a `host ...` case runs: AITER's JIT then builds the attention launcher for real
# (for the host, over the lane simulation) instead of recording the call only.
HOST_BUILD = {"on": False}


def _is_writer(folder) -> bool:
    return str(folder).startswith(WRITER_MODULE + "_")


def _builds_for_real(folder) -> bool:
    return _is_writer(folder) or (HOST_BUILD["on"]
                                  and str(folder).startswith(ATTENTION_MODULE + "_"))


def _host_make(build_dir: Path, builds: dict) -> subprocess.CompletedProcess:
    """What `make build` does in an AITER build directory, for the host: the Makefile's one
    source built with the host stand-ins and the build's own include directory into lib.so.
    The Makefile's compiler flags are recorded."""
    from turboquant import hip_writer

    makefile = (build_dir / "Makefile").read_text()
    (srcs,) = re.findall(r"^SRCS = (.*)$", makefile, re.M)
    (rule,) = re.findall(r"^\t\$\(CXX\) -fPIC (.*) -c \$< -o \$@$", makefile, re.M)
    assert srcs.split() == [f"{build_dir.name}.cpp"], srcs
    if build_dir.name.startswith(ATTENTION_MODULE + "_"):
        _host_build_attention(build_dir / srcs.strip(), build_dir / "include", build_dir / "lib.so")
    else:
        hip_writer.build_host_tu(build_dir / srcs.strip(), [build_dir / "include"],
                                 build_dir / "lib.so")
    builds[build_dir.name] = {"makefile_rule": rule, "build_dir": str(build_dir),
                              "src": (build_dir / srcs.strip()).read_text()}
    return subprocess.CompletedProcess(["make", "build"], 0, "", "")


LANE_SIM = ROOT / "csrc_hip" / "sim" / "tq_fp4_lane_sim.cpp"
LANE_SIM_SHIMS = ROOT / "csrc_hip" / "shims" / "lane_sim"


def _host_build_attention(src: Path, include: Path, out: Path) -> None:
    """The rendered attention unit for the host over the lane simulation (module docstring): the
    simulation is copied into the build's include directory, so the header it includes is the
    one AITER's JIT copied there from the patch, as the rendered unit's is."""
    import shutil

    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no host C++ compiler (g++ or clang++) found")
    (include / "sim").mkdir(exist_ok=True)
    shutil.copy(LANE_SIM, include / "sim" / LANE_SIM.name)
    # -O0: the unit instantiates the whole simulation (its own entry points too); unoptimized it
    # builds in seconds and runs the small problems here in seconds as well.
    subprocess.run([cxx, "-std=c++20", "-O0", "-shared", "-fPIC", "-Wno-psabi", "-DTQ_HOST_SIM",
                    f"-I{LANE_SIM_SHIMS}", f"-I{include}", f'-DTQ_PA_FP4_TU="{src}"', "-o",
                    str(out), str(LANE_SIM_SHIMS / "pa_fp4_host.cpp")], check=True)


def _real_writer_jit(utils, builds: dict) -> None:
    """AITER's JIT as it is for the writer's module, but for the lock (AITER's FileBaton comes
    with aiter.jit's imports), hipconfig (ROCm 7.0), the hipcc flag probe (every flag kept: the
    test probes clang-22) and make (_host_make)."""
    from packaging.version import Version

    def mp_lock(lock_path, main_func, final_func=None, wait_func=None):
        main_func()
        if final_func is not None:
            final_func()

    class _Subprocess:
        def __getattr__(self, name):
            return getattr(subprocess, name)

        @staticmethod
        def run(cmd, *args, **kwargs):
            text = cmd if isinstance(cmd, str) else " ".join(map(str, cmd))
            if "make build" in text:
                cwd = kwargs.get("cwd") or re.search(r"cd (\S+) &&", text).group(1)
                return _host_make(Path(cwd), builds)
            return subprocess.run(cmd, *args, **kwargs)

    utils.mp_lock = mp_lock
    utils.get_hip_version = lambda: Version("7.0.0")
    utils.hip_flag_checker = lambda flag: True
    utils.subprocess = _Subprocess()


def _stub_rocm(root: Path, meta: Path) -> dict:
    """Everything the module docstring lists; returns the capture dict the stubs fill."""
    import torch

    chip_info = types.ModuleType("chip_info")
    chip_info.get_gfx_runtime = chip_info.get_gfx = lambda: "gfx950"
    chip_info.get_cu_num = lambda: 256
    sys.modules["chip_info"] = chip_info
    for name, path in (("aiter", root / "aiter"), ("aiter.ops", root / "aiter" / "ops")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    sys.modules["aiter"].ops = sys.modules["aiter.ops"]
    sys.path[:0] = [str(meta), str(root)]

    class Props:  # gcnArchName (TQ_TEST_GCN_ARCH) and CUs (TQ_TEST_CUS) per case
        warp_size = 64

        @property
        def gcnArchName(self):
            return os.environ.get(ARCH_ENV, "gfx950:sramecc+:xnack-")

        @property
        def multi_processor_count(self):
            return int(os.environ.get(CUS_ENV, "256"))

    props = Props()
    torch.cuda.get_device_properties = lambda device=None: props
    stream = type("Stream", (), {"cuda_stream": 0})  # AITER's torch_to_c_types checks the type
    torch.cuda.Stream = stream
    torch.cuda.current_stream = lambda device=None: stream()
    torch.cuda.is_current_stream_capturing = lambda: os.environ.get(CAPTURING_ENV) == "1"

    from csrc.cpp_itfs import torch_utils, utils

    capture: dict = {"builds": {}}
    real = {name: getattr(utils, name) for name in ("compile_template_op", "not_built",
                                                      "compile_lib", "run_lib")}
    _real_writer_jit(utils, capture["builds"])

    def compile_template_op(src_template, md_name, *args, **kwargs):
        capture["module"] = md_name
        capture["template"] = {k: v for k, v in kwargs.items()
                               if k not in ("folder", "includes", "sources", "cxxflags")}
        capture["cxxflags"] = list(kwargs.get("cxxflags") or [])  # compile_lib extends it
        return real["compile_template_op"](src_template, md_name, *args, **kwargs)

    def compile_lib(src, folder, *args, **kwargs):
        capture["src"] = src
        if _builds_for_real(folder):
            real["compile_lib"](src, folder, *args, **kwargs)

    def run_lib(func_name, folder=None):
        capture["func_name"] = func_name
        lib = real["run_lib"](func_name, folder) if _builds_for_real(func_name) else None

        def call(*args):
            capture["args"] = [_c_value(a) for a in args]
            return lib(*args) if lib is not None else None
        return call

    utils.compile_template_op = compile_template_op
    utils.not_built = lambda folder: real["not_built"](folder) if _builds_for_real(folder) else True
    utils.compile_lib = compile_lib
    utils.run_lib = run_lib
    real_register = torch_utils.direct_register_custom_op
    torch_utils.direct_register_custom_op = (
        lambda *args, **kwargs: real_register(*args, **{**kwargs, "dispatch_key": "CPU"}))
    return capture


def _bind_aiter_op(root: Path) -> dict:
    """aiter.paged_attention_fp4 and aiter.reshape_and_cache_fp4 as the real import chain binds
    them; the facts of that chain."""
    import importlib

    attention = ast.parse((root / "aiter/ops/attention.py").read_text())
    hook = [n for n in attention.body if isinstance(n, ast.ImportFrom) and n.level == 1
            and n.module in ("turboquant_fp4", "turboquant_fp4_cache")]
    init = ast.parse((root / "aiter/__init__.py").read_text())
    facts = {
        "attention_imports": [a.name for n in hook for a in n.names],
        "attention_has_all": any(isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
            for n in attention.body),
        "init_star_imports_attention": any(
            isinstance(n, ast.ImportFrom) and n.level == 1 and n.module == "ops.attention"
            and [a.name for a in n.names] == ["*"] for n in ast.walk(init)),
    }
    for node in hook:
        module = importlib.import_module(f"aiter.ops.{node.module}")
        for alias in node.names:
            setattr(sys.modules["aiter"], alias.asname or alias.name, getattr(module, alias.name))
    return facts


def _problem(seq_lens, hkv=2, gqa=4, d=128, bs=16, dtype="bfloat16", tokens=None,
             max_blocks=None):
    """Named CPU tensors of one call (contents do not matter: nothing runs)."""
    import torch

    max_blocks = max_blocks or max(math.ceil(n / bs) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks
    dt = getattr(torch, dtype)
    query = torch.zeros(tokens or len(seq_lens), hkv * gqa, d, dtype=dt)
    return {
        "out": torch.empty_like(query),
        "query": query,
        "key_cache": torch.zeros(num_blocks, hkv, bs, d // 2, dtype=torch.uint8),
        "value_cache": torch.zeros(num_blocks, hkv, bs, d // 2, dtype=torch.uint8),
        "key_scales": torch.zeros(num_blocks, bs, hkv, dtype=torch.uint8),
        "value_scales": torch.zeros(num_blocks, bs, hkv, dtype=torch.uint8),
        "block_tables": torch.arange(num_blocks, dtype=torch.int32).view(len(seq_lens), -1),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "workspace": torch.empty(1 << 22, dtype=torch.uint8),
    }


def _op_call(t, scale=0.125, **kwargs):
    import aiter

    return lambda: aiter.paged_attention_fp4(
        t["query"], t["key_cache"], t["value_cache"], t["key_scales"], t["value_scales"],
        t["block_tables"], t["seq_lens"], scale, out=t["out"], workspace_buffer=t["workspace"],
        **kwargs)


def _pa_v1_call(t, kv_cache_dtype="fp4_e2m1", scale=0.125, layout="HND", cu_query_lens=None,
                **kwargs):
    from csrc.cpp_itfs.pa import pa_v1

    max_context_len = t["block_tables"].size(1) * t["key_cache"].size(2)
    return lambda: pa_v1.paged_attention_v1(
        t["out"], t["workspace"], t["query"], t["key_cache"], t["value_cache"], scale,
        t["block_tables"], cu_query_lens, t["seq_lens"], max_context_len, None, kv_cache_dtype,
        layout, 0.0, t["key_scales"], t["value_scales"], **kwargs)


def _cases():
    """name -> (environment for the call, tensors, the call)."""
    import torch

    lut = {"AITER_FP4_KV_LUT": "1"}
    decode = _problem([20, 33, 1])
    half = _problem([100, 7], hkv=1, gqa=8, d=64, bs=32, dtype="float16")
    transforms = _problem([20, 33, 1])
    transforms.update(rotation_signs=torch.ones(128), seq_state=torch.zeros(5, 2, 5, 128),
                      state_ids=torch.tensor([4, 0, 2], dtype=torch.int32))
    multi = _problem([20, 33], tokens=5)
    multi["cu_query_lens"] = torch.tensor([0, 3, 5], dtype=torch.int32)
    window = _problem([20, 33, 1])
    states = _problem([20, 33, 1])
    states.update(sinks=torch.zeros(8), lse=torch.zeros(3, 8))
    k8v4 = _problem([20, 33, 1])  # E4M3 keys: rows of D bytes
    k8v4["key_cache"] = torch.zeros(9, 2, 16, 128, dtype=torch.float8_e4m3fn)
    k8v4_u8 = dict(k8v4, key_cache=k8v4["key_cache"].view(torch.uint8))
    k8v4_strided = dict(k8v4, key_cache=torch.zeros(9, 2, 16, 256, dtype=torch.float8_e4m3fn)[..., :128])
    k8v4_narrow = dict(k8v4, key_cache=torch.zeros(9, 2, 16, 64, dtype=torch.float8_e4m3fn))
    bf16_cache = _problem([20, 33, 1])
    gqa32 = _problem([20, 33, 1], hkv=1, gqa=32, d=64)
    small_ws = dict(decode, workspace=torch.empty(1000, dtype=torch.uint8))
    odd_ws = dict(decode, workspace=torch.empty(1 << 20, dtype=torch.uint8)[1:])
    wide = _problem([1] * 300, hkv=64, gqa=1, d=64)  # 300 x 64 = 19200 tickets
    wide["workspace"] = None  # (the op's own, of the plan's size)
    odd_state = _problem([20, 33, 1])
    odd_state.update(seq_state=torch.zeros(5 * 2 * 5 * 128 + 1)[1:].view(5, 2, 5, 128),
                     state_ids=torch.tensor([4, 0, 2], dtype=torch.int32))
    empty = _problem([20, 33, 1])
    empty.update({k: empty[k][:0] for k in ("key_cache", "value_cache", "key_scales",
                                            "value_scales")})
    bf16_cache["key_cache"] = torch.zeros(6, 2, 16, 128, dtype=torch.bfloat16)
    bf16_cache["value_cache"] = torch.zeros(6, 2, 16, 128, dtype=torch.bfloat16)
    t = transforms
    return {
        "op decode": ({}, decode, _op_call(decode)),
        "op decode LUT by env": (lut, decode, _op_call(decode)),
        "op decode use_native=False": ({}, decode, _op_call(decode, use_native=False)),
        "op decode use_native=True, LUT env": (lut, decode, _op_call(decode, use_native=True)),
        "op decode fp16 D64 block 32 gqa 8 soft cap": (
            {}, half, _op_call(half, logits_soft_cap=30.0, max_seq_len=100)),
        "op decode transforms": ({}, t, _op_call(
            t, rotation_signs=t["rotation_signs"], seq_state=t["seq_state"],
            state_ids=t["state_ids"], sink=True)),
        "op seq_state without state_ids": ({}, t, _op_call(t, seq_state=t["seq_state"], sink=True)),
        "pa_v1 fp4_e2m1": ({}, decode, _pa_v1_call(decode)),
        "pa_v1 fp4": ({}, decode, _pa_v1_call(decode, kv_cache_dtype="fp4")),
        "pa_v1 fp4 LUT by env": (lut, decode, _pa_v1_call(decode)),
        "pa_v1 fp4 NHD": ({}, decode, _pa_v1_call(decode, layout="NHD")),
        "pa_v1 auto (bf16 cache)": ({}, bf16_cache, _pa_v1_call(bf16_cache, kv_cache_dtype="auto")),
        "op multi-token": ({}, multi, _op_call(multi, cu_query_lens=multi["cu_query_lens"])),
        "op sliding window": ({}, window, _op_call(window, sliding_window=8)),
        "pa_v1 fp4 multi-token": ({}, multi, _pa_v1_call(
            multi, cu_query_lens=multi["cu_query_lens"])),
        "pa_v1 fp4 sliding window": ({}, window, _pa_v1_call(window, sliding_window=8)),
        "op k8v4": ({}, k8v4, _op_call(k8v4)),
        "op sinks and lse": ({}, states, _op_call(states, sinks=states["sinks"], lse=states["lse"])),
        "op lse of the wrong shape": ({}, states, _op_call(states, lse=states["lse"][:2])),
        "op k8v4 uint8 view": ({}, k8v4_u8, _op_call(k8v4_u8)),
        "op k8v4 LUT by env": (lut, k8v4, _op_call(k8v4)),
        "pa_v1 fp4 k8v4": ({}, k8v4, _pa_v1_call(k8v4)),
        "op k8v4 key strides": ({}, k8v4_strided, _op_call(k8v4_strided)),
        "op k8v4 narrow rows": ({}, k8v4_narrow, _op_call(k8v4_narrow)),
        # gfx942 (MI300X): the LUT path only, FP4 keys only
        "gfx942 op decode": (GFX942, decode, _op_call(decode)),
        "gfx942 op decode LUT env": ({**GFX942, **lut}, decode, _op_call(decode)),
        "gfx942 op decode use_native=True": (GFX942, decode, _op_call(decode, use_native=True)),
        "gfx942 pa_v1 fp4_e2m1": (GFX942, decode, _pa_v1_call(decode)),
        "gfx942 op multi-token": (GFX942, multi, _op_call(multi, cu_query_lens=multi["cu_query_lens"])),
        "gfx942 op k8v4": (GFX942, k8v4, _op_call(k8v4)),
        "gfx90a op decode": ({ARCH_ENV: "gfx90a:sramecc+:xnack-"}, decode, _op_call(decode)),
        # the plan: partition length from the CUs and max_seq_len, GQA 32 decode as multi-token,
        # the workspace's size and alignment
        "op decode max_seq_len 4096": ({}, decode, _op_call(decode, max_seq_len=4096)),
        "op decode max_seq_len 4096 1 CU": ({CUS_ENV: "1"}, decode,
                                            _op_call(decode, max_seq_len=4096)),
        "gfx942 op decode max_seq_len 4096": (GFX942, decode, _op_call(decode, max_seq_len=4096)),
        "op decode gqa 32": ({}, gqa32, _op_call(gqa32)),
        "op workspace too small": ({}, small_ws, _op_call(small_ws, max_seq_len=4096)),
        "op workspace misaligned": ({}, odd_ws, _op_call(odd_ws)),
        "op no workspace": ({}, decode, _op_call(dict(decode, workspace=None))),
        # the reduce's tickets under graph capture: made before (by the cases above), or refused
        "op decode capturing": ({CAPTURING_ENV: "1"}, decode, _op_call(decode)),
        "op capturing more tickets than made": ({CAPTURING_ENV: "1"}, wide, _op_call(wide)),
        "op more tickets than made": ({}, wide, _op_call(wide)),
        "op seq_state misaligned": ({}, odd_state, _op_call(
            odd_state, seq_state=odd_state["seq_state"], state_ids=odd_state["state_ids"])),
        "op empty cache": ({}, empty, _op_call(empty)),
    }


def _writer_problem(n=37, hkv=2, d=128, dtype="bfloat16", config="default", group=None,
                    key_format="fp4", slots32=False, seed=0):
    """The CacheWrite turboquant.reshape_and_cache_fp4 hands a backend (its checks and
    transforms applied; the state records filled by a first reference write), a cache it is to
    fill and the reference writer's bytes for it (both caches start as 0xAB)."""
    import dataclasses

    import torch

    import turboquant
    from turboquant import registry
    from turboquant.cache import allocate_cache
    from turboquant.config import QuantConfig
    from conftest import first_write_state

    cfg = dataclasses.replace(QuantConfig.parse(config), scale_group=group)
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    key = (torch.randn(n, hkv, d, generator=g) * torch.rand(n, hkv, 1, generator=g) * 8).to(dt)
    value = torch.randn(n, hkv, d, generator=g).to(dt)
    key[0, 0] = 0
    key[1, 0, 3] = float("nan")
    value[2, 1] = value[2, 1] * (1e-38 if dt == torch.float32 else 1e-4)  # fp32: subnormals
    nb = n // 16 + 2
    slots = torch.randperm(nb * 16, generator=g)[:n]
    slots[3] = -1
    slots = slots.int() if slots32 else slots
    kw = first_write_state(cfg, key, value, slots, nb, scale_group=group, key_format=key_format)
    ref = allocate_cache(nb, hkv, 16, d, scale_group=group, fill=0xAB, key_format=key_format)
    out = allocate_cache(nb, hkv, 16, d, scale_group=group, fill=0xAB, key_format=key_format)
    turboquant.reshape_and_cache_fp4(key, value, *ref, slots, config=cfg, backend="reference", **kw)
    writes, select = [], registry.select
    registry.select = lambda name, kind, arg: types.SimpleNamespace(reshape_and_cache=writes.append)
    try:
        turboquant.reshape_and_cache_fp4(key, value, *out, slots, config=cfg, **kw)
    finally:
        registry.select = select
    return writes[0], ref, out


def _writer_tensors(write) -> dict:
    names = ("key", "value", "key_cache", "value_cache", "key_scales", "value_scales",
             "slot_mapping", "rotation_signs", "seq_state", "state_ids")
    return {n: getattr(write, n) for n in names if getattr(write, n) is not None}


def _through_backend(write, ref, out):
    """turboquant's aiter backend writes `write` (its op -> aiter.reshape_and_cache_fp4 ->
    the launcher -> the library AITER's JIT built); which cache tensors equal the reference's."""
    import torch

    from turboquant._backends import aiter as tq_aiter

    def call():
        tq_aiter.BACKEND.reshape_and_cache(write)
        as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731
        return {"equal": {n: torch.equal(as_bytes(a), as_bytes(b)) for n, a, b in zip(
                    ("key_cache", "value_cache", "key_scales", "value_scales"), ref, out)},
                "untouched_bytes": int((as_bytes(out.key_cache) == 0xAB).sum())}
    return call


def _aiter_writer_call(write, **changes):
    """aiter.reshape_and_cache_fp4 called directly, with some arguments replaced."""
    import aiter

    t = {**_writer_tensors(write), **changes}
    return lambda: aiter.reshape_and_cache_fp4(
        t["key"], t["value"], t["key_cache"], t["value_cache"], t["key_scales"],
        t["value_scales"], t["slot_mapping"], rotation_signs=t.get("rotation_signs"),
        seq_state=t.get("seq_state"), state_ids=t.get("state_ids"))


def _writer_cases():
    """name -> (environment, tensors, the call): the cache writer's."""
    import torch

    from turboquant._backends import aiter as tq_aiter

    # turboquant's op runs here on CPU tensors: its aiter implementation registered for CPU too
    torch.library.impl(tq_aiter.CACHE_WRITE_OP, "CPU")(tq_aiter._write_impl)
    default = _writer_problem()
    k8v4 = _writer_problem(hkv=3, d=64, dtype="float32", config="plain", key_format="fp8_e4m3",
                           slots32=True, seed=1)
    per32 = _writer_problem(d=256, dtype="float16", config="rotation", group=32, seed=2)
    smooth = _writer_problem(config="smooth", seed=3)
    gfx942 = _writer_problem(seed=4)
    w = default[0]
    other = _writer_problem(d=64, seed=5)[0]
    k8w = k8v4[0]
    wide = torch.zeros(w.key_cache.shape[:3] + (w.key_cache.shape[3] * 2,), dtype=torch.uint8)
    return {
        "writer default": ({}, _writer_tensors(w), _through_backend(*default)),
        "writer k8v4 fp32 D64 int32 slots": ({}, _writer_tensors(k8w), _through_backend(*k8v4)),
        "writer per32 fp16 D256 rotation": ({}, _writer_tensors(per32[0]), _through_backend(*per32)),
        "writer smooth": ({}, _writer_tensors(smooth[0]), _through_backend(*smooth)),
        "gfx942 writer default": (GFX942, _writer_tensors(gfx942[0]), _through_backend(*gfx942)),
        "writer key_cache strided": ({}, {}, _aiter_writer_call(w, key_cache=wide[..., :64])),
        "writer state_ids without seq_state": ({}, {}, _aiter_writer_call(w, seq_state=None)),
        "writer k8v4 per-32 scales": ({}, {}, _aiter_writer_call(
            k8w, key_scales=torch.zeros(k8w.key_scales.shape + (2,), dtype=torch.uint8),
            value_scales=torch.zeros(k8w.key_scales.shape + (2,), dtype=torch.uint8))),
        "writer slot_mapping float": ({}, {}, _aiter_writer_call(
            w, slot_mapping=w.slot_mapping.float())),
        "writer head_size 32": ({}, {}, _aiter_writer_call(
            other, key=other.key[..., :32], value=other.value[..., :32])),
        "writer key rows misaligned": ({}, {}, _aiter_writer_call(
            w, key=torch.zeros(37 * 2 * 128 + 1, dtype=torch.bfloat16)[1:].view(37, 2, 128))),
        "gfx90a writer": ({ARCH_ENV: "gfx90a:sramecc+:xnack-"}, {}, _aiter_writer_call(w)),
    }


def _host_problem(seq_lens, q_lens=None, hkv=2, gqa=4, d=128, config="default",
                  key_format="fp4", seed=0):
    """A paged cache written by the reference writer (default config: rotation, key smoothing
    and the sink, through the shared state), a query and cu_query_lens (None: decode)."""
    import itertools

    import torch

    from turboquant.cache import build_paged_problem
    from turboquant.config import QuantConfig

    g = torch.Generator().manual_seed(seed)
    prob = build_paged_problem(list(seq_lens), hkv, d, 16, write_backend="reference",
                               generator=g, config=QuantConfig.parse(config),
                               key_format=key_format, spare_blocks=2)
    n = len(seq_lens) if q_lens is None else sum(q_lens)
    q = torch.randn(n, hkv * gqa, d, generator=g).to(torch.bfloat16)
    cu = None if q_lens is None else torch.tensor([0, *itertools.accumulate(q_lens)],
                                                  dtype=torch.int32)
    return prob, q, cu


def _compare(out, ref, lse=None, lse_ref=None) -> dict:
    import torch

    rec = {"finite": bool(torch.isfinite(out).all()),
           "rel": ((out.float() - ref.float()).norm() / ref.float().norm()).item()}
    if lse is not None:
        both_inf = torch.isinf(lse) & torch.isinf(lse_ref) & (lse.sign() == lse_ref.sign())
        rec["lse_max_err"] = (lse - lse_ref).abs().masked_fill(both_inf, 0).max().item()
    return rec


def _host_backend_call(prob, q, cu=None, **kw):
    """turboquant.paged_attention_fp4 -> the aiter backend (selected without its device check:
    the tensors are on the CPU) -> its op -> aiter.paged_attention_fp4 -> the launcher -> the
    library AITER's JIT built for the host; compared with the reference backend."""
    import torch

    import turboquant
    from turboquant import registry
    from turboquant._backends import aiter as tq_aiter

    args = (q, *prob.cache, prob.block_tables, prob.seq_lens, q.size(2) ** -0.5)
    kw = {**prob.kwargs, "cu_query_lens": cu, **kw}

    def call():
        ref = turboquant.paged_attention_fp4(*args, backend="reference", **kw)
        select = registry.select
        registry.select = lambda name, kind, arg: tq_aiter.BACKEND
        HOST_BUILD["on"] = True
        try:
            got = turboquant.paged_attention_fp4(*args, backend="aiter", **kw)
        finally:
            registry.select = select
            HOST_BUILD["on"] = False
        if kw.get("return_lse"):
            return _compare(got[0], ref[0], got[1], ref[1])
        return _compare(got, ref)
    return {"query": q, "key_cache": prob.cache[0], "value_cache": prob.cache[1]}, call


def _host_pa_v1_call(prob, q, ws_bytes=None):
    """pa_v1's fp4 branch (no transforms: a plain cache) with a workspace as pa_v1's callers
    fill it (torch.empty: here 0xFF bytes), of ws_bytes (None: pa_v1's size, 256-token
    partitions); after the call, whether the launcher's tickets are all zero."""
    import torch

    import turboquant
    from csrc.cpp_itfs.pa import pa_fp4, pa_v1

    num_tokens, num_heads, d = q.shape
    max_len = prob.block_tables.size(1) * prob.cache[0].size(2)
    parts = -(-max_len // 256)
    ws = torch.full((ws_bytes or num_tokens * num_heads * parts * (8 + 2 * d),), 0xFF,
                    dtype=torch.uint8)
    out = torch.empty_like(q)
    scale = d ** -0.5

    def call():
        HOST_BUILD["on"] = True
        try:
            pa_v1.paged_attention_v1(out, ws, q, prob.cache[0], prob.cache[1], scale,
                                     prob.block_tables, None, prob.seq_lens, max_len, None,
                                     "fp4_e2m1", "HND", 0.0, prob.cache[2], prob.cache[3])
        finally:
            HOST_BUILD["on"] = False
        ref = turboquant.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                             scale, backend="reference", **prob.kwargs)
        tickets = [t for have in pa_fp4._TICKETS.values() for t in have]
        return {**_compare(out, ref), "tickets_zero": bool(tickets) and all(
            bool((t == 0).all()) for t in tickets)}
    return {"query": q, "workspace": ws, "out": out}, call


def _host_cases():
    """name -> (environment, tensors, the call): gfx950 launches on the lane simulation."""
    import torch

    from turboquant._backends import aiter as tq_aiter

    # turboquant's op runs here on CPU tensors: its aiter implementation registered for CPU too
    torch.library.impl(tq_aiter.ATTENTION_OP, "CPU")(tq_aiter._impl)
    lens = [1, 54, 300]
    default = _host_problem(lens)
    plain = _host_problem(lens, config="plain", seed=1)
    multi = _host_problem(lens, q_lens=[1, 5, 3], seed=2)
    k8v4 = _host_problem(lens, config="plain", key_format="fp8_e4m3", seed=3)
    cases = {
        # 304 tokens of block table, 256 CUs: 256-token partitions (2)
        "host decode default": ({}, *_host_backend_call(*default)),
        "host decode default LUT soft cap": (
            {"AITER_FP4_KV_LUT": "1"}, *_host_backend_call(*default, logits_soft_cap=5.0)),
        # one CU: 4 waves wanted, 3 sequences x 2 kv heads x one partition of 2048 give them
        "host decode 1 CU": ({CUS_ENV: "1"}, *_host_backend_call(*plain)),
        "host multi-token window sinks lse": ({}, *_host_backend_call(
            *multi, sliding_window=64, sinks=torch.linspace(-1, 2, 8), return_lse=True)),
        "host k8v4 soft cap": ({}, *_host_backend_call(*k8v4, logits_soft_cap=5.0)),
        # pa_v1's size is too small for the gfx950 plan: the call takes a buffer of its own
        "host pa_v1 fp4 garbage workspace": ({}, *_host_pa_v1_call(plain[0], plain[1])),
        # large enough: used as it is (pa_v1's callers never zero it; nothing needs it zero)
        "host pa_v1 fp4 large garbage workspace": (
            {}, *_host_pa_v1_call(plain[0], plain[1], ws_bytes=1 << 16)),
    }
    return {name: (env, tensors, call) for name, (env, tensors, call) in cases.items()}


def drive(root: str, meta: str) -> dict:
    """Run every case in this (child) process; JSON-able records by case name."""
    root, meta = Path(root), Path(meta)
    capture = _stub_rocm(root, meta)
    records = {"chain": _bind_aiter_op(root)}
    from csrc.cpp_itfs import utils
    from csrc.cpp_itfs.pa import cache_fp4, pa_fp4

    records["digest"] = pa_fp4.KERNEL_DIGEST
    records["writer_digest"] = cache_fp4.WRITER_DIGEST
    records["writer_cxxflags"] = cache_fp4.CXXFLAGS
    records["pa_dir"] = str(Path(pa_fp4.__file__).parent)
    for name, (env, tensors, call) in {**_cases(), **_writer_cases(), **_host_cases()}.items():
        for k in list(capture):
            if k != "builds":
                del capture[k]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            result = call()
            error = None
        except Exception as e:  # noqa: BLE001 - the record says what was raised
            error, result = f"{type(e).__name__}: {e}", None
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        record = {"error": error, **{k: capture[k] for k in ("module", "template", "func_name")
                                     if k in capture}}
        if isinstance(result, dict):
            record.update(result)
        if "template" in capture:
            record["expected_func_name"] = utils.get_default_func_name(
                capture["module"], tuple(capture["template"].values()))
        if capture.get("module") == cache_fp4.MD_NAME:
            record["cxxflags"] = capture["cxxflags"]
        if capture.get("module") in (pa_fp4.MD_NAME, cache_fp4.MD_NAME):
            record["build"] = capture["builds"].get(capture.get("func_name"))
            if "src" not in capture and record["build"]:  # built by an earlier case
                capture["src"] = record["build"]["src"]
        if capture.get("module") == pa_fp4.MD_NAME and record.get("build"):
            import ctypes

            lib = ctypes.CDLL(str(Path(record["build"]["build_dir"]) / "lib.so"))
            record["host_error"] = lib.tq_lane_host_last_error()  # a deadlocked launch: 719
        if capture.get("module") in (pa_fp4.MD_NAME, cache_fp4.MD_NAME) and "args" in capture:
            params = _entry_point_params(capture["src"])
            labels = {t.data_ptr(): f"<{k}>" for k, t in tensors.items() if hasattr(t, "data_ptr")}
            args = [labels.get(a, a) if isinstance(a, int) and a > 4096 else a
                    for a in capture["args"]]
            record["nargs"], record["nparams"] = len(args), len(params)
            record["args"] = dict(zip(params, args))
            record["src"] = capture["src"]
        records[name] = record
    return records


# ---------------------------------------------------------------- the tests (pytest process)

@pytest.fixture(scope="module", params=tp.TREES)
def routes(request, tmp_path_factory):
    tree = tp.make_tree(request.param, tmp_path_factory.mktemp("aiter_routing"))
    assert patch.apply(tree.root).startswith("patched")
    meta = patch.find_layout(tree.root).meta
    script = ("import json, sys; sys.path[:0] = sys.argv[1:3]; import test_aiter_routing as t; "
              "print(json.dumps(t.drive(sys.argv[3], sys.argv[4])))")
    env = dict(os.environ, AITER_ROOT_DIR=str(tmp_path_factory.mktemp("aiter_build_root")))
    env.pop("AITER_FP4_KV_LUT", None)
    # AITER's compile_lib (the writer's library is built): the arch list and an empty CK
    ck = tmp_path_factory.mktemp("composable_kernel")
    (ck / "include").mkdir()
    env.update(GPU_ARCHS="gfx950", CK_DIR=str(ck))
    r = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(ROOT),
                        str(tree.root), str(meta)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, f"{tree.label}:\n{r.stderr[-4000:]}"
    records = json.loads(r.stdout.strip().splitlines()[-1])
    records["tree"] = tree.label
    return records


def _reached(records, case, module="pa_v1_fp4"):
    rec = records[case]
    assert rec["error"] is None, f"{records['tree']}: {case}: {rec['error']}"
    assert rec["module"] == module, f"{case} reached {rec['module']}, not {module}"
    # AITER's compile key of these template arguments: the lib.so that would be loaded
    assert rec["func_name"] == rec["expected_func_name"]
    assert rec["func_name"].startswith(module + "_")
    if module == "pa_v1_fp4":
        assert rec["nargs"] == rec["nparams"], \
            f"{case}: {rec['nargs']} ctypes arguments for {rec['nparams']} C parameters"
    return rec


def _template(gqa, d, bs, scalar, digest, multi_token=False, key_format="fp4", arch="gfx950"):
    return {"gqa_ratio": gqa, "head_size": d, "block_size": bs, "scalar": scalar,
            "multi_token": multi_token, "key_format": key_format, "kv_fp4": "e2m1_e8m0",
            "kernel_digest": digest, "arch": arch}


def _decode_args(rec, **expect):
    for name, value in expect.items():
        assert rec["args"][name] == value, f"{name}: {rec['args'][name]!r} != {value!r}"


sys.path.insert(0, str(ROOT / "benchmarks"))
from isa_model import plan_module  # noqa: E402 - the one loader of the plan

PLAN = plan_module()
def _plan_args(arch, seqs=(20, 33, 1), tokens=None, hkv=2, gqa=4, d=128, max_seq_len=48,
               num_cus=256, multi_token=None):
    """The launcher arguments pa_fp4_plan.plan gives a call of _problem's shape."""
    p = PLAN.plan(arch, num_seqs=len(seqs), num_tokens=tokens or len(seqs), num_heads=hkv * gqa,
                  num_kv_heads=hkv, head_size=d, max_seq_len=max_seq_len,
                  multi_token=tokens is not None if multi_token is None else multi_token,
                  num_cus=num_cus)
    args = {f"{name}_offset": p.offset(name) for name in PLAN.REGIONS}
    args.update(max_num_partitions=p.max_parts, partition_len=p.partition_len,
                row_tiles=p.row_tiles)
    return args


def test_aiter_namespace_gets_the_ops(routes):
    chain = routes["chain"]
    assert chain["attention_imports"] == ["paged_attention_fp4", "paged_attention_fp4_out",
                                          "reshape_and_cache_fp4", "reshape_and_cache_fp4_out"]
    assert chain["init_star_imports_attention"] and not chain["attention_has_all"]


def test_op_decode_reaches_native_kernel(routes):
    rec = _reached(routes, "op decode")
    assert rec["template"] == _template(4, 128, 16, "Bf16", routes["digest"])
    _decode_args(rec, out_ptr="<out>", workspace_buffer_ptr="<workspace>", query_ptr="<query>",
                 key_cache_ptr="<key_cache>", value_cache_ptr="<value_cache>",
                 key_scales_ptr="<key_scales>", value_scales_ptr="<value_scales>",
                 block_tables_ptr="<block_tables>", context_lens_ptr="<seq_lens>", scale=0.125,
                 logits_soft_cap=0.0, max_num_blocks_per_seq=3, num_seqs=3, num_kv_heads=2,
                 max_num_partitions=1, q_stride=8 * 128, kv_block_stride=2 * 16 * 64,
                 kv_head_stride=16 * 64, kv_seq_stride=64, rotation_signs_ptr=None,
                 seq_state_ptr=None, state_ids_ptr=None, num_slots=0, sink=0,
                 use_native_fp4_mfma=1, num_blocks=9)
    # the plan's: 48 tokens of block table, 256 CUs: one 256-token partition; the workspace's
    # regions from its start; the tickets (3 row tiles x 2 kv heads) the launcher's own array
    _decode_args(rec, **_plan_args("gfx950"))
    _decode_args(rec, partition_len=256, max_num_partitions=1, row_tiles=3, exp_sums_offset=0)
    assert isinstance(rec["args"]["tickets_ptr"], int)


@pytest.mark.parametrize("case, num_cus, partition, parts", [
    ("op decode max_seq_len 4096", 256, 256, 16),      # 3 x 2 x 16 = 96 waves < 1024: shortest
    ("op decode max_seq_len 4096 1 CU", 1, 2048, 2),   # 3 x 2 x 2 = 12 >= 4: the longest
])
def test_partition_length_follows_the_plan(routes, case, num_cus, partition, parts):
    """The partition length comes from the device's CUs and max_seq_len (pa_fp4_plan), the
    grid's partitions and the workspace offsets with it; the same library either way."""
    rec = _reached(routes, case)
    assert rec["func_name"] == routes["op decode"]["func_name"]
    _decode_args(rec, partition_len=partition, max_num_partitions=parts)
    _decode_args(rec, **_plan_args("gfx950", max_seq_len=4096, num_cus=num_cus))


def test_gqa_above_16_decode_runs_multi_token(routes):
    """A decode whose GQA group (32) exceeds a tile's 16 columns: the multi-token library, the
    launcher's cu_query_lens 0, 1, .., num_seqs, row tiles num_seqs + ceil(3 x 32 / 16)."""
    rec = _reached(routes, "op decode gqa 32")
    assert rec["template"] == _template(32, 64, 16, "Bf16", routes["digest"], multi_token=True)
    assert rec["args"]["cu_query_lens_ptr"] is not None
    _decode_args(rec, row_tiles=3 + 6)
    _decode_args(rec, **_plan_args("gfx950", hkv=1, gqa=32, d=64))


def test_tickets_made_outside_graph_capture(routes):
    """The reduce's tickets: a captured call takes the array an earlier eager call made on its
    stream; one that needs more than was made is refused, naming it (its zeroing would only
    run at replay); outside capture the array grows (to at least twice its size)."""
    rec = _reached(routes, "op decode capturing")
    assert rec["args"]["tickets_ptr"] == routes["op decode"]["args"]["tickets_ptr"]
    refused = routes["op capturing more tickets than made"]
    assert refused["error"] == ("ValueError: tickets: expected 19200 reduce tickets made on this "
                                "stream before graph capture (run one call of this size eagerly "
                                "first), got 16384 made"), refused["error"]
    grown = _reached(routes, "op more tickets than made")
    assert grown["args"]["tickets_ptr"] != rec["args"]["tickets_ptr"]


def test_misaligned_state_and_empty_cache_refused(routes):
    """The gfx950 kernel loads seq_state and rotation_signs in 16-byte vectors and reads block 0
    for a bad block id: a misaligned state and a cache of no blocks are refused, naming them."""
    odd = routes["op seq_state misaligned"]
    assert odd["error"].startswith("ValueError: seq_state: expected a 16-byte aligned"), odd
    empty = routes["op empty cache"]
    assert empty["error"] == ("ValueError: value_cache: expected at least one block (a bad block "
                              "id reads block 0), got 0"), empty["error"]


def test_workspace_refusals_and_allocation(routes):
    """A caller's workspace smaller than the plan or not 16-byte aligned is refused naming the
    argument, before anything is compiled; without one, the op allocates what the plan needs."""
    need = PLAN.workspace_size("gfx950", num_seqs=3, num_tokens=3, num_heads=8, num_kv_heads=2,
                               head_size=128, max_seq_len=4096, multi_token=False, num_cus=256)
    small = routes["op workspace too small"]
    assert small["error"] == f"ValueError: workspace_buffer: expected at least {need} bytes " \
                             "(workspace_size), got 1000", small["error"]
    odd = routes["op workspace misaligned"]
    assert odd["error"].startswith("ValueError: workspace_buffer: expected a 16-byte aligned"), odd
    assert "module" not in small and "module" not in odd
    rec = _reached(routes, "op no workspace")
    size = PLAN.workspace_size("gfx950", num_seqs=3, num_tokens=3, num_heads=8, num_kv_heads=2,
                               head_size=128, max_seq_len=48, multi_token=False, num_cus=256)
    _decode_args(rec, **_plan_args("gfx950"))
    assert PLAN.plan("gfx950", num_seqs=3, num_tokens=3, num_heads=8, num_kv_heads=2,
                     head_size=128, max_seq_len=48, multi_token=False, num_cus=256).size == size
    assert isinstance(rec["args"]["workspace_buffer_ptr"], int)  # not the problem's workspace


def test_lut_path_by_env_and_argument(routes):
    """AITER_FP4_KV_LUT=1 picks the LUT specialization of the same library; an explicit
    use_native wins over the variable."""
    native = _reached(routes, "op decode")
    for case, want in (("op decode LUT by env", 0), ("op decode use_native=False", 0),
                       ("op decode use_native=True, LUT env", 1), ("pa_v1 fp4 LUT by env", 0)):
        rec = _reached(routes, case)
        assert rec["args"]["use_native_fp4_mfma"] == want, case
        assert rec["func_name"] == native["func_name"], case  # one lib.so holds both


def test_op_other_shape_reaches_its_own_instantiation(routes):
    rec = _reached(routes, "op decode fp16 D64 block 32 gqa 8 soft cap")
    assert rec["template"] == _template(8, 64, 32, "Fp16", routes["digest"])
    assert rec["func_name"] != routes["op decode"]["func_name"]
    _decode_args(rec, logits_soft_cap=30.0, num_seqs=2, num_kv_heads=1, max_num_partitions=1,
                 max_num_blocks_per_seq=4, q_stride=8 * 64, kv_seq_stride=32,
                 use_native_fp4_mfma=1)


def test_op_transforms_reach_the_kernel(routes):
    rec = _reached(routes, "op decode transforms")
    _decode_args(rec, rotation_signs_ptr="<rotation_signs>", seq_state_ptr="<seq_state>",
                 state_ids_ptr="<state_ids>", num_slots=5, sink=1)


def test_op_refuses_state_without_slots(routes):
    rec = routes["op seq_state without state_ids"]
    assert rec["error"].startswith("ValueError: state_ids: expected a contiguous int32 [3]"), rec
    assert "module" not in rec  # refused before anything is compiled


@pytest.mark.parametrize("dtype", ["pa_v1 fp4_e2m1", "pa_v1 fp4"])
def test_pa_v1_fp4_branch(routes, dtype):
    """pa_v1's kv_cache_dtype chain sends both names to turboquant's kernel, k_scale/v_scale
    as the E8M0 scale tensors, no transform."""
    rec = _reached(routes, dtype)
    op = routes["op decode"]
    assert rec["template"] == op["template"] and rec["func_name"] == op["func_name"]
    assert rec["args"] == op["args"]


def test_pa_v1_other_dtypes_stay_with_aiter(routes):
    rec = _reached(routes, "pa_v1 auto (bf16 cache)", module="pa_v1")
    assert rec["template"]["gqa_ratio"] == 4 and rec["template"]["head_size"] == 128


def test_pa_v1_fp4_nhd_is_refused(routes):
    assert routes["pa_v1 fp4 NHD"]["error"].startswith("ValueError: kv_cache_layout: expected 'HND'")
    assert "module" not in routes["pa_v1 fp4 NHD"]


def compile_rendered(src: str, pa_dir, arch: str, tmp_path) -> str:
    """Compile the translation unit AITER would build (``src``, with the injected headers of
    ``pa_dir``; csrc_hip/shims stands in for <hip/hip_runtime.h>) for ``arch``: host code to an
    object, device code to assembly, which is returned. Skips without clang."""
    clang = find_clang()
    if clang is None:
        pytest.skip(CLANG_MISSING)
    tu = tmp_path / f"pa_fp4_rendered_{arch}.cpp"
    tu.write_text(src)
    flags = [clang, "-x", "hip", f"--offload-arch={arch}", "-nogpulib", "-nogpuinc", "-O3",
             "-std=c++20", f"-I{ROOT / 'csrc_hip' / 'shims'}", f"-I{pa_dir}"]
    subprocess.run(flags + ["--offload-host-only", "-c", "-o", str(tmp_path / "host.o"), str(tu)],
                   check=True)
    subprocess.run(flags + ["--offload-device-only", "-S", "-o", str(tmp_path / "dev.s"), str(tu)],
                   check=True)
    return (tmp_path / "dev.s").read_text()


@pytest.mark.parametrize("case", ["op decode", "op k8v4"])
def test_rendered_source_compiles_for_gfx950(routes, tmp_path, case):
    """The translation unit AITER would build, with the injected headers, compiles for gfx950
    (host launch code and device code; csrc_hip/shims stands in for <hip/hip_runtime.h>), with
    both specializations of the partition kernel (Q's transform in its prologue, its reduce
    fused; no pre-pass kernel, no kernel of gfx942's), on the scaled MFMA: in the native path FP4 keys and FP4 V (cbsz:4), for
    K8V4 E4M3 keys (the FP8 operand form, no cbsz) and FP4 V; the LUT path FP8 operands only."""
    src = routes[case]["src"]
    assert "TQ_LAUNCH_GFX950(true)" in src and "TQ_LAUNCH_GFX950(false)" in src
    assert "tq_fp4_pa_partition_kernel" not in src  # gfx942's kernel
    asm = compile_rendered(src, routes["pa_dir"], "gfx950", tmp_path)
    names = [ln.split(":")[0] for ln in asm.splitlines() if ln.startswith("_ZN2tq")]
    kernels = [n for n in names if n.startswith("_ZN2tq6gfx95023tq_fp4_pa_gfx950_kernel")]
    assert len(kernels) == 2, names
    assert not any("prepass" in n for n in names), names
    assert not any("tq_fp4_pa_partition_kernel" in n for n in names), names
    # <Bf16, 128, 16, gqa 4, USE_NATIVE_FP4_MFMA, ...>: both values of the bool after gqa 4
    # the last bool: KEY_E4M3
    key8 = case == "op k8v4"
    for native in ("ELi4ELb1E", "ELi4ELb0E"):
        assert any(native in k and f"ELb{int(key8)}EEEv" in k for k in kernels), (native, kernels)
    for k in kernels:  # each partition kernel's scaled MFMAs: cbsz:4 = an FP4 A operand
        lines = asm.split(f"{k}:", 1)[1].split(".Lfunc_end", 1)[0].splitlines()
        fp4 = [("cbsz:4" in ln) for ln in lines if MFMA in ln]
        assert fp4, k
        if "ELi4ELb0E" in k:      # LUT: K and V decoded to E4M3, FP8 operands only
            assert not any(fp4), k
        elif key8:                # native K8V4: E4M3 keys (QK, FP8), FP4 V (PV, cbsz:4)
            assert any(fp4) and not all(fp4), k
        else:                     # native: FP4 keys and FP4 V
            assert all(fp4), k


def test_each_library_compiles_for_the_other_arch(routes, tmp_path):
    """AITER builds a library for every arch in GPU_ARCHS (the template's arch only picks the
    launch code): the gfx950 library's gfx942 pass compiles without any kernel (the gfx950
    kernels' instructions do not exist there; the launcher runs that library on gfx950 only),
    the gfx942 library's gfx950 pass compiles its old kernel pair."""
    asm = compile_rendered(routes["op decode"]["src"], routes["pa_dir"], "gfx942", tmp_path)
    assert not [ln for ln in asm.splitlines() if ln.startswith("_ZN2tq")]
    asm = compile_rendered(routes["gfx942 op decode"]["src"], routes["pa_dir"], "gfx950",
                           tmp_path)
    names = [ln.split(":")[0] for ln in asm.splitlines() if ln.startswith("_ZN2tq")]
    assert len(names) == 2 and all("gfx950" not in n for n in names), names


# Multi-token (cu_query_lens) and sliding-window calls: the launcher files (files/pa_fp4.py,
# pa_fp4.cpp.jinja, turboquant_fp4.py) name the C parameters, so these tests find them by what
# they carry: the cu_query_lens tensor, the window 8.
def _reached_new(routes, case):
    rec = _reached(routes, case)
    decode = _reached(routes, "op decode")
    assert {k: rec["template"][k] for k in ("gqa_ratio", "head_size", "block_size", "scalar")} \
        == {"gqa_ratio": 4, "head_size": 128, "block_size": 16, "scalar": "Bf16"}
    print(f"{case}: template {rec['template']}\nruntime {rec['args']}")
    return rec, decode


def _param_of(rec, value):
    names = [k for k, v in rec["args"].items() if v == value]
    assert len(names) == 1, f"{value!r} is passed as {names or 'no argument'}: {rec['args']}"
    return names[0]


@pytest.mark.parametrize("case", ["op multi-token", "pa_v1 fp4 multi-token"])
def test_multi_token_reaches_the_kernel(routes, case):
    """Two sequences, 3 + 2 query tokens: the kernel gets cu_query_lens (decode: null), the
    number of sequences from the block table and the 5 query tokens."""
    rec, decode = _reached_new(routes, case)
    assert rec["template"]["multi_token"] is True and decode["template"]["multi_token"] is False
    name = _param_of(rec, "<cu_query_lens>")
    assert decode["args"][name] is None, f"decode passes {name}={decode['args'][name]!r}"
    assert rec["args"]["num_seqs"] == 2
    tokens = [k for k, v in rec["args"].items() if v == 5 and "token" in k]
    assert tokens, f"no parameter carries the 5 query tokens: {rec['args']}"
    assert rec["args"]["query_ptr"] == "<query>" and rec["args"]["out_ptr"] == "<out>"


@pytest.mark.parametrize("case", ["op sliding window", "pa_v1 fp4 sliding window"])
def test_sliding_window_reaches_the_kernel(routes, case):
    rec, decode = _reached_new(routes, case)
    names = [k for k in rec["args"] if "window" in k]
    assert len(names) == 1 and rec["args"][names[0]] == 8, rec["args"]
    assert decode["args"][names[0]] == 0
    assert rec["args"]["num_seqs"] == 3


# K8V4 (E4M3 keys, rows of D bytes): the key format is told by key_cache's dtype and row width;
# the kernel gets the value cache's strides (the key cache's are twice those).
@pytest.mark.parametrize("case", ["op k8v4", "op k8v4 uint8 view", "pa_v1 fp4 k8v4"])
def test_k8v4_reaches_its_instantiation(routes, case):
    rec = _reached(routes, case)
    fp4 = _reached(routes, "op decode")
    assert rec["template"] == _template(4, 128, 16, "Bf16", routes["digest"], key_format="fp8_e4m3")
    assert rec["func_name"] != fp4["func_name"]
    assert rec["args"] == fp4["args"]  # the same runtime arguments: value_cache's strides
    _decode_args(rec, key_cache_ptr="<key_cache>", kv_block_stride=2 * 16 * 64,
                 kv_head_stride=16 * 64, kv_seq_stride=64, use_native_fp4_mfma=1)
    assert 'key_format == "fp8_e4m3"' not in rec["src"] and "key_e4m3 = true" in rec["src"]


def test_k8v4_lut_by_env(routes):
    rec = _reached(routes, "op k8v4 LUT by env")
    assert rec["args"]["use_native_fp4_mfma"] == 0
    assert rec["func_name"] == routes["op k8v4"]["func_name"]


@pytest.mark.parametrize("case, message", [
    ("op k8v4 key strides", "ValueError: key_cache: expected strides (4096, 2048, 128, 1)"),
    ("op k8v4 narrow rows", "ValueError: key_cache: expected float8_e4m3fn (or uint8) [9, 2, 16, 128]"),
])
def test_k8v4_bad_key_cache_is_refused(routes, case, message):
    rec = routes[case]
    assert rec["error"] is not None and rec["error"].startswith(message), rec["error"]
    assert "module" not in rec


def test_sinks_and_lse_reach_the_reduce(routes):
    """Learned sinks and the lse output: two more pointers of the entry point (null when off),
    the same library; a wrong lse shape is refused naming the argument."""
    rec = _reached(routes, "op sinks and lse")
    decode = _reached(routes, "op decode")
    assert rec["func_name"] == decode["func_name"]
    sinks, lse = _param_of(rec, "<sinks>"), _param_of(rec, "<lse>")
    assert decode["args"][sinks] is None and decode["args"][lse] is None
    assert {k: v for k, v in rec["args"].items() if k not in (sinks, lse)} == \
        {k: v for k, v in decode["args"].items() if k not in (sinks, lse)}
    bad = routes["op lse of the wrong shape"]
    assert bad["error"].startswith("ValueError: lse: expected a contiguous float32 [3, 8]"), bad


# gfx942 (MI300X): the launcher accepts it and takes the LUT path there; the library is built
# for it (template argument arch="gfx942": its own compile key, the LUT kernel only).
@pytest.mark.parametrize("case", ["gfx942 op decode", "gfx942 op decode LUT env",
                                  "gfx942 pa_v1 fp4_e2m1"])
def test_gfx942_decode_reaches_the_lut_kernel(routes, case):
    rec = _reached(routes, case)
    gfx950 = _reached(routes, "op decode")
    assert rec["template"] == _template(4, 128, 16, "Bf16", routes["digest"], arch="gfx942")
    assert rec["func_name"] != gfx950["func_name"]  # never the gfx950 library
    # the same arguments but the plan's: 256-token partitions, pa_v1's packed workspace
    plan = _plan_args("gfx942")
    assert plan["partition_len"] == 256
    assert rec["args"] == {**gfx950["args"], "use_native_fp4_mfma": 0, "tickets_ptr": None, **plan}
    # gfx942's LUT kernel, one instantiation (no native or K8V4 form exists there)
    assert rec["src"].count("tq::tq_fp4_pa_partition_kernel<Scalar, head_size, block_size, "
                            "gqa_ratio, multi_token>") == 1
    assert "tq_fp4_pa_gfx950_kernel" not in rec["src"]
    assert '#include "tq_fp4_gfx950_attention.cuh"' not in rec["src"]  # gfx942's header only


def test_gfx942_multi_token_reaches_the_lut_kernel(routes):
    rec = _reached(routes, "gfx942 op multi-token")
    gfx950 = _reached(routes, "op multi-token")
    assert rec["template"] == {**gfx950["template"], "arch": "gfx942"}
    assert rec["args"] == {**gfx950["args"], "use_native_fp4_mfma": 0, "tickets_ptr": None,
                           **_plan_args("gfx942", seqs=(20, 33), tokens=5)}


def test_gfx942_keeps_256_token_partitions(routes):
    """gfx942's partitions stay 256 tokens whatever the CUs (its old kernel's tq::kPartition)."""
    rec = _reached(routes, "gfx942 op decode max_seq_len 4096")
    _decode_args(rec, partition_len=256, max_num_partitions=16)
    _decode_args(rec, **_plan_args("gfx942", max_seq_len=4096))


@pytest.mark.parametrize("case, message", [
    ("gfx942 op decode use_native=True", "ValueError: use_native: expected False on gfx942"),
    ("gfx942 op k8v4", "ValueError: key_cache: expected FP4 (uint8 [..., 64]) keys on gfx942"),
    ("gfx90a op decode", "ValueError: device: expected a gfx950 (MI350X/MI355X) or gfx942"),
])
def test_gfx942_refusals(routes, case, message):
    """No native FP4 MFMA and no K8V4 on gfx942 (refused naming the argument); other archs
    are refused as before."""
    rec = routes[case]
    assert rec["error"] is not None and rec["error"].startswith(message), rec["error"]
    assert "module" not in rec  # refused before anything is compiled


def test_rendered_source_compiles_for_gfx942(routes, tmp_path):
    """The gfx942 library's translation unit compiles for gfx942 (host and device): only the
    LUT partition kernel, on v_mfma_f32_16x16x32_fp8_fp8, no scaled MFMA, no trap."""
    src = routes["gfx942 op decode"]["src"]
    asm = compile_rendered(src, routes["pa_dir"], "gfx942", tmp_path)
    kernels = [ln for ln in asm.splitlines() if ln.startswith("_ZN2tq26tq_fp4_pa_partition_kernel")]
    assert len(kernels) == 1 and "ELi4ELb0E" in kernels[0], kernels  # <.., gqa 4, LUT, ..>
    assert sum(MFMA_942 in ln for ln in asm.splitlines()) == 64
    assert MFMA not in asm and "s_trap" not in asm


# ---------------------------------------------------------------- gfx950 on the lane simulation

HOST_CASES = {  # case -> (partition_len, partitions, use_native_fp4_mfma)
    "host decode default": (256, 2, 1),                 # 304 tokens of block table, 256 CUs
    "host decode default LUT soft cap": (256, 2, 0),
    "host decode 1 CU": (2048, 1, 1),                   # 3 x 2 x 1 = 6 >= 1 x 4 waves
    "host multi-token window sinks lse": (256, 2, 1),
    "host k8v4 soft cap": (256, 2, 1),
    "host pa_v1 fp4 garbage workspace": (256, 2, 1),
    "host pa_v1 fp4 large garbage workspace": (256, 2, 1),
}


@pytest.mark.parametrize("case", HOST_CASES)
def test_gfx950_launcher_on_the_lane_simulation(routes, case):
    """The gfx950 launcher as AITER's JIT builds it from the patch (the rendered
    pa_fp4.cpp.jinja and the shipped headers, compiled for the host over the lane simulation),
    called from turboquant's aiter backend (or pa_v1's fp4 branch): its
    one launch (the partition kernel, Q's transform in its prologue, its fused reduce) with the
    plan's arguments gives turboquant's reference attention and leaves the tickets zero (default
    config: rotation, key smoothing, the sink; soft cap, window, learned sinks, lse, K8V4, both
    paths) on 3 sequences of 1, 54 and 300 tokens."""
    partition, parts, native = HOST_CASES[case]
    rec = routes[case]
    if rec["error"] is not None and "no host C++ compiler" in rec["error"]:
        pytest.skip("no host C++ compiler (g++ or clang++) to build the launcher for the host")
    rec = _reached(routes, case)
    assert rec["build"] is not None and rec["host_error"] == 0, rec.get("host_error")
    _decode_args(rec, partition_len=partition, max_num_partitions=parts,
                 use_native_fp4_mfma=native)
    assert rec["finite"]
    assert rec["rel"] < 1e-2, rec["rel"]  # the lane simulation's tests: about 1e-3 on such data
    if "lse_max_err" in rec:
        assert rec["lse_max_err"] < 1e-2, rec["lse_max_err"]
    if "tickets_zero" in rec:
        assert rec["tickets_zero"]
    if case == "host pa_v1 fp4 garbage workspace":  # too small for the plan: its own buffer
        assert rec["args"]["workspace_buffer_ptr"] != "<workspace>"
    if case == "host pa_v1 fp4 large garbage workspace":
        assert rec["args"]["workspace_buffer_ptr"] == "<workspace>"


def test_host_cases_share_libraries(routes):
    """One library per template: the decode cases (native, LUT, any partition length, pa_v1's
    route) share one; multi-token and K8V4 have their own."""
    names = {c: routes[c]["func_name"] for c in HOST_CASES if routes[c]["error"] is None}
    if len(names) < len(HOST_CASES):
        pytest.skip("some host cases did not run")
    decode = {n for c, n in names.items() if "multi-token" not in c and "k8v4" not in c}
    assert len(decode) == 1 and len(set(names.values())) == 3


# ---------------------------------------------------------------- the cache writer

WRITER_CASES = {  # case -> (template, runtime arguments the launcher must pass)
    "writer default": (
        dict(scalar="Bf16", head_size=128, arch="gfx950"),
        dict(key_stride_token=2 * 128, key_stride_head=128, value_stride_token=2 * 128,
             key_cache_stride_block=2 * 16 * 64, key_cache_stride_head=16 * 64,
             value_cache_stride_block=2 * 16 * 64, slot_mapping_is_int64=1, num_tokens=37,
             num_kv_heads=2, group=128, block_size=16, num_blocks=4, key_e4m3=0,
             rotation_signs_ptr="<rotation_signs>", seq_state_ptr="<seq_state>",
             state_ids_ptr="<state_ids>", num_slots=1)),  # the shared state's layer record
    "writer k8v4 fp32 D64 int32 slots": (
        dict(scalar="Fp32", head_size=64, arch="gfx950"),
        dict(key_stride_token=3 * 64, key_cache_stride_block=3 * 16 * 64,
             key_cache_stride_head=16 * 64, value_cache_stride_block=3 * 16 * 32,
             value_cache_stride_head=16 * 32, slot_mapping_is_int64=0, num_kv_heads=3,
             group=64, key_e4m3=1, rotation_signs_ptr=None, seq_state_ptr=None,
             state_ids_ptr=None, num_slots=0)),
    "writer per32 fp16 D256 rotation": (
        dict(scalar="Fp16", head_size=256, arch="gfx950"),
        dict(group=32, key_e4m3=0, rotation_signs_ptr="<rotation_signs>", seq_state_ptr=None,
             state_ids_ptr=None)),
    "writer smooth": (
        dict(scalar="Bf16", head_size=128, arch="gfx950"),
        dict(rotation_signs_ptr=None, seq_state_ptr="<seq_state>", state_ids_ptr="<state_ids>",
             num_slots=4)),
    "gfx942 writer default": (dict(scalar="Bf16", head_size=128, arch="gfx942"), {}),
}


@pytest.mark.parametrize("case", WRITER_CASES)
def test_writer_through_the_backend_is_bit_exact(routes, case):
    """turboquant's aiter backend -> its op -> aiter.reshape_and_cache_fp4 -> the launcher ->
    the library AITER's JIT built from the patch's template (for the host): the reference
    writer's bytes, every cache tensor, with the launcher's arguments where they belong."""
    template, args = WRITER_CASES[case]
    rec = _reached(routes, case, module=WRITER_MODULE)
    assert rec["template"] == {**template, "writer_digest": routes["writer_digest"]}
    assert rec["nargs"] == rec["nparams"] == 27
    _decode_args(rec, key_ptr="<key>", value_ptr="<value>", key_cache_ptr="<key_cache>",
                 value_cache_ptr="<value_cache>", key_scales_ptr="<key_scales>",
                 value_scales_ptr="<value_scales>", slot_mapping_ptr="<slot_mapping>", **args)
    assert rec["equal"] == dict.fromkeys(("key_cache", "value_cache", "key_scales",
                                          "value_scales"), True), rec["equal"]
    assert rec["untouched_bytes"] > 0  # slot -1 and the free slots keep the fill


def test_writer_libraries_per_dtype_head_size_and_arch(routes):
    """One library per (dtype, head size, arch): default and smooth share one, the others
    (and gfx942's) have their own."""
    names = {c: routes[c]["func_name"] for c in WRITER_CASES}
    assert names["writer default"] == names["writer smooth"]
    assert len({n for c, n in names.items() if c != "writer smooth"}) == 4


@pytest.mark.parametrize("case, message", [
    ("writer key_cache strided", "ValueError: key_cache: expected contiguous, 8-byte aligned "
     "[block_size, 64] blocks, got strides (4096, 2048, 128, 1)"),
    ("writer state_ids without seq_state", "ValueError: state_ids: expected a contiguous int32 "
     "[37] tensor (each token's slot) with seq_state, None without"),
    ("writer k8v4 per-32 scales", "ValueError: key_scales: expected [4, 16, 3]: K8V4 keys have "
     "one scale per (token, kv head), got (4, 16, 3, 2)"),
    ("writer slot_mapping float", "ValueError: slot_mapping: expected a contiguous int64 or "
     "int32 [37] tensor, got torch.float32"),
    ("writer head_size 32", "ValueError: key: expected head_size (dim 2) one of (64, 128, 256), "
     "got 32"),
    ("writer key rows misaligned", "ValueError: key: expected a contiguous last dimension and "
     "16-byte aligned rows, got strides (256, 128, 1), address 2 mod 16"),
    ("gfx90a writer", "ValueError: device: expected a gfx950 (MI350X/MI355X) or gfx942"),
])
def test_writer_refusals(routes, case, message):
    """aiter.reshape_and_cache_fp4 refuses what the writer cannot take, naming the argument,
    before anything is compiled."""
    rec = routes[case]
    assert rec["error"] is not None and rec["error"].startswith(message), rec["error"]
    assert "module" not in rec


def _makefile_flags(rule: str) -> list[str]:
    """The compiler options of an AITER Makefile rule, an option's argument kept with it."""
    words, flags = rule.split(), []
    for w in words:
        if flags and flags[-1] in ("-Xclang", "-mllvm"):
            flags[-1] += " " + w
        else:
            flags.append(w)
    return flags


_CLANG_ACCEPTS: dict = {}


def _clang_accepts(clang: str, flag: str, tmp_path) -> bool:
    """What AITER's hip_flag_checker asks hipcc, asked of clang-22 (ROCm's LLVM has options
    upstream LLVM lacks: -amdgpu-coerce-illegal-types)."""
    if flag not in _CLANG_ACCEPTS:
        empty = tmp_path / "empty.hip"
        empty.write_text("")
        r = subprocess.run([clang, "-x", "hip", "--offload-arch=gfx950", "--offload-device-only",
                            "-nogpulib", "-nogpuinc", "-S", *flag.split(), "-o", os.devnull,
                            str(empty)], capture_output=True)
        _CLANG_ACCEPTS[flag] = r.returncode == 0
    return _CLANG_ACCEPTS[flag]


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_writer_library_compiles_with_aiters_flags(routes, tmp_path, arch):
    """The unit AITER's JIT wrote into its build directory (the rendered template, the shipped
    headers copied into its include directory), compiled for arch with the flags AITER wrote
    into the Makefile (those clang-22 knows; the arch's own): AITER flushes fp32 subnormals
    (-fgpu-flush-denormals-to-zero), the launcher's flag keeps them (FloatMode 0xF0, which the
    bytes depend on), and the library's 12 kernels have no scratch and no spills."""
    from test_hip_writer import NUM_KERNELS, _check_kernel_isa, _kernels
    from turboquant import hip_writer

    clang = find_clang()
    if clang is None:
        pytest.skip(CLANG_MISSING)
    rec = _reached(routes, "gfx942 writer default" if arch == "gfx942" else "writer default",
                   module=WRITER_MODULE)
    build = rec["build"]
    flags = _makefile_flags(build["makefile_rule"])
    assert "-fgpu-flush-denormals-to-zero" in flags
    assert all(f in flags for f in routes["writer_cxxflags"])
    flags = [f for f in flags if not f.startswith(("-I", "--offload-arch="))
             and _clang_accepts(clang, f, tmp_path)]
    src = Path(build["build_dir"]) / f"{rec['func_name']}.cpp"
    out = tmp_path / "writer.s"
    subprocess.run([clang, "-x", "hip", f"--offload-arch={arch}", "--offload-device-only",
                    "-nogpulib", "-nogpuinc", "-S", *(w for f in flags for w in f.split()),
                    f"-I{hip_writer.DEVICE_SHIMS}", f"-I{Path(build['build_dir']) / 'include'}",
                    "-o", str(out), str(src)], check=True)
    ks = _kernels(out.read_text())
    assert len(ks) == NUM_KERNELS // 9
    for name, k in ks.items():
        assert "I14__hip_bfloat16Li128E" in name
        _check_kernel_isa(name, k)
