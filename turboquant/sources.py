"""Where the kernel sources are: in an installed wheel, inside the package
(``turboquant/_csrc/cuda``, ``turboquant/_csrc/hip``: setup.py copies them there); in a checkout
or an editable install, beside the package (``csrc_cuda``, ``csrc_hip``)."""
from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def source_dir(name: str) -> Path:
    """The folder of the ``name`` ("cuda" or "hip") kernel sources."""
    packaged = PACKAGE / "_csrc" / name
    return packaged if packaged.is_dir() else PACKAGE.parent / f"csrc_{name}"


def cuda_limits() -> tuple:
    """(head dims, smallest block size, largest block size) the cuda kernels are built for, as
    ``csrc_cuda/limits.cuh`` states them (the one list: the C++ dispatches by it)."""
    text = (source_dir("cuda") / "limits.cuh").read_text()
    dims = re.search(r"using HeadDims = IntList<([\d, ]+)>;", text).group(1)
    lo, hi = (int(re.search(rf"{name} = (\d+)", text).group(1))
              for name in ("kMinBlockSize", "kMaxBlockSize"))
    return tuple(int(d) for d in dims.split(",")), lo, hi
