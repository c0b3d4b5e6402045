"""The packages of `coserve` import one another one way only: no two packages import each other, directly
or round a loop, and `contract` (the types that cross a process or package boundary) imports nothing
else from coserve. Module circles: tests/test_import_cycles.py (the same import finder)."""

from __future__ import annotations

from pathlib import Path

from test_import_cycles import find_cycle, import_graph


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
