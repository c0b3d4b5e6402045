"""Why a fine-tuning job cannot start, as the `error.code` and `error.param` it fails with.

The job manager raises `JobRefused` for a reason that is not its files' content (a quota, a deleted
starting model); `failure` classifies whatever its preparation raised, by type, never by message text.
"""

from __future__ import annotations

from coserve.contract.training_settings import SettingsError, TooFewExamplesError
from coserve.frontend.job_prep import ValidationFileError


class JobRefused(ValueError):
    """A job that cannot start for a reason other than its training file's content, with the
    `error.code` and `error.param` it fails with (e.g. over the tenant's `max_training_tokens_per_job`:
    `quota_exceeded`; its starting model deleted meanwhile: `model_not_available`, param `model`)."""

    def __init__(self, message: str, code: str, param: str | None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


def failure(err: ValueError) -> tuple[str, str | None]:
    """The `error.code` and `error.param` of a job whose preparation raised `err`."""
    if isinstance(err, JobRefused):
        return err.code, err.param
    if isinstance(err, ValidationFileError):
        return "invalid_validation_file", "validation_file"
    if isinstance(err, TooFewExamplesError):
        return "invalid_n_examples", "training_file"
    if isinstance(err, SettingsError) and err.param.startswith("method.reinforcement.grader"):
        return "invalid_grader", err.param
    return "invalid_training_file", "training_file"
