"""Training runs' saved weights on disk: `<folder>/<run id>/{weights,sampler_weights}/<name>`, beside each
run's `run.json` (its tenant and settings), which outlive the run: a later run loads them.

A saved path (`tinker://<run id>/<kind>/<name>`) resolves for the run's tenant only; another tenant's,
or one that does not exist, is "not found" alike. Names are letters, digits, '.', '_' and '-', matched
whole (`fullmatch`: a `$` anchor lets a name end in a newline, which then names another folder than the
one its checks looked at). A deleted save leaves its name in the run's `deleted/` folder: the name is not
used again (a sampler's weights were an OpenAI model id, and ids are never reused). Pure Python.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from coserve.contract.training_calls import CallFailure

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RUN_ID = r"session-[0-9a-f]{24}:train:[0-9]{1,9}"
_PATH = re.compile(rf"tinker://({RUN_ID})/(weights|sampler_weights)/(.+)")
_CHECKPOINT = re.compile(r"(weights|sampler_weights)/(.+)")
RUN_FILE = "run.json"
DELETED = "deleted"


def kind_of(resumable: bool) -> str:
    """The folder of a save: a training state's, or a sampler's weights."""
    return "weights" if resumable else "sampler_weights"


def tree_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


class RunSaves:
    """The saves under `folder` (module docstring)."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder

    def owner(self, run_id: str) -> str | None:
        """The tenant of a run (ended or not) that has a folder here; None when none has."""
        if not re.fullmatch(RUN_ID, run_id):
            return None
        try:
            return str(json.loads((self._folder / run_id / RUN_FILE).read_text())["tenant"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def check_name(self, run_id: str, name: str, resumable: bool) -> CallFailure | None:
        """Why a save of the run may not take `name` (None: it may)."""
        if not NAME.fullmatch(name):
            return CallFailure("invalid_name", f"a checkpoint name is 1-128 letters, digits, '.', '_' or '-', "
                               f"got {name!r}")
        if (self._folder / run_id / DELETED / f"{kind_of(resumable)}-{name}").exists():
            return CallFailure("invalid_name", f"the save {kind_of(resumable)}/{name} of this run was deleted; "
                               "a deleted save's name is not used again: choose another")
        return None

    def resolve_path(self, tenant: str, path: str) -> Path | CallFailure:
        """The folder of a saved path of the tenant's runs; another tenant's is 'not found' too."""
        match = _PATH.fullmatch(path)
        if match is None:
            return CallFailure("invalid_path", f"a saved path is tinker://<run id>/weights/<name> or "
                               f"tinker://<run id>/sampler_weights/<name>, got {path!r}")
        return self._folder_of(tenant, *match.groups()) or CallFailure(
            "path_not_found", f"no saved weights at {path!r}")

    def _folder_of(self, tenant: str, run_id: str, kind: str, name: str) -> Path | None:
        folder = self._folder / run_id / kind / name
        if self.owner(run_id) != tenant or not NAME.fullmatch(name) or not folder.is_dir():
            return None
        return folder

    def remove(self, folder: Path) -> None:
        """Remove a save's folder (over the storage quota): its name may be saved again."""
        shutil.rmtree(folder, ignore_errors=True)

    def delete(self, tenant: str, run_id: str, checkpoint_id: str) -> str | CallFailure:
        """Delete a save of the tenant's run (`checkpoint_id`: `weights/<name>` or `sampler_weights/<name>`);
        returns its tinker:// path."""
        match = _CHECKPOINT.fullmatch(checkpoint_id)
        missing = CallFailure("checkpoint_not_found", f"training run {run_id!r} has no checkpoint {checkpoint_id!r}")
        if match is None:
            return missing
        kind, name = match.groups()
        folder = self._folder_of(tenant, run_id, kind, name)
        if folder is None:
            return missing
        tombstone = self._folder / run_id / DELETED / f"{kind}-{name}"
        tombstone.parent.mkdir(exist_ok=True)
        tombstone.touch()
        shutil.rmtree(folder)
        return f"tinker://{run_id}/{kind}/{name}"

    @staticmethod
    def parse(path: str) -> tuple[str, str, str] | None:
        """(run id, kind, name) of a saved path, None when it is not one."""
        match = _PATH.fullmatch(path)
        return None if match is None else (match.group(1), match.group(2), match.group(3))
