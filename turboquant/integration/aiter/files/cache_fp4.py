# turboquant-fp4: the FP4 (E2M1 codes, E8M0 scales) KV-cache writer for AITER, the one that
# fills the caches pa_fp4.py reads. Injected into csrc/cpp_itfs/pa/ by
# `python -m turboquant.integration.aiter.patch`; removed by its --revert. The kernels are
# turboquant's CUDA cache writer as hipify-torch translated it (tq_cache_writer_hip.cuh,
# tq_fp4_portable_hip.cuh, tq_limits.cuh, tq_tuning.cuh, next to this file), built by AITER's
# JIT from cache_fp4.cpp.jinja: one library per (input dtype, head size, arch).
#
# key, value [num_tokens, num_kv_heads, head_size] bf16/fp16/fp32, quantized to the cache at
# slot_mapping (int64 or int32 [num_tokens]; slot = block * block_size + offset; -1 skips the
# token, a slot past the cache too). Cache, HND: key/value uint8 [num_blocks, num_kv_heads,
# block_size, head_size // 2] (two E2M1 codes per byte, the even element in the low nibble);
# scales uint8 [num_blocks, block_size, num_kv_heads] (one E8M0 byte per token and kv head) or
# [..., head_size // 32] (one per 32 elements). K8V4 (the second key format): key_cache
# float8_e4m3fn (or its uint8 view) [num_blocks, num_kv_heads, block_size, head_size], E4M3
# bytes with one scale per (token, kv head). Scale rule: the smallest power of two s with
# amax / s <= 6 (448 for E4M3 keys); a group holding NaN or Inf gets byte 255 and zero codes.
# turboquant's accuracy transforms (optional, fused into the kernel, in fp32 before the scale
# rule): rotation_signs float32 [head_size] of +-1 (both tensors rotated by a randomized
# Hadamard matrix), seq_state float32 [num_slots, num_kv_heads, 5, head_size] with state_ids
# int32 [num_tokens] (key smoothing: each key becomes (k - m) * (1 / lam) of its token's record;
# a slot outside [0, num_slots) writes NaN codes). The bytes are those of turboquant's
# reference writer, bit for bit; they need fp32 subnormals kept, which AITER's JIT flushes for
# every library it builds (-fgpu-flush-denormals-to-zero): CXXFLAGS below undoes that here.
import ctypes
import hashlib

from jinja2 import Template

from csrc.cpp_itfs.utils import AITER_CORE_DIR, compile_template_op

MD_NAME = "reshape_and_cache_fp4"
# The GPU architectures the writer is built for (the same source: no FP8/FP4 conversion
# instruction is used, so gfx942's FNUZ FP8 does not matter to it).
ARCHS = ("gfx950", "gfx942")
HEAD_SIZES = (64, 128, 256)
SCALARS = {"bfloat16": "Bf16", "float16": "Fp16", "float32": "Fp32"}
THREAD_ELEMENTS = 16  # elements of K and of V per work-item (the writer's WRITER_EPT)
# One option string, as AITER's own "-mllvm ..." flags are: its compile_lib dedups the flags
# through a set (no order), and the cc1 option wins over -fgpu-flush-denormals-to-zero wherever
# it lands (it is forwarded after the driver's own denormal option).
CXXFLAGS = ["-Xclang -fdenormal-fp-math-f32=ieee"]

_DIR = f"{AITER_CORE_DIR}/csrc/cpp_itfs/pa"
_HEADERS = [f"{_DIR}/tq_cache_writer_hip.cuh", f"{_DIR}/tq_fp4_portable_hip.cuh",
            f"{_DIR}/tq_limits.cuh", f"{_DIR}/tq_tuning.cuh"]
with open(f"{_DIR}/cache_fp4.cpp.jinja", "r") as f:
    _TEMPLATE_TEXT = f.read()
src_template = Template(_TEMPLATE_TEXT)


def _writer_digest() -> str:
    """Part of the compile key: a changed writer header or template never reuses an old lib.so."""
    h = hashlib.sha256(_TEMPLATE_TEXT.encode())
    for path in _HEADERS:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


WRITER_DIGEST = _writer_digest()


def _fail(name, expected, got):
    raise ValueError(f"{name}: expected {expected}, got {got}")


def compile(scalar: str, head_size: int, arch: str = "gfx950", folder: str = None):
    """The writer library of one (input dtype, head size) for arch; every key format, scale
    group and transform is in it (picked at launch)."""
    if scalar not in SCALARS.values():
        _fail("scalar", f"one of {tuple(SCALARS.values())}", repr(scalar))
    if head_size not in HEAD_SIZES:
        _fail("head_size", f"one of {HEAD_SIZES}", head_size)
    if arch not in ARCHS:
        _fail("arch", f"one of {ARCHS}", repr(arch))
    return compile_template_op(
        src_template,
        MD_NAME,
        _HEADERS,
        cxxflags=list(CXXFLAGS),
        scalar=scalar,
        head_size=head_size,
        writer_digest=WRITER_DIGEST,
        arch=arch,
        folder=folder,
    )


def _rows(name, t, element_size, align):
    """t's last dim contiguous and its rows `align`-byte aligned (the writer's vector loads)."""
    if t.stride(-1) != 1 or any(s * element_size % align for s in t.stride()[:-1]) \
            or t.data_ptr() % align:
        _fail(name, f"a contiguous last dimension and {align}-byte aligned rows", f"strides "
              f"{tuple(t.stride())}, address {t.data_ptr() % align} mod {align}")


def reshape_and_cache_fp4_launch(key, value, key_cache, value_cache, key_scales, value_scales,
                                 slot_mapping, rotation_signs=None, seq_state=None,
                                 state_ids=None):
    """Quantize key/value into the FP4 (or K8V4) paged cache in place; see the top of this file.
    Launches one kernel on the current stream; reads no tensor on the host."""
    import torch

    arch = torch.cuda.get_device_properties(key.device).gcnArchName.split(":")[0]
    if arch not in ARCHS:
        _fail("device", "a gfx950 (MI350X/MI355X) or gfx942 (MI300X) GPU", arch)
    if key.dtype not in (torch.bfloat16, torch.float16, torch.float32) or key.dim() != 3:
        _fail("key", "a bfloat16, float16 or float32 [num_tokens, num_kv_heads, head_size] tensor",
              f"{key.dtype} {tuple(key.shape)}")
    num_tokens, num_kv_heads, head_size = key.shape
    if head_size not in HEAD_SIZES:
        _fail("key", f"head_size (dim 2) one of {HEAD_SIZES}", head_size)
    if value.dtype != key.dtype or value.shape != key.shape:
        _fail("value", f"{key.dtype} {tuple(key.shape)} (key's dtype and shape)",
              f"{value.dtype} {tuple(value.shape)}")
    # 16 elements per work-item, loaded as 16-byte vectors
    _rows("key", key, key.element_size(), 16)
    _rows("value", value, value.element_size(), 16)
    # The key format from key_cache: rows of head_size // 2 FP4 bytes (uint8), or of head_size
    # E4M3 bytes (K8V4: float8_e4m3fn, or its uint8 view).
    key_e4m3 = key_cache.dim() == 4 and (key_cache.dtype == torch.float8_e4m3fn or (
        key_cache.dtype == torch.uint8 and key_cache.size(3) == head_size))
    key_width = head_size if key_e4m3 else head_size // 2
    if value_cache.dtype != torch.uint8 or value_cache.dim() != 4 \
            or value_cache.size(1) != num_kv_heads or value_cache.size(3) != head_size // 2:
        _fail("value_cache", f"uint8 [num_blocks, {num_kv_heads}, block_size, {head_size // 2}] "
              "(HND)", f"{value_cache.dtype} {tuple(value_cache.shape)}")
    num_blocks, _, block_size, _ = value_cache.shape
    if key_cache.dtype not in (torch.uint8, torch.float8_e4m3fn) or key_cache.dim() != 4 \
            or tuple(key_cache.shape) != (num_blocks, num_kv_heads, block_size, key_width):
        _fail("key_cache", f"uint8 [{num_blocks}, {num_kv_heads}, {block_size}, "
              f"{head_size // 2}] (FP4) or float8_e4m3fn [..., {head_size}] (K8V4 keys)",
              f"{key_cache.dtype} {tuple(key_cache.shape)}")
    if block_size < 1 or block_size & (block_size - 1):
        _fail("block_size", "a power of two (value_cache dim 2)", block_size)
    # a work-item stores 8 bytes of FP4 codes, 16 of E4M3
    for name, t, row, align in (("key_cache", key_cache, key_width, 16 if key_e4m3 else 8),
                                ("value_cache", value_cache, head_size // 2, 8)):
        if t.stride(3) != 1 or t.stride(2) != row or t.stride(1) % align or t.stride(0) % align \
                or t.data_ptr() % align:
            _fail(name, f"contiguous, {align}-byte aligned [block_size, {row}] blocks",
                  f"strides {tuple(t.stride())}, address {t.data_ptr() % align} mod {align}")
    per_token = (num_blocks, block_size, num_kv_heads)
    if key_scales.dtype != torch.uint8 or not key_scales.is_contiguous() \
            or tuple(key_scales.shape) not in (per_token, per_token + (head_size // 32,)):
        _fail("key_scales", f"contiguous uint8 {list(per_token)} (one E8M0 byte per token and kv "
              f"head) or {list(per_token + (head_size // 32,))} (per 32 elements)",
              f"{key_scales.dtype} {tuple(key_scales.shape)}")
    group = head_size if key_scales.dim() == 3 else 32
    if key_e4m3 and group != head_size:
        _fail("key_scales", f"{list(per_token)}: K8V4 keys have one scale per (token, kv head)",
              tuple(key_scales.shape))
    if value_scales.dtype != torch.uint8 or not value_scales.is_contiguous() \
            or value_scales.shape != key_scales.shape:
        _fail("value_scales", f"contiguous uint8 {list(key_scales.shape)} (key_scales' shape)",
              f"{value_scales.dtype} {tuple(value_scales.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32) \
            or tuple(slot_mapping.shape) != (num_tokens,) or not slot_mapping.is_contiguous():
        _fail("slot_mapping", f"a contiguous int64 or int32 [{num_tokens}] tensor",
              f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if rotation_signs is not None and (
            rotation_signs.dtype != torch.float32 or tuple(rotation_signs.shape) != (head_size,)
            or not rotation_signs.is_contiguous() or rotation_signs.data_ptr() % 16):
        _fail("rotation_signs", f"a contiguous, 16-byte aligned float32 [{head_size}] tensor",
              f"{rotation_signs.dtype} {tuple(rotation_signs.shape)}")
    num_slots = 0
    if seq_state is not None:
        want = (num_kv_heads, 5, head_size)
        if seq_state.dtype != torch.float32 or seq_state.dim() != 4 \
                or tuple(seq_state.shape[1:]) != want or not seq_state.is_contiguous() \
                or seq_state.data_ptr() % 16 or seq_state.size(0) >= 2 ** 31:
            _fail("seq_state", f"a contiguous, 16-byte aligned float32 [num_slots, {num_kv_heads}, "
                  f"5, {head_size}] tensor", f"{seq_state.dtype} {tuple(seq_state.shape)}")
        num_slots = seq_state.size(0)
    if (state_ids is None) != (seq_state is None) or state_ids is not None and (
            state_ids.dtype != torch.int32 or tuple(state_ids.shape) != (num_tokens,)
            or not state_ids.is_contiguous()):
        _fail("state_ids", f"a contiguous int32 [{num_tokens}] tensor (each token's slot) with "
              "seq_state, None without", None if state_ids is None else
              f"{state_ids.dtype} {tuple(state_ids.shape)}")
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("key_scales", key_scales), ("value_scales", value_scales),
                    ("slot_mapping", slot_mapping), ("rotation_signs", rotation_signs),
                    ("seq_state", seq_state), ("state_ids", state_ids)):
        if t is not None and t.device != key.device:
            _fail(name, f"a tensor on {key.device} (key's device)", t.device)
    work_items = num_tokens * num_kv_heads * (head_size // THREAD_ELEMENTS)
    if work_items >= 2 ** 31:
        _fail("key", f"fewer than 2^31 work-items (num_tokens x num_kv_heads x head_size / "
              f"{THREAD_ELEMENTS}): split the call", work_items)
    if num_tokens == 0:
        return
    func = compile(SCALARS[str(key.dtype).split(".")[-1]], head_size, arch)
    ptr = lambda t: ctypes.c_void_p(None if t is None else t.data_ptr())  # noqa: E731
    err = func(ptr(key), ptr(value),
               ctypes.c_longlong(key.stride(0)), ctypes.c_longlong(key.stride(1)),
               ctypes.c_longlong(value.stride(0)), ctypes.c_longlong(value.stride(1)),
               ptr(key_cache), ptr(value_cache),
               ctypes.c_longlong(key_cache.stride(0)), ctypes.c_longlong(key_cache.stride(1)),
               ctypes.c_longlong(value_cache.stride(0)), ctypes.c_longlong(value_cache.stride(1)),
               ptr(key_scales), ptr(value_scales), ptr(slot_mapping),
               ctypes.c_int(1 if slot_mapping.dtype == torch.int64 else 0),
               ctypes.c_int(num_tokens), ctypes.c_int(num_kv_heads), ctypes.c_int(group),
               ctypes.c_int(block_size), ctypes.c_int(num_blocks),
               ptr(rotation_signs), ptr(seq_state), ptr(state_ids), ctypes.c_int(num_slots),
               ctypes.c_int(1 if key_e4m3 else 0),
               ctypes.c_void_p(torch.cuda.current_stream(key.device).cuda_stream))
    if err:
        raise RuntimeError(f"reshape_and_cache_fp4: the writer's launch failed (hipError_t {err})")
