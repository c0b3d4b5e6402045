"""Docstrings name what exists: every file path (`jobs/manager.py`, `coserve/cluster/engine_core.py`, a bare
`events.py` of the docstring's own package) and every dotted name that starts at a coserve package
(`coserve.finetune.job.CoservedJob`, `finetune.sequence_kv`, `graders.rollout_judges.RolloutJudges`) in a
docstring of `coserve` resolves to a file, a module or a name defined in it. The one-page map and the package
list (ARCHITECTURE.md, docs/layout.md) are held to the same rule for the paths they name.

A path resolves from the repository's root, from `coserve/`, or from the docstring's own package (a bare
module name: that package only; the package list's paths from their package). A dotted name resolves when
its longest prefix that is a module exists and the rest are names the module defines (at its top level, or
a class's members). Names are read with `ast`: no module is imported."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

import coserve

PACKAGE = Path(coserve.__file__).parent
ROOT = PACKAGE.parent
PACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
# a path: folders then a file of a kind the tree holds (a bare name too), not part of a longer word
PATH = re.compile(r"(?<![\w./*-])((?:[\w-]+/)*[\w-]+\.(?:py|md|yaml|jinja|sh|c))(?![\w/])")
# a dotted name from a package: `coserve.a.b` or `a.b` where `a` is a package (in backticks only: prose
# such as "the store." is no reference), not a file name (`planner.py`)
DOTTED = re.compile(r"`((?:coserve\.)?(?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)(?<!\.py)(?<!\.md)(?![\w.])")
TEXT_FILES = [ROOT / "ARCHITECTURE.md", ROOT / "docs" / "layout.md"]


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the module's, its classes' and its functions' docstrings."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                found.append((getattr(node, "lineno", 1), text))
    return found


@cache
def defined_names(module: Path) -> frozenset[str]:
    """Top-level names of a module (imports included: a re-export), and `Class.member` for its classes."""
    tree = ast.parse(module.read_text(), str(module))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in ast.walk(node):
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(f"{node.name}.{item.name}")
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(f"{node.name}.{item.target.id}")
                elif isinstance(item, ast.Assign):
                    names.update(f"{node.name}.{t.id}" for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return frozenset(names)


def module_file(dotted: list[str]) -> Path | None:
    """The file of the module `coserve.<dotted>` (a package's __init__), None when there is none."""
    path = PACKAGE.joinpath(*dotted)
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None


def dotted_resolves(name: str) -> bool:
    """Whether a dotted name resolves. Without `coserve.`, `a.b` with `b` in lower case and neither a module of
    package `a` nor a name its `__init__` defines is a variable's attribute (`model.predict`), not a name."""
    parts = name.removeprefix("coserve.").split(".")
    if not name.startswith("coserve.") and parts[1][:1].islower() and module_file(parts[:2]) is None \
            and parts[1] not in defined_names(PACKAGE / parts[0] / "__init__.py"):
        return True
    for cut in range(len(parts), 0, -1):
        module = module_file(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        return not rest or ".".join(rest[:2]) in defined_names(module)
    return False


def path_resolves(ref: str, package: Path | None) -> bool:
    if "/" not in ref and ref.endswith(".md"):  # a page: at the root, in docs/ or benchmarks/
        return any((ROOT / folder / ref).exists() for folder in (".", "docs", "benchmarks"))
    if "/" not in ref:  # a bare module of the docstring's own package (other bare names: a model's files)
        return not ref.endswith(".py") or package is not None and (package / ref).exists()
    bases = [ROOT, PACKAGE] + ([package] if package is not None else [PACKAGE / name for name in PACKAGES])
    return any((base / ref).exists() for base in bases)


def stale_names(text: str, package: Path | None) -> list[str]:
    stale = [ref for ref in PATH.findall(text) if not path_resolves(ref, package)]
    stale += [name.rstrip(".") for name in DOTTED.findall(text) if not dotted_resolves(name.rstrip("."))]
    return stale


def all_stale() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in docstrings(path):
            found += [f"{path.relative_to(ROOT)}:{line}: {name}" for name in stale_names(text, path.parent)]
    for path in TEXT_FILES:
        found += [f"{path.relative_to(ROOT)}: {name}" for name in stale_names(path.read_text(), None)
                  if "/" in name or name.startswith("coserve.")]
    return found


def test_every_name_in_a_docstring_resolves() -> None:
    stale = all_stale()
    assert not stale, f"{len(stale)} stale name(s) in docstrings:\n" + "\n".join(stale)


@pytest.mark.parametrize(("text", "stale"), [
    ("the job manager (`jobs/manager.py`, `coserve.jobs.manager.JobManager.run`)", []),
    ("its events (`events.py`), its watchdog `finetune.kept_progress`", []),
    ("the old room `actors/job_manager.py` and `share/policy.py`", ["actors/job_manager.py", "share/policy.py"]),
    ("a bare `job_events.py`, a gone `coserve.finetune.job.FinetuneJob`, `jobs.manager.NoSuchThing`",
     ["job_events.py", "coserve.finetune.job.FinetuneJob", "jobs.manager.NoSuchThing"]),
    ("`finetune.NothingHere`, `model.predict(x)` and `graders.rollout_judges.RolloutJudges.judge`",
     ["finetune.NothingHere"]),
    ("`manager.py` is the job manager's file, `planner.policy` the co-serving policy", []),
])
def test_the_check_sees_stale_names(text: str, stale: list[str]) -> None:
    assert stale_names(text, PACKAGE / "jobs") == stale
