# turboquant-fp4: FP4 (E2M1 codes, E8M0 scales) KV cache for AITER's pa_v1.
# Injected into csrc/cpp_itfs/pa/ by `python -m turboquant.integration.aiter.patch`; removed by
# its --revert. The kernels are turboquant's, next to this file: gfx950 runs
# tq_fp4_gfx950_attention.cuh (1 launch: one-wave partitions of a length chosen per call, each
# transforming its rows' Q in its prologue, the last partition of each row tile reducing it),
# gfx942
# tq_fp4_paged_attention.cuh (256-token partitions of 4 waves, then its reduce kernel). The
# partition length, the grid and the workspace layout come from pa_fp4_plan.py (one place, also
# read by turboquant's ISA model).
#
# Cache, HND only: key/value uint8 [num_blocks, num_kv_heads, block_size, head_size // 2],
# two E2M1 codes per byte (even element in the low nibble); key/value scales uint8
# [num_blocks, block_size, num_kv_heads], one E8M0 byte per (token, kv head). K8V4 (the second
# key format): key_cache float8_e4m3fn (or its uint8 view) [num_blocks, num_kv_heads,
# block_size, head_size], E4M3 bytes with the same one E8M0 scale per (token, kv head), its
# strides twice value_cache's; values unchanged (compile(..., key_format="fp8_e4m3")).
# Queries: decode (one token per sequence, cu_query_lens None) or several tokens per sequence,
# causal among themselves (cu_query_lens int32 [num_seqs + 1]: query token j of a sequence with
# q tokens and seq_len keys is at position seq_len - q + j); sliding_window W > 0: a query at
# position p sees keys p - W + 1 .. p. Decode and multi-token are two instantiations of the
# kernel (compile(..., multi_token=)); the window is a runtime argument of both.
# turboquant's accuracy transforms (optional, fused into the kernel): rotation_signs float32
# [head_size] of +-1 (Hadamard rotation), seq_state float32 [num_slots, num_kv_heads, 5,
# head_size] with state_ids int32 [num_seqs] (key smoothing), sink (position 0 from seq_state).
# Architectures (compile(..., arch=)): gfx950 (MI350X/MI355X: the native FP4 MFMA path by
# default, or the LUT path) and gfx942 (MI300X: the LUT path only, FP4 decoded to E4M3FNUZ on
# v_mfma_f32_16x16x32_fp8_fp8 with the scales in fp32; K8V4 caches are refused there: their OCP
# E4M3 key bytes are not gfx942's FNUZ FP8).
# Workspace (workspace_size / new_workspace; layout in pa_fp4_plan.py): gfx942's is pa_v1's
# (exp_sums, max_logits, tmp_out for 256-token partitions), gfx950's fp32 partials. Nothing in
# it outlives a call: any buffer of the call's size serves, kept or new. gfx950's reduce
# tickets live apart (`_tickets`): one zeroed array per device and stream that every call
# leaves zero.
import ctypes
import hashlib
import operator
import os

from jinja2 import Template

from csrc.cpp_itfs.pa import pa_fp4_plan as plan
from csrc.cpp_itfs.utils import AITER_CORE_DIR, compile_template_op

MD_NAME = "pa_v1_fp4"
FP4_KV_CACHE_DTYPES = ("fp4", "fp4_e2m1")
PARTITION_SIZE = 256  # pa_v1's partition_size (its caller's workspace); gfx942's partitions
MAX_DECODE_GQA = plan.MAX_DECODE_GQA  # the decode kernel's GQA limit (one MFMA column per head)
# LUT path instead of the native FP4 MFMA: argument use_native=False, or this variable = 1.
LUT_ENV = "AITER_FP4_KV_LUT"
# The GPU architectures the kernel is built for; the native FP4 MFMA exists on gfx950 only.
ARCHS = ("gfx950", "gfx942")
NATIVE_ARCHS = ("gfx950",)

_DIR = f"{AITER_CORE_DIR}/csrc/cpp_itfs/pa"
_HEADERS = [f"{_DIR}/tq_fp4_platform.cuh", f"{_DIR}/tq_fp4_common.cuh",
            f"{_DIR}/tq_fp4_paged_attention.cuh", f"{_DIR}/tq_fp4_gfx950_attention.cuh"]
with open(f"{_DIR}/pa_fp4.cpp.jinja", "r") as f:
    _TEMPLATE_TEXT = f.read()
src_template = Template(_TEMPLATE_TEXT)


def _kernel_digest() -> str:
    """Part of the compile key: a changed kernel header or template never reuses an old lib.so."""
    h = hashlib.sha256(_TEMPLATE_TEXT.encode())
    for path in _HEADERS:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


KERNEL_DIGEST = _kernel_digest()


KEY_FORMATS = ("fp4", "fp8_e4m3")


def compile(gqa_ratio: int, head_size: int, block_size: int, scalar: str,
            multi_token: bool = False, key_format: str = "fp4", folder: str = None,
            arch: str = "gfx950"):
    """The launcher library of one (GQA, head size, block size, query dtype) class; multi_token:
    the instantiation for cu_query_lens (several query tokens per sequence), else decode;
    key_format: "fp4" (E2M1 keys) or "fp8_e4m3" (K8V4: E4M3 keys); arch: the GPU it is for
    ("gfx950": both paths; "gfx942": the LUT path only, FP4 keys only). The kernel source picks
    the arch's instructions when AITER compiles it for that GPU; arch is part of the compile
    key, so one build directory never hands a library built for one arch to the other."""
    if key_format not in KEY_FORMATS:
        _fail("key_format", f"one of {KEY_FORMATS}", repr(key_format))
    if arch not in ARCHS:
        _fail("arch", f"one of {ARCHS}", repr(arch))
    if arch == "gfx942" and key_format != "fp4":
        _fail("key_format", "fp4 on gfx942 (K8V4's OCP E4M3 key bytes are not gfx942's FNUZ "
              "FP8)", repr(key_format))
    return compile_template_op(
        src_template,
        MD_NAME,
        _HEADERS,
        gqa_ratio=gqa_ratio,
        head_size=head_size,
        block_size=block_size,
        scalar=scalar,
        multi_token=bool(multi_token),
        key_format=key_format,
        kv_fp4="e2m1_e8m0",
        kernel_digest=KERNEL_DIGEST,
        arch=arch,
        folder=folder,
    )


def default_use_native() -> bool:
    return os.environ.get(LUT_ENV, "0") not in ("1", "true", "True")


def _fail(name, expected, got):
    raise ValueError(f"{name}: expected {expected}, got {got}")


def workspace_size(num_tokens: int, num_heads: int, max_seq_len: int, head_size: int, *,
                   num_kv_heads: int, num_seqs: int = None, multi_token: bool = False,
                   arch: str = "gfx950", num_cus: int = None, partition: int = None) -> int:
    """Bytes of workspace of a call (pa_fp4_plan.plan(...).size): num_seqs defaults to num_tokens
    (decode), multi_token: cu_query_lens given. gfx950: the partition length from num_cus (the
    GPU's multi_processor_count), or partition (a multiple of 128) as given: partition=128 gives
    the most any plan of the shape needs (a buffer reused across calls). gfx942: pa_v1's size."""
    return plan.workspace_size(arch, num_seqs=num_tokens if num_seqs is None else num_seqs,
                               num_tokens=num_tokens, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_size=head_size,
                               max_seq_len=max_seq_len, multi_token=multi_token, num_cus=num_cus,
                               partition=partition)


def _device(device):
    """(arch, CUs) of a torch device."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return props.gcnArchName.split(":")[0], props.multi_processor_count


def new_workspace(query, num_kv_heads: int, max_seq_len: int, num_seqs: int = None,
                  cu_query_lens=None, reusable: bool = False):
    """A workspace for a call of this query on its device (uint8, uninitialized).
    reusable: sized with the shortest partitions, enough for any call with at most as many query
    tokens and sequences (the same heads, at most this max_seq_len)."""
    import torch

    arch, num_cus = _device(query.device)
    if arch not in ARCHS:
        _fail("device", "a gfx950 (MI350X/MI355X) or gfx942 (MI300X) GPU", arch)
    num_tokens, num_heads, head_size = query.shape
    p = plan.plan(arch, num_seqs=num_tokens if num_seqs is None else num_seqs,
                  num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_size=head_size, max_seq_len=max_seq_len,
                  multi_token=cu_query_lens is not None, num_cus=num_cus,
                  partition=plan.MIN_PARTITION_LEN if reusable and arch == "gfx950" else None)
    return torch.empty(p.size, dtype=torch.uint8, device=query.device)


# (device, stream handle) -> the ticket arrays made for it, the newest (largest) last.
# Older ones are kept: a captured graph may hold their address.
_TICKETS = {}
_MIN_TICKETS = 16384  # 64 KiB: 2048 row tiles x 8 kv heads before the first growth


def _tickets(device, n: int):
    """gfx950: at least n uint32 tickets for a call on the current stream of `device`, zero
    (every call leaves the ones it takes at zero; calls on one stream never overlap). A larger
    array than any before is allocated zeroed, at least twice the last one, and never under
    graph capture (its zeroing would only run at replay, after other calls had used it): a
    captured call needs one of its size made before, by a call outside capture on that stream
    (engines run their batch sizes eagerly before capturing them). Graphs captured on one
    stream share its array: replay them one at a time, as a stream does."""
    import torch

    stream = torch.cuda.current_stream(device)
    key = (str(device), stream.cuda_stream)
    have = _TICKETS.setdefault(key, [])
    if not have or have[-1].numel() < n:
        if torch.cuda.is_current_stream_capturing():
            _fail("tickets", f"{n} reduce tickets made on this stream before graph capture (run "
                  "one call of this size eagerly first)",
                  f"{have[-1].numel() if have else 0} made")
        size = max(n, _MIN_TICKETS, 2 * have[-1].numel() if have else 0)
        have.append(torch.zeros(size, dtype=torch.int32, device=device))
    return have[-1]


def _check_queries(query, seq_lens, block_tables, cu_query_lens, sliding_window):
    """The query layout arguments: -> num_seqs (decode: one query token per sequence)."""
    import torch

    num_tokens = query.size(0)
    for name, t in (("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32 or not t.is_contiguous() or t.device != query.device:
            _fail(name, f"a contiguous int32 tensor on {query.device}", f"{t.dtype} on {t.device}")
    num_seqs = seq_lens.size(0)
    if block_tables.dim() != 2 or block_tables.size(0) != num_seqs:
        _fail("block_tables", f"int32 [{num_seqs}, max_blocks_per_seq]", tuple(block_tables.shape))
    if cu_query_lens is None:
        if num_seqs != num_tokens:
            _fail("seq_lens", f"one length per query token ({num_tokens}) without cu_query_lens",
                  num_seqs)
    elif cu_query_lens.dtype != torch.int32 or tuple(cu_query_lens.shape) != (num_seqs + 1,) \
            or not cu_query_lens.is_contiguous() or cu_query_lens.device != query.device:
        _fail("cu_query_lens", f"a contiguous int32 [{num_seqs + 1}] tensor on {query.device} "
              "(None: decode)", f"{cu_query_lens.dtype} {tuple(cu_query_lens.shape)} on "
              f"{cu_query_lens.device}")
    if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) \
            or not 0 <= sliding_window < 2 ** 31:
        _fail("sliding_window", "an int >= 0 (0: off)", repr(sliding_window))
    return num_seqs


def _check_transforms(query, num_seqs, num_kv_heads, rotation_signs, seq_state, state_ids, sink):
    import torch

    head_size = query.size(2)
    if rotation_signs is not None:
        if rotation_signs.dtype != torch.float32 or tuple(rotation_signs.shape) != (head_size,) \
                or not rotation_signs.is_contiguous() or rotation_signs.device != query.device:
            _fail("rotation_signs", f"a contiguous float32 [{head_size}] tensor on {query.device}",
                  f"{rotation_signs.dtype} {tuple(rotation_signs.shape)} on {rotation_signs.device}")
    for name, t in (("rotation_signs", rotation_signs), ("seq_state", seq_state)):
        if t is not None and t.data_ptr() % 16:  # the gfx950 kernel loads them in 16-byte vectors
            _fail(name, "a 16-byte aligned data pointer", hex(t.data_ptr()))
    if seq_state is None:
        if state_ids is not None or sink:
            _fail("seq_state", "a state tensor when state_ids or sink is given", None)
        return 0
    want = (num_kv_heads, 5, head_size)
    if seq_state.dtype != torch.float32 or seq_state.dim() != 4 or tuple(seq_state.shape[1:]) != want \
            or not seq_state.is_contiguous() or seq_state.device != query.device:
        _fail("seq_state", f"a contiguous float32 [num_slots, {num_kv_heads}, 5, {head_size}] tensor "
              f"on {query.device}", f"{seq_state.dtype} {tuple(seq_state.shape)} on {seq_state.device}")
    if state_ids is None or state_ids.dtype != torch.int32 or tuple(state_ids.shape) != (num_seqs,) \
            or not state_ids.is_contiguous() or state_ids.device != query.device:
        _fail("state_ids", f"a contiguous int32 [{num_seqs}] tensor on {query.device} (each "
              "sequence's slot in seq_state)",
              None if state_ids is None else f"{state_ids.dtype} {tuple(state_ids.shape)}")
    return seq_state.size(0)


def paged_attention_fp4_launch(out, workspace_buffer, query, key_cache, value_cache, key_scales,
                               value_scales, block_tables, seq_lens, max_seq_len: int,
                               scale: float, logits_soft_cap: float = 0.0, use_native=None,
                               rotation_signs=None, seq_state=None, state_ids=None,
                               sink: bool = False, cu_query_lens=None, sliding_window: int = 0,
                               sinks=None, lse=None, grow_workspace: bool = False):
    """Attention over the FP4 (or K8V4) paged cache into out: decode (cu_query_lens None: one query
    token per sequence) or cu_query_lens int32 [num_seqs + 1] (several, causal among
    themselves); sliding_window W > 0: keys p - W + 1 .. p. rotation_signs / seq_state +
    state_ids / sink: turboquant's transforms (None / False: off). sinks: learned sink logits
    float32 [num_heads] (one more logit per head, no value); lse: float32 [num_tokens,
    num_heads], written with each row's natural-log log-sum-exp (None: not wanted).
    workspace_buffer: contiguous, 16-byte aligned, at least workspace_size(...) bytes, contents
    unused. grow_workspace: a buffer sized for another layout (pa_v1's): on gfx950 one too small,
    misaligned or not contiguous for this call's plan is replaced by a new one instead of
    refused."""
    import torch

    arch, num_cus = _device(query.device)
    if arch not in ARCHS:
        _fail("device", "a gfx950 (MI350X/MI355X) or gfx942 (MI300X) GPU (the FP4 paged attention "
              "uses their MFMA instructions)", arch)
    if use_native is None:
        # gfx942 has no scaled MFMA: the LUT path there, whatever AITER_FP4_KV_LUT says.
        use_native = arch in NATIVE_ARCHS and default_use_native()
    if use_native and arch not in NATIVE_ARCHS:
        _fail("use_native", f"False on {arch} (the native FP4 MFMA needs gfx950; {arch} runs the "
              "LUT path)", use_native)
    if query.dtype not in (torch.bfloat16, torch.float16):
        _fail("query.dtype", "bfloat16 or float16", query.dtype)
    if out.dtype != query.dtype or out.shape != query.shape or not out.is_contiguous():
        _fail("out", f"a contiguous {query.dtype} tensor of shape {tuple(query.shape)}",
              f"{out.dtype} {tuple(out.shape)}")
    num_tokens, num_heads, head_size = query.shape
    if head_size not in (64, 128, 256):
        _fail("head_size", "64, 128 or 256", head_size)
    if query.stride(2) != 1 or query.stride(1) != head_size or query.stride(0) % 8 \
            or query.data_ptr() % 16:
        _fail("query", "contiguous heads and head elements, 16-byte aligned rows (the kernel "
              "loads Q in 16-byte vectors)", f"strides {tuple(query.stride())}, address "
              f"{query.data_ptr() % 16} mod 16")
    # The key format from key_cache: rows of head_size // 2 FP4 bytes (uint8), or of head_size
    # E4M3 bytes (K8V4: float8_e4m3fn, or its uint8 view).
    key_e4m3 = key_cache.dim() == 4 and (key_cache.dtype == torch.float8_e4m3fn or (
        key_cache.dtype == torch.uint8 and key_cache.size(3) == head_size))
    key_width, key_dtype = (head_size, "float8_e4m3fn (or uint8)") if key_e4m3 else (head_size // 2, "uint8")
    if value_cache.dtype != torch.uint8 or value_cache.dim() != 4 \
            or value_cache.size(3) != head_size // 2:
        _fail("value_cache", f"uint8 [num_blocks, num_kv_heads, block_size, {head_size // 2}] (HND)",
              f"{value_cache.dtype} {tuple(value_cache.shape)}")
    if key_cache.dim() != 4 or key_cache.size(3) != key_width \
            or tuple(key_cache.shape[:3]) != tuple(value_cache.shape[:3]):
        _fail("key_cache", f"{key_dtype} [{', '.join(map(str, value_cache.shape[:3]))}, {key_width}] "
              f"(value_cache's blocks, heads and slots; {head_size // 2} FP4 bytes or {head_size} "
              "E4M3 bytes per row)", f"{key_cache.dtype} {tuple(key_cache.shape)}")
    if value_cache.stride(3) != 1 or value_cache.stride(2) % 16:
        _fail("value_cache", "rows contiguous and 16-byte aligned", tuple(value_cache.stride()))
    key_strides = tuple((2 if key_e4m3 else 1) * st for st in value_cache.stride()[:3]) + (1,)
    if key_e4m3 and arch not in NATIVE_ARCHS:
        _fail("key_cache", f"FP4 (uint8 [..., {head_size // 2}]) keys on {arch}: K8V4's OCP E4M3 "
              f"key bytes are not {arch}'s FNUZ FP8", f"{key_cache.dtype} {tuple(key_cache.shape)}")
    if key_cache.stride() != key_strides:
        _fail("key_cache", f"strides {key_strides} (value_cache's, times 2 for E4M3 rows)"
              if key_e4m3 else f"value_cache's strides {key_strides}", tuple(key_cache.stride()))
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.data_ptr() % 16:
            _fail(name, "a 16-byte aligned data pointer", hex(t.data_ptr()))
    num_blocks, num_kv_heads, block_size, _ = value_cache.shape
    if num_blocks < 1:
        _fail("value_cache", "at least one block (a bad block id reads block 0)", num_blocks)
    if block_size not in (16, 32, 64, 128, 256):
        _fail("block_size", "16, 32, 64, 128 or 256", block_size)
    if num_heads % num_kv_heads:
        _fail("num_heads", f"a multiple of num_kv_heads={num_kv_heads}", num_heads)
    for name, t in (("key_scales", key_scales), ("value_scales", value_scales)):
        if t.dtype != torch.uint8 or tuple(t.shape) != (num_blocks, block_size, num_kv_heads) \
                or not t.is_contiguous():
            _fail(name, f"contiguous uint8 [{num_blocks}, {block_size}, {num_kv_heads}] "
                  "(one E8M0 byte per token and kv head)", f"{t.dtype} {tuple(t.shape)}")
    num_seqs = _check_queries(query, seq_lens, block_tables, cu_query_lens, sliding_window)
    num_slots = _check_transforms(query, num_seqs, num_kv_heads, rotation_signs, seq_state,
                                  state_ids, sink)
    for name, t, shape in (("sinks", sinks, (num_heads,)), ("lse", lse, (num_tokens, num_heads))):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != shape
                              or not t.is_contiguous() or t.device != query.device):
            _fail(name, f"a contiguous float32 {list(shape)} tensor on {query.device}",
                  f"{t.dtype} {tuple(t.shape)} on {t.device}")
    try:
        max_seq_len = operator.index(max_seq_len)
    except TypeError:
        _fail("max_seq_len", "an int (a bound on seq_lens)", repr(max_seq_len))
    if not 0 <= max_seq_len < 2 ** 31:
        _fail("max_seq_len", "an int in [0, 2^31) (a bound on seq_lens)", max_seq_len)
    kw = dict(num_seqs=num_seqs, num_tokens=num_tokens, num_heads=num_heads,
              num_kv_heads=num_kv_heads, head_size=head_size, max_seq_len=max_seq_len,
              multi_token=cu_query_lens is not None, num_cus=num_cus)
    nbytes = workspace_buffer.numel() * workspace_buffer.element_size()
    p = plan.plan(arch, **kw)
    if grow_workspace and arch == "gfx950" and (
            nbytes < p.size or not workspace_buffer.is_contiguous()
            or workspace_buffer.data_ptr() % 16):
        workspace_buffer = torch.empty(p.size, dtype=torch.uint8, device=query.device)
        nbytes = p.size
    if not workspace_buffer.is_contiguous() or workspace_buffer.device != query.device:
        _fail("workspace_buffer", f"a contiguous tensor on {query.device}",
              f"strides {tuple(workspace_buffer.stride())} on {workspace_buffer.device}")
    if nbytes < p.size:
        _fail("workspace_buffer", f"at least {p.size} bytes (workspace_size)", nbytes)
    if arch == "gfx950" and workspace_buffer.data_ptr() % 16:
        _fail("workspace_buffer", "a 16-byte aligned data pointer",
              hex(workspace_buffer.data_ptr()))
    tickets = _tickets(query.device, plan.num_tickets(p, num_kv_heads)) if arch == "gfx950" else None
    scalar = "Bf16" if query.dtype == torch.bfloat16 else "Fp16"
    gqa_ratio = num_heads // num_kv_heads
    if cu_query_lens is None and p.multi_token:
        # A decode workgroup holds one GQA group in the MFMA's 16 columns: a larger group runs
        # the multi-token kernel, one query token per sequence.
        cu_query_lens = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    func = compile(gqa_ratio, head_size, block_size, scalar,
                   multi_token=cu_query_lens is not None,
                   key_format="fp8_e4m3" if key_e4m3 else "fp4", arch=arch)
    ptr = lambda t: ctypes.c_void_p(None if t is None else t.data_ptr())  # noqa: E731
    func(ptr(out), ptr(workspace_buffer),
         *(ctypes.c_long(p.offset(name)) for name in plan.REGIONS), ptr(tickets),
         ptr(query), ptr(key_cache), ptr(value_cache),
         ptr(key_scales), ptr(value_scales),
         ctypes.cast(block_tables.data_ptr(), ctypes.POINTER(ctypes.c_int)),
         ctypes.cast(seq_lens.data_ptr(), ctypes.POINTER(ctypes.c_int)),
         ptr(cu_query_lens), ctypes.c_float(scale), ctypes.c_float(logits_soft_cap),
         ctypes.c_int(sliding_window), ctypes.c_int(block_tables.size(1)),
         ctypes.c_int(p.max_parts), ctypes.c_int(p.partition_len), ctypes.c_int(p.row_tiles),
         ctypes.c_int(num_seqs), ctypes.c_int(num_tokens), ctypes.c_int(num_kv_heads),
         ctypes.c_int(num_blocks), ctypes.c_int(query.stride(0)), ctypes.c_long(value_cache.stride(0)),
         ctypes.c_int(value_cache.stride(1)), ctypes.c_int(value_cache.stride(2)),
         ptr(rotation_signs), ptr(seq_state), ptr(state_ids), ctypes.c_int(num_slots),
         ctypes.c_int(1 if sink else 0), ptr(sinks), ptr(lse), ctypes.c_int(1 if use_native else 0),
         ctypes.c_void_p(torch.cuda.current_stream(query.device).cuda_stream))
    return out


def paged_attention_v1_fp4(out, workspace_buffer, query, key_cache, value_cache, scale,
                           block_tables, cu_query_lens, context_lens, max_context_len,
                           alibi_slopes, kv_cache_layout, logits_soft_cap, k_scale, v_scale,
                           fp8_out_scale, partition_size, mtp, q_scale, sliding_window):
    """pa_v1 with kv_cache_dtype 'fp4_e2m1': k_scale / v_scale are the E8M0 scale tensors.
    cu_query_lens (int32 [num_seqs + 1], or None: decode) and sliding_window go to the kernel;
    with cu_query_lens, mtp (pa_v1's bound on the query tokens of a sequence) is not needed.
    workspace_buffer: sized by pa_v1's caller for pa_v1's layout (256-token partitions; exactly
    gfx942's): on gfx950 the call takes a new buffer when this one is smaller than its plan
    (pa_fp4_plan.py)."""
    unsupported = {
        "kv_cache_layout": (kv_cache_layout, "HND"),
        "alibi_slopes": (alibi_slopes, None),
        "fp8_out_scale": (fp8_out_scale, None),
        "q_scale": (q_scale, None),
        "partition_size": (partition_size, PARTITION_SIZE),
    }
    if cu_query_lens is None:
        unsupported["mtp"] = (mtp, 1)
    for name, (got, expected) in unsupported.items():
        if (got is not None) if expected is None else (got != expected):
            _fail(name, f"{expected!r} with an FP4 KV cache", "a tensor" if hasattr(got, "shape") else got)
    return paged_attention_fp4_launch(out, workspace_buffer, query, key_cache, value_cache,
                                      k_scale, v_scale, block_tables, context_lens,
                                      max_context_len, scale, logits_soft_cap,
                                      cu_query_lens=cu_query_lens,
                                      sliding_window=sliding_window or 0, grow_workspace=True)
