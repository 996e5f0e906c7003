"""``python -m turboquant bench``: byte counting against hand computation, the CPU path's
files and fields (both timing figures), the chained calls feeding each output into the next
query, the refusal without a GPU, the argument parsing, and the split of the bench into modules
(no function left in two of them). Runs on a 2-core CPU in a few seconds (tiny shapes on the
reference backend)."""
import argparse
import ast
import csv
import json
import math
from pathlib import Path

import pytest
import torch

from turboquant.bench import problems as bench_problems
from turboquant.bench import report as bench_report
from turboquant.bench import run as bench
from turboquant.bench import timing as bench_timing


def _args(*argv):
    return bench.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_fp4_attention_bytes_by_hand():
    # batch 2, context 64, 8 q heads / 2 kv heads, D 64, one scale per (token, head), bf16 q:
    # K codes 2*64*2*32 = 8192, V codes 8192, K scales 2*64*2*1 = 256, V scales 256,
    # Q 2*8*64*2 = 2048, O 2048
    assert bench_problems.fp4_attention_bytes(2, 64, 8, 2, 64) == 8192 + 8192 + 256 + 256 + 2048 + 2048
    # per-32 scales: 2 scale bytes per token per head
    assert bench_problems.fp4_attention_bytes(2, 64, 8, 2, 64, scale_group=32) == (
        8192 + 8192 + 512 + 512 + 2048 + 2048)
    # Llama-3-8B decode, batch 1 x 1k: codes 2 * 1024*8*64, scales 2 * 1024*8, Q+O 2 * 32*128*2
    assert bench_problems.fp4_attention_bytes(1, 1024, 32, 8, 128) == (
        2 * 1024 * 8 * 64 + 2 * 1024 * 8 + 2 * 32 * 128 * 2)


def test_dense_and_writer_bytes_by_hand():
    # dense bf16: K, V 2*64*2*64*2 = 32768 each, Q + O 2048 each
    assert bench_problems.dense_attention_bytes(2, 64, 8, 2, 64) == 2 * 32768 + 2 * 2048
    # FP4 is 4x smaller than BF16 in K/V, less the scales: 128+2 vs 512 bytes per token-head
    fp4 = bench_problems.fp4_attention_bytes(64, 4096, 32, 8, 128)
    dense = bench_problems.dense_attention_bytes(64, 4096, 32, 8, 128)
    assert 3.8 < dense / fp4 < 4.0
    # writer, 64k tokens x 8 kv heads x D 128 bf16: read 2*65536*8*128*2, codes 2*65536*8*64,
    # scales 2*65536*8
    t = 65536
    assert bench_problems.writer_bytes(t, 8, 128) == 2 * t * 8 * 128 * 2 + 2 * t * 8 * 64 + 2 * t * 8
    assert bench_problems.fp4_cache_bytes(10, 8, 16, 128) == 2 * 10 * 16 * 8 * (64 + 1)
    # K8V4: D key bytes + D/2 value bytes + 2 scales per token and head (194 at D 128)
    assert bench_problems.fp4_cache_bytes(10, 8, 16, 128, key_format="fp8_e4m3") == 10 * 16 * 8 * 194
    assert bench_problems.fp4_attention_bytes(1, 1024, 32, 8, 128, key_format="fp8_e4m3") == (
        1024 * 8 * 194 + 2 * 32 * 128 * 2)
    assert bench_problems.writer_bytes(t, 8, 128, key_format="fp8_e4m3") == (
        2 * t * 8 * 128 * 2 + t * 8 * (128 + 64) + 2 * t * 8)


def test_parsing():
    assert bench.parse_shapes("32/8/128, 64x8x128") == [(32, 8, 128), (64, 8, 128)]
    assert bench_problems.parse_int_list("1,16,1k,32K") == [1, 16, 1024, 32768]
    for bad in ("32/8", "30/8/128", "a/b/c"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_shapes(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        bench_problems.parse_int_list("1,zero")
    a = _args("--quick", "--backend", "reference", "--repeats", "5", "--out", "x")
    assert a.quick and a.backend == "reference" and a.repeats == 5 and a.out == "x"
    assert _args().out == "bench_out" and _args().backend == "auto"


def test_sets_cover_l2():
    a = _args()
    row = bench_problems.Row(32, 8, 128, 1, 1024)
    l2 = 50 * 2**20
    n = bench_problems.sets_for(row, a, l2)
    one = bench_problems.fp4_cache_bytes(64, 8, 16, 128)  # batch 1 x 1k = 64 blocks
    assert n * one >= 4 * l2 and (n - 1) * one < 4 * l2
    assert bench_problems.sets_for(bench_problems.Row(32, 8, 128, 128, 32768), a, l2) == 1


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
    assert set(doc["meta"]["timing_figures"]) >= {"chained", "single"}
    assert "fp4_us_single" in doc["meta"]["timing_figures"]["single"]
    rows = doc["rows"]
    assert [(r["batch"], r["context"], r["config"]) for r in rows] == [
        (1, 40, "default"), (1, 40, "plain"), (2, 40, "default"), (2, 40, "plain")]
    for r in rows:
        assert r["status"] == "ok", r
        assert set(r) == set(bench_report.ATTENTION_FIELDS)
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
        # both figures of FP4 and SDPA: chained (fp4_us, sdpa_us) and one call alone
        for key in ("fp4_us", "fp4_us_single", "sdpa_us", "sdpa_us_single"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r)
        assert r["timing"] == "wall" and r["n_sets"] == 1
        # the CPU run caps --min-calls at 2: a chain of 2 calls over the one set
        assert r["calls_per_timing"] == 2
        # the FP4 output is attention over the quantized cache: close to SDPA, not equal
        assert 0.0 < r["rel_err_vs_sdpa"] < 0.35
    assert [w["config"] for w in doc["writers"]] == ["default", "plain"]
    for w in doc["writers"]:
        assert w["status"] == "ok" and set(w) == set(bench_report.WRITER_FIELDS)
        assert w["bytes"] == 2 * 64 * 2 * 32 * 2 + 2 * 64 * 2 * 16 + 2 * 64 * 2

    with open(out / "bench.csv") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == bench_report.ATTENTION_FIELDS
        csv_rows = list(reader)
    assert len(csv_rows) == 4
    assert int(csv_rows[1]["fp4_bytes"]) == rows[1]["fp4_bytes"]
    assert float(csv_rows[0]["fp4_us"]) == pytest.approx(rows[0]["fp4_us"])
    assert float(csv_rows[0]["fp4_us_single"]) == pytest.approx(rows[0]["fp4_us_single"])
    assert float(csv_rows[2]["sdpa_us_single"]) == pytest.approx(rows[2]["sdpa_us_single"])
    # the printed table has both columns
    header = [line for line in text.splitlines() if line.split()[:2] == ["shape", "batch"]]
    assert header and "single_us" in header[0] and "sdpa_single" in header[0]
    with open(out / "bench_writer.csv") as fh:
        assert next(csv.reader(fh)) == bench_report.WRITER_FIELDS


def test_cli_wires_bench():
    from turboquant import cli

    args = cli.build_parser().parse_args(["bench", "--quick", "--contexts", "1k"])
    assert args.command == "bench" and args.quick and args.contexts == "1k"


def test_max_observed_note():
    rows = [{"status": "ok", "shape": "32/8/128", "batch": 64, "context": 16384,
             "fp4_GBps": 1600.0, "sdpa_GBps": 3100.0},
            {"status": "skipped", "shape": "64/8/128", "batch": 128, "context": 32768}]
    bw = {"reference_GBps": 3000.0}
    note = bench_report.note_max_observed(rows, bw)
    assert bw["max_observed_GBps"] == 3100.0 and "sdpa 32/8/128 batch 64" in note
    assert "103.3%" in note and "52%" in note
    bw = {"reference_GBps": 3200.0}
    assert bench_report.note_max_observed(rows, bw) == "" and bw["max_observed_GBps"] == 3200.0


def test_multi_token_rows_parse_and_count_causal_flops():
    from turboquant.bench import multitoken as M

    assert M.parse_multi("1x2048@16k, 64x4@4k") == [M.MultiRow(1, 2048, 16384),
                                                    M.MultiRow(64, 4, 4096)]
    for bad in ("1x2048", "0x4@4k", "1x5000@4k", "ax4@4k", "1x2048+@16k", "1x2048+0x1@16k"):
        with pytest.raises(ValueError):
            M.parse_multi(bad)
    # a mixed step: one chunk and decode rows in one call
    (mix,) = M.parse_multi("1x2048+64x1@16k")
    assert (mix.batch, mix.query_len, mix.context) == (65, 2048, 16384)
    assert mix.query_lens() == [2048] + [1] * 64 and mix.label() == "2048+64x1"
    assert M.MultiRow(2, 3, 8).query_lens() == [3, 3] and M.MultiRow(2, 3, 8).label() == 3
    # query j of Q sees L - Q + j + 1 keys: Q = L is the full causal triangle L (L + 1) / 2
    assert M.causal_flops(1, 4, 4, 1, 1) == 4 * (1 + 2 + 3 + 4)
    assert M.causal_flops(2, 2, 10, 32, 128) == 2 * 4 * 32 * 128 * (9 + 10)


def test_mixed_multi_token_row_runs_on_the_cpu():
    """A mixed step through the reference backend: each sequence its own query length, the
    exact causal FLOPs of both groups, bytes = the cache once + Q and O of every token, SDPA
    skipped with the reason (its [B, Hq, Q, D] view needs one Q)."""
    import turboquant as tq
    from turboquant.bench import multitoken as M

    a = _args("--configs", "plain", "--backend", "reference", "--timing", "eager",
              "--repeats", "1", "--warmup", "0", "--min-calls", "1", "--block-size", "16")
    (row,) = M.parse_multi("1x24+3x1@32")
    rec = M.run_multi_row(tq, (4, 2, 32), row, "plain", a, torch.device("cpu"), 0.0)
    assert rec["status"] == "ok", rec
    assert rec["query_len"] == "24+3x1" and rec["batch"] == 4
    assert rec["flops"] == M.causal_flops(1, 24, 32, 4, 32) + 3 * M.causal_flops(1, 1, 32, 4, 32)
    assert rec["bytes"] == bench_problems.fp4_attention_bytes(4, 32, 4, 2, 32, query_len=0) \
        + 2 * 27 * 4 * 32 * 2
    assert "SDPA: uniform rows only" in rec["note"]


# --------------------------------------------------------------------------------------------
# single and chained timing


def _decode_problem(n_sets=2, config="default", batch=2, context=40):
    """A CPU decode problem of 4 query / 2 kv heads, D 32, block 16 (reference backend)."""
    import turboquant as tq

    a = _args("--configs", config)
    cfg, key_format = bench_problems.cache_config(config, a)
    row = bench_problems.Row(4, 2, 32, batch, context)
    p = bench_problems.build_decode_problem(tq, row, n_sets, cfg, key_format, torch.bfloat16,
                                            16, 0, 0, torch.device("cpu"), 2**20)
    return tq, p


def _recorded(steps, log):
    """``steps`` with each call's set, query / output buffers and values logged."""
    def wrap(s, step):
        def f(q, out):
            entry = {"set": s, "q": q, "q_in": q.clone(), "out": out}
            res = step(q, out)
            entry.update(res=res, res_val=res.clone())
            log.append(entry)
            return res
        return f
    return [wrap(s, step) for s, step in enumerate(steps)]


def test_fp4_chain_feeds_each_output_into_the_next_query():
    tq, p = _decode_problem(n_sets=2)
    log = []
    steps = _recorded(bench_problems.fp4_steps(tq, p, "reference", 40), log)
    buffers = (p.query[0].clone(), torch.empty_like(p.query[0]))
    with bench_problems.checks_off(tq):
        last = bench_timing.chain(steps, buffers, 3)()
    assert [e["set"] for e in log] == [0, 1, 0]  # call i on set i % n_sets
    # call i reads buffer i % 2 and writes buffer (i + 1) % 2: never the one it reads
    for i, e in enumerate(log):
        assert e["q"] is buffers[i % 2] and e["out"] is buffers[(i + 1) % 2]
        assert e["res"] is e["out"]
    assert torch.equal(log[0]["q_in"], p.query[0])
    for prev, nxt in zip(log, log[1:]):
        assert torch.equal(nxt["q_in"], prev["res_val"])  # the query is the previous output
        assert not torch.equal(nxt["q_in"], p.query[0])
    assert last is buffers[1] and torch.equal(last, log[2]["res_val"])
    # the chain computes attention: call 1 = set 1's attention of call 0's output
    with bench_problems.checks_off(tq):
        again = bench_problems.fp4_steps(tq, p, "reference", 40)[1](
            log[0]["res_val"], torch.empty_like(p.query[0]))
    assert torch.equal(again, log[1]["res_val"])


def test_sdpa_chain_hands_on_the_tensor_sdpa_returns():
    _tq, p = _decode_problem(n_sets=2, config="plain")
    log = []
    steps = _recorded(bench_problems.sdpa_steps(p, gqa=True), log)
    q0 = p.query[0].unsqueeze(2)  # [B, Hq, 1, D]
    buffers = (q0.clone(), torch.empty_like(q0))
    last = bench_timing.chain(steps, buffers, 2)()
    assert [e["set"] for e in log] == [0, 1]
    assert log[0]["q"] is buffers[0] and log[1]["q"] is log[0]["res"]  # no copy in between
    assert log[0]["res"].shape == q0.shape and log[0]["res"].dtype == q0.dtype
    assert not torch.equal(log[1]["q_in"], q0)
    ref = torch.nn.functional.scaled_dot_product_attention(
        log[0]["res_val"], p.dense_k[2:4], p.dense_v[2:4], scale=p.scale, enable_gqa=True)
    assert torch.equal(last, ref)


def test_time_decode_runs_single_calls_and_whole_chains():
    """One call per set round-robin for the single figure; chains of whole passes over the
    sets, at least min_calls long, for the chained figure (CPU: wall clock)."""
    calls = []

    def step(s):
        def f(q, out):
            calls.append((s, q.data_ptr()))
            return torch.mul(q, 0.5, out=out)
        return f

    queries = torch.ones(3, 2, 4)
    outs = torch.empty_like(queries)
    t = bench_timing.time_decode([step(s) for s in range(3)], queries, outs,
                                 torch.device("cpu"), repeats=2, warmup=1, timing="graph",
                                 min_calls=4)
    assert isinstance(t, bench_timing.DecodeTimes)
    assert t.chain_calls == 6 and t.timing == "wall" and t.note == ""
    assert t.single_us > 0 and t.chained_us > 0
    single, chained = calls[:5], calls[5:]
    # single: 1 warm-up pass over the 3 sets, then 2 timed calls, each on its own query
    assert [s for s, _ in single] == [0, 1, 2, 0, 1]
    assert [ptr for _, ptr in single] == [queries[s].data_ptr() for s, _ in single]
    # chained: 1 warm-up + 2 timed chains of 6 calls, sets in turn, two buffers in turn
    assert len(chained) == 3 * 6 and [s for s, _ in chained] == [0, 1, 2] * 6
    assert len({ptr for _, ptr in chained}) == 2
    assert all(a[1] != b[1] for a, b in zip(chained, chained[1:]))


def test_time_calls_keeps_independent_repeated_calls():
    n = []
    us, used, calls, note = bench_timing.time_calls([lambda: n.append(1)], torch.device("cpu"),
                                                    repeats=3, warmup=1, timing="graph",
                                                    min_calls=5)
    assert calls == 5 and used == "wall" and note == "" and us >= 0
    assert len(n) == 5 * (1 + 3)


def test_table_shows_both_figures():
    r = {f: "" for f in bench_report.ATTENTION_FIELDS}
    r.update(status="ok", shape="32/8/128", batch=1, context=1024, n_sets=100, fp4_us=6.25,
             fp4_us_single=9.5, fp4_GBps=400.0, fp4_pct_bw=13.0, floor_us=1.0, sdpa_us=20.0,
             sdpa_us_single=23.75, speedup=3.2, timing="graph", backend="cuda",
             config="default")
    line = bench_report.format_row(r)
    cols = bench_report.HEADER.split()
    vals = line.split()
    assert vals[cols.index("fp4_us")] == "6.2" and vals[cols.index("single_us")] == "9.5"
    assert vals[cols.index("sdpa_us")] == "20.0" and vals[cols.index("sdpa_single")] == "23.8"


# --------------------------------------------------------------------------------------------
# the split of the bench into modules


BENCH_MODULES = ("run", "timing", "problems", "report", "multitoken", "peers")


def _definitions():
    root = Path(bench.__file__).resolve().parent
    defs = []
    for mod in BENCH_MODULES:
        tree = ast.parse((root / f"{mod}.py").read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(
                        getattr(body[0], "value", None), ast.Constant):
                    body = body[1:]  # the docstring
                defs.append((mod, node.name, "\n".join(ast.dump(b) for b in body)))
    return defs


def test_no_function_is_defined_twice_across_the_bench_modules():
    defs = _definitions()
    by_name = {}
    for mod, name, _body in defs:
        by_name.setdefault(name, []).append(mod)
    twice = {name: mods for name, mods in by_name.items() if len(mods) > 1}
    # the attention table's row and the multi-token table's row are different tables
    assert twice == {"format_row": ["report", "multitoken"]}
    by_body = {}
    for mod, name, body in defs:
        by_body.setdefault(body, []).append(f"{mod}.{name}")
    assert [v for v in by_body.values() if len(v) > 1] == []


def test_each_piece_lives_in_one_module_and_importers_find_it():
    # what turboquant.cli takes from turboquant.bench.run
    assert callable(bench.add_arguments) and callable(bench.main)
    for name in ("time_calls", "kernel_names", "measure_bandwidth", "triton_read_sum"):
        assert getattr(bench_timing, name).__module__ == "turboquant.bench.timing"
    for name in ("fp4_attention_bytes", "row_memory", "sets_for", "fill_cache",
                 "build_decode_problem", "writer_state"):
        assert getattr(bench_problems, name).__module__ == "turboquant.bench.problems"
    for name in ("format_row", "write_csv", "write_plot", "note_max_observed", "device_meta"):
        assert getattr(bench_report, name).__module__ == "turboquant.bench.report"
    assert math.isclose(bench_timing.GB, 1e9)
