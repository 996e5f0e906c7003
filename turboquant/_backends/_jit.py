"""Compiling a backend's CUDA extension on first use (torch.utils.cpp_extension), cached.

The cache lives under ``$TURBOQUANT_BUILD_DIR`` (default ``~/.cache/turboquant``); each build's
name carries a hash of its source folder, so editing a kernel header rebuilds.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")


def build_dir() -> Path:
    root = os.environ.get("TURBOQUANT_BUILD_DIR")
    return Path(root) if root else Path.home() / ".cache" / "turboquant"


def sources_hash(folder: Path) -> str:
    """12 hex digits over the names and bytes of the C++/CUDA files directly in ``folder``."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*")):
        if f.suffix in SOURCE_SUFFIXES:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def load(name: str, source: Path, cuda_flags: list) -> None:
    """Build (or reuse) ``source`` as the torch library ``name`` and load it; raises on failure.
    ``cuda_flags`` holds the architecture flags and any extra defines."""
    from torch.utils import cpp_extension

    bdir = build_dir() / name
    bdir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_include_paths=[str(source.parent)],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17"] + cuda_flags,
        build_directory=str(bdir),
        is_python_module=False,
        verbose=os.environ.get("TURBOQUANT_BUILD_VERBOSE", "0") == "1",
    )
