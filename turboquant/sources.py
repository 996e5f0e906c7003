"""Where the kernel sources are: in an installed wheel, inside the package
(``turboquant/_csrc/cuda``, ``turboquant/_csrc/hip``: setup.py copies them there); in a checkout
or an editable install, beside the package (``csrc_cuda``, ``csrc_hip``)."""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def source_dir(name: str) -> Path:
    """The folder of the ``name`` ("cuda" or "hip") kernel sources."""
    packaged = PACKAGE / "_csrc" / name
    return packaged if packaged.is_dir() else PACKAGE.parent / f"csrc_{name}"
