"""The AITER patch script on real AITER sources: the pinned amd-aiter wheel and a snapshot of
the newest upstream ROCm/aiter.

The wheel (amd-aiter 0.1.7.post2.dev18, pure Python + sources, ~40 MB) is not installed: it
is unpacked into a temporary directory, which has the installed layout (aiter/ and
aiter_meta/csrc/). Point TURBOQUANT_AITER_WHEEL_DIR at a directory holding the .whl, or put
it in <repo>/.whl/:

    pip download --no-deps amd-aiter==0.1.7.post2.dev18 -d .whl

Upstream: TURBOQUANT_AITER_SRC names a ROCm/aiter checkout or its git directory (without it,
the newest git snapshot under /work/.mirror/ROCm+aiter*, where this workplace's fetch tool puts
them); its csrc/cpp_itfs/ and aiter/ are copied (from a git directory: `git archive HEAD`) into
a temporary directory, so the source is never written to. Without either, those tests skip.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from turboquant import hip_writer
from turboquant.integration.aiter import patch

ROOT = Path(__file__).resolve().parents[1]
PINNED = "amd_aiter-0.1.7.post2.dev18-py3-none-any.whl"
PA = Path("aiter_meta/csrc/cpp_itfs/pa")
UPSTREAM_ENV = "TURBOQUANT_AITER_SRC"
MIRRORS = Path("/work/.mirror")
# What the patch reads or writes, and what the patched pa_v1 route imports.
UPSTREAM_PATHS = ("csrc/cpp_itfs", "aiter")


def _wheel() -> Path:
    for d in (os.environ.get("TURBOQUANT_AITER_WHEEL_DIR"), ROOT / ".whl"):
        if d and (Path(d) / PINNED).is_file():
            return Path(d) / PINNED
    pytest.skip(f"{PINNED} not found in $TURBOQUANT_AITER_WHEEL_DIR or {ROOT / '.whl'}: "
                "pip download --no-deps amd-aiter==0.1.7.post2.dev18 -d .whl")


def unpack_wheel(dst: Path, prefixes: tuple[str, ...] = ()) -> Path:
    """The pinned wheel's files (those under `prefixes`, or all) in dst, the site-packages."""
    with zipfile.ZipFile(_wheel()) as z:
        z.extractall(dst, [n for n in z.namelist() if not prefixes or n.startswith(prefixes)])
    return dst


def _git(git_dir: Path, *args: str, text: bool = True):
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True,
                          check=True, text=text, timeout=120).stdout


def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def _upstream_source() -> Path:
    """A checkout (holding csrc/cpp_itfs/pa/pa_v1.py) or a git directory of ROCm/aiter."""
    named = os.environ.get(UPSTREAM_ENV)
    if named:
        path = Path(named)
        if (path / "csrc/cpp_itfs/pa/pa_v1.py").is_file() or _is_git_dir(path):
            return path
        pytest.fail(f"${UPSTREAM_ENV}={named}: neither a ROCm/aiter checkout "
                    "(csrc/cpp_itfs/pa/pa_v1.py) nor a git directory")
    candidates = [d for d in [*MIRRORS.glob("ROCm+aiter*"), *MIRRORS.glob("ROCm+aiter*/repo")]
                  if _is_git_dir(d)]
    if not candidates:
        pytest.skip(f"no snapshot of upstream ROCm/aiter: set ${UPSTREAM_ENV} to a checkout or "
                    f"its git directory (none under {MIRRORS}/ROCm+aiter*)")
    if shutil.which("git") is None:
        pytest.skip(f"git is needed to read the snapshot of ROCm/aiter in {candidates[0]}")
    return max(candidates, key=lambda d: int(_git(d, "log", "-1", "--format=%ct", "HEAD")))


def copy_upstream(dst: Path) -> tuple[Path, str]:
    """Upstream's csrc/cpp_itfs/ and aiter/ in dst, arranged as a checkout; and which upstream
    it is, in words (commit and date where known)."""
    src = _upstream_source()
    dst.mkdir(parents=True, exist_ok=True)
    if _is_git_dir(src):
        commit = _git(src, "rev-parse", "HEAD").strip()
        date = _git(src, "log", "-1", "--format=%cs", commit).strip()
        archive = _git(src, "archive", "--format=tar", commit, *UPSTREAM_PATHS, text=False)
        with tarfile.open(fileobj=io.BytesIO(archive)) as t:
            t.extractall(dst, filter="data")
        return dst, f"ROCm/aiter {commit} ({date}, git snapshot {src})"
    for rel in UPSTREAM_PATHS:
        shutil.copytree(src / rel, dst / rel, ignore=shutil.ignore_patterns("__pycache__"))
    return dst, f"ROCm/aiter checkout {src}"


@dataclass(frozen=True)
class Tree:
    """An unpatched AITER tree in a temporary directory."""

    root: Path
    pa: Path  # csrc/cpp_itfs/pa relative to root
    label: str  # which AITER, in words
    version: str  # what the patch script prints for it


TREES = ("pinned wheel", "upstream")


def make_tree(which: str, dst: Path, full: bool = False) -> Tree:
    """The pinned wheel (all of it with full=True, else what the patch and the pa_v1 route
    touch) or the upstream snapshot, unpacked under dst."""
    if which == "pinned wheel":
        prefixes = () if full else ("aiter/", "aiter_meta/csrc/cpp_itfs/")
        root = unpack_wheel(dst / "site-packages", prefixes)
        return Tree(root, PA, PINNED, "0.1.7.post2.dev18")
    root, label = copy_upstream(dst / "aiter-checkout")
    print(f"upstream tree: {label}")
    return Tree(root, Path("csrc/cpp_itfs/pa"), label, "unknown (no aiter/_version.py)")


@pytest.fixture(scope="module", params=TREES)
def pristine(request, tmp_path_factory):
    """Each AITER unpacked once per module: not to be changed by a test."""
    return make_tree(request.param, tmp_path_factory.mktemp("aiter"), full=True)


@pytest.fixture
def tree(pristine, tmp_path):
    """A copy of the pristine tree's files that the patch reads or writes."""
    dst = tmp_path / pristine.root.name
    for rel in ("aiter/_version.py", "aiter/ops/attention.py", "aiter/ops/__init__.py"):
        if (pristine.root / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(pristine.root / rel, dst / rel)
    shutil.copytree(pristine.root / pristine.pa, dst / pristine.pa)
    return Tree(dst, pristine.pa, pristine.label, pristine.version)


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


def test_round_trip(pristine):
    """The whole tree (the wheel: about 9,000 files): apply, check, re-apply, revert."""
    tree, pa = pristine.root, pristine.pa
    before = snapshot(tree)
    stat_before = snapshot(tree, content=False)
    rc, out = cli("--aiter-root", tree, "--check")
    assert rc == 1 and out.startswith(f"unpatched: AITER {pristine.version} ("), out

    rc, diff = cli("--aiter-root", tree, "--dry-run")
    assert rc == 0 and snapshot(tree, content=False) == stat_before
    assert f"+++ b/{pa}/pa_v1.py" in diff and '+    elif kv_cache_dtype in ("fp4", "fp4_e2m1")' in diff
    assert "+++ b/aiter/ops/attention.py" in diff and f"+++ b/{pa}/tq_fp4_paged_attention.cuh" in diff
    assert f"+++ b/{pa}/tq_cache_writer_hip.cuh" in diff and f"+++ b/{pa}/cache_fp4.py" in diff

    rc, out = cli("--aiter-root", tree)
    assert rc == 0 and out.startswith(f"patched AITER {pristine.version}"), out
    patched = snapshot(tree, content=False)
    added = sorted(set(patched) - set(stat_before))
    changed = sorted(k for k in stat_before if stat_before[k] != patched.get(k))
    print("added:", added, "\nchanged:", changed)
    assert added == sorted([f"{pa}/tq_fp4_platform.cuh", f"{pa}/tq_fp4_common.cuh",
                            f"{pa}/tq_fp4_paged_attention.cuh",
                            f"{pa}/tq_fp4_gfx950_attention.cuh", f"{pa}/pa_fp4.cpp.jinja",
                            f"{pa}/pa_fp4.py", f"{pa}/pa_fp4_plan.py",
                            "aiter/ops/turboquant_fp4.py", *WRITER_FILES(pa)])
    assert changed == sorted([f"{pa}/pa_v1.py", "aiter/ops/attention.py"])
    # The fp4 branch sits right before the fp8 one, the import right after pa_v1's.
    pa_v1 = (tree / pa / "pa_v1.py").read_text()
    assert ('        )  # turboquant-fp4\n    elif kv_cache_dtype == "fp8" or kv_cache_dtype == '
            '"fp8_e4m3":\n') in pa_v1
    assert ("from csrc.cpp_itfs.pa.pa_v1 import paged_attention_v1 as paged_attention_v1_core\n"
            "from .turboquant_fp4 import paged_attention_fp4, paged_attention_fp4_out  "
            "# turboquant-fp4\n"
            "from .turboquant_fp4_cache import reshape_and_cache_fp4, reshape_and_cache_fp4_out  "
            "# turboquant-fp4\n") in (tree / "aiter/ops/attention.py").read_text()
    # the writer's sources as hip_writer hipifies them, includes renamed to the shipped names
    for name, data in hip_writer.aiter_sources().items():
        assert (tree / pa / name).read_bytes() == data
    writer = (tree / pa / "tq_cache_writer_hip.cuh").read_text()
    assert writer.startswith("// turboquant-fp4: csrc_cuda/cache_writer.cuh of turboquant")
    assert '#include "tq_fp4_portable_hip.cuh"' in writer and '#include "tq_tuning.cuh"' in writer
    assert '#include "tuning.cuh"' not in writer and "hipLaunchKernelGGL" in writer
    assert cli("--aiter-root", tree, "--check")[0] == 0

    rc, out = cli("--aiter-root", tree)
    assert rc == 0 and out.startswith("already patched"), out
    assert snapshot(tree, content=False) == patched

    rc, diff = cli("--aiter-root", tree, "--revert", "--dry-run")
    assert rc == 0 and snapshot(tree, content=False) == patched and f"--- a/{pa}/pa_v1.py" in diff

    rc, out = cli("--aiter-root", tree, "--revert")
    assert rc == 0, out
    assert snapshot(tree) == before  # every file byte for byte, modes included, nothing extra
    assert cli("--aiter-root", tree, "--check")[0] == 1


def WRITER_FILES(pa):
    """What the patch adds for the cache writer (aiter.reshape_and_cache_fp4)."""
    return [f"{pa}/tq_cache_writer_hip.cuh", f"{pa}/tq_fp4_portable_hip.cuh", f"{pa}/tq_limits.cuh",
            f"{pa}/tq_tuning.cuh", f"{pa}/cache_fp4.cpp.jinja", f"{pa}/cache_fp4.py", "aiter/ops/turboquant_fp4_cache.py"]


def test_earlier_patch_is_reported_and_reverted(tree):
    """An AITER patched by a turboquant before the cache writer op (attention.py importing
    paged_attention_fp4 alone, no writer files): --check says partial and names the old hook,
    apply refuses, --revert restores every byte."""
    before = snapshot(tree.root)
    assert patch.apply(tree.root).startswith("patched")
    attention = tree.root / "aiter/ops/attention.py"
    _edit(attention, "from .turboquant_fp4_cache import reshape_and_cache_fp4, "
          "reshape_and_cache_fp4_out  # turboquant-fp4\n", "")
    for rel in WRITER_FILES(tree.pa):
        (tree.root / rel).unlink()
    rc, out = cli("--aiter-root", tree.root, "--check")
    assert rc == 3 and out.startswith("partial"), out
    assert "OLD HOOK   aiter/ops/attention.py" in out and f"absent     {tree.pa}/cache_fp4.py" in out
    rc, out = cli("--aiter-root", tree.root)
    assert rc == 2 and "--revert" in out, out
    rc, out = cli("--aiter-root", tree.root, "--revert")
    assert rc == 0 and out.startswith("reverted"), out
    assert snapshot(tree.root) == before


def test_pa_v1_branch_passes_the_checked_names():
    """The inserted branch tests the names patch.FP4_KV_CACHE_DTYPES and passes exactly
    patch.PA_V1_ARGS (the parameters it checks paged_attention_v1 has), in that order."""
    branch = ast.parse("if kv_cache_dtype == 'auto':\n    pass\n" + patch._render_pa_v1(""))
    fp4 = branch.body[0].orelse[0]
    assert tuple(c.value for c in fp4.test.comparators[0].elts) == patch.FP4_KV_CACHE_DTYPES
    call = fp4.body[1].value
    assert call.func.id == "paged_attention_v1_fp4"
    assert tuple(a.id for a in call.args) == patch.PA_V1_ARGS and not call.keywords


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) == count, f"{path}: {old!r} is not in this AITER {count} times"
    path.write_text(text.replace(old, new))


PA_V1_CHAIN_START = '    if kv_cache_dtype == "auto":\n'
PA_V1_CHAIN_END = '        raise ValueError(f"Unsupported kv_cache_dtype: {kv_cache_dtype}")\n'
PA_V1_IMPORT = "from csrc.cpp_itfs.pa.pa_v1 import paged_attention_v1 as paged_attention_v1_core\n"
TORCH_UTILS_IMPORT = "from csrc.cpp_itfs.torch_utils import direct_register_custom_op\n"


def test_moved_anchors_are_found_by_structure(tree):
    """Upstream reformatting: the chain nested one level deeper with a multi-line fp8 test, the
    pa_v1 import split over lines and moved below another import. Apply finds both places,
    --check says patched, a second apply is a no-op, --revert restores every byte."""
    pa_v1, attention = tree.root / tree.pa / "pa_v1.py", tree.root / "aiter/ops/attention.py"
    text = pa_v1.read_text()
    i, j = text.index(PA_V1_CHAIN_START), text.index(PA_V1_CHAIN_END) + len(PA_V1_CHAIN_END)
    chain = text[i:j].replace('elif kv_cache_dtype == "fp8" or kv_cache_dtype == "fp8_e4m3":',
                              'elif kv_cache_dtype in (\n        "fp8",\n        "fp8_e4m3",\n    ):')
    nested = "".join("    " + line if line.strip() else line for line in chain.splitlines(True))
    pa_v1.write_text(text[:i] + "    if query is not None:\n" + nested + text[j:])
    _edit(attention, PA_V1_IMPORT, "")
    _edit(attention, TORCH_UTILS_IMPORT, TORCH_UTILS_IMPORT + "from csrc.cpp_itfs.pa.pa_v1 import (\n"
          "    paged_attention_v1 as paged_attention_v1_core,\n)\n")
    before = snapshot(tree.root)

    rc, out = cli("--aiter-root", tree.root)
    assert rc == 0 and out.startswith("patched"), out
    assert ('            )  # turboquant-fp4\n        elif kv_cache_dtype in (\n            "fp8",\n'
            in pa_v1.read_text())
    assert ("    paged_attention_v1 as paged_attention_v1_core,\n)\nfrom .turboquant_fp4 import "
            in attention.read_text())
    rc, out = cli("--aiter-root", tree.root, "--check")
    assert rc == 0 and "hooked     aiter/ops/attention.py" in out, out
    patched = snapshot(tree.root)
    assert cli("--aiter-root", tree.root)[1].startswith("already patched")
    assert snapshot(tree.root) == patched
    assert cli("--aiter-root", tree.root, "--revert")[0] == 0
    assert snapshot(tree.root) == before


MISSING = {
    "function renamed": ("pa_v1.py", "def paged_attention_v1(", "def paged_attention_v1_impl(",
                         "pa_v1.py: " + patch.PA_V1_ANCHOR + ": no top-level def paged_attention_v1"),
    "parameter renamed": ("pa_v1.py", "    sliding_window: int = 0,\n", "    window: int = 0,\n",
                          "paged_attention_v1 has no parameter sliding_window (the fp4 branch passes these names"),
    # the three tests of the chain ("auto", "fp8", "fp8_e4m3") on another variable
    "no chain": ("pa_v1.py", "kv_cache_dtype == ", "dtype_name == ",
                 "paged_attention_v1 has no 'if kv_cache_dtype ...' statement"),
    "own fp4 branch": ("pa_v1.py", 'kv_cache_dtype == "fp8_e4m3"', 'kv_cache_dtype == "fp4_e2m1"',
                     "already handles 'fp4_e2m1': this AITER has an FP4 branch of its own"),
    "import gone": ("attention.py", PA_V1_IMPORT, "",
                    "aiter/ops/attention.py: " + patch.ATTENTION_ANCHOR + ": not found"),
}


@pytest.mark.parametrize("case", MISSING)
def test_missing_anchor_is_named_and_nothing_written(tree, case):
    name, old, new, message = MISSING[case]
    path = tree.root / (tree.pa / name if name == "pa_v1.py" else "aiter/ops/attention.py")
    _edit(path, old, new, 3 if case == "no chain" else 1)
    before = snapshot(tree.root, content=False)
    rc, out = cli("--aiter-root", tree.root)
    assert rc == 2 and f"AITER {tree.version}" in out and "nothing was written" in out, out
    assert message in out, out
    assert snapshot(tree.root, content=False) == before
    rc, out = cli("--aiter-root", tree.root, "--check")
    assert rc == 1 and "NO ANCHOR" in out and message.split(": ")[-1] in out, out


def test_partial_patch_is_reported_and_reverted(tree):
    before = snapshot(tree.root)
    assert patch.apply(tree.root).startswith("patched")
    (tree.root / tree.pa / "pa_fp4.py").unlink()
    rc, out = cli("--aiter-root", tree.root, "--check")
    assert rc == 3 and out.startswith("partial") and "absent" in out, out
    rc, out = cli("--aiter-root", tree.root)
    assert rc == 2 and "--revert" in out
    assert patch.revert(tree.root).startswith("reverted")
    assert snapshot(tree.root) == before


def test_edited_hook_is_not_reverted(tree):
    """A hand-edited inserted line: --check says MODIFIED, --revert refuses and writes nothing."""
    assert patch.apply(tree.root).startswith("patched")
    pa_v1 = tree.root / tree.pa / "pa_v1.py"
    _edit(pa_v1, "            sliding_window,\n", "            sliding_window or 0,\n")
    rc, out = cli("--aiter-root", tree.root, "--check")
    assert rc == 3 and f"MODIFIED   {tree.pa}/pa_v1.py" in out, out
    before = snapshot(tree.root, content=False)
    rc, out = cli("--aiter-root", tree.root, "--revert")
    assert rc == 2 and "turboquant lines were edited" in out, out
    assert snapshot(tree.root, content=False) == before


def test_git_checkout_layout(tmp_path):
    """The wheel's sources arranged as a ROCm/aiter checkout (csrc/ at the root)."""
    site = unpack_wheel(tmp_path / "site-packages", ("aiter/ops/", "aiter_meta/csrc/cpp_itfs/"))
    root = tmp_path / "aiter-checkout"
    shutil.copytree(site / "aiter" / "ops", root / "aiter" / "ops")
    shutil.copytree(site / "aiter_meta" / "csrc" / "cpp_itfs", root / "csrc" / "cpp_itfs")
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
