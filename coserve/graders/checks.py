"""Whether this server can run a grader, checked before anything runs (`check_grader`): its templates
(`templates.check_template`), a multi grader's formula (`formula.check_formula`), its metric
(`similarity.unsupported`), and its type: `python` graders unless the operator turned them on, model
graders where there is no server to judge with; and how much grading one sample asks for: at most
`MAX_LEAF_GRADERS` graders that score (the leaves of its multi graders), `MAX_PYTHON_GRADERS` of them python
graders (each may run for its wall-clock limit). Each refusal is a `SettingsError` whose `param` is the
field's path."""

from __future__ import annotations

from coserve.contract.grader import (
    Grader,
    ModelGrader,
    MultiGrader,
    PythonGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from coserve.contract.training_settings import SettingsError
from coserve.graders.formula import check_formula
from coserve.graders.similarity import unsupported
from coserve.graders.templates import check_template

Variable = tuple[str, list[str | int]]
MAX_LEAF_GRADERS = 64  # graders that score, in one grader (a multi grader nested 4 deep could hold a million)
MAX_PYTHON_GRADERS = 4  # python graders in one grader, each up to its wall-clock limit per sample


def leaves(grader: Grader) -> list[Grader]:
    """The graders that score (a multi grader's, recursively; the grader itself otherwise)."""
    if isinstance(grader, MultiGrader):
        return [leaf for _, sub in grader.graders for leaf in leaves(sub)]
    return [grader]


def check_work(grader: Grader, param: str = "grader") -> None:
    """SettingsError (`param`) when one sample would run more graders than this server grades at once."""
    scoring = leaves(grader)
    if len(scoring) > MAX_LEAF_GRADERS:
        raise SettingsError(param, f"{param} holds {len(scoring)} graders that score; at most {MAX_LEAF_GRADERS}")
    python = sum(isinstance(leaf, PythonGrader) for leaf in scoring)
    if python > MAX_PYTHON_GRADERS:
        raise SettingsError(param, f"{param} holds {python} python graders; at most {MAX_PYTHON_GRADERS}")


def check_grader(grader: Grader, param: str = "grader", *, python: bool = False,
                 judges: bool = False) -> list[Variable]:
    """The template variables the grader reads (for a job to check against its rows); SettingsError when
    this server cannot run it. `python`: the server runs python graders (`--enable-python-graders`);
    `judges`: the caller can run model graders (the gateway, which checks their models itself)."""
    check_work(grader, param)
    return _check(grader, param, python, judges)


def _check(grader: Grader, param: str, python: bool, judges: bool) -> list[Variable]:
    if isinstance(grader, StringCheckGrader | TextSimilarityGrader):
        if isinstance(grader, TextSimilarityGrader) and (reason := unsupported(grader.metric)) is not None:
            raise SettingsError(f"{param}.evaluation_metric", reason)
        return check_template(grader.input, f"{param}.input") + \
            check_template(grader.reference, f"{param}.reference")
    if isinstance(grader, MultiGrader):
        names = [name for name, _ in grader.graders]
        check_formula(grader.calculate_output, names, f"{param}.calculate_output")
        return [v for name, sub in grader.graders
                for v in _check(sub, f"{param}.graders.{name}", python, judges)]
    if isinstance(grader, PythonGrader):
        if not python:
            raise SettingsError(f"{param}.type", "python graders are off on this server: its operator turns "
                                "them on with `coserve serve --enable-python-graders` (docs/graders.md says "
                                "what isolation they run with)")
        return []
    assert isinstance(grader, ModelGrader)
    if not judges:
        raise SettingsError(f"{param}.type", f"{grader.kind} graders run on the server (their judge is a model "
                            "it serves), not here; use string_check, text_similarity, multi or python")
    return [v for i, (_, content) in enumerate(grader.messages)
            for v in check_template(content, f"{param}.input.{i}.content")]
