"""`/v1/files`: the file objects and the fine-tuning JSONL check run at upload.

Objects follow https://platform.openai.com/docs/api-reference/files/object. The JSONL rules are the
chat format of https://platform.openai.com/docs/guides/supervised-fine-tuning: every line a JSON object
with a non-empty `messages` list; valid roles; string contents; at least one assistant message; an
optional `weight` of 0 or 1 on assistant messages only. Numbers in error messages are 1-based.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from coserve.api.protocol.base import OpenAIBaseModel, ProtocolError, now

FilePurpose = Literal["assistants", "assistants_output", "batch", "batch_output", "fine-tune",
                      "fine-tune-results", "vision", "user_data"]
# What a client may upload (OpenAI's `FilePurpose`); coserve stores only fine-tuning data.
UploadPurpose = Literal["assistants", "batch", "fine-tune", "vision", "user_data", "evals"]
SUPPORTED_UPLOAD_PURPOSES: frozenset[str] = frozenset({"fine-tune"})

TRAINING_ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "developer", "tool"})
# Keys a training message may carry (the cookbook validator's list plus the newer tool keys).
_MESSAGE_KEYS = frozenset({"role", "content", "name", "weight", "tool_calls", "tool_call_id", "refusal",
                           "function_call"})


class FileObject(OpenAIBaseModel):
    """An uploaded file. `status` is deprecated by OpenAI but required; "processed" lets
    `client.files.wait_for_processing` return at once (coserve validates at upload)."""

    id: str
    bytes: int
    created_at: int = Field(default_factory=now)
    filename: str
    object: Literal["file"] = "file"
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(OpenAIBaseModel):
    """A page of files (`GET /v1/files`); the client pages with `after` while `has_more` is true."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(OpenAIBaseModel):
    """The answer to `DELETE /v1/files/{id}`."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool


def _bad_line(line_no: int, reason: str) -> ProtocolError:
    return ProtocolError(f"Invalid file format. Line {line_no}: {reason}.", param="file",
                         code="invalid_file_format")


def _check_message(msg: Any, number: int) -> str | None:
    """Why message `number` (1-based) of an example is invalid, or None if it is fine."""
    if not isinstance(msg, dict):
        return f"message {number} is not a JSON object"
    role = msg.get("role")
    if role not in TRAINING_ROLES:
        return f"message {number} has an invalid 'role' {role!r}; expected one of {sorted(TRAINING_ROLES)}"
    extra = sorted(set(msg) - _MESSAGE_KEYS)
    if extra:
        return f"message {number} has unrecognized keys {extra}"
    if not isinstance(msg.get("content"), str):
        return f"message {number} needs a string 'content'"
    if "weight" in msg:
        if role != "assistant":
            return f"message {number} has a 'weight' but only assistant messages may have one"
        weight = msg["weight"]
        # `type is int`: bool is an int subclass and 1.0 == 1, but neither `true` nor `1.0` is a weight.
        if type(weight) is not int or weight not in (0, 1):
            return f"message {number} has 'weight' {weight!r}; it must be 0 or 1"
    return None


def _check_example(example: Any) -> str | None:
    """Why one parsed JSONL line is not a valid chat training example, or None."""
    if not isinstance(example, dict):
        return "expected a JSON object"
    messages = example.get("messages")
    if not isinstance(messages, list) or not messages:
        return "expected a non-empty 'messages' list"
    for number, msg in enumerate(messages, start=1):
        reason = _check_message(msg, number)
        if reason:
            return reason
    if not any(m["role"] == "assistant" for m in messages):
        return "the example has no assistant message"
    return None


def validate_finetune_jsonl(data: bytes) -> int:
    """Check a fine-tuning upload and return its number of examples.

    Blank lines (a trailing newline, say) are skipped but still counted in line numbers.

    Raises:
        ProtocolError: 400 `invalid_file_format`, param `file`, naming the FIRST bad line (1-based);
            also when the file holds no example at all. The minimum of 10 examples is checked when a
            job is created, as OpenAI does, not here.
    """
    count = 0
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        try:
            # utf-8-sig on the first line: editors on Windows prepend a byte-order mark.
            line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError:
            raise _bad_line(line_no, "not valid UTF-8") from None
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _bad_line(line_no, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        reason = _check_example(example)
        if reason:
            raise _bad_line(line_no, reason)
        count += 1
    if count == 0:
        raise ProtocolError("Invalid file format. The file contains no examples.", param="file",
                            code="invalid_file_format")
    return count
