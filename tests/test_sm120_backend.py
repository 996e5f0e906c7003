"""The sm120 backend on a machine without an SM120 GPU: importing builds nothing, the backend
says why it cannot run, its ops carry the shared schema, auto dispatch never picks it, the
transforms and K8V4 caches are taken, not declined (the log-sum-exp output and learned sinks
still are); and the attention kernel's source runs on the host (coroutine threads, the MMA
software model) against the reference, for FP4 and K8V4 keys."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import turboquant
from turboquant import registry
from turboquant.calls import make_attention_call
from turboquant.config import PLAIN
from turboquant._backends import sm120
from turboquant.ops import ATTENTION_SCHEMA

ROOT = Path(__file__).resolve().parents[1]


def _cpu_call():
    d, bs = 128, 16
    return make_attention_call(torch.zeros(1, 4, d, dtype=torch.bfloat16),
                               torch.zeros(2, 2, bs, d // 2, dtype=torch.uint8),
                               torch.zeros(2, 2, bs, d // 2, dtype=torch.uint8),
                               torch.full((2, bs, 2), 127, dtype=torch.uint8),
                               torch.full((2, bs, 2), 127, dtype=torch.uint8),
                               torch.zeros(1, 2, dtype=torch.int32),
                               torch.tensor([3], dtype=torch.int32), 0.1)


def test_import_builds_nothing_and_registers():
    assert sm120._loads.results == {} or torch.cuda.is_available()
    backend = registry.get("sm120")
    assert backend is sm120.BACKEND and backend.priority == 70
    assert any(r["name"] == "sm120" for r in registry.status())


def test_unavailable_says_compute_capability_12():
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 12:
        return
    reason = sm120.BACKEND.unavailable()
    assert reason is not None and "compute capability 12" in reason
    assert sm120._loads.results == {}  # deciding that built nothing


def test_ops_use_the_shared_schema():
    for emulate in (False, True):
        attention, probe = sm120.op_names(emulate)
        op = getattr(torch.ops.turboquant, attention.split("::")[1]).default
        assert str(op._schema) == attention + ATTENTION_SCHEMA
        assert hasattr(torch.ops.turboquant, probe.split("::")[1])


def test_binding_implements_exactly_the_defined_ops():
    text = (ROOT / "csrc_cuda" / "sm120" / "torch_binding_sm120.cu").read_text()
    impls = re.findall(r'm\.impl\("(\w+)" TQ_SM120_SUFFIX', text)
    assert sorted(impls) == ["paged_attention_fp4_sm120", "sm120_mma_probe"]
    assert "TORCH_LIBRARY_FRAGMENT" not in text and "m.def" not in text  # schemas live in Python


def test_declines_cpu_tensors_and_auto_never_picks_it_here():
    call = _cpu_call()
    assert "not on a CUDA device" in sm120.BACKEND.check_attention(call)
    assert registry.select("auto", "attention", call).name != "sm120"
    out = turboquant.paged_attention_fp4(call.query, call.key_cache, call.value_cache, call.key_scales,
                                         call.value_scales, call.block_tables, call.seq_lens, 0.1,
                                         config=PLAIN)
    assert out.shape == call.query.shape


def test_transforms_are_fused_not_declined():
    """The kernel takes rotation, state records and the sink: the backend no longer declines
    them (on this CPU-only call the reason is the device), and it still names malformed
    transform tensors a direct caller might pass."""
    import dataclasses

    from turboquant.rotation import rotation_signs
    from turboquant.smoothing import allocate_state

    base = _cpu_call()
    call = dataclasses.replace(base, rotation_signs=rotation_signs(128), seq_state=allocate_state(3, 2, 128),
                               state_ids=torch.tensor([1], dtype=torch.int32), sink=True)
    assert registry.transform_tensors_reason(call) is None
    assert "not on a CUDA device" in sm120.BACKEND.check_attention(call)
    assert "not fused" not in sm120.BACKEND.check_attention(call)
    bad = [
        (dataclasses.replace(call, rotation_signs=torch.ones(64)), "rotation_signs"),
        (dataclasses.replace(call, state_ids=None), "both or neither"),
        (dataclasses.replace(call, seq_state=None, state_ids=None), "sink"),
        (dataclasses.replace(call, seq_state=allocate_state(3, 2, 64)), "seq_state"),
        (dataclasses.replace(call, state_ids=torch.tensor([1])), "state_ids"),
    ]
    for c, word in bad:
        reason = registry.transform_tensors_reason(c)
        assert reason is not None and word in reason, (word, reason)


def test_k8v4_is_taken_and_what_is_not_still_declined():
    """A K8V4 cache (E4M3 keys) is no reason to decline (on this CPU-only call the reason is the
    device); the log-sum-exp output and learned sinks still are, with their reason."""
    import dataclasses

    from turboquant.api import prepare_attention
    from turboquant.cache import allocate_cache

    cache = allocate_cache(2, 2, 16, 128, key_format="fp8_e4m3")
    call = prepare_attention(torch.zeros(1, 4, 128, dtype=torch.bfloat16), *cache, torch.zeros(1, 2, dtype=torch.int32),
                             torch.tensor([3], dtype=torch.int32), 0.1, config=PLAIN)
    assert call.key_format == "fp8_e4m3"
    reason = sm120.BACKEND.check_attention(call)
    assert "not on a CUDA device" in reason and "fp8_e4m3" not in reason
    lse = sm120.BACKEND.check_attention(dataclasses.replace(call, return_lse=True))
    assert "log-sum-exp" in lse and "sm120" in lse
    sinks = sm120.BACKEND.check_attention(dataclasses.replace(call, sinks=torch.zeros(4)))
    assert "learned sinks" in sinks and "sm120" in sinks


def test_binding_checks_the_k8v4_key_cache():
    """The binding takes float8_e4m3fn keys with rows of D bytes (the kernel's K8V4 instantiation)
    and names key_cache / key_scales when the layout does not fit."""
    text = (ROOT / "csrc_cuda" / "sm120" / "torch_binding_sm120.cu").read_text()
    assert "at::kFloat8_e4m3fn" in text and "key_e4m3, plan.tile_stride" in text
    for message in ('"key_cache: expected a contiguous uint8 (FP4) or float8_e4m3fn (K8V4) CUDA tensor',
                    '"key_cache: expected last dim "', '"value_cache: expected ["',
                    '"key_scales: a K8V4 cache (float8_e4m3fn keys) has one scale per (token, kv head)'):
        assert message in text, message


def test_binding_passes_the_transforms_to_the_kernel():
    text = (ROOT / "csrc_cuda" / "sm120" / "torch_binding_sm120.cu").read_text()
    assert "not implemented by the sm120 kernel" not in text
    for field in ("p.rotation_signs =", "p.seq_state =", "p.state_ids =", "p.num_slots =", "p.rotation_norm =",
                  "p.sink ="):
        assert field in text, field


# ------------------------------------------------------------------------------------------
# The attention kernel's source run on the CPU (csrc_cuda/sm120/tests/attention_host_sim.cpp):
# coroutine threads, the MMA software model of the emulation build. A smoke test of the
# transforms' code paths where no GPU is at hand; tests/gpu/test_sm120_emulation.py holds the
# derived tolerances.
# ------------------------------------------------------------------------------------------
SIM_PATCHES = [  # (text in paged_attention_sm120.cuh, its host replacement)
    ("""  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(lo) : "f"(x0), "f"(x1));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(hi) : "f"(x2), "f"(x3));
  return uint32_t(lo) | (uint32_t(hi) << 16);""",
     "  return sim_e4m3(x0) | (sim_e4m3(x1) << 8) | (sim_e4m3(x2) << 16) | (sim_e4m3(x3) << 24);"),
    ('  asm volatile("" : "+l"(ptr));\n', ""),
]


def _host_sim(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    sm120_dir = ROOT / "csrc_cuda" / "sm120"
    text = (sm120_dir / "paged_attention_sm120.cuh").read_text()
    for old, new in SIM_PATCHES:
        assert text.count(old) == 1, f"host simulation: kernel text changed: {old[:60]!r}"
        text = text.replace(old, new)
    start = text.index("template <typename T, int D, bool kPer32, bool kKeyE4m3>\ninline cudaError_t launch_with")
    text = text[:start] + text[text.index("}  // namespace sm120", start):]  # launches: <<<>>>
    (tmp_path / "paged_attention_sm120.cuh").write_text(text)
    for name in ("cuda_bf16.h", "cuda_fp16.h", "cuda_runtime.h"):
        (tmp_path / name).write_text("#pragma once\n")
    lib = tmp_path / "libsm120_host_sim.so"
    subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-D__CUDACC__", "-DTQ_SM120_EMULATE",
                    f"-I{tmp_path}", f"-I{sm120_dir}", str(sm120_dir / "tests" / "attention_host_sim.cpp"),
                    "-o", str(lib)], check=True)
    so = ctypes.CDLL(str(lib))
    ptr, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    so.sim_attention.argtypes = [ptr] * 9 + [i32] * 10 + [f32, f32, i32, i32, ptr, ptr, ptr, i32, i32, i32]
    so.sim_attention.restype = i32

    def op(out, query, kc, vc, ks, vs, bt, sl, cu, scale, window, cap, max_seq_len, signs, state, ids, sink,
           sinks=None, lse=None, workspace=None, sink_kv=None, sink_tags=None):
        assert sinks is None and lse is None  # the backend declines them (and ignores workspace)
        assert sink_kv is None and sink_tags is None  # (the backend builds the records)
        def p(t):
            return None if t is None else ctypes.c_void_p(t.data_ptr())
        assert out.dtype == torch.bfloat16 and query.is_contiguous() and out.is_contiguous()
        nt, nh, d = query.shape
        n = so.sim_attention(p(out), p(query), p(kc), p(vc), p(ks), p(vs), p(bt), p(sl), p(cu), sl.shape[0], nt, nh,
                             kc.shape[1], kc.shape[2], bt.shape[1], kc.shape[0], d, int(ks.dim() == 4),
                             int(kc.dtype == torch.float8_e4m3fn), scale, cap, window, max_seq_len, p(signs), p(state), p(ids),
                             0 if state is None else state.shape[0], int(sink), 4)
        assert n > 0
    return op


def _host_sim_against_reference(op, prob, gen, label, poison=True):
    """Poison position 0's bytes and scales of the 3 sequences (NaN if they were read), run
    decode and multi-token rows with and without a soft cap through the host-simulated kernel
    ``op``: close to the reference (E4M3 Q and P: 0.06 against outputs about 3; smoke
    tolerance 0.1); the one-token sequence gives exactly the un-rotated sink value.
    Returns the last call and its output."""
    from turboquant.api import prepare_attention
    from turboquant.calls import attention_op_args
    from turboquant.reference import attention_reference
    from turboquant.rotation import unrotate
    from turboquant.shared_state import call_with_records
    from turboquant.smoothing import SINK_VALUE

    kc, vc, ks, vs = prob.cache
    for s in range(3 if poison else 0):
        blk = int(prob.block_tables[s, 0])
        kc.view(torch.uint8)[blk, :, 0], vc[blk, :, 0], ks[blk, 0], vs[blk, 0] = 0xFF, 0xFF, 0xFF, 0xFF
    query = torch.randn(7, 8, 64, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, 1, 3, 7], dtype=torch.int32)
    for cap in (0.0, 3.0):
        call = call_with_records(prepare_attention(query, *prob.cache, prob.block_tables, prob.seq_lens, 64 ** -0.5,
                                                   cu_query_lens=cu, logits_soft_cap=cap, **prob.kwargs))
        out = torch.empty_like(query)
        op(*attention_op_args(call, out))
        ref = torch.empty(query.shape)
        attention_reference(call, ref)
        err = (out.float() - ref).abs().max().item()
        print(f"host simulation {label}, soft cap {cap}: max|out-ref| {err:.3e}, max|ref| {ref.abs().max().item():.3e}")
        assert torch.isfinite(out).all() and err < 0.1
    sink = unrotate(call.seq_state[int(call.state_ids[0]), :, SINK_VALUE], call.rotation_signs)
    assert torch.equal(out[0], sink.repeat_interleave(4, 0).to(out.dtype))
    return call, out


def test_k8v4_kernel_source_on_host(tmp_path):
    """K8V4 (E4M3 keys through the e4m3 x e4m3 model) with the per-sequence transforms (records
    that differ per sequence; the shared state hands the kernel such records too), decode and
    multi-token rows, with and without a soft cap: close to the reference (the same smoke
    tolerance as FP4 keys); position 0's poisoned key bytes never count; a one-token sequence
    gives exactly the un-rotated sink value."""
    from turboquant.cache import build_paged_problem
    from turboquant.config import PER_SEQUENCE

    op = _host_sim(tmp_path)
    gen = torch.Generator().manual_seed(6)
    prob = build_paged_problem([1, 40, 70], 2, 64, 16, generator=gen, write_backend="reference",
                               config=PER_SEQUENCE, spare_blocks=1, key_format="fp8_e4m3")
    assert prob.cache.key_cache.dtype == torch.float8_e4m3fn and prob.cache.key_cache.shape[-1] == 64
    call, _ = _host_sim_against_reference(op, prob, gen, "K8V4")
    assert call.key_format == "fp8_e4m3"


def test_kernel_source_on_host_with_the_shared_state(tmp_path):
    """The default config: the reader builds each sequence's record from the layer's shared
    state and the kernel reads it (decode and multi-token rows, with and without a soft cap):
    close to the reference; a one-token sequence gives exactly its sink value from the table."""
    from turboquant.cache import build_paged_problem

    op = _host_sim(tmp_path)
    gen = torch.Generator().manual_seed(7)
    prob = build_paged_problem([1, 40, 70], 2, 64, 16, generator=gen, write_backend="reference",
                               spare_blocks=1)
    assert "shared_state" in prob.kwargs
    _host_sim_against_reference(op, prob, gen, "FP4 shared state", poison=False)


def test_kernel_source_on_host_with_transforms(tmp_path):
    """Per-sequence transforms (rotation, key smoothing, sink; records that differ per sequence,
    as the shared state's reader builds them), decode and multi-token rows, a soft cap
    with keys far from 0 (q.m): close to the reference (E4M3 Q and P: 0.06 against outputs
    about 3); a one-token sequence gives exactly the un-rotated sink value; position 0's
    poisoned FP4 bytes never count; a slot outside seq_state gives NaN rows for its sequence."""
    import dataclasses

    from turboquant.calls import attention_op_args
    from turboquant.cache import build_paged_problem
    from turboquant.config import PER_SEQUENCE

    op = _host_sim(tmp_path)
    gen = torch.Generator().manual_seed(5)
    center = 2.0 * torch.randn(64, generator=gen)
    prob = build_paged_problem([1, 40, 70], 2, 64, 16, generator=gen, write_backend="reference",
                               config=PER_SEQUENCE, spare_blocks=1,
                               kv_factory=lambda s, shape: (torch.randn(shape, generator=gen) + center,
                                                            torch.randn(shape, generator=gen)))
    call, out = _host_sim_against_reference(op, prob, gen, "FP4")
    query = call.query
    ids = call.state_ids.clone()
    ids[1] = 99
    bad = torch.empty_like(query)
    op(*attention_op_args(dataclasses.replace(call, state_ids=ids), bad))
    assert torch.isnan(bad[1:3]).all() and torch.equal(bad[0], out[0]) and torch.equal(bad[3:], out[3:])
