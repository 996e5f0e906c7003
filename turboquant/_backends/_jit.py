"""Compiling a backend's CUDA extension on first use (torch.utils.cpp_extension), cached.

The cache lives under ``$TURBOQUANT_BUILD_DIR`` (default ``~/.cache/turboquant``); each build's
name carries a hash of its source folder, so editing a kernel header rebuilds. A library built
elsewhere under the same name (``benchmarks/prebuild_cuda.py``: on a machine without a GPU, for
the device's torch) is loaded instead of compiling when ``$TURBOQUANT_PREBUILT_DIR`` holds it as
``torch-<torch version>/<name>.so``.
"""
from __future__ import annotations

import hashlib
import os
import threading
import warnings
from pathlib import Path
from typing import Callable, Hashable, Optional

SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
CUDA_CFLAGS = ["-O3", "-std=c++17"]  # beside torch's own nvcc flags and the caller's


def build_dir() -> Path:
    root = os.environ.get("TURBOQUANT_BUILD_DIR")
    return Path(root) if root else Path.home() / ".cache" / "turboquant"


def sources_hash(*paths: Path) -> str:
    """12 hex digits over the names and bytes of the C++/CUDA files directly in each folder of
    ``paths``, and of each file among them (a header included from elsewhere)."""
    h = hashlib.sha256()
    for path in paths:
        for f in sorted(path.glob("*")) if path.is_dir() else [path]:
            if f.suffix in SOURCE_SUFFIXES:
                h.update(f.name.encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:12]


def prebuilt(name: str, torch_version: str) -> Optional[Path]:
    """The prebuilt library ``name`` for ``torch_version`` under ``$TURBOQUANT_PREBUILT_DIR``,
    or None."""
    shelf = os.environ.get("TURBOQUANT_PREBUILT_DIR")
    lib = Path(shelf) / f"torch-{torch_version}" / f"{name}.so" if shelf else None
    return lib if lib is not None and lib.is_file() else None


def load(name: str, source: Path, cuda_flags: list) -> None:
    """Load the prebuilt library ``name`` or build (or reuse) ``source`` as it and load it;
    raises on failure. ``cuda_flags`` holds the architecture flags and any extra defines."""
    import torch
    from torch.utils import cpp_extension

    lib = prebuilt(name, torch.__version__)
    if lib is not None:
        try:
            torch.ops.load_library(str(lib))
            return
        except OSError as e:  # e.g. built against another torch build of the same version
            warnings.warn(f"the prebuilt {lib} did not load ({e}); compiling {name} instead")

    bdir = build_dir() / name
    bdir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_include_paths=[str(source.parent)],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=CUDA_CFLAGS + cuda_flags,
        build_directory=str(bdir),
        is_python_module=False,
        verbose=os.environ.get("TURBOQUANT_BUILD_VERBOSE", "0") == "1",
    )


class Once:
    """A backend's build (or check) run once per key, under a lock: ``once(key, fn)`` runs
    ``fn()`` the first time, which returns None (usable) or the reason it is not, or raises
    (the reason then names ``failure`` and the error's last lines); later calls return the same
    answer. A usable key answers without the lock (torch.compile traces the dispatch through
    here)."""

    def __init__(self, failure: str):
        self.failure = failure  # e.g. "building the CUDA extension failed"
        self.results: dict = {}  # key -> None or the reason
        self._lock = threading.Lock()

    def __call__(self, key: Hashable, fn: Callable[[], Optional[str]]) -> Optional[str]:
        if key in self.results and self.results[key] is None:
            return None
        with self._lock:
            if key not in self.results:
                try:
                    self.results[key] = fn()
                except Exception as e:  # noqa: BLE001 - a failure is a reason, not a crash
                    lines = str(e).strip().splitlines()
                    tail = " | ".join(lines[-3:]) if lines else type(e).__name__
                    self.results[key] = f"{self.failure}: {type(e).__name__}: {tail}"
            return self.results[key]
