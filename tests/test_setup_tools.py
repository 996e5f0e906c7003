"""The set-up of a fresh machine (issue 14): the tests find NVIDIA's tools inside the pip wheels
that .ci/install gets where no CUDA toolkit is installed, and the package pulls numpy (torch
warns on import without it)."""
import ast
import sys
from pathlib import Path

import _tools

ROOT = Path(__file__).resolve().parents[1]


def test_tools_are_found_inside_the_nvidia_wheels(tmp_path, monkeypatch):
    # a site-packages holding only the nvidia namespace package, as nvidia-cuda-nvcc lays it out
    bin_dir = tmp_path / "nvidia" / "cu13" / "bin"
    bin_dir.mkdir(parents=True)
    tool = bin_dir / "cuobjdump-fake"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    assert _tools.find_tool("cuobjdump-fake") == str(tool)
    assert _tools.find_tool("no-such-tool") is None


def test_wheel_nvcc_gets_its_library_directory(tmp_path):
    root = tmp_path / "nvidia" / "cu13"
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "lib" / "libcudart_static.a").write_bytes(b"")
    nvcc = root / "bin" / "nvcc"
    assert _tools.nvcc_link_flags(str(nvcc)) == ["-L", str(root / "lib")]
    (root / "lib64").mkdir()  # a toolkit's layout: nvcc finds its libraries itself
    assert _tools.nvcc_link_flags(str(nvcc)) == []


def test_the_package_requires_numpy():
    tree = ast.parse((ROOT / "setup.py").read_text())
    reqs = [kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
            for kw in node.keywords if kw.arg == "install_requires"]
    assert reqs and "numpy" in [ast.literal_eval(e) for e in reqs[0].elts]
