"""turboquant: FP4 KV-cache paged attention (AMD gfx950, NVIDIA SM120 and SM80-SM90, PyTorch).

The CUDA extensions are compiled on first use (torch.utils.cpp_extension.load, cached), so
installing never needs a GPU or reinstalls torch: `pip install --no-deps -e .` on a machine
that already has PyTorch, or `pip install -e .` elsewhere.
"""
from setuptools import find_packages, setup

setup(
    name="turboquant",
    version="0.1.0",
    description="FP4 KV-cache paged attention with one cache format across AMD and NVIDIA",
    packages=find_packages(include=["turboquant", "turboquant.*"]),
    package_data={"turboquant": ["data/*.txt", "integration/aiter/files/**/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    # numpy: torch's NumPy interop; without it, importing torch warns "Failed to initialize NumPy".
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"test": ["pytest"], "bench": ["matplotlib"]},
)
