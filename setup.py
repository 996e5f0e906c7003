"""turboquant: FP4 KV-cache paged attention (AMD gfx950, NVIDIA SM120 and SM80-SM90, PyTorch).

The CUDA extensions are compiled on first use (torch.utils.cpp_extension.load with ninja,
cached under ~/.cache/turboquant), so installing needs no GPU and no CUDA toolkit; the first
call on an NVIDIA GPU needs nvcc of the CUDA version torch was built with. The kernel sources
(csrc_cuda/, csrc_hip/) travel inside the package: a wheel holds them as turboquant/_csrc/
(``turboquant.sources`` finds them there, or beside the package in a checkout).
"""
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
KERNEL_SOURCES = {"cuda": "csrc_cuda", "hip": "csrc_hip"}  # turboquant/_csrc/<key> <- <value>


class BuildPyWithKernels(build_py):
    """build_py, then the kernel source folders copied into the built package."""

    def run(self):
        super().run()
        for name, folder in KERNEL_SOURCES.items():
            dst = Path(self.build_lib) / "turboquant" / "_csrc" / name
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(HERE / folder, dst,
                            ignore=shutil.ignore_patterns("__pycache__", "*.o", "*.so"))


setup(
    name="turboquant",
    version="0.1.0",
    description="FP4 KV-cache paged attention with one cache format across AMD and NVIDIA",
    packages=find_packages(include=["turboquant", "turboquant.*"]),
    package_data={"turboquant": ["data/*.txt", "integration/aiter/files/**/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    # numpy: torch's NumPy interop (without it importing torch warns); ninja: what
    # torch.utils.cpp_extension builds the CUDA extensions with on first use.
    install_requires=["torch>=2.4", "numpy", "ninja"],
    extras_require={"test": ["pytest"], "bench": ["matplotlib"]},
    cmdclass={"build_py": BuildPyWithKernels},
    # vLLM loads this in each of its processes (turboquant/integration/vllm: `--kv-cache-dtype
    # tq_fp4 --attention-backend TQ_FP4`); without vLLM nothing reads it.
    entry_points={"vllm.general_plugins": ["turboquant = turboquant.integration.vllm:register"]},
)
