"""QuantConfig options: the rotation, the "mse" scale rule, key smoothing, the sink, and their
plumbing in the API."""
import math

import pytest
import torch

import turboquant as tq
from turboquant import format as fmt
from turboquant.cache import build_paged_problem
from turboquant.config import PER_SEQUENCE, PLAIN
from turboquant.rotation import fwht, rotate, rotation_matrix, rotation_signs, unrotate
from turboquant.smoothing import KEY_CENTER, KEY_INV_SCALE, KEY_SCALE, allocate_state

from conftest import dequant_f64


@pytest.mark.parametrize("name", ["default", "plain", "per32", "rotation", "rotation+per32",
                                  "mse", "rotation+per32+mse", "rotation+smooth", "sink",
                                  "rotation+smooth+sink", "default+per32+mse"])
def test_parse_and_name_round_trip(name):
    assert tq.QuantConfig.parse(name).name == name


def test_the_default_is_rotation_smoothing_and_sink():
    cfg = tq.QuantConfig()
    assert (cfg.rotation, cfg.key_smoothing, cfg.sink, cfg.scale_group) == \
        (True, "calibrated", True, None)
    assert tq.QuantConfig.parse("rotation+calibrated+sink") == cfg and cfg.shares_state
    per_seq = tq.QuantConfig.parse("rotation+smooth+sink")
    assert per_seq == PER_SEQUENCE and per_seq.needs_slots and not per_seq.shares_state
    assert per_seq.name == "rotation+smooth+sink" and not PLAIN.shares_state
    assert not PLAIN.rotation and not PLAIN.uses_state and PLAIN.name == "plain"


def test_bad_config_values():
    with pytest.raises(ValueError, match="scale_group"):
        tq.QuantConfig(scale_group=16)
    with pytest.raises(ValueError, match="scale_rule"):
        tq.QuantConfig(scale_rule="max")
    with pytest.raises(ValueError, match="config.*'hadamard'"):
        tq.QuantConfig.parse("hadamard")
    with pytest.raises(ValueError, match="key_smoothing"):
        tq.QuantConfig(key_smoothing="layer")
    with pytest.raises(ValueError, match="rotation_seed"):
        tq.QuantConfig(rotation_seed=-1)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_rotation_is_orthogonal_and_fp32_round_trip_error(d):
    r = rotation_matrix(d, seed=7, dtype=torch.float64)
    assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert not torch.allclose(r, rotation_matrix(d, seed=8, dtype=torch.float64))
    x = torch.randn(4096, d, generator=torch.Generator().manual_seed(0))
    s = rotation_signs(d, 7)
    torch.testing.assert_close(rotate(x, s).double(), x.double() @ r, rtol=0, atol=2e-6)
    back = unrotate(rotate(x, s), s)
    # measured 2026-11-24: about 2e-7 relative (fp32 rounding of 2 log2(D) butterfly stages)
    assert ((back - x).norm() / x.norm()).item() < 1e-6


def test_fwht_stages_are_the_defined_ones():
    """Structured inputs: a unit vector gives a row of H (+-1, the Sylvester sign pattern);
    the stage order fixes the rounding, checked on values whose sums round differently."""
    d = 8
    for i in range(d):
        row = fwht(torch.eye(d)[i])
        want = torch.tensor([(-1) ** bin(i & j).count("1") for j in range(d)], dtype=torch.float32)
        assert torch.equal(row, want)
    x = torch.tensor([1.0, 2.0 ** -24, 2.0 ** -24, 0.0])
    # stage h=1: [1 + e -> 1, 1 - e, e, e]; stage h=2: [1 + e -> 1, (1 - e) + e, 1 - e, 1 - 2e]
    # (the other order, h=2 first, gives [1, 1 - e, 1, 1 - 2e])
    e = 2.0 ** -24
    assert fwht(x).tolist() == [1.0, 1.0, 1.0 - e, 1.0 - 2 * e]


def test_rotation_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="head_dim"):
        rotation_matrix(96)
    cache = tq.allocate_cache(4, 1, 16, 96)
    with pytest.raises(ValueError, match="config: rotation needs a power-of-two head dim"):
        tq.reshape_and_cache_fp4(torch.zeros(1, 1, 96), torch.zeros(1, 1, 96), *cache,
                                 torch.zeros(1, dtype=torch.int32),
                                 config=tq.QuantConfig(key_smoothing=None, sink=False))


def test_mse_rule_is_never_worse_per_group(gen):
    x = torch.randn(2048, 4, 128, generator=gen) * torch.rand(2048, 4, 1, generator=gen) * 10
    for group in (None, 32):
        g = 128 if group is None else group
        a = fmt.dequantize_fp4(*fmt.quantize_fp4(x, group), group).double()
        c, s = fmt.quantize_fp4(x, group, "mse")
        b = fmt.dequantize_fp4(c, s, group).double()
        ea = (a - x.double()).pow(2).reshape(2048, 4, -1, g).sum(-1)
        eb = (b - x.double()).pow(2).reshape(2048, 4, -1, g).sum(-1)
        assert (eb <= ea).all() and (eb < ea).any()
        assert torch.equal(b, dequant_f64(c, s, g))


def test_mse_rule_keeps_special_groups():
    x = torch.zeros(3, 64)
    x[1, 2] = float("nan")
    x[2] = 1e-44
    c, s = fmt.quantize_fp4(x, None, "mse")
    assert s.flatten().tolist() == [0, 255, 0]


@pytest.mark.parametrize("name", ["rotation", "rotation+per32", "mse", "rotation+mse",
                                  "rotation+smooth", "smooth+per32", "default",
                                  "rotation+smooth+sink"])
def test_api_with_config_matches_float64(name):
    """Writer bytes are the transformed keys quantized with the config's rule; attention equals
    float64 attention over the dequantized cache with q * lam rotated and the output rotated
    back (position 0 from the sink record where the config keeps one)."""
    cfg = tq.QuantConfig.parse(name)
    gen = torch.Generator().manual_seed(4)
    lens, hkv, d, bs = [1, 54, 97], 2, 64, 16
    cache = tq.allocate_cache(12, hkv, bs, d, scale_group=cfg.scale_group)
    keys = [torch.randn(n, hkv, d, generator=gen).bfloat16() for n in lens]
    values = [torch.randn(n, hkv, d, generator=gen).bfloat16() for n in lens]
    perm = torch.randperm(12, generator=gen).to(torch.int32)
    tables = torch.full((3, 7), -1, dtype=torch.int32)
    tables[0, :1], tables[1, :4], tables[2, :7] = perm[:1], perm[1:5], perm[5:12]
    slots = torch.cat([tables[s, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for s, n in enumerate(lens)])
    state = {}
    ids = torch.tensor([2, 0, 1], dtype=torch.int32)  # slot of each sequence
    tok_ids = torch.repeat_interleave(ids, torch.tensor(lens))
    if cfg.shares_state:  # the default: the layer's shared state
        state = {"shared_state": tq.allocate_shared_state(hkv, d, 12)}
        tq.reshape_and_cache_fp4(torch.cat(keys), torch.cat(values), *cache, slots, config=cfg,
                                 positions=torch.cat([torch.arange(n) for n in lens]), **state)
        layer = state["shared_state"].smoothing
        token_records = layer.expand(len(tok_ids), -1, -1, -1)
        seq_records = tq.shared_state.records(state["shared_state"], tuple(cache), tables,
                                              torch.tensor(lens, dtype=torch.int32), cfg.scale_group)
    elif cfg.uses_state:
        state = {"seq_state": allocate_state(3, hkv, d)}
        positions = torch.cat([torch.arange(n) for n in lens])
        tq.reshape_and_cache_fp4(torch.cat(keys), torch.cat(values), *cache, slots, config=cfg,
                                 state_ids=tok_ids, positions=positions, **state)
        state["state_ids"] = ids
        token_records, seq_records = state["seq_state"][tok_ids.long()], state["seq_state"][ids.long()]
    else:
        tq.reshape_and_cache_fp4(torch.cat(keys), torch.cat(values), *cache, slots, config=cfg)
    # the written bytes are the transformed keys quantized with the config's rule
    k_all = torch.cat(keys).float()
    if cfg.key_smoothing:
        rec = token_records
        k_all = (k_all - rec[:, :, KEY_CENTER]) * rec[:, :, KEY_INV_SCALE]
    signs = rotation_signs(d, cfg.rotation_seed)
    k_src = rotate(k_all, signs) if cfg.rotation else k_all
    codes, sc = fmt.quantize_fp4(k_src, cfg.scale_group, cfg.scale_rule)
    assert torch.equal(cache.key_cache[slots // bs, :, slots % bs], codes)
    query = torch.randn(3, 8, d, generator=gen).bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = tq.paged_attention_fp4(query, *cache, tables, seq_lens, 0.125, config=cfg, **state)
    # float64: rotate q, attend over the dequantized (rotated) cache, rotate back
    r = rotation_matrix(d, cfg.rotation_seed, dtype=torch.float64) if cfg.rotation else \
        torch.eye(d, dtype=torch.float64)
    group = d if cfg.scale_group is None else 32
    ks = cache.key_scales if group == 32 else cache.key_scales.unsqueeze(-1)
    vs = cache.value_scales if group == 32 else cache.value_scales.unsqueeze(-1)
    for s, n in enumerate(lens):
        t = torch.arange(n)
        blk, off = tables[s, t // bs].long(), t % bs
        k = dequant_f64(cache.key_cache[blk, :, off], ks[blk, off], group)
        v = dequant_f64(cache.value_cache[blk, :, off], vs[blk, off], group)
        q = query[s].double()
        if cfg.uses_state:
            rec = seq_records[s].double()  # [Hkv, 5, D]
            q = q * rec[:, KEY_SCALE].repeat_interleave(4, 0)
            if cfg.sink:
                k[0], v[0] = rec[:, 2], rec[:, 3]
        q = q @ r  # rotation in fp32 inside the API: compare loosely below
        for h in range(8):
            w = torch.softmax(k[:, h // 4] @ q[h] * 0.125, dim=0)
            want = (w @ v[:, h // 4]) @ r.T
            torch.testing.assert_close(out[s, h].double(), want, rtol=1.5e-2, atol=4e-3)


def test_config_must_match_the_scale_layout():
    gen = torch.Generator().manual_seed(0)
    prob = build_paged_problem([5], 1, 64, 16, generator=gen, config=PLAIN)
    q = torch.randn(1, 1, 64).bfloat16()
    with pytest.raises(ValueError, match="config: scale_group 32"):
        tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.1,
                               config=tq.QuantConfig(scale_group=32))
    with pytest.raises(TypeError, match="config"):
        tq.paged_attention_fp4(q, *prob.cache, prob.block_tables, prob.seq_lens, 0.1,
                               config="rotation")


def test_rotation_fixes_outlier_keys():
    """The reason for the option: two outlier channels cost ~7 dB; rotated, they don't."""
    x = torch.randn(16384, 128, generator=torch.Generator().manual_seed(0))
    x[:, [3, 77]] *= 20
    plain = fmt.sqnr_db(x, fmt.dequantize_fp4(*fmt.quantize_fp4(x)))
    xr = rotate(x, rotation_signs(128, 0))
    rotated = fmt.sqnr_db(xr, fmt.dequantize_fp4(*fmt.quantize_fp4(xr)))
    assert plain < 11.5 and rotated > 17.5
