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
from turboquant.api import make_attention_call
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


@pytest.fixture
def fake_gfx950(monkeypatch):
    """Pretend to be a ROCm PyTorch on a gfx950 machine (device queries only)."""
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-"))
    monkeypatch.setitem(tq_aiter._state, "checked", False)


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
    monkeypatch.setitem(tq_aiter._state, "checked", False)
    # Patched: the next step is importing aiter itself (absent here, on a CPU machine).
    reason = tq_aiter.BACKEND.unavailable()
    assert reason is None or "import aiter" in reason or "lacks paged_attention_fp4" in reason


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
    assert "no cache writer" in b.check_cache_write(None)


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
        dataclasses.replace(call, seq_state=None, state_ids=None))
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
