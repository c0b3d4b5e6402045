"""What a part reports (`PartRecord`: checks, details, one summary line) and the whole report (JSON and a
markdown table).

A check is a measured value against a stated limit: `ok` True or False, or None for a value that is
reported, not judged (a speed ratio, an agreement rate in bf16). A part passes when it ran to the end
and none of its checks is False; a part that raised keeps what it recorded before, with its traceback.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASS, FAIL, ERROR, SKIPPED = "pass", "fail", "error", "skipped"


@dataclass(slots=True)
class Check:
    name: str
    value: Any
    limit: str  # the stated limit, e.g. "== 1.0", "<= 1e-4"; "" for a reported value
    ok: bool | None


@dataclass(slots=True)
class PartRecord:
    name: str
    status: str = ERROR  # until the part returns
    seconds: float = 0.0
    summary: str = ""
    checks: list[Check] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def check(self, name: str, value: Any, limit: str = "", ok: bool | None = None) -> None:
        self.checks.append(Check(name, _plain(value), limit, ok))

    def at_most(self, name: str, value: float, limit: float) -> None:
        self.check(name, value, f"<= {limit:g}", bool(value <= limit))

    def at_least(self, name: str, value: float, limit: float) -> None:
        self.check(name, value, f">= {limit:g}", bool(value >= limit))

    def finish(self) -> None:
        """The part returned: pass unless a check failed."""
        self.status = FAIL if any(c.ok is False for c in self.checks) else PASS


def _plain(value: Any) -> Any:
    """JSON-safe: floats rounded to 6 significant digits, NaN/inf as strings."""
    if isinstance(value, float):
        return f"{value}" if not math.isfinite(value) else float(f"{value:.6g}")
    return value


def to_json(meta: dict[str, Any], parts: list[PartRecord]) -> dict[str, Any]:
    return {"meta": meta, "parts": {p.name: asdict(p) for p in parts},
            "passed": bool(parts) and all(p.status == PASS for p in parts)}


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text.replace("|", "/")


def markdown(meta: dict[str, Any], parts: list[PartRecord]) -> str:
    """One row per part, then one row per check."""
    lines = [f"GPU check on {meta['device_name']} ({meta['device']}), {meta['date']}, "
             f"torch {meta['versions'].get('torch')}, total {meta.get('total_s', 0):.0f} s", "",
             "| part | status | s | summary |", "|---|---|---:|---|"]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.1f} | {_cell(p.summary)} |" for p in parts]
    lines += ["", "| part | check | value | limit | result |", "|---|---|---|---|---|"]
    for p in parts:
        for c in p.checks:
            verdict = "reported" if c.ok is None else ("ok" if c.ok else "FAILED")
            lines.append(f"| {p.name} | {c.name} | {_cell(c.value)} | {c.limit} | {verdict} |")
        if p.error:
            last = p.error.strip().splitlines()[-1] if p.error.strip() else ""
            lines.append(f"| {p.name} | error | {_cell(last)} | | FAILED |")
    return "\n".join(lines) + "\n"


def write(out_dir: Path, meta: dict[str, Any], parts: list[PartRecord]) -> tuple[Path, Path]:
    """Write gpu_check.json and gpu_check.md into `out_dir` (after every part: a run stopped by its
    time limit still leaves what it measured)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu_check.json", out_dir / "gpu_check.md"
    json_path.write_text(json.dumps(to_json(meta, parts), indent=1) + "\n")
    md_path.write_text(markdown(meta, parts))
    return json_path, md_path
