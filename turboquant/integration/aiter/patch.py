"""Inject turboquant's FP4 paged attention into an AITER source tree.

    python -m turboquant.integration.aiter.patch --aiter-root PATH [--check] [--dry-run] [--revert]

PATH is either a git checkout of ROCm/aiter (``csrc/`` and ``aiter/`` at its root) or the
site-packages directory of an installed amd-aiter wheel (``aiter_meta/csrc/`` and ``aiter/``).

What it does:

- adds new files: the kernel headers (``csrc_hip/*.cuh``: the platform header, the shared
  ``tq_fp4_common.cuh``, gfx942's kernel ``tq_fp4_paged_attention.cuh`` and gfx950's
  ``tq_fp4_gfx950_attention.cuh``), ``pa_fp4.cpp.jinja`` (on gfx950 both specializations of the
  kernel, native FP4 and LUT, one picked at launch),
  ``pa_fp4.py`` (the launcher, compiled under its own module name ``pa_v1_fp4`` with a digest of
  the kernel sources in the compile key) and ``pa_fp4_plan.py`` (its launch plan: partition
  length, grid, workspace layout) in ``csrc/cpp_itfs/pa/``, and ``aiter/ops/turboquant_fp4.py``
  (``aiter.paged_attention_fp4``); for the cache writer, the CUDA writer hipified by
  ``turboquant.hip_writer`` (``tq_cache_writer_hip.cuh``, ``tq_fp4_portable_hip.cuh``,
  ``tq_limits.cuh``, ``tq_tuning.cuh``), ``cache_fp4.cpp.jinja`` and ``cache_fp4.py`` (its
  launcher, module name ``reshape_and_cache_fp4``) in ``csrc/cpp_itfs/pa/``, and
  ``aiter/ops/turboquant_fp4_cache.py`` (``aiter.reshape_and_cache_fp4``);
- inserts lines at two places found from the structure of the Python code (its syntax tree,
  never a line number or an exact line, so reformatted or moved code is still found): pa_v1's
  ``kv_cache_dtype`` if/elif chain gains an ``fp4``/``fp4_e2m1`` branch before its first elif
  (k_scale/v_scale are then the E8M0 scale tensors), and ``aiter/ops/attention.py`` imports
  the new ops right after its ``from csrc.cpp_itfs.pa.pa_v1 import ...`` statement (AITER's
  ``__init__`` star-imports that module: ``aiter.paged_attention_fp4``,
  ``aiter.reshape_and_cache_fp4``).

Every place is found before anything is written (an error names the one that is missing); a
second apply changes nothing;
``--revert`` removes exactly what apply added, so the tree is byte-for-byte as before (also
the lines of an earlier turboquant's patch, which --check reports as an old hook).
Exit status: 0 done (or, with --check, patched), 1 unpatched (--check), 3 partial (--check),
2 error.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ...sources import source_dir

MARK = "turboquant-fp4"
HERE = Path(__file__).resolve().parent
FILES = HERE / "files"
LUT_ENV = "AITER_FP4_KV_LUT"


class PatchError(Exception):
    pass


def kernel_source_dir() -> Path:
    """The HIP kernel sources of this turboquant (``turboquant.sources``: the wheel's copy, or
    the checkout's csrc_hip/)."""
    candidate = source_dir("hip")
    if (candidate / "tq_fp4_paged_attention.cuh").is_file():
        return candidate
    raise PatchError(f"turboquant's kernel headers (tq_fp4_paged_attention.cuh) were not found in "
                     f"{candidate}: reinstall turboquant, or use a source checkout")


@dataclass(frozen=True)
class Layout:
    root: Path
    meta: Path  # the directory that holds csrc/
    kind: str  # "git checkout" or "installed wheel"

    @property
    def pa_dir(self) -> Path:
        return self.meta / "csrc" / "cpp_itfs" / "pa"

    @property
    def ops_dir(self) -> Path:
        return self.root / "aiter" / "ops"


def find_layout(root: Path) -> Layout:
    root = Path(root).resolve()
    if root.name == "aiter" and (root / "ops" / "attention.py").is_file():
        root = root.parent  # the package directory itself was given
    if (root / "aiter_meta" / "csrc" / "cpp_itfs" / "pa" / "pa_v1.py").is_file():
        return Layout(root, root / "aiter_meta", "installed wheel")
    if (root / "csrc" / "cpp_itfs" / "pa" / "pa_v1.py").is_file():
        return Layout(root, root, "git checkout")
    raise PatchError(f"--aiter-root {root}: no AITER found (expected csrc/cpp_itfs/pa/pa_v1.py "
                     "for a git checkout, or aiter_meta/csrc/cpp_itfs/pa/pa_v1.py for an "
                     "installed amd-aiter)")


def aiter_version(layout: Layout) -> str:
    version_file = layout.root / "aiter" / "_version.py"
    if version_file.is_file():
        m = re.search(r"""version__\s*=\s*['"]([^'"]+)""", version_file.read_text())
        if m:
            return m.group(1)
    if (layout.root / ".git").exists():
        try:
            described = subprocess.run(["git", "-C", str(layout.root), "describe", "--always",
                                        "--tags", "--dirty"], capture_output=True, text=True,
                                       timeout=30)
            if described.returncode == 0 and described.stdout.strip():
                return f"git {described.stdout.strip()}"
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown (no aiter/_version.py)"


class AnchorNotFound(Exception):
    """The place a hook goes was not found; the message says what is missing."""


def _parse(text: str) -> ast.Module:
    try:
        return ast.parse(text)
    except SyntaxError as e:
        raise AnchorNotFound(f"the file does not parse as Python ({e.msg}, line {e.lineno})") from None


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip(" \t"))]


@dataclass(frozen=True)
class Hook:
    """Lines inserted into `path` before the line that `locate` finds from the file's structure
    (never from a line number): `render(indent)` is the inserted text; its first line holds the
    mark, and finding that line again (with its indentation) is how status and revert find it."""

    path: Path
    anchor: str  # the place, in words, for messages
    locate: Callable[[str], tuple[int, str]]  # text -> (0-based line index, indentation)
    render: Callable[[str], str]
    # what earlier turboquants inserted here (found by status and removed by revert)
    legacy: tuple[Callable[[str], str], ...] = ()

    def inserted(self, text: str, render: Optional[Callable[[str], str]] = None) -> Optional[str]:
        """The inserted text (of `render`, default this hook's), if it is in `text` exactly once
        and unedited."""
        render = render or self.render
        first = render("").splitlines()[0]
        for line in text.splitlines():
            if line.lstrip(" \t") == first:
                block = render(_indent(line))
                if text.count(block) == 1:
                    return block
        return None

    def inserted_legacy(self, text: str) -> Optional[str]:
        """The text an earlier turboquant inserted here, if it is in `text` as it was inserted."""
        return next((b for b in (self.inserted(text, r) for r in self.legacy) if b is not None),
                    None)

    def insert(self, text: str) -> str:
        index, indent = self.locate(text)
        lines = text.splitlines(keepends=True)
        if index == len(lines) and not text.endswith("\n"):
            raise AnchorNotFound("the file ends without a newline right at the place")
        patched = "".join(lines[:index]) + self.render(indent) + "".join(lines[index:])
        try:
            ast.parse(patched)
        except SyntaxError as e:
            raise AnchorNotFound(f"the inserted lines would not parse there ({e.msg}, line "
                                 f"{e.lineno})") from None
        return patched


# The names paged_attention_v1's fp4 branch passes on, in paged_attention_v1_fp4's order; each
# must be a parameter of AITER's paged_attention_v1.
PA_V1_ARGS = ("out", "workspace_buffer", "query", "key_cache", "value_cache", "scale",
              "block_tables", "cu_query_lens", "context_lens", "max_context_len", "alibi_slopes",
              "kv_cache_layout", "logits_soft_cap", "k_scale", "v_scale", "fp8_out_scale",
              "partition_size", "mtp", "q_scale", "sliding_window")
FP4_KV_CACHE_DTYPES = ("fp4", "fp4_e2m1")
PA_V1_ANCHOR = "the first elif of the kv_cache_dtype if/elif chain in def paged_attention_v1"
ATTENTION_ANCHOR = "the top-level 'from csrc.cpp_itfs.pa.pa_v1 import ...' statement"


def _render_pa_v1(indent: str) -> str:
    body = indent + "    "
    return (
        f'{indent}elif kv_cache_dtype in ("fp4", "fp4_e2m1"):  # turboquant-fp4: E2M1 codes, E8M0 k/v_scale\n'
        f"{body}from csrc.cpp_itfs.pa.pa_fp4 import paged_attention_v1_fp4  # turboquant-fp4\n"
        "\n"
        f"{body}return paged_attention_v1_fp4(  # turboquant-fp4\n"
        f"{body}    out, workspace_buffer, query, key_cache, value_cache, scale, block_tables,\n"
        f"{body}    cu_query_lens, context_lens, max_context_len, alibi_slopes, kv_cache_layout,\n"
        f"{body}    logits_soft_cap, k_scale, v_scale, fp8_out_scale, partition_size, mtp, q_scale,\n"
        f"{body}    sliding_window,\n"
        f"{body})  # turboquant-fp4\n"
    )


def _render_attention(indent: str) -> str:
    return (f"{indent}from .turboquant_fp4 import paged_attention_fp4, paged_attention_fp4_out  # turboquant-fp4\n"
            f"{indent}from .turboquant_fp4_cache import reshape_and_cache_fp4, reshape_and_cache_fp4_out  # turboquant-fp4\n")


def _render_attention_before_writer(indent: str) -> str:
    """The import line of turboquants before the cache writer op (attention only)."""
    return f"{indent}from .turboquant_fp4 import paged_attention_fp4, paged_attention_fp4_out  # turboquant-fp4\n"


def _locate_pa_v1(text: str) -> tuple[int, str]:
    """Before the second branch of paged_attention_v1's `if kv_cache_dtype ...: / elif ...` chain
    (the fp8 branch in every AITER so far), at that elif's indentation."""
    func = next((node for node in _parse(text).body if isinstance(node, ast.FunctionDef)
                 and node.name == "paged_attention_v1"), None)
    if func is None:
        raise AnchorNotFound("no top-level def paged_attention_v1")
    params = {a.arg for a in func.args.posonlyargs + func.args.args + func.args.kwonlyargs}
    missing = [name for name in PA_V1_ARGS if name not in params]
    if missing:
        raise AnchorNotFound(f"paged_attention_v1 has no parameter {', '.join(missing)} (the fp4 "
                             "branch passes these names on to turboquant's launcher)")
    chain = next((node for node in ast.walk(func) if isinstance(node, ast.If) and any(
        isinstance(n, ast.Name) and n.id == "kv_cache_dtype" for n in ast.walk(node.test))), None)
    if chain is None:
        raise AnchorNotFound("paged_attention_v1 has no 'if kv_cache_dtype ...' statement")
    branches = [chain]
    while (len(branches[-1].orelse) == 1 and isinstance(branches[-1].orelse[0], ast.If)
           and branches[-1].orelse[0].col_offset == chain.col_offset):
        branches.append(branches[-1].orelse[0])
    handled = [n.value for b in branches for n in ast.walk(b.test)
               if isinstance(n, ast.Constant) and n.value in FP4_KV_CACHE_DTYPES]
    if handled:
        raise AnchorNotFound(f"the kv_cache_dtype chain (line {chain.lineno}) already handles "
                             f"{handled[0]!r}: this AITER has an FP4 branch of its own")
    if len(branches) < 2:
        raise AnchorNotFound(f"the kv_cache_dtype chain (line {chain.lineno}) has no elif")
    line = text.splitlines()[branches[1].lineno - 1]
    return branches[1].lineno - 1, _indent(line)


def _locate_attention(text: str) -> tuple[int, str]:
    """After the statement that imports pa_v1 (one line or several), at the top level."""
    node = next((node for node in _parse(text).body if isinstance(node, ast.ImportFrom)
                 and node.level == 0 and node.module == "csrc.cpp_itfs.pa.pa_v1"), None)
    if node is None:
        raise AnchorNotFound("not found")
    return node.end_lineno, ""


def hooks(layout: Layout) -> list[Hook]:
    return [
        Hook(layout.pa_dir / "pa_v1.py", PA_V1_ANCHOR, _locate_pa_v1, _render_pa_v1),
        Hook(layout.ops_dir / "attention.py", ATTENTION_ANCHOR, _locate_attention,
             _render_attention, legacy=(_render_attention_before_writer,)),
    ]


def writer_sources() -> dict[str, bytes]:
    """The hipified cache writer as the patch ships it (turboquant.hip_writer.aiter_sources)."""
    from ... import hip_writer

    missing = [n for n in hip_writer.WRITER_SOURCES if not (hip_writer.CSRC_CUDA / n).is_file()]
    if missing:
        raise PatchError(f"turboquant's CUDA cache writer ({', '.join(missing)} in "
                         f"{hip_writer.CSRC_CUDA}) was not found; use a source checkout of "
                         "turboquant")
    try:
        return hip_writer.aiter_sources()
    except Exception as e:  # noqa: BLE001 - hipify-torch's failures are reasons, not crashes
        raise PatchError(f"hipifying turboquant's cache writer failed: {type(e).__name__}: "
                         f"{e}") from None


def new_files(layout: Layout) -> dict[Path, bytes]:
    src = kernel_source_dir()
    files = {
        layout.pa_dir / "tq_fp4_platform.cuh": (src / "tq_fp4_platform.cuh").read_bytes(),
        layout.pa_dir / "tq_fp4_common.cuh": (src / "tq_fp4_common.cuh").read_bytes(),
        layout.pa_dir / "tq_fp4_paged_attention.cuh": (src / "tq_fp4_paged_attention.cuh").read_bytes(),
        layout.pa_dir / "tq_fp4_gfx950_attention.cuh": (src / "tq_fp4_gfx950_attention.cuh").read_bytes(),
        layout.pa_dir / "pa_fp4.cpp.jinja": (FILES / "pa_fp4.cpp.jinja").read_bytes(),
        layout.pa_dir / "pa_fp4.py": (FILES / "pa_fp4.py").read_bytes(),
        layout.pa_dir / "pa_fp4_plan.py": (FILES / "pa_fp4_plan.py").read_bytes(),
        layout.ops_dir / "turboquant_fp4.py": (FILES / "turboquant_fp4.py").read_bytes(),
    }
    files.update({layout.pa_dir / name: data for name, data in writer_sources().items()})
    files.update({
        layout.pa_dir / "cache_fp4.cpp.jinja": (FILES / "cache_fp4.cpp.jinja").read_bytes(),
        layout.pa_dir / "cache_fp4.py": (FILES / "cache_fp4.py").read_bytes(),
        layout.ops_dir / "turboquant_fp4_cache.py": (FILES / "turboquant_fp4_cache.py").read_bytes(),
    })
    return files


def _is_ours(data: bytes) -> bool:
    return b"turboquant" in data[:400]


@dataclass
class Status:
    state: str  # "patched", "unpatched" or "partial"
    details: list[str]
    version: str
    layout: Layout


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise PatchError(f"{path}: file not found") from None


def status(root) -> Status:
    layout = find_layout(Path(root))
    version = aiter_version(layout)
    done, todo, details = 0, 0, []
    for hook in hooks(layout):
        text = _read(hook.path)
        rel = hook.path.relative_to(layout.root)
        if hook.inserted(text) is not None:
            done += 1
            details.append(f"hooked     {rel}")
        elif hook.inserted_legacy(text) is not None:
            todo += 1
            details.append(f"OLD HOOK   {rel} (an earlier turboquant's lines; --revert removes "
                           "them)")
        elif MARK in text:
            todo += 1
            details.append(f"MODIFIED   {rel} (holds '{MARK}' lines that are not this patch's)")
        else:
            todo += 1
            try:
                hook.locate(text)
                details.append(f"unhooked   {rel}")
            except AnchorNotFound as e:
                details.append(f"NO ANCHOR  {rel}: {hook.anchor}: {e}")
    for path, data in new_files(layout).items():
        rel = path.relative_to(layout.root)
        if not path.exists():
            todo += 1
            details.append(f"absent     {rel}")
        elif path.read_bytes() == data:
            done += 1
            details.append(f"present    {rel}")
        else:
            todo += 1
            details.append(f"OUTDATED   {rel} (differs from this turboquant's copy)")
    damaged = any(d.startswith(("MODIFIED", "OUTDATED", "OLD HOOK")) for d in details)
    state = "patched" if todo == 0 else ("partial" if done or damaged else "unpatched")
    return Status(state, details, version, layout)


def _plan_apply(layout: Layout, version: str) -> dict[Path, bytes]:
    """New contents of every file apply writes; raises before anything is written."""
    missing, plan = [], {}
    for hook in hooks(layout):
        text = _read(hook.path)
        rel = hook.path.relative_to(layout.root)
        if MARK in text:
            missing.append(f"{rel}: already holds turboquant lines")
            continue
        try:
            plan[hook.path] = hook.insert(text).encode("utf-8")
        except AnchorNotFound as e:
            missing.append(f"{rel}: {hook.anchor}: {e}")
    for path, data in new_files(layout).items():
        if path.exists():
            missing.append(f"{path.relative_to(layout.root)}: already exists")
        if not path.parent.is_dir():
            missing.append(f"{path.parent.relative_to(layout.root)}: directory not found")
        plan[path] = data
    if missing:
        raise PatchError(f"cannot patch AITER {version} ({layout.kind} at {layout.root}); nothing "
                         "was written:\n  " + "\n  ".join(missing))
    return plan


def _plan_revert(layout: Layout) -> dict[Path, Optional[bytes]]:
    """Original contents (None: delete) of every file revert touches."""
    problems, plan = [], {}
    for hook in hooks(layout):
        text = _read(hook.path)
        block = hook.inserted(text) or hook.inserted_legacy(text)
        if block is not None:
            plan[hook.path] = text.replace(block, "", 1).encode("utf-8")
        elif MARK in text:
            problems.append(f"{hook.path.relative_to(layout.root)}: turboquant lines were edited; "
                            "restore the file from AITER's sources")
    for path in new_files(layout):
        if path.exists():
            if not _is_ours(path.read_bytes()):
                problems.append(f"{path.relative_to(layout.root)}: not a turboquant file")
            plan[path] = None
    if problems:
        raise PatchError("cannot revert; nothing was changed:\n  " + "\n  ".join(problems))
    return plan


def _write_all(plan: dict[Path, Optional[bytes]]) -> None:
    """Write every file, each through a temporary file and a rename; on a failure, put back
    the files already written."""
    done: list[tuple[Path, Optional[bytes]]] = []
    try:
        for path, data in plan.items():
            before = path.read_bytes() if path.exists() else None
            if data is None:
                path.unlink()
            else:
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                if before is not None:
                    os.chmod(tmp, path.stat().st_mode & 0o7777)
                else:
                    os.chmod(tmp, 0o644)
                os.replace(tmp, path)
            done.append((path, before))
    except OSError:
        for path, before in reversed(done):
            if before is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(before)
        raise


def _diff(layout: Layout, plan: dict[Path, Optional[bytes]]) -> str:
    out = []
    for path, data in plan.items():
        rel = str(path.relative_to(layout.root))
        old = path.read_text() if path.exists() else ""
        new = "" if data is None else data.decode("utf-8")
        out.extend(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        f"a/{rel}" if path.exists() else "/dev/null",
                                        "/dev/null" if data is None else f"b/{rel}"))
    return "".join(out)


def apply(root, dry_run: bool = False) -> str:
    st = status(root)
    if st.state == "patched":
        return f"already patched: AITER {st.version} ({st.layout.kind} at {st.layout.root}); nothing changed"
    if st.state == "partial":
        raise PatchError(f"AITER {st.version} at {st.layout.root} is partly patched; run with "
                         "--revert first (nothing was changed):\n  " + "\n  ".join(st.details))
    plan = _plan_apply(st.layout, st.version)
    if dry_run:
        return _diff(st.layout, plan)
    _write_all(plan)
    return (f"patched AITER {st.version} ({st.layout.kind} at {st.layout.root}): "
            f"{len(plan)} files. FP4 paged attention: aiter.paged_attention_fp4, or pa_v1 with "
            f"kv_cache_dtype='fp4_e2m1'; native FP4 MFMA by default, LUT path with {LUT_ENV}=1. "
            "FP4 cache writer: aiter.reshape_and_cache_fp4")


def revert(root, dry_run: bool = False) -> str:
    st = status(root)
    plan = _plan_revert(st.layout)
    if not plan:
        return f"not patched: AITER {st.version} at {st.layout.root}; nothing changed"
    if dry_run:
        return _diff(st.layout, plan)
    _write_all(plan)
    return f"reverted AITER {st.version} at {st.layout.root}: {len(plan)} files restored or removed"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turboquant.integration.aiter.patch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiter-root", required=True, type=Path,
                        help="AITER git checkout, or site-packages of an installed amd-aiter")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="report patched/unpatched/partial")
    action.add_argument("--revert", action="store_true", help="remove the patch, byte for byte")
    parser.add_argument("--dry-run", action="store_true", help="print the unified diff only")
    args = parser.parse_args(argv)
    try:
        if args.check:
            st = status(args.aiter_root)
            print(f"{st.state}: AITER {st.version} ({st.layout.kind} at {st.layout.root})")
            for line in st.details:
                print(f"  {line}")
            return {"patched": 0, "unpatched": 1}.get(st.state, 3)
        print(revert(args.aiter_root, args.dry_run) if args.revert
              else apply(args.aiter_root, args.dry_run))
        return 0
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
