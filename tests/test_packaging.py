"""The installable package: a wheel built from this checkout, installed into a fresh virtual
environment outside it, works from any directory (the kernel sources inside the package, the
data files, the backend listing, an attention call on the reference backend), and declares what
the first CUDA build needs (ninja)."""
import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMOKE = r"""
import json, sys
from pathlib import Path
import torch, turboquant as tq
from turboquant import sources
from turboquant._backends import cuda, sm120
from turboquant.integration.aiter import patch

pkg = Path(tq.__file__).resolve().parent
cache = tq.allocate_cache(8, 2, 16, 64)
state = tq.allocate_shared_state(2, 64, 8)
k = torch.randn(40, 2, 64, dtype=torch.bfloat16)
tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(40), shared_state=state,
                         positions=torch.arange(40))
q = torch.randn(1, 8, 64, dtype=torch.bfloat16)
out = tq.paged_attention_fp4(q, *cache, torch.arange(3, dtype=torch.int32)[None],
                             torch.tensor([40], dtype=torch.int32), 0.125, shared_state=state)
print(json.dumps({
    "package": str(pkg), "cuda_src": str(cuda.CSRC), "sm120_src": str(sm120.CSRC),
    "hip_src": str(patch.kernel_source_dir()),
    "has_tuning": (cuda.CSRC / "tuning.cuh").is_file(),
    "has_sm120": (sm120.CSRC / "paged_attention_sm120.cuh").is_file(),
    "has_shims": (sources.source_dir("hip") / "shims" / "host").is_dir(),
    "finite": bool(torch.isfinite(out).all()), "shape": list(out.shape),
    "backends": [b["name"] for b in tq.backends()],
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("turboquant-*.whl")
    return whl


def test_wheel_carries_the_kernel_sources_the_plugin_and_declares_ninja(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for folder, package in (("csrc_cuda", "cuda"), ("csrc_hip", "hip")):
        want = {str(p.relative_to(ROOT / folder)) for p in (ROOT / folder).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
        got = {n.split(f"turboquant/_csrc/{package}/", 1)[1] for n in names
               if n.startswith(f"turboquant/_csrc/{package}/")}
        assert want and got == want, f"{folder}: missing {sorted(want - got)[:5]}"
    assert "turboquant/data/accuracy_text.txt" in names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    assert any(line.split()[1].startswith("ninja") for line in requires), requires
    eps = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(eps).decode()  # the vLLM plugin, loaded by vLLM
    assert "[vllm.general_plugins]\nturboquant = turboquant.integration.vllm:register" in text
    assert "turboquant/integration/vllm/layer.py" in names


def test_wheel_installed_outside_the_checkout_runs(wheel, tmp_path):
    """A fresh venv (torch from the system site, no network: --no-deps), the wheel installed
    into it, Python started in an empty directory: the package, its kernel sources and data are
    the installed copies, and a write and an attention call run on the reference backend."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                        "-q", str(wheel)], capture_output=True, text=True, timeout=600)
    if r.returncode and "no such option: --python" in r.stderr:  # pip < 22.3
        pytest.skip("pip cannot install into another environment (--python)")
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    r = subprocess.run([str(py), "-c", SMOKE], cwd=work, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    facts = json.loads(r.stdout.strip().splitlines()[-1])
    package = Path(facts["package"])
    assert env_dir in package.parents and ROOT not in package.parents
    for key in ("cuda_src", "sm120_src", "hip_src"):
        assert package in Path(facts[key]).parents, (key, facts[key])
    assert facts["has_tuning"] and facts["has_sm120"] and facts["has_shims"]
    assert facts["finite"] and facts["shape"] == [1, 8, 64]
    assert {"reference", "cuda", "sm120", "aiter"} <= set(facts["backends"])
    r = subprocess.run([str(py), "-m", "turboquant", "backends"], cwd=work, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0 and "reference" in r.stdout, r.stderr[-2000:]
