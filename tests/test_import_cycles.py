"""No import circle between `coserve` modules: every import counts, those inside functions and under
`if TYPE_CHECKING:` included (a circle hidden in a function is still a circle in the design).

An edge goes from a module to the module an import names: `from coserve.a import b` is an edge to
`coserve.a.b` when that is a module and to `coserve.a` otherwise; relative imports are resolved
against the importing module's package. Parent packages that Python also runs (`coserve.a`'s
`__init__` when importing `coserve.a.b`) are not edges: a package re-exporting its own modules would
otherwise close a circle with every module that imports one of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import coserve

ROOT = Path(coserve.__file__).parent


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of the package under `root`."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The `coserve` modules that `module` imports anywhere in its file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, module, path.name == "__init__.py")
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import coserve.a.b as x` of a name inside
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    names = module_names(root)
    return {module: imports_of(module, path, set(names)) for module, path in names.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module], _ = 1, path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        state[module], _ = 2, path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_the_finder_sees_a_circle_through_a_function_level_relative_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import b\n")
    (pkg / "a.py").write_text("from pkg.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\nthing = 1\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.sub"] == {"pkg.sub.b"}  # a package importing its own module: no circle
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (pkg / "sub" / "b.py").write_text("thing = 1\n")
    assert find_cycle(import_graph(pkg)) is None


def test_coserve_has_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])
