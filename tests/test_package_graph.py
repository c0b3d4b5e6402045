"""The packages of `coserve` import one another one way only: no two packages import each other, directly
or round a loop, and `contract` (the types that cross a process or package boundary) imports nothing
else from coserve. Module circles: tests/test_import_cycles.py (the same import finder).

Each package says who may import it, on the second line of its `__init__.py` docstring ("Imported by: a, b,
c." or "Imported by: every package"): those are the allowed arrows, and an import from anywhere else fails
here, so a new arrow is a decision written where the next reader of that package looks. `coserve` itself
(the package's `__init__`, re-exporting the offline API) and `cli` stand above every package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_import_cycles import ROOT, find_cycle, import_graph

TOP = {"coserve", "cli"}  # the package's __init__ and the command line: above every package


def package_of(module: str) -> str:
    """`coserve.planner.hybrid` -> `share`; a module at the top (`coserve.cli`) is its own node."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(root: Path | None = None) -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    graph: dict[str, set[str]] = {}
    for module, targets in (import_graph() if root is None else import_graph(root)).items():
        source = package_of(module)
        graph.setdefault(source, set()).update(package_of(t) for t in targets if package_of(t) != source)
    return graph


def test_the_package_graph_sees_a_loop(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for sub in ("a", "b", "c"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from pkg.b.y import thing\n")
    (pkg / "b" / "y.py").write_text("thing = 1\ndef f():\n    from pkg.c import z\n")
    (pkg / "c" / "z.py").write_text("from pkg.a import x\n")
    graph = package_graph(pkg)
    assert graph["a"] == {"b"} and graph["b"] == {"c"} and graph["c"] == {"a"}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (pkg / "c" / "z.py").write_text("")
    assert find_cycle(package_graph(pkg)) is None


def test_no_two_packages_import_each_other() -> None:
    cycle = find_cycle(package_graph())
    assert cycle is None, "package loop: " + " -> ".join(cycle or [])


def test_the_contract_imports_nothing_else_from_coserve() -> None:
    assert package_graph()["contract"] == set()


def allowed_importers(root: Path = ROOT) -> dict[str, set[str] | None]:
    """Package -> who may import it, as its `__init__` docstring's second line says (None: every package).

    Raises:
        AssertionError: a package's docstring does not say it.
    """
    allowed: dict[str, set[str] | None] = {}
    for init in sorted(root.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        lines = doc.splitlines()
        said = re.fullmatch(r"Imported by: (.+)\.", lines[1]) if len(lines) > 1 else None
        assert said, f"{init}: the docstring's second line must say `Imported by: ...` (who may import it)"
        words = re.sub(r"\(.*?\)", "", said.group(1))
        allowed[init.parent.name] = None if words.startswith("every package") else \
            {w.strip() for w in words.split(",") if w.strip()}
    return allowed


def test_every_package_says_who_may_import_it_and_no_one_else_does() -> None:
    allowed = allowed_importers()
    packages = set(allowed)
    for importer, imported in sorted(package_graph().items()):
        for package in sorted(imported & packages):
            may = allowed[package]
            assert may is None or importer in may or importer in TOP, (
                f"{importer} imports {package}, whose __init__ docstring does not allow it "
                f"(Imported by: {', '.join(sorted(may))})")
    for package, may in allowed.items():
        assert may is None or may <= packages | TOP, f"{package}: unknown importers {sorted(may - packages - TOP)}"


def test_the_allowed_arrows_are_read_from_the_docstrings(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for sub, doc in (("a", "A thing.\nImported by: b."), ("b", "B.\nImported by: every package."), ("c", "C.")):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text(f'"""{doc}"""\n')
    (pkg / "c" / "__init__.py").write_text('"""C.\nImported by: a (its helpers), b."""\n')
    assert allowed_importers(pkg) == {"a": {"b"}, "b": None, "c": {"a", "b"}}
