"""The package's layering, read from the imports of its sources (every import statement, at
module level or inside a function): the library imports neither the lab (``turboquant.bench``)
nor the accuracy study (``turboquant.accuracy``), only the command line reaches them; the
backends and the reference build on ``turboquant.calls``, below the public API, not on it; the
bench's modules import each other without a cycle."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "turboquant"
TOP = ("cli.py", "__main__.py")  # the command line: above the library and the lab
LAB = ("bench", "accuracy")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set:
    """The turboquant modules ``path`` imports (relative imports resolved)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("turboquant")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("turboquant"):
                target = node.module
            else:
                continue
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}  # `from . import api`
    return found


def sources(under: Path = PACKAGE):
    return sorted(p for p in under.rglob("*.py") if "files" not in p.relative_to(PACKAGE).parts)


def is_lab(mod: str) -> bool:
    return any(mod == f"turboquant.{x}" or mod.startswith(f"turboquant.{x}.") for x in LAB)


@pytest.mark.parametrize("path", [p for p in sources() if not is_lab(module_name(p))
                                  and p.relative_to(PACKAGE).as_posix() not in TOP],
                         ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_library_imports_no_lab(path):
    assert not {m for m in imports(path) if is_lab(m)}


@pytest.mark.parametrize("path", sources(PACKAGE / "_backends") + [PACKAGE / "reference.py"],
                         ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_backends_build_below_the_api(path):
    assert "turboquant.api" not in imports(path)
    assert "turboquant.calls" in imports(path) or path.name in ("__init__.py", "_jit.py")



@pytest.mark.parametrize("path", [p for p in sources() if p.parent.name != "_backends"
                                  and p != PACKAGE / "__init__.py"],
                         ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_only_the_package_imports_the_backends(path):
    """A backend registers itself when the package imports it; the rest of the library reaches
    one through ``turboquant.registry`` (by name), never by importing it."""
    assert not {m for m in imports(path) if m.startswith("turboquant._backends")}

def test_the_bench_modules_have_no_cycle():
    graph = {module_name(p): {m for m in imports(p) if m.startswith("turboquant.bench.")}
             for p in sources(PACKAGE / "bench")}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, seen + (n,)))
                   for n in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []


def test_the_check_sees_an_import():
    """The reader finds relative, absolute and function-level imports (else the tests above
    could pass on a reader that sees nothing)."""
    found = imports(PACKAGE / "bench" / "run.py")
    assert {"turboquant.bench.multitoken", "turboquant.api", "turboquant.rotation"} <= found
    assert "turboquant.bench.run" in imports(PACKAGE / "cli.py")
