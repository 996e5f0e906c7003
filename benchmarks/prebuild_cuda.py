"""Build the cuda backend's extension here, on a machine without a GPU, for the device's torch.

Why: a device call that builds the extension spends about 260 s of device time on nvcc before
anything runs (the device machine keeps no build between calls, and each tree or flag variant is
one more build). Built here, the libraries travel with the call (`carry`) and load at once.

What: for each tree (a checkout of this repository: `.` or a `git archive` copy) and each flag
variant, the library that `turboquant._backends.cuda._load` would build on a GPU of compute
capability --arch with those TURBOQUANT_CUDA_EXTRA_FLAGS, under the same name (architecture, a
hash of the tree's csrc_cuda/, a hash of the flags), compiled with the nvcc flags that torch's
cpp_extension uses (read from the device torch's own cpp_extension.py) against that torch's
headers, linked against its libraries. Output: OUT/torch-<torch version>/<name>.so, which
`turboquant._backends._jit.load` takes when TURBOQUANT_PREBUILT_DIR=OUT (benchmarks/device_env.sh
sets that where .prebuilt/ was carried). A tree whose sources change gets a new name: a stale
library is never loaded for other sources.

The device's torch (wheel and CUDA headers) is fetched once from the package index into
~/.cache/turboquant/prebuild/ (about 1.3 GB downloaded, 1 GB kept).

    python benchmarks/prebuild_cuda.py                      # this tree, no extra flags
    python benchmarks/prebuild_cuda.py --tree .ab --variant nd4:-DTQ_PREFILL_DEC_BUFFERS=4
    (then the device call: carry .prebuilt, and the build step finds every library built)

--check-load PYTHON: load each library, in its tree, with a Python that has the device's torch
(e.g. a venv with `pip install torch==2.11.0 numpy`, 4.7 GB; no GPU needed) and check that the
backend's three CUDA ops are registered, without compiling: a library that would not load on
the device fails here instead of costing a device call.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "turboquant" / "prebuild"
# the device machine's Python and platform (KINDS.md: Python 3.12, x86-64 Linux)
PIP_TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
              "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
              "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
TORCH_LIBS = ("libc10.so", "libc10_cuda.so", "libtorch_cpu.so", "libtorch_cuda.so", "libtorch.so")
CUDA_LIBRARY_HEADERS = ("cublas", "cusolver", "cusparse")  # what ATen/cuda/CUDAContext.h includes


def _download(spec: str, dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET,
                    "-d", str(dest), spec], check=True)
    name = re.split(r"[=\[<>]", spec)[0].replace("-", "_").lower()
    (wheel,) = [w for w in dest.glob("*.whl") if w.name.lower().startswith(name + "-")]
    return wheel


def _requires(wheel: Path) -> list:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]


def toolchain(torch_spec: str) -> Path:
    """The folder holding the device torch's include/ and lib/, the CUDA library headers
    (cuda_include/), torch's nvcc flags (nvcc_flags.json) and its version (version.txt)."""
    home = CACHE / torch_spec.replace("=", "")
    if (home / "version.txt").is_file():
        return home
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:  # on the cache's file system: moves are renames
        tmp = Path(tmp)
        part = home.with_name(home.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        wheel = _download(torch_spec, tmp)
        with zipfile.ZipFile(wheel) as z:
            for n in z.namelist():
                if n.startswith("torch/include/") or n in {f"torch/lib/{lib}" for lib in TORCH_LIBS}:
                    z.extract(n, tmp / "x")
            version_py = z.read("torch/version.py").decode()
            ext_py = z.read("torch/utils/cpp_extension.py").decode()
        shutil.move(str(tmp / "x" / "torch"), str(part))
        # torch's own COMMON_NVCC_FLAGS, read from the device torch's cpp_extension.py
        tree = ast.parse(ext_py)
        flags = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                     and any(getattr(t, "id", None) == "COMMON_NVCC_FLAGS" for t in node.targets))
        (part / "nvcc_flags.json").write_text(json.dumps(flags))
        # the CUDA toolkit pin in torch's requirements, then the pins of its library extras
        (toolkit,) = [r.split(";")[0].strip() for r in _requires(wheel) if r.startswith("cuda-toolkit")]
        version = re.search(r"==\s*([\w.]+)", toolkit).group(1)
        tk_wheel = _download(f"cuda-toolkit=={version}", tmp)
        for lib in CUDA_LIBRARY_HEADERS:
            (pin,) = {r.split(";")[0].strip() for r in _requires(tk_wheel)
                      if f"extra == '{lib}'" in r and r.startswith(f"nvidia-{lib}")}
            with zipfile.ZipFile(_download(pin.replace(" ", ""), tmp)) as z:
                for n in z.namelist():
                    if "/include/" in n and not n.endswith("/"):
                        target = part / "cuda_include" / n.split("/include/", 1)[1]
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(z.read(n))
        (part / "version.txt").write_text(re.search(r"__version__ = '([^']+)'", version_py).group(1))
        shutil.rmtree(home, ignore_errors=True)
        part.rename(home)
    return home


def spec(tree: Path, arch: str, flags: list) -> tuple:
    """(name, nvcc flags, csrc_cuda/ path, jit's own nvcc flags) from the tree's own package."""
    major, minor = arch.split(".")
    code = ("import json; from turboquant._backends import cuda, _jit; "
            f"n, f = cuda.build_spec({major}, {minor}, {flags!r}); "
            "print(json.dumps([n, f, str(cuda.CSRC), _jit.CUDA_CFLAGS]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, check=True, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(tree)))
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def cuda_toolkit() -> tuple:
    """(the CUDA toolkit's root, its libcudart) for nvcc's headers and the link: $CUDA_HOME, the
    folder above the nvcc on PATH, or /usr/local/cuda, whichever holds include/cuda_runtime.h."""
    nvcc = shutil.which("nvcc")
    for home in (os.environ.get("CUDA_HOME"), nvcc and Path(nvcc).resolve().parents[1], "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_runtime.h").is_file():
            libs = sorted(Path(home).glob("lib*/libcudart.so*")) + sorted(Path(home).glob("targets/*/lib/libcudart.so*"))
            if libs:
                return Path(home), libs[0]
    raise SystemExit("no CUDA toolkit with include/cuda_runtime.h and libcudart found (set CUDA_HOME)")


def build(tc: Path, out: Path, name: str, flags: list, csrc: str, jit_flags: list) -> str:
    lib, csrc = out / f"{name}.so", Path(csrc)
    if lib.is_file():
        return f"{name}: present"
    cuda_home, cudart = cuda_toolkit()
    with tempfile.TemporaryDirectory() as tmp:
        obj = Path(tmp) / "torch_binding.o"
        cmd = (["nvcc", f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                f"-I{csrc}", "-isystem", str(tc / "include"),
                "-isystem", str(tc / "include" / "torch" / "csrc" / "api" / "include"),
                "-isystem", str(tc / "cuda_include"), "-isystem", str(cuda_home / "include")]
               + json.loads((tc / "nvcc_flags.json").read_text())
               + ["--compiler-options", "-fPIC"] + jit_flags + flags
               + ["-c", str(csrc / "torch_binding.cu"), "-o", str(obj)])
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return f"{name}: nvcc failed\n{r.stderr[-4000:]}"
        link = ["c++", str(obj), "-shared", f"-L{tc / 'lib'}", "-lc10", "-lc10_cuda", "-ltorch_cpu",
                "-ltorch_cuda", "-ltorch", f"-L{cudart.parent}", f"-l:{cudart.name}", "-o", str(lib) + ".part"]
        r = subprocess.run(link, capture_output=True, text=True)
        if r.returncode != 0:
            return f"{name}: link failed\n{r.stderr[-4000:]}"
        os.replace(str(lib) + ".part", lib)
    return f"{name}: built ({lib.stat().st_size / 2**20:.1f} MiB)"


LOAD_CHECK = """
import sys, warnings
sys.path.insert(0, ".")
import torch
from torch.utils import cpp_extension
warnings.simplefilter("error")  # a prebuilt library that does not load warns, then compiles
cpp_extension.load = lambda **kw: sys.exit("not prebuilt: would compile " + kw["name"])
from turboquant._backends import _jit, cuda
name, flags = cuda.build_spec({major}, {minor}, {flags!r})
_jit.load(name, cuda.CSRC / "torch_binding.cu", flags)
ops = ("paged_attention_fp4_cuda", "reshape_and_cache_fp4_cuda", "merge_attention_states_cuda")
missing = [o for o in ops if not torch._C._dispatch_has_kernel_for_dispatch_key("turboquant::" + o, "CUDA")]
print(name, "loads, CUDA ops registered" if not missing else "loads, MISSING " + str(missing))
sys.exit(1 if missing else 0)
"""


def check_load(python: str, tree: Path, arch: str, flags: list, shelf: Path) -> bool:
    major, minor = arch.split(".")
    r = subprocess.run([python, "-c", LOAD_CHECK.format(major=major, minor=minor, flags=flags)], cwd=tree,
                       capture_output=True, text=True, env=dict(os.environ, TURBOQUANT_PREBUILT_DIR=str(shelf)))
    print(f"{tree}: " + (r.stdout.strip() or r.stderr.strip().splitlines()[-1]), flush=True)
    return r.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", help="a checkout to build (repeatable; default .)")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:FLAG,FLAG: also build each tree with these extra flags (repeatable)")
    ap.add_argument("--no-plain", action="store_true", help="only the variants, not the plain build")
    ap.add_argument("--arch", default="9.0", help="the device's compute capability (default 9.0)")
    ap.add_argument("--torch", default="torch==2.11.0", help="the device's torch (KINDS.md)")
    ap.add_argument("--out", default=str(REPO / ".prebuilt"))
    ap.add_argument("-j", type=int, default=os.cpu_count() or 1, help="parallel nvcc processes")
    ap.add_argument("--check-load", metavar="PYTHON", help="load each library with this Python (the device's torch)")
    args = ap.parse_args()
    tc = toolchain(args.torch)
    out = Path(args.out) / f"torch-{(tc / 'version.txt').read_text().strip()}"
    out.mkdir(parents=True, exist_ok=True)
    variants = ([] if args.no_plain else [[]]) + [v.split(":", 1)[1].split(",") for v in args.variant]
    trees = [(Path(t).resolve(), v) for t in (args.tree or ["."]) for v in variants]
    jobs = [spec(t, args.arch, v) for t, v in trees]
    with cf.ThreadPoolExecutor(args.j) as pool:
        for line in pool.map(lambda j: build(tc, out, *j), jobs):
            print(line, flush=True)
    if args.check_load and not all([check_load(args.check_load, t, args.arch, v, Path(args.out)) for t, v in trees]):
        raise SystemExit("a library did not load")


if __name__ == "__main__":
    main()
