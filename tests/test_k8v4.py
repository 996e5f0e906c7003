"""The second key format, K8V4 (issue 17): E4M3 keys with one E8M0 scale per (token, kv head),
FP4 values: the format, the allocator and the reference on the CPU (the kernels' tests:
tests/gpu, tests/test_sm120_*.py, tests/test_aiter_*.py)."""
import pytest
import torch

import turboquant as tq
from turboquant import format as fmt
from turboquant.api import prepare_attention
from turboquant.calls import make_cache_write
from turboquant.config import PER_SEQUENCE, PLAIN, QuantConfig
from turboquant.rotation import rotate, rotation_signs
from turboquant.smoothing import transform_keys

D, HKV, BS = 64, 2, 16


def _write(config, n=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = tq.allocate_cache(4, HKV, BS, D, key_format="fp8_e4m3", fill=0xFF)
    k = torch.randn(n, HKV, D, generator=gen).bfloat16()
    v = torch.randn(n, HKV, D, generator=gen).bfloat16()
    pos = torch.arange(n)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    slots = table[0, pos // BS].long() * BS + pos % BS
    kw = {"config": config}
    if config.needs_slots:
        kw.update(seq_state=tq.allocate_state(1, HKV, D),
                  state_ids=torch.zeros(n, dtype=torch.int32), positions=pos)
    elif config.uses_state:
        kw.update(shared_state=tq.allocate_shared_state(HKV, D, 4), positions=pos)
    tq.reshape_and_cache_fp4(k, v, *cache, slots, **kw)
    return cache, k, v, table, slots, kw


@pytest.mark.parametrize("config", [PLAIN, QuantConfig(), PER_SEQUENCE],
                         ids=["plain", "default", "per-sequence"])
def test_writer_stores_e4m3_keys_and_fp4_values(config):
    cache, k, v, _, slots, kw = _write(config)
    b, o = slots // BS, slots % BS
    center = inv = None
    if config.key_smoothing:
        rec = kw["shared_state"].smoothing[0] if "shared_state" in kw else kw["seq_state"][0]
        center, inv = rec[:, 0], rec[:, 4]
    signs = rotation_signs(D, config.rotation_seed) if config.rotation else None
    codes, scales = fmt.quantize_e4m3(transform_keys(k, center, inv, signs))
    assert cache.key_cache.dtype == torch.float8_e4m3fn
    assert torch.equal(cache.key_cache[b, :, o].view(torch.uint8), codes)
    assert torch.equal(cache.key_scales[b, o], scales)
    vsrc = rotate(v.float(), signs) if signs is not None else v
    vcodes, vscales = fmt.quantize_fp4(vsrc)
    assert torch.equal(cache.value_cache[b, :, o], vcodes)
    assert torch.equal(cache.value_scales[b, o], vscales.squeeze(-1))


def test_attention_over_k8v4_matches_float64_and_beats_fp4_keys():
    cache, k, v, table, _, kw = _write(PLAIN, n=40, seed=1)
    q = torch.randn(1, 4, D, generator=torch.Generator().manual_seed(2)).bfloat16()
    lens = torch.tensor([40], dtype=torch.int32)
    out = tq.paged_attention_fp4(q, *cache, table, lens, 0.125, config=PLAIN).double()
    k_hat = fmt.dequantize_e4m3(*fmt.quantize_e4m3(k.float())).double()
    v_hat = fmt.dequantize_fp4(*fmt.quantize_fp4(v.float())).double()
    g = 2

    def attend(kk, vv):
        res = torch.empty(4, D, dtype=torch.float64)
        for h in range(4):
            p = torch.softmax(0.125 * kk[:, h // g] @ q[0, h].double(), 0)
            res[h] = p @ vv[:, h // g]
        return res

    torch.testing.assert_close(out[0], attend(k_hat, v_hat), rtol=1e-2, atol=1e-2)
    # against bf16 attention, FP8 keys are closer than FP4 keys with the same FP4 values
    exact = attend(k.double(), v.double())
    fp4_keys = attend(fmt.dequantize_fp4(*fmt.quantize_fp4(k.float())).double(), v_hat)
    assert (out[0] - exact).norm() < (fp4_keys - exact).norm()


def test_cache_layout_is_checked_and_named():
    fp8 = tq.allocate_cache(4, HKV, BS, D, key_format="fp8_e4m3")
    fp4 = tq.allocate_cache(4, HKV, BS, D)
    q = torch.zeros(1, 4, D).bfloat16()
    table, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="key_cache.*float8_e4m3fn"):  # E4M3 bytes as uint8
        tq.paged_attention_fp4(q, fp8.key_cache.view(torch.uint8), *fp8[1:], table, lens, 0.1,
                               config=PLAIN)
    with pytest.raises(ValueError, match="key_cache"):  # FP4 bytes labelled E4M3
        tq.paged_attention_fp4(q, fp4.key_cache.view(torch.float8_e4m3fn), *fp4[1:], table,
                               lens, 0.1, config=PLAIN)
    with pytest.raises(ValueError, match="key_scales"):
        tq.paged_attention_fp4(q, fp8.key_cache, fp8.value_cache,
                               torch.zeros(4, BS, HKV, 2, dtype=torch.uint8),
                               torch.zeros(4, BS, HKV, 2, dtype=torch.uint8), table, lens, 0.1,
                               config=PLAIN)
    with pytest.raises(ValueError, match="scale_group"):
        tq.allocate_cache(4, HKV, BS, D, key_format="fp8_e4m3", scale_group=32)
    with pytest.raises(ValueError, match="key_format"):
        tq.allocate_cache(4, HKV, BS, D, key_format="int8")


def test_backends_without_k8v4_decline_it_with_a_reason():
    from turboquant._backends import aiter, cuda, sm120

    cache = tq.allocate_cache(4, HKV, BS, D, key_format="fp8_e4m3")
    q = torch.zeros(1, 4, D).bfloat16()
    call = prepare_attention(q, *cache, torch.tensor([[0]], dtype=torch.int32),
                             torch.tensor([4], dtype=torch.int32), 0.1, config=PLAIN)
    assert call.key_format == "fp8_e4m3"
    # the aiter kernel has K8V4 (lane simulation); here it declines only for the device
    assert "not on a ROCm GPU" in aiter.BACKEND.check_attention(call)
    # the cuda and sm120 kernels have K8V4 (tests/gpu); here they decline only for the device
    for backend in (cuda.BACKEND, sm120.BACKEND):
        assert "not on a CUDA device" in backend.check_attention(call)
    write = make_cache_write(torch.zeros(2, HKV, D), torch.zeros(2, HKV, D), *cache,
                             torch.tensor([0, 1]))
    # the cuda writer has K8V4 (tests/gpu); here it declines only for the device
    assert "not on a CUDA device" in cuda.BACKEND.check_cache_write(write)
