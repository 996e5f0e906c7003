"""Prebuilt extensions (benchmarks/prebuild_cuda.py): the loader takes a library built elsewhere
only under the name and torch version it would build itself, and the script names its builds as
the backend does."""
import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from turboquant._backends import _jit, cuda

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("prebuild_cuda", ROOT / "benchmarks" / "prebuild_cuda.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _shelf(tmp_path, monkeypatch, name: str, content: bytes) -> Path:
    """A prebuilt library ``name`` for this torch under tmp_path, TURBOQUANT_PREBUILT_DIR there;
    its path."""
    lib = tmp_path / f"torch-{torch.__version__}" / f"{name}.so"
    lib.parent.mkdir()
    lib.write_bytes(content)
    monkeypatch.setenv("TURBOQUANT_PREBUILT_DIR", str(tmp_path))
    return lib


def test_prebuilt_library_is_found_by_name_and_torch_version(tmp_path, monkeypatch):
    lib = tmp_path / "torch-2.11.0+cu130" / "turboquant_cuda_sm90a_0123456789ab.so"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    monkeypatch.delenv("TURBOQUANT_PREBUILT_DIR", raising=False)
    assert _jit.prebuilt(lib.stem, "2.11.0+cu130") is None  # only where the variable points
    monkeypatch.setenv("TURBOQUANT_PREBUILT_DIR", str(tmp_path))
    assert _jit.prebuilt(lib.stem, "2.11.0+cu130") == lib
    assert _jit.prebuilt(lib.stem, "2.12.0+cu130") is None  # another torch: built again
    assert _jit.prebuilt("turboquant_cuda_sm90a_ba9876543210", "2.11.0+cu130") is None  # other sources


def test_load_takes_the_prebuilt_library_instead_of_compiling(tmp_path, monkeypatch):
    name = "turboquant_cuda_sm90a_feedfacecafe"
    lib = _shelf(tmp_path, monkeypatch, name, b"")
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("compiled"))
    _jit.load(name, ROOT / "csrc_cuda" / "torch_binding.cu", [])
    assert loaded == [str(lib)]
    compiled = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: compiled.append(kw["name"]))
    _jit.load(name + "_0", ROOT / "csrc_cuda" / "torch_binding.cu", [])  # not prebuilt
    assert compiled == [name + "_0"] and loaded == [str(lib)]


def test_the_script_names_its_builds_as_the_backend_does():
    flags = ["-DTQ_PREFILL_DEC_BUFFERS=4"]
    name, nvcc_flags, csrc, jit_flags = _script().spec(ROOT, "9.0", flags)
    assert (name, nvcc_flags) == tuple(cuda.build_spec(9, 0, flags))
    assert name.startswith("turboquant_cuda_sm90a_") and name != cuda.build_spec(9, 0, [])[0]
    assert Path(csrc) == cuda.CSRC and jit_flags == _jit.CUDA_CFLAGS


def test_a_prebuilt_library_that_does_not_load_is_compiled_with_a_warning(tmp_path, monkeypatch):
    name = "turboquant_cuda_sm90a_badbadbadbad"
    _shelf(tmp_path, monkeypatch, name, b"not an ELF file")
    compiled = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: compiled.append(kw["name"]))
    with pytest.warns(UserWarning, match="did not load"):
        _jit.load(name, ROOT / "csrc_cuda" / "torch_binding.cu", [])
    assert compiled == [name]


def test_once_runs_each_key_once_and_keeps_the_reason():
    """The build-once guard every backend uses: a key's first answer is kept (a usable one, a
    reason, or a raised error turned into a reason naming the failure); keys are independent."""
    once, calls = _jit.Once("building the test extension failed"), []

    def build(result):
        def fn():
            calls.append(result)
            if isinstance(result, Exception):
                raise result
            return result
        return fn

    assert once("ok", build(None)) is None and once("ok", build("never")) is None
    assert once("no", build("no GPU")) == "no GPU" == once("no", build(None))
    why = once("bad", build(RuntimeError("nvcc failed\nline 2\nerror: x")))
    assert why == "building the test extension failed: RuntimeError: nvcc failed | line 2 | error: x"
    assert once("bad", build(None)) == why and calls[:2] == [None, "no GPU"] and len(calls) == 3
