"""The ``aiter`` backend: turboquant's gfx950 / gfx942 FP4 paged attention (csrc_hip/) run
through a patched AITER (``python -m turboquant.integration.aiter.patch --aiter-root PATH``).

Importing this module is cheap and works anywhere: it defines the two op schemas (attention,
cache write) and their fake implementations and registers the backend; AITER is looked for (and its patch state read) on
the first ``unavailable()`` call, and imported only on a machine with a gfx950 or gfx942 GPU.

Architectures (the kernel source picks its instructions at compile time):
- gfx950 (MI350X/MI355X): ``v_mfma_scale_f32_16x16x128_f8f6f4``, native FP4 (default) or the
  LUT path; csrc_hip/tq_fp4_gfx950_attention.cuh, 1 launch per call (one wave per (row tile,
  partition, kv head), Q transformed in its prologue, over partitions whose length the launcher
  picks per call from the GPU's CUs, the last partition of each row tile reducing it). Rung: compiled +
  ISA-checked + lane-simulated, and the AITER launcher (built by AITER's JIT from the patch,
  for the host) run on the lane simulation against the reference; not run on hardware.
- gfx942 (MI300X): the LUT path only (FP4 decoded through a 16-entry table to FP8 E4M3FNUZ,
  gfx942's FP8) on ``v_mfma_f32_16x16x32_fp8_fp8``, which has no scale operand: the E8M0
  scales are applied in fp32 (K's per token on the logits, Q's and P's powers of two on the
  accumulators); csrc_hip/tq_fp4_paged_attention.cuh, 256-token partitions of 4 waves and a
  reduce kernel. Rung: compiled + ISA-checked + lane-simulated; not run on hardware. K8V4
  caches are declined there: their OCP E4M3 key bytes would need converting to FNUZ (0x80 is
  FNUZ's NaN, every other byte means half its OCP value), which the kernel does not do.

Supported: decode (one query token per sequence) and several query tokens per sequence
(cu_query_lens: speculative decoding, chunked prefill; causal among a sequence's tokens),
sliding window, soft cap, query bf16/fp16, head_dim 64/128/256, block_size 16..256 (powers of
two), any GQA ratio (above 16, decode runs the multi-token kernel), one scale per (token, kv
head), FP4 keys or K8V4 caches (E4M3 keys straight into the MFMA's FP8 operand), and the
accuracy transforms of the default QuantConfig fused into the kernel (rotation,
key smoothing's q * lam and q.m under a soft cap, the sink token, masked by causality and the
window like any key), learned sinks and the lse output (return_lse) in the reduce. Declined
with a reason (the dispatcher then falls back): per-32 scales, head dims and block sizes
other than those above, tensors off the GPU or in layouts the kernel does not address.
On gfx950 the native FP4 MFMA path runs by default; AITER_FP4_KV_LUT=1 selects the LUT path.

Cache writer (``reshape_and_cache_fp4``, the patch's ``aiter.reshape_and_cache_fp4``): the
cuda backend's writer translated by hipify-torch (turboquant/hip_writer.py) and built by
AITER's JIT from the patch's ``cache_fp4.cpp.jinja``, on gfx950 and gfx942 alike. Rung:
compiled for both + ISA-checked (every writer kernel, no scratch, no spills, fp32 subnormals
kept under AITER's flags) + bit-exact with the reference writer in a host simulation of the
same source; not run on hardware. Supported: key/value bf16/fp16/fp32 with a contiguous,
16-byte aligned head dimension, head_dim 64/128/256, any power-of-two block size, one scale
per (token, kv head) or per 32 elements, FP4 keys or K8V4 (E4M3 keys; written on gfx942 too:
the writer uses no FP8 instruction), the transforms (rotation, key smoothing). Declined with a
reason naming the argument: scale_rule "mse", caches whose blocks are not contiguous and 8-byte
aligned (16 for E4M3 keys), non-contiguous scales or slot_mapping, more than 2^31 work-items
(num_tokens x num_kv_heads x head_dim / 16), tensors off the ROCm GPU.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import torch

from ..calls import attention_op_args, cache_write_op_args
from ..ops import ATTENTION_SCHEMA, CACHE_WRITE_SCHEMA, define
from ..registry import AttentionCall, Backend, CacheWrite, register, transform_tensors_reason
from ..shared_state import call_with_records
from ..smoothing import STATE_ROWS
from ._jit import Once

ATTENTION_OP = "turboquant::paged_attention_fp4_aiter"
CACHE_WRITE_OP = "turboquant::reshape_and_cache_fp4_aiter"
HEAD_DIMS = (64, 128, 256)
WRITER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WRITER_EPT = 16  # elements of K and of V per work-item (csrc_cuda/tuning.cuh WRITER_EPT)
BLOCK_SIZES = (16, 32, 64, 128, 256)
PATCH_COMMAND = "python -m turboquant.integration.aiter.patch --aiter-root {root}"
# The architectures the kernel is built for: gfx950 (native FP4 or LUT), gfx942 (LUT only).
ARCHS = ("gfx950", "gfx942")
K8V4_GFX942_REASON = ("K8V4 (fp8_e4m3 keys) is not supported on gfx942: its FP8 is E4M3FNUZ, "
                      "and the cache's OCP E4M3 key bytes would need converting (the LUT path "
                      "runs FP4 keys on gfx942)")


define(ATTENTION_OP, ATTENTION_SCHEMA)
define(CACHE_WRITE_OP, CACHE_WRITE_SCHEMA)


def _impl(out, query, key_cache, value_cache, key_scales, value_scales, block_tables,
          seq_lens, cu_query_lens, scale, sliding_window, logits_soft_cap, max_seq_len,
          rotation_signs, seq_state, state_ids, sink, sinks=None, lse=None, workspace=None,
          sink_kv=None, sink_tags=None):
    import aiter  # (workspace: not taken; aiter's wrapper sizes its own per call)

    if sink_kv is not None or sink_tags is not None:
        raise ValueError("sink_kv/sink_tags: the aiter kernels read per-sequence records "
                         "(turboquant.shared_state.call_with_records builds them)")
    aiter.paged_attention_fp4(query, key_cache, value_cache, key_scales, value_scales,
                              block_tables, seq_lens, scale, cu_query_lens=cu_query_lens,
                              out=out, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, max_seq_len=max_seq_len,
                              rotation_signs=rotation_signs, seq_state=seq_state,
                              state_ids=state_ids, sink=sink, sinks=sinks, lse=lse)


# ROCm builds of PyTorch dispatch HIP as CUDA; the function stays importable (the routing tests
# register it for CPU too).
torch.library.impl(ATTENTION_OP, "CUDA")(_impl)


def _write_impl(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping,
                rotation_signs, seq_state, state_ids):
    import aiter

    aiter.reshape_and_cache_fp4(key, value, key_cache, value_cache, key_scales, value_scales,
                                slot_mapping, rotation_signs=rotation_signs, seq_state=seq_state,
                                state_ids=state_ids)


torch.library.impl(CACHE_WRITE_OP, "CUDA")(_write_impl)  # ROCm builds dispatch HIP as CUDA


_checked = Once("checking the patched AITER failed")


def aiter_root() -> Optional[Path]:
    """The directory that holds the ``aiter`` package (site-packages or a checkout), or None."""
    try:
        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent


def _aiter_reason() -> Optional[str]:
    from ..integration.aiter import patch

    root = aiter_root()
    if root is None:
        return ("AITER is not installed: pip install amd-aiter (or a ROCm/aiter checkout), then "
                + PATCH_COMMAND.format(root="<the directory that holds aiter/>"))
    try:
        st = patch.status(root)
    except patch.PatchError as e:
        return f"AITER at {root} cannot be patched: {e}"
    if st.state != "patched":
        return (f"AITER {st.version} at {root} is {st.state} (no FP4 paged attention): run "
                + PATCH_COMMAND.format(root=root))
    try:
        import aiter
    except Exception as e:  # noqa: BLE001 - any import failure is a reason, not a crash
        return f"import aiter failed: {type(e).__name__}: {e}"
    for op in ("paged_attention_fp4", "reshape_and_cache_fp4"):
        if not hasattr(aiter, op):
            return (f"the imported aiter ({getattr(aiter, '__file__', '?')}) lacks {op}: run "
                    + PATCH_COMMAND.format(root=root))
    return None


def _arch(device=None) -> Optional[str]:
    """The gfx name of ``device`` (None: the current one), or None without a ROCm GPU."""
    if not getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return None
    if device is None or getattr(device, "type", "cuda") != "cuda":
        device = torch.cuda.current_device()
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def _device_reason() -> Optional[str]:
    if not getattr(torch.version, "hip", None):
        return ("not a ROCm build of PyTorch (the aiter backend needs an AMD gfx950 or gfx942 "
                "GPU)")
    if not torch.cuda.is_available():
        return "no ROCm GPU is available"
    arch = _arch()
    if arch not in ARCHS:
        return (f"GPU architecture {arch} (the FP4 kernel is built for gfx950, MI350X/MI355X, "
                "and gfx942, MI300X)")
    return None


class AiterBackend(Backend):
    name = "aiter"
    priority = 60
    description = ("turboquant FP4 paged attention in a patched AITER: gfx950 scaled MFMA "
                   "(v_mfma_scale_f32_16x16x128_f8f6f4), native FP4 or LUT (AMD MI355X); "
                   "gfx942 LUT on v_mfma_f32_16x16x32_fp8_fp8 (AMD MI300X); the HIP cache "
                   "writer (hipified from the cuda one)")

    def unavailable(self) -> Optional[str]:
        reason = _device_reason()
        if reason is not None:
            return reason
        return _checked(None, _aiter_reason)

    def check_attention(self, call: AttentionCall) -> Optional[str]:
        reason = transform_tensors_reason(call)
        if reason is not None:
            return reason
        if call.scale_group != call.head_dim:
            return (f"per-{call.scale_group} scales are not supported by the aiter kernel (one "
                    "scale per (token, head) only)")
        if call.head_dim not in HEAD_DIMS:
            return f"head_dim {call.head_dim} not in {HEAD_DIMS}"
        if call.block_size not in BLOCK_SIZES:
            return f"block_size {call.block_size} not in {BLOCK_SIZES}"
        q = call.query
        if call.key_format == "fp8_e4m3" and _arch(q.device) == "gfx942":
            return K8V4_GFX942_REASON
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"query dtype {q.dtype} (expected float16 or bfloat16)"
        if not q.is_cuda:
            return f"tensors are on {q.device}, not on a ROCm GPU"
        if (q.stride(2) != 1 or q.stride(1) != call.head_dim or q.stride(0) % 8
                or q.data_ptr() % 16):
            return "query must have contiguous heads and 16-byte aligned rows"
        v = call.value_cache
        if v.stride(3) != 1 or v.stride(2) % 16 or v.data_ptr() % 16:
            return "value_cache must have contiguous, 16-byte aligned rows"
        # the kernel addresses keys with value_cache's strides (twice them for E4M3 rows)
        wide = 2 if call.key_format == "fp8_e4m3" else 1
        if call.key_cache.stride() != tuple(wide * s for s in v.stride()[:3]) + (1,) \
                or call.key_cache.data_ptr() % 16:
            return ("key_cache must be 16-byte aligned with value_cache's strides"
                    + (" times 2 (E4M3 rows of D bytes)" if wide == 2 else ""))
        if not (call.key_scales.is_contiguous() and call.value_scales.is_contiguous()):
            return "key_scales/value_scales must be contiguous"
        if not (call.block_tables.is_contiguous() and call.seq_lens.is_contiguous()):
            return "block_tables and seq_lens must be contiguous"
        if call.cu_query_lens is not None and not call.cu_query_lens.is_contiguous():
            return "cu_query_lens must be contiguous"
        return None

    def check_cache_write(self, write: CacheWrite) -> Optional[str]:
        """What aiter.reshape_and_cache_fp4 (files/cache_fp4.py) takes, each reason naming the
        argument."""
        k, d = write.key, write.head_dim
        if k.dtype not in WRITER_DTYPES:
            return f"key dtype {k.dtype} (expected bfloat16, float16 or float32)"
        if d not in HEAD_DIMS:
            return f"head_dim {d} not in {HEAD_DIMS}"
        if write.scale_group not in (d, 32):
            return f"scale group {write.scale_group} (expected {d} or 32)"
        rule = getattr(write, "scale_rule", "smallest")
        if rule != "smallest":
            return (f"scale_rule {rule!r} is not implemented by the HIP writer (only 'smallest'; "
                    "the reference has it)")
        k8 = write.key_format == "fp8_e4m3"  # K8V4: key rows of D bytes
        if k8 and write.scale_group != d:
            return "key_scales: K8V4 keys have one scale per (token, kv head), not per 32"
        bs = write.block_size
        if bs < 1 or bs & (bs - 1):
            return f"block_size {bs} is not a power of two"
        if not k.is_cuda:
            return f"tensors are on {k.device}, not on a ROCm GPU"
        for nm in ("key", "value"):  # 16 elements per work-item, loaded as 16-byte vectors
            t = getattr(write, nm)
            el = t.element_size()
            if (t.stride(2) != 1 or (t.stride(1) * el) % 16 or (t.stride(0) * el) % 16
                    or t.data_ptr() % 16):
                return f"{nm} must have a contiguous, 16-byte aligned head dimension"
        # a work-item stores 8 bytes of FP4 codes, 16 of E4M3
        for nm, row, align in (("key_cache", d if k8 else d // 2, 16 if k8 else 8),
                               ("value_cache", d // 2, 8)):
            c = getattr(write, nm)
            if (c.stride(3) != 1 or c.stride(2) != row or c.stride(1) % align
                    or c.stride(0) % align or c.data_ptr() % align):
                return f"{nm} must have contiguous, {align}-byte aligned [block_size, {row}] blocks"
        if not (write.key_scales.is_contiguous() and write.value_scales.is_contiguous()):
            return "key_scales/value_scales must be contiguous"
        if not write.slot_mapping.is_contiguous():
            return "slot_mapping must be contiguous"
        signs, state, ids = write.rotation_signs, write.seq_state, write.state_ids
        if signs is not None and (signs.dtype != torch.float32 or tuple(signs.shape) != (d,)
                                  or not signs.is_contiguous() or signs.data_ptr() % 16
                                  or signs.device != k.device):
            return f"rotation_signs: expected a contiguous, 16-byte aligned float32 [{d}] tensor"
        if (state is None) != (ids is None):
            return "seq_state and state_ids: expected both or neither"
        if state is not None:
            want = (write.num_kv_heads, STATE_ROWS, d)
            if (state.dtype != torch.float32 or state.dim() != 4 or tuple(state.shape[1:]) != want
                    or not state.is_contiguous() or state.data_ptr() % 16
                    or state.device != k.device or state.shape[0] >= 2 ** 31):
                return (f"seq_state: expected a contiguous, 16-byte aligned float32 [num_slots, "
                        f"{want[0]}, {want[1]}, {want[2]}] tensor")
            if (ids.dtype != torch.int32 or tuple(ids.shape) != (k.shape[0],)
                    or not ids.is_contiguous() or ids.device != k.device):
                return f"state_ids: expected a contiguous int32 [{k.shape[0]}] tensor"
        items = k.shape[0] * write.num_kv_heads * (d // WRITER_EPT)
        if items >= 2 ** 31:
            return (f"key: {items} work-items (num_tokens x num_kv_heads x head_dim / "
                    f"{WRITER_EPT}), the writer takes fewer than 2^31: split the call")
        return None

    def reshape_and_cache(self, write: CacheWrite) -> None:
        torch.ops.turboquant.reshape_and_cache_fp4_aiter(*cache_write_op_args(write))

    def paged_attention(self, call: AttentionCall, out: torch.Tensor,
                        lse: Optional[torch.Tensor] = None) -> None:
        torch.ops.turboquant.paged_attention_fp4_aiter(
            *attention_op_args(call_with_records(call), out, lse))


BACKEND = register(AiterBackend())
