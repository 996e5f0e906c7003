"""The ``sm120`` backend: FP4 paged attention on the SM120 family's block-scaled warp MMA
(RTX 50xx, RTX PRO Blackwell: sm_120a; DGX Spark: sm_121a). Kernels and design note:
``csrc_cuda/sm120/`` (``paged_attention_sm120.cuh``, MMA wrappers in ``mma_sm120.cuh``).

Evidence reached (README): compiled for sm_120a and sm_121a, SASS-checked (QMMA.SF in the
attention kernel, no spills or local memory), and the same kernel source, with only the MMA
wrappers replaced by a software model of each instruction, run on an H100 against the
reference. It has NOT been run on SM120 hardware; ``pytest -m sm120`` on an RTX 50xx runs the
layout probes and the attention tests on the real instructions.

Importing this module builds nothing and works without a GPU: it defines the op schemas
(attention: ``turboquant.ops.ATTENTION_SCHEMA``) with fake implementations and registers the
backend. The extension is built with ``torch.utils.cpp_extension.load`` on first use:
``load_extension()`` for sm_120a + sm_121a, ``load_extension(emulate=True)`` for sm_90a with
the software MMA model (ops ``..._emulated``; for testing on Hopper only). Builds are cached
under ``$TURBOQUANT_BUILD_DIR`` or ``~/.cache/turboquant``, named by a hash of the sources.

Supported: query fp16/bf16 on a CUDA device of compute capability 12.x; head_dim 64/128/256;
one scale per (token, head) or per 32 elements; any block size; any GQA ratio; multi-token
queries; sliding window; soft cap; both key formats: FP4 keys (e4m3 x e2m1 MMAs) and K8V4's
E4M3 keys (``key_format="fp8_e4m3"``: the e4m3 x e4m3 form of the same instruction, key rows
of D bytes loaded as they are); the transforms of CONTRACT.md section 2 (rotation, key
smoothing state records, the sink token, q.m under a soft cap), fused into the kernel's Q
prologue, a sink merge in split 0 and the un-rotation in the split combiner. Declined with a
reason: the log-sum-exp output and learned sinks (not in the kernel yet). The cache writer is
left to the other backends.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..calls import attention_op_args
from ..shared_state import call_with_records
from ..ops import ATTENTION_SCHEMA, define
from ..sources import cuda_limits, source_dir
from ._jit import Once, load, sources_hash
from ..registry import (AttentionCall, Backend, register, state_outputs_reason,
                        transform_tensors_reason)

ATTENTION_OP = "turboquant::paged_attention_fp4_sm120"
PROBE_SCHEMA = "(Tensor a, Tensor b, Tensor sfa, Tensor sfb, Tensor c, int kind, int selectors) -> Tensor"
HEAD_DIMS = cuda_limits()[0]  # csrc_cuda/limits.cuh, which the kernel's dispatch reads
CSRC = source_dir("cuda") / "sm120"
# the cuda backend's headers the kernel includes (its build name hashes them too)
SHARED_HEADERS = tuple(CSRC.parent / f for f in ("limits.cuh", "paged_kv.cuh"))

# -gencode flags of the two builds: the real instructions, or the model on Hopper.
ARCH_FLAGS = {
    False: ["-gencode=arch=compute_120a,code=sm_120a", "-gencode=arch=compute_121a,code=sm_121a"],
    True: ["-gencode=arch=compute_90a,code=sm_90a", "-DTQ_SM120_EMULATE"],
}


def op_names(emulate: bool = False) -> tuple[str, str]:
    """(attention op, MMA probe op) of the real or the emulation build."""
    suffix = "_emulated" if emulate else ""
    return (f"turboquant::paged_attention_fp4_sm120{suffix}", f"turboquant::sm120_mma_probe{suffix}")


def _define_ops() -> None:
    """Define the schemas once (the C++ library only adds CUDA implementations)."""
    for emulate in (False, True):
        attention, probe = op_names(emulate)
        define(attention, ATTENTION_SCHEMA)
        ns, op = probe.split("::")
        if not hasattr(getattr(torch.ops, ns), op):
            torch.library.define(probe, PROBE_SCHEMA)

            @torch.library.register_fake(probe)
            def _probe_fake(a, b, sfa, sfb, c, kind, selectors):
                return c.new_empty((32, 4))


_define_ops()

_loads = Once("building the sm120 extension failed")  # key: emulate


def _build(emulate: bool) -> None:
    name = f"turboquant_sm120{'_emulated' if emulate else ''}_{sources_hash(CSRC, *SHARED_HEADERS)}"
    load(name, CSRC / "torch_binding_sm120.cu", ["-lineinfo"] + ARCH_FLAGS[emulate])


def load_extension(emulate: bool = False) -> Optional[str]:
    """Build (or reuse) and load the extension once; None, or why it cannot be used."""
    return _loads(emulate, lambda: _build(emulate))


class Sm120Backend(Backend):
    name = "sm120"
    priority = 70
    description = ("block-scaled mma.sync e4m3 x e2m1 / e4m3 x e4m3 (kind::mxf8f6f4, FP4 or K8V4 "
                   "keys) on NVIDIA SM120 (compiled, SASS-checked, emulated on H100; not run on "
                   "SM120 hardware)")

    def unavailable(self) -> Optional[str]:
        if getattr(torch.version, "hip", None) or torch.version.cuda is None:
            return "needs an NVIDIA SM120-family GPU (compute capability 12.x); PyTorch has no CUDA"
        if not torch.cuda.is_available():
            return "needs an NVIDIA SM120-family GPU (compute capability 12.x); no CUDA device"
        major, minor = torch.cuda.get_device_capability()
        if major != 12:
            return (f"needs an NVIDIA SM120-family GPU (compute capability 12.x), "
                    f"this GPU is {major}.{minor}")
        return load_extension()

    def check_attention(self, call: AttentionCall) -> Optional[str]:
        reason = state_outputs_reason(call, "sm120")
        if reason is not None:
            return reason
        q = call.query
        if not q.is_cuda:
            return f"tensors are on {q.device}, not on a CUDA device"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"query dtype {q.dtype} (expected float16 or bfloat16)"
        if call.head_dim not in HEAD_DIMS:
            return f"head_dim {call.head_dim} not in {HEAD_DIMS}"
        if call.scale_group not in (call.head_dim, 32):
            return f"scale group {call.scale_group} (expected {call.head_dim} or 32)"
        for nm in ("key_cache", "value_cache", "key_scales", "value_scales", "block_tables",
                   "seq_lens"):
            if not getattr(call, nm).is_contiguous():
                return f"{nm} must be contiguous"
        if call.cu_query_lens is not None and not call.cu_query_lens.is_contiguous():
            return "cu_query_lens must be contiguous"
        for nm in ("key_cache", "value_cache"):
            if getattr(call, nm).data_ptr() % 16:
                return f"{nm} must be 16-byte aligned"
        return transform_tensors_reason(call)

    def paged_attention(self, call: AttentionCall, out: torch.Tensor,
                        lse: Optional[torch.Tensor] = None) -> None:
        torch.ops.turboquant.paged_attention_fp4_sm120(
            *attention_op_args(call_with_records(call), out, lse))


BACKEND = register(Sm120Backend())
