"""The AITER patch script on the real AITER sources: the pinned amd-aiter wheel.

The wheel (amd-aiter 0.1.7.post2.dev18, pure Python + sources, ~40 MB) is not installed: it
is unpacked into a temporary directory, which has the installed layout (aiter/ and
aiter_meta/csrc/). Point TURBOQUANT_AITER_WHEEL_DIR at a directory holding the .whl, or put
it in <repo>/.whl/:

    pip download --no-deps amd-aiter==0.1.7.post2.dev18 -d .whl
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from _tools import CLANG_MISSING, find_clang
from turboquant.integration.aiter import patch

ROOT = Path(__file__).resolve().parents[1]
PINNED = "amd_aiter-0.1.7.post2.dev18-py3-none-any.whl"
PA = Path("aiter_meta/csrc/cpp_itfs/pa")


def _wheel() -> Path:
    for d in (os.environ.get("TURBOQUANT_AITER_WHEEL_DIR"), ROOT / ".whl"):
        if d and (Path(d) / PINNED).is_file():
            return Path(d) / PINNED
    pytest.skip(f"{PINNED} not found in $TURBOQUANT_AITER_WHEEL_DIR or {ROOT / '.whl'}: "
                "pip download --no-deps amd-aiter==0.1.7.post2.dev18 -d .whl")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    tree = tmp_path_factory.mktemp("aiter_wheel") / "site-packages"
    with zipfile.ZipFile(_wheel()) as z:
        z.extractall(tree)
    return tree


@pytest.fixture
def tree(pristine, tmp_path):
    """The files of the wheel the patch reads or writes (and their directories), copied."""
    dst = tmp_path / "site-packages"
    for rel in ("aiter/_version.py", "aiter/ops/attention.py", "aiter/ops/__init__.py"):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine / rel, dst / rel)
    shutil.copytree(pristine / "aiter_meta" / "csrc" / "cpp_itfs", dst / "aiter_meta" / "csrc" / "cpp_itfs")
    return dst


def snapshot(root: Path, content: bool = True) -> dict:
    """Every path under root -> (kind, mode, sha256 of the bytes); with content=False the
    size and modification time instead of the hash (cheap: for 'nothing was written')."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if p.is_symlink():
            out[str(p.relative_to(root))] = ("link", os.readlink(p))
        elif p.is_dir():
            out[str(p.relative_to(root))] = ("dir", st.st_mode)
        elif content:
            out[str(p.relative_to(root))] = ("file", st.st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
        else:
            out[str(p.relative_to(root))] = ("file", st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def cli(*args):
    """patch.main in this process (the command line costs a torch import per call)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = patch.main([str(a) for a in args])
    return rc, buf.getvalue()


def test_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "turboquant.integration.aiter.patch", "--aiter-root",
                        str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "no AITER found" in r.stderr


def test_round_trip_on_pinned_wheel(pristine):
    """The whole unpacked wheel (about 9,000 files): apply, check, re-apply, revert."""
    tree = pristine
    before = snapshot(tree)
    stat_before = snapshot(tree, content=False)
    rc, out = cli("--aiter-root", tree, "--check")
    assert rc == 1 and out.startswith("unpatched: AITER 0.1.7.post2.dev18 (installed wheel"), out

    rc, diff = cli("--aiter-root", tree, "--dry-run")
    assert rc == 0 and snapshot(tree, content=False) == stat_before
    assert f"+++ b/{PA}/pa_v1.py" in diff and '+    elif kv_cache_dtype in ("fp4", "fp4_e2m1")' in diff
    assert "+++ b/aiter/ops/attention.py" in diff and f"+++ b/{PA}/tq_fp4_paged_attention.cuh" in diff

    rc, out = cli("--aiter-root", tree)
    assert rc == 0 and out.startswith("patched AITER 0.1.7.post2.dev18"), out
    patched = snapshot(tree, content=False)
    added = sorted(set(patched) - set(stat_before))
    changed = sorted(k for k in stat_before if stat_before[k] != patched.get(k))
    print("added:", added, "\nchanged:", changed)
    assert added == sorted([f"{PA}/tq_fp4_platform.cuh", f"{PA}/tq_fp4_paged_attention.cuh",
                            f"{PA}/pa_fp4.cpp.jinja", f"{PA}/pa_fp4.py",
                            "aiter/ops/turboquant_fp4.py"])
    assert changed == sorted([f"{PA}/pa_v1.py", "aiter/ops/attention.py"])
    assert cli("--aiter-root", tree, "--check")[0] == 0

    rc, out = cli("--aiter-root", tree)
    assert rc == 0 and out.startswith("already patched"), out
    assert snapshot(tree, content=False) == patched

    rc, diff = cli("--aiter-root", tree, "--revert", "--dry-run")
    assert rc == 0 and snapshot(tree, content=False) == patched and f"--- a/{PA}/pa_v1.py" in diff

    rc, out = cli("--aiter-root", tree, "--revert")
    assert rc == 0, out
    assert snapshot(tree) == before  # every file byte for byte, modes included, nothing extra
    assert cli("--aiter-root", tree, "--check")[0] == 1


def test_missing_anchor_writes_nothing(tree):
    pa_v1 = tree / PA / "pa_v1.py"
    pa_v1.write_text(pa_v1.read_text().replace('kv_cache_dtype == "fp8" or ', 'kv_cache_dtype in ("fp8",) or '))
    before = snapshot(tree, content=False)
    rc, out = cli("--aiter-root", tree)
    assert rc == 2
    assert "AITER 0.1.7.post2.dev18" in out and "nothing was written" in out
    assert '\'elif kv_cache_dtype == "fp8" or kv_cache_dtype == "fp8_e4m3":\'' in out
    assert snapshot(tree, content=False) == before


def test_partial_patch_is_reported_and_reverted(tree):
    before = snapshot(tree)
    assert patch.apply(tree).startswith("patched")
    (tree / PA / "pa_fp4.py").unlink()
    rc, out = cli("--aiter-root", tree, "--check")
    assert rc == 3 and out.startswith("partial") and "absent" in out, out
    rc, out = cli("--aiter-root", tree)
    assert rc == 2 and "--revert" in out
    assert patch.revert(tree).startswith("reverted")
    assert snapshot(tree) == before


def test_git_checkout_layout(pristine, tmp_path):
    """The same sources arranged as a ROCm/aiter checkout (csrc/ at the root)."""
    root = tmp_path / "aiter-checkout"
    shutil.copytree(pristine / "aiter" / "ops", root / "aiter" / "ops")
    shutil.copytree(pristine / "aiter_meta" / "csrc" / "cpp_itfs", root / "csrc" / "cpp_itfs")
    before = snapshot(root)
    assert patch.status(root).layout.kind == "git checkout"
    assert patch.apply(root / "aiter").startswith("patched AITER unknown")  # package dir accepted
    assert (root / "csrc" / "cpp_itfs" / "pa" / "pa_fp4.py").is_file()
    assert patch.status(root).state == "patched"
    assert patch.revert(root).startswith("reverted")
    assert snapshot(root) == before


def test_unknown_tree_is_refused(tmp_path):
    rc, out = cli("--aiter-root", tmp_path)
    assert rc == 2 and "no AITER found" in out


def test_patched_python_routes_fp4_and_renders_both_specializations(tree, tmp_path):
    """Import the patched pa_v1 (CPU: no GPU calls are made), call it with
    kv_cache_dtype='fp4_e2m1', and catch AITER's own compile_template_op at the point where it
    would build: the rendered source, its compile key and the launch arguments."""
    patch.apply(tree)
    for f in (tree / PA / "pa_v1.py", tree / PA / "pa_fp4.py", tree / "aiter/ops/attention.py",
              tree / "aiter/ops/turboquant_fp4.py"):
        compile(f.read_text(), str(f), "exec")
    script = textwrap.dedent(f"""
        import json, sys, types
        import torch
        sys.path.insert(0, {str(tree / 'aiter_meta')!r})
        from csrc.cpp_itfs import utils
        captured = {{}}
        def compile_lib(src, folder, includes, sources, cxxflags):
            captured.update(src=src, folder=folder, includes=includes)
        def run_lib(func_name, folder=None):
            captured["func_name"] = func_name
            def launch(*args):
                captured.update(nargs=len(args), use_native=args[-2].value,
                                transforms=[args[i].value for i in range(-7, -2)])
            return launch
        utils.compile_lib, utils.run_lib = compile_lib, run_lib
        utils.not_built = lambda folder: True
        props = types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-", warp_size=64)
        torch.cuda.get_device_properties = lambda device: props
        torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
        from csrc.cpp_itfs.pa import pa_v1
        nb, hkv, bs, d, g = 4, 2, 16, 128, 4
        q = torch.zeros(3, hkv * g, d, dtype=torch.bfloat16)
        kc = torch.zeros(nb, hkv, bs, d // 2, dtype=torch.uint8)
        ks = torch.zeros(nb, bs, hkv, dtype=torch.uint8)
        bt = torch.zeros(3, 2, dtype=torch.int32)
        sl = torch.full((3,), 20, dtype=torch.int32)
        ws = torch.empty(1 << 20, dtype=torch.uint8)
        out = torch.empty_like(q)
        args = [out, ws, q, kc, kc.clone(), 0.1, bt, None, sl, 32, None, "fp4_e2m1", "HND", 0.0, ks, ks.clone()]
        pa_v1.paged_attention_v1(*args)
        try:
            args[12] = "NHD"
            pa_v1.paged_attention_v1(*args)
        except ValueError as e:
            captured["nhd_error"] = str(e)
        from csrc.cpp_itfs.pa import pa_fp4
        captured["plain_transforms"] = captured["transforms"]
        signs = torch.ones(d)
        state = torch.zeros(5, hkv, 5, d)
        ids = torch.tensor([4, 0, 2], dtype=torch.int32)
        pa_fp4.paged_attention_fp4_launch(out, ws, q, kc, kc.clone(), ks, ks.clone(), bt, sl, 32,
                                          0.1, 0.0, True, rotation_signs=signs, seq_state=state,
                                          state_ids=ids, sink=True)
        captured["pointers"] = [signs.data_ptr(), state.data_ptr(), ids.data_ptr()]
        try:
            pa_fp4.paged_attention_fp4_launch(out, ws, q, kc, kc.clone(), ks, ks.clone(), bt, sl,
                                              32, 0.1, 0.0, True, seq_state=state, sink=True)
        except ValueError as e:
            captured["ids_error"] = str(e)
        kw = (g, d, bs, "Bf16", "e2m1_e8m0")
        captured["expected_key"] = utils.get_default_func_name("pa_v1_fp4", kw + (pa_fp4.KERNEL_DIGEST,))
        captured["key_with_other_digest"] = utils.get_default_func_name("pa_v1_fp4", kw + ("0" * 16,))
        print(json.dumps(captured))
    """)
    env = dict(os.environ, AITER_ROOT_DIR=str(tmp_path / "aiter_root"), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["func_name"].startswith("pa_v1_fp4_")  # its own module name: never pa_v1's lib.so
    assert got["nargs"] == 26 and got["use_native"] == 1
    # pa_v1 passes no transform (null pointers, sink 0); turboquant's launcher passes them all
    assert got["plain_transforms"] == [None, None, None, 0, 0]
    assert got["transforms"] == got["pointers"] + [5, 1]
    assert "state_ids: expected a contiguous int32 [3]" in got["ids_error"]
    assert "kv_cache_layout: expected 'HND'" in got["nhd_error"]
    src = got["src"]
    assert "tq::tq_fp4_pa_partition_kernel<Scalar, head_size, block_size, gqa_ratio, NATIVE>" in src
    assert "TQ_LAUNCH_PARTITION(true)" in src and "TQ_LAUNCH_PARTITION(false)" in src
    # The compile key is AITER's md5 of the kwargs, which include the kernel digest.
    assert got["func_name"] == got["expected_key"] != got["key_with_other_digest"]

    # The rendered translation unit, with the injected headers, compiles for gfx950 (host
    # launch code and device code; csrc_hip/shims stands in for <hip/hip_runtime.h>).
    clang = find_clang()
    if clang is None:
        pytest.skip(CLANG_MISSING)
    tu = tmp_path / "pa_fp4_rendered.cpp"
    tu.write_text(src)
    flags = [clang, "-x", "hip", "--offload-arch=gfx950", "-nogpulib", "-nogpuinc", "-O3",
             "-std=c++20", f"-I{ROOT / 'csrc_hip' / 'shims'}", f"-I{tree / PA}"]
    subprocess.run(flags + ["--offload-host-only", "-c", "-o", str(tmp_path / "host.o"), str(tu)],
                   check=True)
    subprocess.run(flags + ["--offload-device-only", "-S", "-o", str(tmp_path / "dev.s"), str(tu)],
                   check=True)
    asm = (tmp_path / "dev.s").read_text()
    kernels = [ln for ln in asm.splitlines() if ln.startswith("_ZN2tq26tq_fp4_pa_partition_kernel")]
    assert len(kernels) == 2 and any("Lb1E" in k for k in kernels) and any("Lb0E" in k for k in kernels)
    assert asm.count("v_mfma_scale_f32_16x16x128_f8f6f4") == 32
