"""Finds the compilers and binary tools that some tests run, for the tests and for .ci/install.

NVIDIA's tools (nvcc, cuobjdump, nvdisasm) are looked for on PATH, in $CUDA_HOME/bin and
/usr/local/cuda/bin, then inside the pip-installed NVIDIA wheels, which put them in
site-packages/nvidia/cu13/bin (13.x) or nvidia/cuda_nvcc/bin (12.x): .ci/install gets them
from PyPI where no CUDA toolkit has them. clang-22 is $TURBOQUANT_CLANG or clang-22 on PATH.

    python tests/_tools.py nvcc cuobjdump   # prints each path; exit status 1 if one is missing
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

CLANG_MISSING = ("clang-22 not found: apt-get install -y --no-install-recommends clang-22 (Debian "
                 "bookworm-security; bash .ci/install does it as root), or set TURBOQUANT_CLANG")


def find_tool(name: str) -> str | None:
    """The path of an executable `name`, or None."""
    found = shutil.which(name)
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and os.access(Path(base) / "bin" / name, os.X_OK):
            return str(Path(base) / "bin" / name)
    spec = importlib.util.find_spec("nvidia")  # the nvidia-* wheels' namespace package
    for root in (spec.submodule_search_locations or []) if spec else []:
        for cand in sorted(Path(root).glob(f"*/bin/{name}")):
            if os.access(cand, os.X_OK):
                return str(cand)
    return None


def find_nvcc() -> str | None:
    """nvcc (find_tool), where g++, its host compiler, is on PATH too; else None."""
    return find_tool("nvcc") if shutil.which("g++") else None


def nvcc_link_flags(nvcc: str) -> list[str]:
    """What nvcc needs to link an executable: nothing with a CUDA toolkit; with NVIDIA's wheels,
    -L to nvidia/cu13/lib, where nvidia-cuda-runtime puts libcudart_static.a (nvcc looks in lib64,
    which the wheels don't have)."""
    root = Path(nvcc).resolve().parent.parent
    wheel = not (root / "lib64").is_dir() and (root / "lib" / "libcudart_static.a").is_file()
    return ["-L", str(root / "lib")] if wheel else []


def find_clang() -> str | None:
    """clang-22 for the gfx950 tests: $TURBOQUANT_CLANG, else clang-22 on PATH, else None."""
    return os.environ.get("TURBOQUANT_CLANG") or shutil.which("clang-22")


if __name__ == "__main__":
    paths = {name: find_tool(name) for name in sys.argv[1:]}
    for name, path in paths.items():
        print(f"{name}: {path or 'not found'}")
    sys.exit(0 if all(paths.values()) else 1)
