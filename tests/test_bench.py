"""``python -m turboquant bench``: byte counting against hand computation, the CPU path's
files and fields, the refusal without a GPU, and the argument parsing. Runs on a 2-core CPU
in a few seconds (tiny shapes on the reference backend)."""
import argparse
import csv
import json

import pytest
import torch

from turboquant import bench


def _args(*argv):
    return bench.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_fp4_attention_bytes_by_hand():
    # batch 2, context 64, 8 q heads / 2 kv heads, D 64, one scale per (token, head), bf16 q:
    # K codes 2*64*2*32 = 8192, V codes 8192, K scales 2*64*2*1 = 256, V scales 256,
    # Q 2*8*64*2 = 2048, O 2048
    assert bench.fp4_attention_bytes(2, 64, 8, 2, 64) == 8192 + 8192 + 256 + 256 + 2048 + 2048
    # per-32 scales: 2 scale bytes per token per head
    assert bench.fp4_attention_bytes(2, 64, 8, 2, 64, scale_group=32) == (
        8192 + 8192 + 512 + 512 + 2048 + 2048)
    # Llama-3-8B decode, batch 1 x 1k: codes 2 * 1024*8*64, scales 2 * 1024*8, Q+O 2 * 32*128*2
    assert bench.fp4_attention_bytes(1, 1024, 32, 8, 128) == (
        2 * 1024 * 8 * 64 + 2 * 1024 * 8 + 2 * 32 * 128 * 2)


def test_dense_and_writer_bytes_by_hand():
    # dense bf16: K, V 2*64*2*64*2 = 32768 each, Q + O 2048 each
    assert bench.dense_attention_bytes(2, 64, 8, 2, 64) == 2 * 32768 + 2 * 2048
    # FP4 is 4x smaller than BF16 in K/V, less the scales: 128+2 vs 512 bytes per token-head
    fp4 = bench.fp4_attention_bytes(64, 4096, 32, 8, 128)
    dense = bench.dense_attention_bytes(64, 4096, 32, 8, 128)
    assert 3.8 < dense / fp4 < 4.0
    # writer, 64k tokens x 8 kv heads x D 128 bf16: read 2*65536*8*128*2, codes 2*65536*8*64,
    # scales 2*65536*8
    t = 65536
    assert bench.writer_bytes(t, 8, 128) == 2 * t * 8 * 128 * 2 + 2 * t * 8 * 64 + 2 * t * 8
    assert bench.fp4_cache_bytes(10, 8, 16, 128) == 2 * 10 * 16 * 8 * (64 + 1)
    # K8V4: D key bytes + D/2 value bytes + 2 scales per token and head (194 at D 128)
    assert bench.fp4_cache_bytes(10, 8, 16, 128, key_format="fp8_e4m3") == 10 * 16 * 8 * 194
    assert bench.fp4_attention_bytes(1, 1024, 32, 8, 128, key_format="fp8_e4m3") == (
        1024 * 8 * 194 + 2 * 32 * 128 * 2)
    assert bench.writer_bytes(t, 8, 128, key_format="fp8_e4m3") == (
        2 * t * 8 * 128 * 2 + t * 8 * (128 + 64) + 2 * t * 8)


def test_parsing():
    assert bench.parse_shapes("32/8/128, 64x8x128") == [(32, 8, 128), (64, 8, 128)]
    assert bench.parse_int_list("1,16,1k,32K") == [1, 16, 1024, 32768]
    for bad in ("32/8", "30/8/128", "a/b/c"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_shapes(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_int_list("1,zero")
    a = _args("--quick", "--backend", "reference", "--repeats", "5", "--out", "x")
    assert a.quick and a.backend == "reference" and a.repeats == 5 and a.out == "x"
    assert _args().out == "bench_out" and _args().backend == "auto"


def test_sets_cover_l2():
    a = _args()
    row = bench.Row(32, 8, 128, 1, 1024)
    l2 = 50 * 2**20
    n = bench._sets_for(row, a, l2)
    one = bench.fp4_cache_bytes(64, 8, 16, 128)  # batch 1 x 1k = 64 blocks
    assert n * one >= 4 * l2 and (n - 1) * one < 4 * l2
    assert bench._sets_for(bench.Row(32, 8, 128, 128, 32768), a, l2) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_refuses_without_gpu(tmp_path, capsys):
    assert bench.main(_args("--quick", "--out", str(tmp_path))) != 0
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="--allow-cpu runs only where CUDA is absent")
def test_cpu_run_writes_json_and_csv(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--allow-cpu", "--quick", "--out", str(out), "--no-plot", "--shapes", "4/2/32",
            "--batches", "1,2", "--contexts", "40", "--repeats", "1", "--writer-tokens", "64",
            "--configs", "default,plain"]
    assert bench.main(_args(*argv)) == 0
    text = capsys.readouterr().out
    assert "summary" in text and "cache writer" in text

    doc = json.loads((out / "bench.json").read_text())
    assert set(doc) >= {"meta", "bandwidth", "rows", "writers", "byte_counting"}
    bw = doc["bandwidth"]
    assert bw["read_GBps"] > 0 and "read-only" in bw["read_method"]
    assert bw["read_GBps"] == max(m["GBps"] for m in bw["methods"].values())
    assert set(bw["methods"]) >= {"sum", "gemv"}
    assert doc["meta"]["backend_requested"] == "auto"
    rows = doc["rows"]
    assert [(r["batch"], r["context"], r["config"]) for r in rows] == [
        (1, 40, "default"), (1, 40, "plain"), (2, 40, "default"), (2, 40, "plain")]
    for r in rows:
        assert r["status"] == "ok", r
        assert set(r) == set(bench.ATTENTION_FIELDS)
        assert r["backend"] == "reference"
        # context 40 is not a multiple of the block size: bytes count the 40 tokens only
        b = r["batch"]
        # the default config's reader also takes lam and the sink's key and value (fp32)
        state = b * 2 * 32 * 4 * 3 if r["config"] == "default" else 0
        assert r["fp4_bytes"] == (2 * b * 40 * 2 * 16 + 2 * b * 40 * 2 * 1 + 2 * b * 4 * 32 * 2
                                  + state)
        assert r["sdpa_bytes"] == 2 * b * 40 * 2 * 32 * 2 + 2 * b * 4 * 32 * 2
        assert r["fp4_GBps"] == pytest.approx(r["fp4_bytes"] / (r["fp4_us"] * 1e-6) / 1e9)
        assert r["fp4_pct_bw"] == pytest.approx(
            100 * r["fp4_GBps"] / doc["bandwidth"]["reference_GBps"])
        assert r["speedup"] == pytest.approx(r["sdpa_us"] / r["fp4_us"])
        # the FP4 output is attention over the quantized cache: close to SDPA, not equal
        assert 0.0 < r["rel_err_vs_sdpa"] < 0.35
    assert [w["config"] for w in doc["writers"]] == ["default", "plain"]
    for w in doc["writers"]:
        assert w["status"] == "ok" and set(w) == set(bench.WRITER_FIELDS)
        assert w["bytes"] == 2 * 64 * 2 * 32 * 2 + 2 * 64 * 2 * 16 + 2 * 64 * 2

    with open(out / "bench.csv") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == bench.ATTENTION_FIELDS
        csv_rows = list(reader)
    assert len(csv_rows) == 4
    assert int(csv_rows[1]["fp4_bytes"]) == rows[1]["fp4_bytes"]
    assert float(csv_rows[0]["fp4_us"]) == pytest.approx(rows[0]["fp4_us"])
    with open(out / "bench_writer.csv") as fh:
        assert next(csv.reader(fh)) == bench.WRITER_FIELDS


def test_cli_wires_bench():
    from turboquant import cli

    args = cli.build_parser().parse_args(["bench", "--quick", "--contexts", "1k"])
    assert args.command == "bench" and args.quick and args.contexts == "1k"


def test_max_observed_note():
    rows = [{"status": "ok", "shape": "32/8/128", "batch": 64, "context": 16384,
             "fp4_GBps": 1600.0, "sdpa_GBps": 3100.0},
            {"status": "skipped", "shape": "64/8/128", "batch": 128, "context": 32768}]
    bw = {"reference_GBps": 3000.0}
    note = bench.note_max_observed(rows, bw)
    assert bw["max_observed_GBps"] == 3100.0 and "sdpa 32/8/128 batch 64" in note
    assert "103.3%" in note and "52%" in note
    bw = {"reference_GBps": 3200.0}
    assert bench.note_max_observed(rows, bw) == "" and bw["max_observed_GBps"] == 3200.0


def test_multi_token_rows_parse_and_count_causal_flops():
    from turboquant import bench_multitoken as M

    assert M.parse_multi("1x2048@16k, 64x4@4k") == [M.MultiRow(1, 2048, 16384),
                                                    M.MultiRow(64, 4, 4096)]
    for bad in ("1x2048", "0x4@4k", "1x5000@4k", "ax4@4k"):
        with pytest.raises(ValueError):
            M.parse_multi(bad)
    # query j of Q sees L - Q + j + 1 keys: Q = L is the full causal triangle L (L + 1) / 2
    assert M.causal_flops(1, 4, 4, 1, 1) == 4 * (1 + 2 + 3 + 4)
    assert M.causal_flops(2, 2, 10, 32, 128) == 2 * 4 * 32 * 128 * (9 + 10)
