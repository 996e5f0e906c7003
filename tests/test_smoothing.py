"""Key smoothing and the sink (turboquant/smoothing.py, CONTRACT.md section 2), on the reference."""
import pytest
import torch

import turboquant as tq
from turboquant.cache import build_paged_problem
from turboquant.config import PER_SEQUENCE, PLAIN, QuantConfig
from turboquant.smoothing import (KEY_CENTER, KEY_INV_SCALE, KEY_SCALE, LAYER_RANGE_QUANTILE,
                                  SINK_KEY, SINK_VALUE, calibrate,
                                  load_calibration, save_calibration, smoothing_from_keys)


def _exact(q, keys, values, scale, cap=0.0):
    """float64 attention of one query row per sequence over its unquantized keys/values."""
    out = []
    for s, (k, v) in enumerate(zip(keys, values)):
        hkv, g = k.shape[1], q.shape[1] // k.shape[1]
        qs = q[s].double().view(hkv, g, -1)
        logits = torch.einsum("hgd,thd->hgt", qs, k.double()) * scale
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)
        out.append(torch.einsum("hgt,thd->hgd", logits.softmax(-1), v.double()).reshape(-1, q.shape[2]))
    return torch.stack(out)


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def test_smoothing_rule_on_structured_keys():
    keys = torch.zeros(5, 1, 4)
    keys[:, 0, 0] = torch.tensor([9.0, 1.0, 3.0, 1.0, 3.0])  # position 0 is left out by callers
    keys[:, 0, 1] = 2.0  # a constant channel: centered to 0, floored scale
    m, lam = smoothing_from_keys(keys[1:])
    assert m[0].tolist() == [2.0, 2.0, 0.0, 0.0]
    # a = (1, 0 -> floor, 0 -> floor, 0 -> floor): lam ~ a^0.5 normalized to RMS 1
    assert lam[0, 0] > 10 * lam[0, 1] and torch.allclose(lam.pow(2).mean(-1), torch.ones(1))
    m0, lam0 = smoothing_from_keys(keys[:0])
    assert (m0 == 0).all() and (lam0 == 1).all()


def test_layer_range_is_a_quantile_not_the_maximum():
    """A layer's range (calibration, the shared state's first write) is the 99.9th percentile of
    |k - m|: one outlier token among 3000 barely moves it, where it sets the maximum; it equals
    torch.quantile over the keys."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(3000, 2, 8, generator=g)
    spiked = keys.clone()
    spiked[1234, 1, 5] = 1000.0
    q = LAYER_RANGE_QUANTILE
    _, lam_max = smoothing_from_keys(spiked)
    _, lam_q = smoothing_from_keys(spiked, quantile=q)
    _, lam_clean = smoothing_from_keys(keys, quantile=q)
    assert lam_max[1, 5] > 4 * lam_max[1].median()  # the outlier sets the maximum's range
    assert torch.allclose(lam_q, lam_clean, rtol=0.05)  # not the quantile's
    m, lam = smoothing_from_keys(spiked[:1777], quantile=q)
    kept = spiked[:1777]
    a = torch.quantile((kept - kept.mean(0)).abs(), q, dim=0)
    lam_ref = a.sqrt() / a.mean(-1, keepdim=True).sqrt()
    assert torch.allclose(m, kept.mean(0), atol=1e-6)
    assert torch.allclose(lam, lam_ref, rtol=1e-5)


@pytest.mark.parametrize("cap", [0.0, 5.0])
def test_softmax_invariance_to_the_key_center(cap):
    """Keys shifted by a large per-channel offset: per-sequence smoothing removes it, so without
    a soft cap the output is that of the unshifted keys; with a cap the logits change (q.m is
    added back before the cap) and the output follows the shifted keys' exact attention."""
    gen = torch.Generator().manual_seed(3)
    lens, hkv, d = [300, 77], 2, 64
    offset = 6.0 * torch.randn(hkv, d, generator=gen)
    base = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    vals = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    q = torch.randn(len(lens), 8, d, generator=gen).bfloat16()
    outs = {}
    for name, shift in (("base", 0.0), ("shifted", 1.0)):
        keys = [(k + shift * offset).bfloat16() for k in base]

        def kv(s, shape, keys=keys):
            return keys[s], vals[s].bfloat16()

        prob = build_paged_problem(lens, hkv, d, 16, generator=gen, kv_factory=kv,
                                   config=QuantConfig())
        outs[name] = tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens,
                                            d ** -0.5, logits_soft_cap=cap, **prob.kwargs)
        outs[name + "_exact"] = _exact(q, keys, [v.bfloat16() for v in vals], d ** -0.5, cap)
    # measured 2026-11-24: every FP4 output ~0.986-0.989 cosine to its exact attention
    base_err = _cos(outs["base"], outs["base_exact"])
    if cap == 0:
        # the center absorbs the offset: the shifted cache is as good as the unshifted one
        # (the exact outputs of the two key sets agree, up to the keys' bf16 rounding)
        assert _cos(outs["shifted_exact"], outs["base_exact"]) > 0.9999
        assert abs(_cos(outs["shifted"], outs["base_exact"]) - base_err) < 0.005
        assert base_err > 0.98
    else:
        # capped logits depend on the offset; with q.m added back the reference follows the
        # shifted keys' exact attention (as closely as the unshifted case), not the unshifted
        assert _cos(outs["shifted_exact"], outs["base_exact"]) < 0.95
        assert abs(_cos(outs["shifted"], outs["shifted_exact"]) - base_err) < 0.005
        assert _cos(outs["shifted"], outs["base_exact"]) < 0.95


def test_sink_is_exact_and_ignores_the_cache_bytes():
    """A one-token sequence sees only its sink: the output is its value (bf16-rounded), whatever
    the FP4 bytes of position 0 hold; a longer sequence's sink row is the transformed key."""
    gen = torch.Generator().manual_seed(1)
    prob = build_paged_problem([1, 40], 2, 64, 16, generator=gen, config=PER_SEQUENCE)
    kc, vc, ks, vs = prob.cache
    b0 = prob.block_tables[0, 0]
    kc[b0, :, 0], vc[b0, :, 0], ks[b0, 0], vs[b0, 0] = 0x77, 0x77, 255, 255  # NaN scales
    q = torch.randn(2, 4, 64, generator=gen).bfloat16()
    out = tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.125,
                                 **prob.kwargs)
    want = prob.values[0][0].float().repeat_interleave(2, dim=0)
    torch.testing.assert_close(out[0].float(), want, rtol=8e-3, atol=1e-6)
    assert torch.isfinite(out[1]).all()
    rec = prob.kwargs["seq_state"][prob.kwargs["state_ids"][1]]
    k0 = prob.keys[1][0].float()
    assert torch.equal(rec[:, KEY_INV_SCALE], 1.0 / rec[:, KEY_SCALE])
    sink = tq.rotation.rotate((k0 - rec[:, KEY_CENTER]) * rec[:, KEY_INV_SCALE],
                              tq.rotation.rotation_signs(64))
    torch.testing.assert_close(rec[:, SINK_KEY], sink, rtol=0, atol=0)
    assert torch.isfinite(rec[:, SINK_VALUE]).all()


def test_unwritten_record_and_bad_slot_give_nan():
    gen = torch.Generator().manual_seed(2)
    prob = build_paged_problem([30, 30], 1, 64, 16, generator=gen, config=PER_SEQUENCE)
    q = torch.randn(2, 2, 64, generator=gen).bfloat16()
    state = prob.kwargs["seq_state"].clone()
    state[prob.kwargs["state_ids"][0]] = float("nan")  # as allocate_state leaves a slot
    out = tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.1,
                                 config=PER_SEQUENCE, seq_state=state,
                                 state_ids=prob.kwargs["state_ids"])
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()
    ids = prob.kwargs["state_ids"].clone()
    ids[1] = 99
    with tq.value_checks(False):
        out = tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.1,
                                     config=PER_SEQUENCE, seq_state=prob.kwargs["seq_state"],
                                     state_ids=ids)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


def test_decode_steps_without_positions_keep_the_record():
    """Prefill with positions fills the record; decode writes (positions None) reuse it."""
    gen = torch.Generator().manual_seed(5)
    hkv, d, bs = 1, 64, 16
    cache = tq.allocate_cache(4, hkv, bs, d)
    state = tq.allocate_state(2, hkv, d)
    k = torch.randn(20, hkv, d, generator=gen).bfloat16()
    v = torch.randn(20, hkv, d, generator=gen).bfloat16()
    ids = torch.ones(20, dtype=torch.int32)
    tq.reshape_and_cache_fp4(k[:16], v[:16], *cache, torch.arange(16), seq_state=state,
                             state_ids=ids[:16], positions=torch.arange(16), config=PER_SEQUENCE)
    rec = state[1].clone()
    assert torch.isnan(state[0]).all() and torch.isfinite(rec).all()
    for t in range(16, 20):  # decode steps
        tq.reshape_and_cache_fp4(k[t:t + 1], v[t:t + 1], *cache, torch.tensor([t]),
                                 seq_state=state, state_ids=ids[t:t + 1])
    assert torch.equal(state[1], rec)
    m, lam = smoothing_from_keys(k[1:16].float())
    torch.testing.assert_close(rec[:, KEY_CENTER], m)
    torch.testing.assert_close(rec[:, KEY_SCALE], lam)


def test_calibration_file_round_trip_and_use(tmp_path):
    gen = torch.Generator().manual_seed(4)
    layers = [torch.randn(50, 2, 64, generator=gen) * (i + 1) for i in range(3)]
    cal = calibrate(layers)
    path = tmp_path / "model.safetensors"
    save_calibration(path, cal, {"model": "test"})
    back = load_calibration(path)
    assert len(back) == 3
    for (m, lam), (m2, lam2) in zip(cal, back):
        assert torch.equal(m, m2) and torch.equal(lam, lam2)
    # the calibrated config writes (k - m) * (1 / lam) of the file's layer
    cfg = QuantConfig(key_smoothing="calibrated")
    cache = tq.allocate_cache(4, 2, 16, 64)
    state = tq.allocate_state(1, 2, 64)
    k = layers[1][:20].bfloat16()
    tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(20), config=cfg, seq_state=state,
                             state_ids=torch.zeros(20, dtype=torch.int32),
                             positions=torch.arange(20), calibration=back[1])
    assert torch.equal(state[0, :, KEY_CENTER], back[1][0])
    assert torch.equal(state[0, :, KEY_SCALE], back[1][1])


def test_bad_calibration_files(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(1)}, str(path), metadata={"format": "something"})
    with pytest.raises(ValueError, match="not a turboquant.key_smoothing.v1 file"):
        load_calibration(path)
    bad = tmp_path / "bad.safetensors"
    save_calibration(bad, [(torch.zeros(2, 8), -torch.ones(2, 8))])
    with pytest.raises(ValueError, match=r"layers.0: key_scale: expected values > 0"):
        load_calibration(bad)


def test_plain_config_needs_no_state():
    gen = torch.Generator().manual_seed(0)
    prob = build_paged_problem([10], 1, 64, 16, generator=gen, config=PLAIN)
    assert set(prob.kwargs) == {"config"}
    with pytest.raises(ValueError, match="positions: config 'plain' keeps no per-sequence state"):
        tq.reshape_and_cache_fp4(torch.zeros(1, 1, 64), torch.zeros(1, 1, 64), *prob.cache,
                                 torch.tensor([3]), config=PLAIN, positions=torch.tensor([3]))
