"""The ``cuda`` backend: fused split-KV FP4 paged attention for NVIDIA SM80-SM90 (and later GPUs
as a fallback), plus a CUDA cache writer. Kernels: ``csrc_cuda/`` (design note at the top of
``csrc_cuda/attention_decode.cuh`` for decode with at most 8 heads per kv head,
``csrc_cuda/attention_general.cuh`` for the rest; tuning choices in ``csrc_cuda/tuning.cuh``).

Importing this module builds nothing: it defines the op schemas (from ``turboquant.ops``:
attention, cache write, merge of attention states), their fake (meta) implementations, and
registers the backend. The extension is compiled with ``torch.utils.cpp_extension.load`` on
first use (``unavailable()`` or a call), for the present GPU's architecture only (sm_90a on
H100/H200, sm_80 on A100, ...), and cached under
``$TURBOQUANT_BUILD_DIR`` or ``~/.cache/turboquant``; the build name carries a hash of every
file in ``csrc_cuda/``, so editing a header rebuilds (``TURBOQUANT_PREBUILT_DIR``: a library of
the same name built without a GPU by benchmarks/prebuild_cuda.py is loaded instead, see
``_jit``). ``TURBOQUANT_CUDA_LIB=/path/lib.so``
loads a prebuilt library instead, which must be built the same way: on SM 9.x its prefill kernel
is the sm_90a one (producer and row warps, 512 threads per CTA, the count the launcher uses
there); a plain sm_90 build holds the 256-thread SM80-SM89 kernel, whose prefill launches would
fail.

Supported: query fp16/bf16 on a CUDA device; head_dim 64/128/256; block_size a power of two
16 .. 256; one scale per (token, head) for attention (per-32 scales are declined with a reason;
the cache writer supports both); any GQA ratio; multi-token queries; sliding window; soft cap;
the log-sum-exp output and learned sinks (turboquant.states); both key formats (FP4, and
K8V4's E4M3 keys, decoded in registers like FP4) in the writer and both attention kernels.
The transforms of CONTRACT.md section 2 run inside the kernels: the writer rotates
((k - m) * (1 / lam)) and v in registers (a Walsh-Hadamard transform over the lanes of a row); the
attention kernels multiply Q by lam and rotate it in the prologue, merge the sink record as one
more key after the warp merge, and un-rotate O before its store (the split-KV reduce
un-rotates the combined row). With a soft cap and records, the
prologue also computes q.m (the key center) and adds it back to every logit before the cap.
"""
from __future__ import annotations

import hashlib
import os
from typing import Optional

import torch

from ..calls import attention_op_args, cache_write_op_args
from ..ops import (ATTENTION_SCHEMA, CACHE_WRITE_SCHEMA, MERGE_STATES_SCHEMA,
                   SHARED_ENTER_SINKS_SCHEMA, SHARED_RECORDS_SCHEMA, WORKSPACE_BYTES_SCHEMA,
                   define)
from ..sources import cuda_limits, source_dir
from ._jit import Once, load, sources_hash
from ..registry import (AttentionCall, Backend, CacheWrite, MergeCall, register,
                        transform_tensors_reason)

ATTENTION_OP = "turboquant::paged_attention_fp4_cuda"
CACHE_WRITE_OP = "turboquant::reshape_and_cache_fp4_cuda"
MERGE_STATES_OP = "turboquant::merge_attention_states_cuda"
SHARED_RECORDS_OP = "turboquant::shared_records_cuda"  # turboquant.shared_state's two kernels
SHARED_ENTER_SINKS_OP = "turboquant::shared_enter_sinks_cuda"
WORKSPACE_BYTES_OP = "turboquant::prefill_workspace_bytes_cuda"
HEAD_DIMS, MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = cuda_limits()  # csrc_cuda/limits.cuh

CSRC = source_dir("cuda")


define(ATTENTION_OP, ATTENTION_SCHEMA)
define(CACHE_WRITE_OP, CACHE_WRITE_SCHEMA)
define(MERGE_STATES_OP, MERGE_STATES_SCHEMA)
define(SHARED_RECORDS_OP, SHARED_RECORDS_SCHEMA)
define(SHARED_ENTER_SINKS_OP, SHARED_ENTER_SINKS_SCHEMA)
define(WORKSPACE_BYTES_OP, WORKSPACE_BYTES_SCHEMA)

_loaded = Once("building the CUDA extension failed")


def _arch_flags(major: int, minor: int) -> tuple[str, str]:
    """(-gencode flag, tag) for the present GPU: sm_90a on Hopper, else sm_XY."""
    cc = f"{major}{minor}"
    if cc == "90":
        return "-gencode=arch=compute_90a,code=sm_90a", "sm90a"
    return f"-gencode=arch=compute_{cc},code=sm_{cc}", f"sm{cc}"


def build_spec(major: int, minor: int, extra: list) -> tuple[str, list]:
    """(name, nvcc flags) of the extension for compute capability major.minor with the extra
    flags: what ``_load`` builds, and what benchmarks/prebuild_cuda.py builds on a machine
    without the GPU. The name carries the architecture, a hash of csrc_cuda/ and one of ``extra``."""
    gencode, tag = _arch_flags(major, minor)
    suffix = hashlib.sha256(" ".join(extra).encode()).hexdigest()[:6] if extra else ""
    name = f"turboquant_cuda_{tag}_{sources_hash(CSRC)}{'_' + suffix if suffix else ''}"
    return name, [gencode, "-lineinfo"] + list(extra)


def _load() -> None:
    """Build (or reuse) and load the extension; raises on failure."""
    prebuilt = os.environ.get("TURBOQUANT_CUDA_LIB")
    if prebuilt:
        torch.ops.load_library(prebuilt)
        return
    extra = os.environ.get("TURBOQUANT_CUDA_EXTRA_FLAGS", "").split()  # tuning variants
    name, flags = build_spec(*torch.cuda.get_device_capability(), extra)
    load(name, CSRC / "torch_binding.cu", flags)


def ensure_loaded() -> Optional[str]:
    """Load the extension once; return None or the reason it cannot be used."""
    return _loaded(None, _load)


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes == 0


class CudaBackend(Backend):
    name = "cuda"
    priority = 50
    description = ("fused split-KV paged attention, FP4 decoded in registers, mma.sync fp16 "
                   "tensor cores (NVIDIA SM80+)")

    def unavailable(self) -> Optional[str]:
        if getattr(torch.version, "hip", None):
            return "ROCm build of PyTorch (the cuda backend needs NVIDIA CUDA)"
        if torch.version.cuda is None:
            return "PyTorch was built without CUDA"
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            return f"compute capability {major}.{minor} < 8.0 (needs SM80 or newer)"
        return ensure_loaded()

    def check_attention(self, call: AttentionCall) -> Optional[str]:
        reason = transform_tensors_reason(call)
        if reason is not None:
            return reason
        q = call.query
        if not q.is_cuda:
            return f"tensors are on {q.device}, not on a CUDA device"
        if call.scale_group != call.head_dim:
            return (f"per-{call.scale_group} scales are not supported by the cuda attention "
                    f"kernel (one scale per (token, head) only)")
        if call.head_dim not in HEAD_DIMS:
            return f"head_dim {call.head_dim} not in {HEAD_DIMS}"
        if not MIN_BLOCK_SIZE <= call.block_size <= MAX_BLOCK_SIZE:
            return f"block_size {call.block_size} outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"query dtype {q.dtype} (expected float16 or bfloat16)"
        d = call.head_dim
        if q.stride(2) != 1 or q.stride(1) % 8 or q.stride(0) % 8 or not _aligned(q, 16):
            return "query must have a contiguous, 16-byte aligned head dimension"
        k8 = call.key_format == "fp8_e4m3"  # K8V4: key rows of D bytes
        for nm, row in (("key_cache", d if k8 else d // 2), ("value_cache", d // 2)):
            c = getattr(call, nm)
            if (c.stride(3) != 1 or c.stride(2) != row or c.stride(1) % 16 or c.stride(0) % 16
                    or not _aligned(c, 16)):
                return f"{nm} must have contiguous, 16-byte aligned [block_size, {row}] blocks"
        if not (call.key_scales.is_contiguous() and call.value_scales.is_contiguous()):
            return "key_scales/value_scales must be contiguous"
        ratio = 2 if k8 else 1  # one tile offset serves both caches
        if (call.key_cache.stride(0) != ratio * call.value_cache.stride(0)
                or call.key_cache.stride(0) >= 2 ** 31):
            return ("key_cache's block stride must be " + ("twice " if k8 else "") +
                    "value_cache's, below 2^31 bytes")
        if call.block_tables.stride(1) != 1:
            return "block_tables rows must be contiguous"
        if call.cu_query_lens is not None and not call.cu_query_lens.is_contiguous():
            return "cu_query_lens must be contiguous"
        if not call.seq_lens.is_contiguous():
            return "seq_lens must be contiguous"
        return None

    def check_cache_write(self, write: CacheWrite) -> Optional[str]:
        k = write.key
        if not k.is_cuda:
            return f"tensors are on {k.device}, not on a CUDA device"
        if write.head_dim not in HEAD_DIMS:
            return f"head_dim {write.head_dim} not in {HEAD_DIMS}"
        if write.scale_group not in (write.head_dim, 32):
            return f"scale group {write.scale_group} not supported"
        rule = getattr(write, "scale_rule", "smallest")
        if rule != "smallest":
            return f"scale_rule {rule!r} is not implemented by the cuda writer (only 'smallest')"
        for nm in ("key", "value"):
            t = getattr(write, nm)
            el = t.element_size()
            if (t.stride(2) != 1 or (t.stride(1) * el) % 16 or (t.stride(0) * el) % 16
                    or not _aligned(t, 16)):
                return f"{nm} must have a contiguous, 16-byte aligned head dimension"
        d = write.head_dim
        k8 = write.key_format == "fp8_e4m3"  # K8V4: key rows of D bytes
        # a thread stores WRITER_EPT = 16 elements: 8 bytes of FP4 codes, 16 of E4M3
        for nm, row, align in (("key_cache", d if k8 else d // 2, 16 if k8 else 8),
                               ("value_cache", d // 2, 8)):
            c = getattr(write, nm)
            if (c.stride(3) != 1 or c.stride(2) != row or c.stride(1) % align
                    or c.stride(0) % align or not _aligned(c, align)):
                return f"{nm} must have contiguous, {align}-byte aligned [block_size, {row}] blocks"
        if not (write.key_scales.is_contiguous() and write.value_scales.is_contiguous()):
            return "key_scales/value_scales must be contiguous"
        if not write.slot_mapping.is_contiguous():
            return "slot_mapping must be contiguous"
        return None

    def check_merge(self, merge: MergeCall) -> Optional[str]:
        out = merge.out
        if not out.is_cuda:
            return f"tensors are on {out.device}, not on a CUDA device"
        if out.shape[2] % 2:
            return f"head dim {out.shape[2]} is odd (the merge kernel reads element pairs)"
        align = 8 if out.dtype == torch.float32 else 4
        for t in (out,) + merge.outs:
            if not t.is_contiguous() or not _aligned(t, align):
                return f"outputs must be contiguous and {align}-byte aligned"
        if not all(s.is_contiguous() for s in (merge.lse,) + merge.lses):
            return "lse tensors must be contiguous"
        if out.shape[0] * out.shape[1] >= 2 ** 31:
            return "at most 2^31 - 1 rows (tokens x heads)"
        return None

    def merge_states(self, merge: MergeCall) -> None:
        torch.ops.turboquant.merge_attention_states_cuda(merge.out, merge.lse, list(merge.outs),
                                                         list(merge.lses))

    def paged_attention(self, call: AttentionCall, out: torch.Tensor,
                        lse: Optional[torch.Tensor] = None) -> None:
        torch.ops.turboquant.paged_attention_fp4_cuda(*attention_op_args(call, out, lse))

    def workspace_bytes(self, num_seqs: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                        key_format: str, device: torch.device) -> int:
        if device.type != "cuda" or head_dim not in HEAD_DIMS or self.unavailable() is not None:
            return 0
        query = torch.empty(0, num_kv_heads, head_dim, device=device)  # (its device, head dim)
        return int(torch.ops.turboquant.prefill_workspace_bytes_cuda(
            query, num_seqs, max_seq_len, num_kv_heads, key_format == "fp8_e4m3"))

    def reshape_and_cache(self, write: CacheWrite) -> None:
        torch.ops.turboquant.reshape_and_cache_fp4_cuda(*cache_write_op_args(write))


BACKEND = register(CudaBackend())
