"""Whether a row has the `{{ item.* }}` values a grader reads: a reinforcement job's files are checked
with `missing_item_field` before the job exists, so that a row without `answer` is a 400 naming it, not
a job that grades every sample of that row 0."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coserve.graders.templates import has_value

Variable = tuple[str, Sequence[str | int]]  # (namespace, steps), as `check_template` returns them


def variable_text(variable: Variable) -> str:
    """The variable as a template writes it: `{{ item.a.b[0] }}`."""
    namespace, steps = variable
    path = "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in steps)
    return f"{{{{ {namespace}{path} }}}}"


def missing_item_field(variables: Sequence[Variable], row: Any) -> str | None:
    """The first `item` variable (as `variable_text` writes it) that `row` has no value for; None when the
    row has all of them. `sample` variables are the model's answer, not the row's: they are skipped."""
    for variable in variables:
        namespace, steps = variable
        if namespace == "item" and not has_value(row, steps):
            return variable_text(variable)
    return None
