"""The ``aiter`` backend: its reasons everywhere, and (marker gfx950) its results on MI355X."""
from __future__ import annotations

import itertools
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

import turboquant
from turboquant import registry
from turboquant.calls import make_attention_call
from turboquant._backends import aiter as tq_aiter
from turboquant.cache import build_paged_problem
from turboquant.config import PLAIN
from turboquant.integration.aiter import patch

ROOT = Path(__file__).resolve().parents[1]


def test_import_is_cheap_and_registers():
    code = ("import sys, turboquant._backends.aiter as a; from turboquant import registry; "
            "assert 'aiter' not in sys.modules; b = registry.get('aiter'); "
            "assert b.priority == 60 and isinstance(b, a.AiterBackend); print(b.unavailable())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    if not getattr(torch.version, "hip", None):
        assert "not a ROCm build of PyTorch" in r.stdout



def test_head_dims_match_the_nvidia_list():
    """The HIP kernels keep their own head-dim list; the vLLM plugin states one list for every
    backend it picks (limits.cuh's), so the two must name the same head dims."""
    from turboquant.sources import cuda_limits
    assert tuple(tq_aiter.HEAD_DIMS) == cuda_limits()[0]

@pytest.fixture
def fake_gfx950(monkeypatch):
    """Pretend to be a ROCm PyTorch on a gfx950 machine (device queries only)."""
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-"))
    monkeypatch.setattr(tq_aiter._checked, "results", {})


def test_missing_aiter_names_the_command(fake_gfx950, monkeypatch):
    monkeypatch.setattr(tq_aiter, "aiter_root", lambda: None)
    reason = tq_aiter.BACKEND.unavailable()
    assert "AITER is not installed" in reason
    assert "python -m turboquant.integration.aiter.patch --aiter-root" in reason
    with pytest.raises(ValueError, match="python -m turboquant.integration.aiter.patch"):
        registry.select("aiter", "attention", None)


def test_other_gpu_is_refused(fake_gfx950, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(gcnArchName="gfx90a:sramecc+:xnack-"))
    reason = tq_aiter.BACKEND.unavailable()
    assert "gfx90a" in reason and "gfx950" in reason and "gfx942" in reason


def _fake_arch(monkeypatch, arch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-"))


def test_gfx942_is_accepted(fake_gfx950, monkeypatch):
    """MI300X (gfx942) passes the device check (the LUT path on v_mfma_f32_16x16x32_fp8_fp8);
    what remains is AITER itself."""
    _fake_arch(monkeypatch, "gfx942")
    assert tq_aiter._device_reason() is None
    monkeypatch.setattr(tq_aiter, "aiter_root", lambda: None)
    assert "AITER is not installed" in tq_aiter.BACKEND.unavailable()


def test_gfx942_declines_k8v4_with_a_reason(fake_gfx950, monkeypatch):
    """On gfx942 a K8V4 cache (OCP E4M3 key bytes; gfx942's FP8 is FNUZ) is declined with its
    reason; FP4 keys go on (here they stop at the device: CPU tensors); on gfx950 K8V4 goes on."""
    b = tq_aiter.BACKEND
    _fake_arch(monkeypatch, "gfx942")
    reason = b.check_attention(_call(key_format="fp8_e4m3"))
    assert "gfx942" in reason and "fp8_e4m3" in reason and "FNUZ" in reason
    assert DEVICE in b.check_attention(_call())
    _fake_arch(monkeypatch, "gfx950")
    assert DEVICE in b.check_attention(_call(key_format="fp8_e4m3"))


def test_unpatched_aiter_names_the_command(fake_gfx950, monkeypatch, tmp_path):
    from test_aiter_patch import PINNED, _wheel

    wheel = _wheel()
    assert wheel.name == PINNED
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(("aiter/ops/attention.py", "aiter/_version.py",
                                "aiter_meta/csrc/cpp_itfs/pa/")):
                z.extract(name, site)
    monkeypatch.setattr(tq_aiter, "aiter_root", lambda: site)
    reason = tq_aiter.BACKEND.unavailable()
    assert f"AITER 0.1.7.post2.dev18 at {site} is unpatched" in reason
    assert f"python -m turboquant.integration.aiter.patch --aiter-root {site}" in reason
    patch.apply(site)
    monkeypatch.setattr(tq_aiter._checked, "results", {})
    # Patched: the next step is importing aiter itself (absent here, on a CPU machine).
    reason = tq_aiter.BACKEND.unavailable()
    assert reason is None or "import aiter" in reason or "lacks paged_attention_fp4" in reason
    # an aiter without the writer op (a stale import) is named; with both ops, nothing is left
    fake = types.ModuleType("aiter")
    fake.paged_attention_fp4 = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "aiter", fake)
    monkeypatch.setattr(tq_aiter._checked, "results", {})
    assert "lacks reshape_and_cache_fp4" in tq_aiter.BACKEND.unavailable()
    fake.reshape_and_cache_fp4 = lambda *a, **k: None
    monkeypatch.setattr(tq_aiter._checked, "results", {})
    assert tq_aiter.BACKEND.unavailable() is None


def _call(seq_lens=(20, 33), hkv=2, gqa=4, d=128, bs=16, q_lens=None, scale_group=None,
          key_format="fp4", **kw):
    """A call over a small cache; q_lens: query tokens per sequence (with cu_query_lens)."""
    prob = build_paged_problem(list(seq_lens), hkv, d, bs, write_backend="reference",
                               generator=torch.Generator().manual_seed(0), config=PLAIN,
                               scale_group=scale_group, key_format=key_format)
    num_tokens = len(seq_lens) if q_lens is None else sum(q_lens)
    q = torch.randn(num_tokens, hkv * gqa, d).to(torch.bfloat16)
    args = dict(cu_query_lens=None, sliding_window=0, logits_soft_cap=0.0, max_seq_len=None)
    if q_lens is not None:
        args["cu_query_lens"] = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    args.update(kw)
    return make_attention_call(q, *prob.cache, prob.block_tables, prob.seq_lens, d ** -0.5,
                               args["cu_query_lens"], args["sliding_window"],
                               args["logits_soft_cap"], args["max_seq_len"])


DEVICE = "not on a ROCm GPU"  # the reason of a call that gets past every other check, on a CPU


def test_declines_with_reasons():
    """What the kernel cannot do, each with its reason (the dispatcher falls back)."""
    import dataclasses

    b = tq_aiter.BACKEND
    assert "per-32 scales" in b.check_attention(_call(scale_group=32))
    assert "head_dim 96" in b.check_attention(_call(d=96))
    call = _call()
    # learned sinks and the lse output are in the kernel: only the device stops them here
    for other in (dataclasses.replace(call, sinks=torch.zeros(8)),
                  dataclasses.replace(call, return_lse=True),
                  dataclasses.replace(call, sinks=torch.zeros(8), return_lse=True)):
        assert DEVICE in b.check_attention(other)
    assert DEVICE in b.check_attention(call)


def test_k8v4_is_not_declined():
    """A K8V4 cache (E4M3 keys, rows of D bytes) gets past every kernel check, decode and
    multi-token, all head dims (here it stops at the device; the launcher's key_cache
    checks are in tests/test_aiter_routing.py)."""
    b = tq_aiter.BACKEND
    for kw in (dict(), dict(d=64, gqa=8), dict(d=256, q_lens=(3, 5), sliding_window=4)):
        call = _call(key_format="fp8_e4m3", **kw)
        assert call.key_format == "fp8_e4m3"
        reason = b.check_attention(call)
        assert DEVICE in reason and "fp8_e4m3" not in reason, reason


@pytest.mark.parametrize("kw", [dict(q_lens=(5, 17)), dict(q_lens=(1, 1)), dict(sliding_window=8),
                                dict(q_lens=(33, 0), sliding_window=1),
                                dict(q_lens=(4, 2), sliding_window=16, logits_soft_cap=5.0),
                                dict(hkv=1, gqa=32), dict(hkv=1, gqa=32, q_lens=(3, 1))],
                         ids=["multi-token", "q-1", "window", "prefill-w1", "all", "gqa32",
                              "gqa32-multi-token"])
def test_multi_token_and_window_are_not_declined(kw):
    """Multi-token queries (ragged, a whole sequence as a chunk, empty ones), sliding window
    and soft cap, alone and together, and GQA groups larger than 16: the call gets past every
    kernel check (here it stops at the device) and no reason names them."""
    seq_lens = (20, 33) if kw.get("q_lens") != (33, 0) else (33, 0)
    reason = tq_aiter.BACKEND.check_attention(_call(seq_lens=seq_lens, **kw))
    assert DEVICE in reason, reason
    for word in ("multi-token", "cu_query_lens", "window", "decode"):
        assert word not in reason, reason


def test_transforms_are_not_declined():
    """The kernel fuses rotation, key smoothing and the sink: a call with the default config
    gets past the transform checks (here it stops at the device), and nothing names them."""
    import dataclasses

    from turboquant.api import prepare_attention
    from turboquant.config import QuantConfig

    b = tq_aiter.BACKEND
    for config in (QuantConfig(), QuantConfig.parse("rotation"), QuantConfig.parse("smooth+sink")):
        prob = build_paged_problem([20, 1, 33], 2, 128, 16, write_backend="reference",
                                   generator=torch.Generator().manual_seed(0), config=config)
        q = torch.randn(3, 8, 128).to(torch.bfloat16)
        call = prepare_attention(q, *prob.cache, prob.block_tables, prob.seq_lens, 128 ** -0.5,
                                 logits_soft_cap=5.0, **prob.kwargs)
        reason = b.check_attention(call)
        assert DEVICE in reason and "fused" not in reason, reason
        assert registry.transform_tensors_reason(call) is None
    assert "needs seq_state" in registry.transform_tensors_reason(
        dataclasses.replace(call, seq_state=None, state_ids=None, sink_kv=None, sink_tags=None))
    assert "rotation_signs: expected" in registry.transform_tensors_reason(
        dataclasses.replace(call, rotation_signs=torch.ones(64)))


@pytest.mark.gfx950
@pytest.mark.parametrize("lut", [False, True], ids=["native", "lut"])
@pytest.mark.parametrize("config", ["default", "rotation"])
def test_on_gfx950_transforms_match_reference(config, lut, monkeypatch):
    """On an MI355X with a patched AITER: the fused transforms against the reference."""
    from turboquant.config import QuantConfig

    reason = tq_aiter.BACKEND.unavailable()
    if reason is not None:
        pytest.skip(f"aiter backend: {reason}")
    monkeypatch.setenv("AITER_FP4_KV_LUT", "1" if lut else "0")
    lens = [1, 54, 97, 257, 1000]
    prob = build_paged_problem(lens, 8, 128, 16, device="cuda", spare_blocks=3,
                               generator=torch.Generator().manual_seed(1),
                               config=QuantConfig.parse(config))
    q = torch.randn(len(lens), 32, 128, generator=torch.Generator().manual_seed(2)).to(
        "cuda", torch.bfloat16)
    args = (q, *prob.cache, prob.block_tables, prob.seq_lens, 128 ** -0.5)
    for cap in (0.0, 5.0):
        out = turboquant.paged_attention_fp4(*args, logits_soft_cap=cap, backend="aiter",
                                             **prob.kwargs)
        ref = turboquant.paged_attention_fp4(*args, logits_soft_cap=cap, backend="reference",
                                             **prob.kwargs)
        assert torch.isfinite(out).all()
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, rel  # the lane simulation measured 1.6e-4 to 1.7e-3 on such data


@pytest.mark.gfx950
@pytest.mark.parametrize("lut", [False, True], ids=["native", "lut"])
@pytest.mark.parametrize("shape", [(32, 8, 128, 16), (64, 8, 128, 16), (8, 2, 64, 32),
                                   (16, 4, 256, 16)], ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_on_gfx950_matches_reference(shape, lut, monkeypatch):
    """On an MI355X with a patched AITER: both paths against the reference backend."""
    reason = tq_aiter.BACKEND.unavailable()
    if reason is not None:
        pytest.skip(f"aiter backend: {reason}")
    monkeypatch.setenv("AITER_FP4_KV_LUT", "1" if lut else "0")
    hq, hkv, d, bs = shape
    lens = [1, 255, 256, 257, 1000, 4097]
    prob = build_paged_problem(lens, hkv, d, bs, device="cuda", spare_blocks=3,
                               generator=torch.Generator().manual_seed(1), config=PLAIN)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(2)).to("cuda",
                                                                                     torch.bfloat16)
    args = (q, *prob.cache, prob.block_tables, prob.seq_lens, d ** -0.5)
    out = turboquant.paged_attention_fp4(*args, backend="aiter", config=PLAIN)
    ref = turboquant.paged_attention_fp4(*args, backend="reference", config=PLAIN)
    assert torch.isfinite(out).all()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 1e-2, rel  # the lane simulation measured 3e-4 to 2e-3 on such data
    for c in (5.0,):
        out = turboquant.paged_attention_fp4(*args, logits_soft_cap=c, backend="aiter", config=PLAIN)
        ref = turboquant.paged_attention_fp4(*args, logits_soft_cap=c, backend="reference", config=PLAIN)
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.gfx950
@pytest.mark.parametrize("lut", [False, True], ids=["native", "lut"])
@pytest.mark.parametrize("config", ["default", "plain"])
def test_on_gfx950_multi_token_and_window_match_reference(config, lut, monkeypatch):
    """On an MI355X with a patched AITER: ragged multi-token queries (1 up to 40 tokens, a
    chunk from position 0), windows and soft cap against the reference."""
    from turboquant.config import QuantConfig

    reason = tq_aiter.BACKEND.unavailable()
    if reason is not None:
        pytest.skip(f"aiter backend: {reason}")
    monkeypatch.setenv("AITER_FP4_KV_LUT", "1" if lut else "0")
    lens, q_lens = [1, 54, 97, 300, 1000, 40], [1, 5, 20, 7, 33, 40]
    prob = build_paged_problem(lens, 8, 128, 16, device="cuda", spare_blocks=3,
                               generator=torch.Generator().manual_seed(1),
                               config=QuantConfig.parse(config))
    q = torch.randn(sum(q_lens), 32, 128, generator=torch.Generator().manual_seed(2)).to(
        "cuda", torch.bfloat16)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    args = (q, *prob.cache, prob.block_tables, prob.seq_lens, 128 ** -0.5)
    for window, cap in ((0, 0.0), (1, 0.0), (16, 5.0), (300, 0.0)):
        kw = dict(cu_query_lens=cu, sliding_window=window, logits_soft_cap=cap, **prob.kwargs)
        out = turboquant.paged_attention_fp4(*args, backend="aiter", **kw)
        ref = turboquant.paged_attention_fp4(*args, backend="reference", **kw)
        assert torch.isfinite(out).all()
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, (window, cap, rel)  # the lane simulation: about 1e-3 on such data


@pytest.mark.gfx950
@pytest.mark.parametrize("lut", [False, True], ids=["native", "lut"])
@pytest.mark.parametrize("config", ["default", "plain"])
def test_on_gfx950_k8v4_matches_reference(config, lut, monkeypatch):
    """On an MI355X with a patched AITER: a K8V4 cache (E4M3 keys), decode and multi-token
    with a window and a soft cap, against the reference."""
    from turboquant.config import QuantConfig

    reason = tq_aiter.BACKEND.unavailable()
    if reason is not None:
        pytest.skip(f"aiter backend: {reason}")
    monkeypatch.setenv("AITER_FP4_KV_LUT", "1" if lut else "0")
    lens, q_lens = [1, 54, 97, 300, 1000, 40], [1, 5, 20, 7, 33, 40]
    for d in (64, 128, 256):
        prob = build_paged_problem(lens, 8, d, 16, device="cuda", spare_blocks=3,
                                   generator=torch.Generator().manual_seed(1),
                                   config=QuantConfig.parse(config), key_format="fp8_e4m3")
        gen = torch.Generator().manual_seed(2)
        for cu_lens in (None, q_lens):
            n = len(lens) if cu_lens is None else sum(cu_lens)
            q = torch.randn(n, 32, d, generator=gen).to("cuda", torch.bfloat16)
            kw = dict(prob.kwargs, logits_soft_cap=5.0)
            if cu_lens is not None:
                kw.update(cu_query_lens=torch.tensor([0, *itertools.accumulate(cu_lens)],
                                                     dtype=torch.int32, device="cuda"),
                          sliding_window=16)
            args = (q, *prob.cache, prob.block_tables, prob.seq_lens, d ** -0.5)
            out = turboquant.paged_attention_fp4(*args, backend="aiter", **kw)
            ref = turboquant.paged_attention_fp4(*args, backend="reference", **kw)
            assert torch.isfinite(out).all()
            rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert rel < 1e-2, (d, cu_lens is None, rel)


# ---------------------------------------------------------------- the cache writer

class _OnGpu:
    """A CPU tensor that says it is on the GPU (is_cuda): lets the writer checks past the
    device test on a CPU machine; everything else is the tensor's."""

    def __init__(self, t):
        self._t = t

    is_cuda = True

    def __getattr__(self, name):
        return getattr(self._t, name)


def _write(n=5, hkv=2, d=128, bs=16, dtype=torch.bfloat16, config="default", key_format="fp4",
           on_gpu=True, **changes):
    """The CacheWrite reshape_and_cache_fp4 hands a backend (transforms included), its key
    marked as on the GPU unless on_gpu=False; changes: fields replaced afterwards."""
    import dataclasses

    from turboquant.cache import allocate_cache
    from turboquant.config import QuantConfig
    from turboquant.shared_state import allocate_shared_state
    from turboquant.smoothing import allocate_state

    cfg = QuantConfig.parse(config)
    g = torch.Generator().manual_seed(0)
    key, value = (torch.randn(n, hkv, d, generator=g).to(dtype) for _ in range(2))
    cache = allocate_cache(8, hkv, bs, d, scale_group=cfg.scale_group, key_format=key_format)
    kw = {}
    if cfg.needs_slots:
        kw = dict(seq_state=allocate_state(2, hkv, d),
                  state_ids=torch.zeros(n, dtype=torch.int32), positions=torch.arange(n))
    elif cfg.uses_state:
        kw = dict(shared_state=allocate_shared_state(hkv, d, 8), positions=torch.arange(n))
    writes = []
    select = registry.select
    registry.select = lambda name, kind, arg: types.SimpleNamespace(reshape_and_cache=writes.append)
    try:
        turboquant.reshape_and_cache_fp4(key, value, *cache, torch.arange(n), config=cfg, **kw)
    finally:
        registry.select = select
    (write,) = writes
    if on_gpu:
        write = dataclasses.replace(write, key=_OnGpu(write.key))
    return dataclasses.replace(write, **changes)


WRITER_ACCEPTS = {  # what the HIP writer (aiter.reshape_and_cache_fp4) takes
    "default bf16 D128": {},
    "plain fp16 D64 block 1": dict(dtype=torch.float16, d=64, bs=1, config="plain"),
    "fp32 D256 block 256": dict(dtype=torch.float32, d=256, bs=256),
    "per-32 scales": dict(config="default+per32"),
    "rotation only": dict(config="rotation"),
    "smoothing only": dict(config="smooth"),
    "per-sequence records": dict(config="rotation+smooth+sink"),
    "k8v4 default": dict(key_format="fp8_e4m3"),
    "k8v4 plain fp32 D64": dict(key_format="fp8_e4m3", config="plain", dtype=torch.float32, d=64),
}


@pytest.mark.parametrize("case", WRITER_ACCEPTS)
def test_cache_writer_accepts_what_the_hip_writer_writes(case):
    """Every input dtype, head dim, power-of-two block size, scale group, key format and
    transform the HIP writer has (test_hip_writer.py checks its bytes) passes the check; on the
    CPU the only reason left is the device."""
    assert tq_aiter.BACKEND.check_cache_write(_write(**WRITER_ACCEPTS[case])) is None
    reason = tq_aiter.BACKEND.check_cache_write(_write(on_gpu=False, **WRITER_ACCEPTS[case]))
    assert reason == "tensors are on cpu, not on a ROCm GPU", reason


def _strided(t, cols, offset=0):
    """t's values in a tensor whose last dim has `cols` columns (rows padded), from `offset`."""
    n = t[..., 0].numel() * cols
    wide = torch.zeros(n + offset, dtype=t.dtype)[offset:].view(t.shape[:-1] + (cols,))
    out = wide[..., :t.shape[-1]]
    out.copy_(t)
    return out


def test_cache_writer_declines_naming_the_argument():
    """What the writer cannot take, each declined with a reason that names it."""
    import dataclasses

    b = tq_aiter.BACKEND
    w = _write()
    k = w.key._t
    k8 = _write(key_format="fp8_e4m3")
    cases = {
        "scale_rule 'mse' is not implemented by the HIP writer": dict(scale_rule="mse"),
        "key dtype torch.float64": dict(key=_OnGpu(k.double())),
        "head_dim 96 not in (64, 128, 256)": dict(head_dim=96),
        "block_size 12 is not a power of two": dict(block_size=12),
        "key must have a contiguous, 16-byte aligned head dimension":
            dict(key=_OnGpu(_strided(k, 132))),  # rows of 264 bytes
        "value must have a contiguous, 16-byte aligned head dimension":
            dict(value=_strided(w.value, 128 + 8, offset=4)),
        "key_cache must have contiguous, 8-byte aligned [block_size, 64] blocks":
            dict(key_cache=_strided(w.key_cache, 68)),
        "value_cache must have contiguous, 8-byte aligned [block_size, 64] blocks":
            dict(value_cache=w.value_cache.transpose(1, 2)),
        "key_scales/value_scales must be contiguous":
            dict(key_scales=w.key_scales.transpose(1, 2)),
        "slot_mapping must be contiguous":
            dict(slot_mapping=torch.arange(10)[::2]),
        "rotation_signs: expected a contiguous, 16-byte aligned float32 [128] tensor":
            dict(rotation_signs=torch.ones(129)[1:]),
        "seq_state and state_ids: expected both or neither": dict(state_ids=None),
        "seq_state: expected a contiguous, 16-byte aligned float32 [num_slots, 2, 5, 128]":
            dict(seq_state=w.seq_state[:, :1]),
        "state_ids: expected a contiguous int32 [5] tensor":
            dict(state_ids=w.state_ids.long()),
    }
    for message, change in cases.items():
        reason = b.check_cache_write(dataclasses.replace(w, **change))
        assert reason is not None and reason.startswith(message), (message, reason)
    huge = _OnGpu(torch.zeros(1, 2, 128, dtype=torch.bfloat16).expand(2 ** 27, 2, 128))
    assert b.check_cache_write(dataclasses.replace(_write(config="plain"), key=huge)) == (
        "key: 2147483648 work-items (num_tokens x num_kv_heads x head_dim / 16), the writer "
        "takes fewer than 2^31: split the call")
    # K8V4: E4M3 key rows of D bytes, 16-byte stores; one scale per (token, head)
    assert b.check_cache_write(dataclasses.replace(k8, key_cache=_strided(k8.key_cache, 136))) \
        .startswith("key_cache must have contiguous, 16-byte aligned [block_size, 128] blocks")
    assert b.check_cache_write(dataclasses.replace(k8, scale_group=32)).startswith(
        "key_scales: K8V4 keys have one scale per (token, kv head)")
    assert b.check_cache_write(w) is None  # the unchanged write passes


def test_cache_write_routes_to_the_aiter_op(monkeypatch):
    """reshape_and_cache on the backend calls its torch op, whose ROCm implementation hands
    every argument to aiter.reshape_and_cache_fp4 (a fake aiter here; the op's implementation
    registered for CPU for the test, then removed)."""
    calls = []
    fake = types.ModuleType("aiter")
    fake.reshape_and_cache_fp4 = lambda *args, **kwargs: calls.append((args, kwargs))
    monkeypatch.setitem(sys.modules, "aiter", fake)
    w = _write(on_gpu=False)
    lib = torch.library.Library("turboquant", "IMPL")
    lib.impl("reshape_and_cache_fp4_aiter", tq_aiter._write_impl, "CPU")
    try:
        tq_aiter.BACKEND.reshape_and_cache(w)
    finally:
        lib._destroy()
    ((args, kwargs),) = calls
    want = (w.key, w.value, w.key_cache, w.value_cache, w.key_scales, w.value_scales,
            w.slot_mapping)
    assert len(args) == len(want) and all(a is b for a, b in zip(args, want))
    assert kwargs.keys() == {"rotation_signs", "seq_state", "state_ids"}
    assert kwargs["rotation_signs"] is w.rotation_signs and kwargs["seq_state"] is w.seq_state
    assert kwargs["state_ids"] is w.state_ids and w.seq_state is not None
    # the op's schema and fake implementation exist without ROCm (torch.compile traces it):
    # under fake tensors the call runs the fake implementation, not aiter
    assert "Tensor(a!) key_cache" in str(torch.ops.turboquant.reshape_and_cache_fp4_aiter.default._schema)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from turboquant.calls import cache_write_op_args

    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                     for a in cache_write_op_args(w)]
        torch.ops.turboquant.reshape_and_cache_fp4_aiter(*fake_args)
    assert len(calls) == 1


@pytest.mark.gfx950
@pytest.mark.parametrize("config,key_format", [("default", "fp4"), ("plain", "fp4"),
                                               ("default", "fp8_e4m3"), ("default+per32", "fp4")])
def test_on_gfx950_writer_matches_reference(config, key_format):
    """On an MI355X (or MI300X) with a patched AITER: the cache the aiter backend writes is the
    reference writer's, byte for byte."""
    from turboquant.cache import allocate_cache
    from turboquant.config import QuantConfig
    from turboquant.smoothing import allocate_state

    reason = tq_aiter.BACKEND.unavailable()
    if reason is not None:
        pytest.skip(f"aiter backend: {reason}")
    cfg = QuantConfig.parse(config)
    g = torch.Generator().manual_seed(3)
    n, hkv, d = 1000, 8, 128
    key = (torch.randn(n, hkv, d, generator=g) * 3).to(torch.bfloat16)
    value = torch.randn(n, hkv, d, generator=g).to(torch.bfloat16)
    slots = torch.randperm(80 * 16, generator=g)[:n]
    slots[::17] = -1
    pos = torch.arange(n) % 250
    ids = (torch.arange(n) // 250).to(torch.int32)
    out = {}
    for backend, device in (("reference", "cpu"), ("aiter", "cuda")):
        cache = allocate_cache(80, hkv, 16, d, scale_group=cfg.scale_group, fill=0xAB,
                               key_format=key_format, device=device)
        kw = {}
        if cfg.uses_state:
            kw = dict(seq_state=allocate_state(4, hkv, d, device=device),
                      state_ids=ids.to(device), positions=pos.to(device))
        turboquant.reshape_and_cache_fp4(key.to(device), value.to(device), *cache,
                                         slots.to(device), config=cfg, backend=backend, **kw)
        out[backend] = [t.cpu().view(torch.uint8) for t in cache]
    for a, b in zip(out["reference"], out["aiter"]):
        assert torch.equal(a, b)
