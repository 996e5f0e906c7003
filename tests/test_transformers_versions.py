"""The transformers integrations under transformers 5.17 too (the installed one is 5.23; the GPU
machines have 5.17): tests/test_transformers_batching.py and tests/test_transformers_integration.py
run in a subprocess with transformers 5.17 first on the path (.ci/install puts it in
$TURBOQUANT_TF517_DIR, default ~/.cache/turboquant/transformers-5.17)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TF517 = Path(os.environ.get("TURBOQUANT_TF517_DIR",
                            Path.home() / ".cache" / "turboquant" / "transformers-5.17"))
FILES = ("tests/test_transformers_batching.py", "tests/test_transformers_integration.py")


def test_the_transformers_tests_pass_under_5_17():
    if not (TF517 / "transformers" / "__init__.py").is_file():
        pytest.skip(f"transformers 5.17 is not installed in {TF517} (.ci/install puts it there)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TF517), str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    version = subprocess.run([sys.executable, "-c", "import transformers; "
                              "print(transformers.__version__)"], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert version.stdout.strip() == "5.17.0", version.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *FILES], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
