"""The main job and the CLI, run as a user would."""
import json
import subprocess
import sys

import pytest


def run(*args):
    res = subprocess.run([sys.executable, "-m", "turboquant", *args], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res


def test_main_job_json_on_a_small_shape():
    res = run("--json", "--batch", "3", "--context", "300", "--heads", "8", "--kv-heads", "2",
              "--head-dim", "64", "--block-size", "32")
    row = json.loads(res.stdout)
    assert row["backend"] == "reference" and row["device"] == "cpu"
    assert row["kv_compression"] == pytest.approx(2 * 64 * 2 / (2 * (32 + 1)))
    assert row["cosine"] > 0.97 and row["relative_error"] < 0.3
    assert row["time_per_call_us"] > 0 and row["effective_gb_per_s"] > 0


def test_main_job_text_and_progress():
    res = run("--batch", "2", "--context", "100", "--scale-group", "32")
    for key in ("backend", "KV cache bytes", "accuracy vs BF16", "time per call",
                "not a performance figure", "KL divergence"):
        assert key in res.stdout
    assert "[1/4]" in res.stderr and "[4/4]" in res.stderr


def test_help_documents_every_option():
    res = run("--help")
    for opt in ("--batch", "--context", "--heads", "--kv-heads", "--head-dim", "--block-size",
                "--scale-group", "--dtype", "--backend", "--device", "--iters", "--seed",
                "--json", "bench", "backends"):
        assert opt in res.stdout


def test_bench_from_the_command_line_gives_both_timing_figures(tmp_path):
    """``python -m turboquant bench --allow-cpu`` as a user types it: the table's chained and
    single columns, and the same two figures per row in bench.json."""
    if torch_cuda_available():
        pytest.skip("--allow-cpu runs on the CPU only where CUDA is absent")
    res = run("bench", "--allow-cpu", "--quick", "--shapes", "4/2/32", "--batches", "1",
              "--contexts", "40", "--repeats", "1", "--no-writer", "--no-plot",
              "--out", str(tmp_path))
    assert "single_us" in res.stdout and "sdpa_single" in res.stdout
    row, = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert row["status"] == "ok"
    for key in ("fp4_us", "fp4_us_single", "sdpa_us", "sdpa_us_single"):
        assert row[key] > 0


def test_backends_lists_reasons():
    rows = json.loads(run("backends", "--json").stdout)
    ref = [r for r in rows if r["name"] == "reference"][0]
    assert ref["available"]
    for row in rows:
        assert row["available"] or row["reason"]


def test_readme_commands_are_the_ones_ci_runs():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    block = re.search(r"## Set up.*?```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    assert commands[0].endswith("python -m turboquant")
    assert commands[1] in (root / ".ci" / "run").read_text()


def test_readme_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    # the transformers recipes load a model (MODEL): tests/test_transformers_integration.py runs
    # them with a local one
    sections = [s for s in readme.split("\n## ") if not s.startswith("Use it with transformers")]
    examples = re.findall(r"```python\n(.*?)```", "\n## ".join(sections), re.S)
    assert len(examples) >= 2  # one sequence; a batch with the cache read back
    for i, example in enumerate(examples):
        exec(compile(example, f"README example {i}", "exec"), {})


@pytest.mark.parametrize("argv,word", [
    (["--backend", "cuda"], "backend='cuda' cannot run"), (["--kv-heads", "7"], "num_kv_heads (7)"),
    (["--block-size", "7"], "power-of-two block size"), (["--context", "-5"], "--context"),
    (["--heads", "0"], "--heads"), (["--context", "0"], "--context"), (["--batch", "0"], "--batch"),
    (["--iters", "0"], "--iters"), (["--device", "nope"], "--device"),
])
def test_main_job_bad_arguments_give_one_line_errors(argv, word):
    """Issue 14: raw tracebacks, and 0 silently turned into the default, before."""
    if argv[:2] == ["--backend", "cuda"] and torch_cuda_available():
        pytest.skip("a CUDA machine runs the cuda backend")
    # a small shape first; argparse takes the last value of a repeated option
    res = subprocess.run([sys.executable, "-m", "turboquant", "--batch", "1", "--context", "40",
                          *argv], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert word in res.stderr.strip().splitlines()[-1]


def torch_cuda_available():
    import torch

    return torch.cuda.is_available()
