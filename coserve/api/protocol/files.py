"""`/v1/files`: the file objects and the fine-tuning JSONL check run at upload.

Objects follow https://platform.openai.com/docs/api-reference/files/object. The JSONL rules are the
chat format of https://platform.openai.com/docs/guides/supervised-fine-tuning: every line a JSON object
with a non-empty `messages` list; valid roles; string contents; at least one assistant message; an
optional `weight` of 0 or 1 on assistant messages only. Numbers in error messages are 1-based.
Rows may also carry OpenAI's function-calling shapes (`tools`, `parallel_tool_calls`, assistant
`tool_calls` with a null or absent content, `tool` messages with `tool_call_id`), checked strictly by
`training_tools.py`. The deprecated `functions` / `function_call` shapes are refused, not dropped.
A file may instead hold DPO's preference rows (`preference_rows.py`), or reinforcement rows: a
`messages` list ending with a user message (the prompt), each message checked as above, and any other
keys, the item fields a grader reads (`{{ item.answer }}`; any JSON). One file holds one kind.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from coserve.api.protocol.base import OpenAIBaseModel, ProtocolError, now
from coserve.api.protocol.preference_rows import check_preference_row, is_preference_row
from coserve.api.protocol.training_tools import check_tool_calls, check_tool_flow, check_tools
from coserve.contract.training_jsonl import RowError, jsonl_rows
from coserve.contract.training_rows import ParsedTrainingFile, TrainingFileKind

FilePurpose = Literal["assistants", "assistants_output", "batch", "batch_output", "fine-tune",
                      "fine-tune-results", "vision", "user_data"]
# What a client may upload (OpenAI's `FilePurpose`); coserve stores only fine-tuning data.
UploadPurpose = Literal["assistants", "batch", "fine-tune", "vision", "user_data", "evals"]
SUPPORTED_UPLOAD_PURPOSES: frozenset[str] = frozenset({"fine-tune"})

TRAINING_ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "developer", "tool"})
# Keys a training message may carry (the cookbook validator's list plus the newer tool keys).
_MESSAGE_KEYS = frozenset({"role", "content", "name", "weight", "tool_calls", "tool_call_id", "refusal"})
_ROW_KEYS = frozenset({"messages", "tools", "parallel_tool_calls"})
# The deprecated function-calling shapes: the trainer would drop them, so they are refused with a hint.
_LEGACY_KEYS = {"functions": "'tools'", "function_call": "'tool_calls'"}
# Keys whose null means absent, as the official client writes them when dumping a reply's message.
_NULLABLE_KEYS = frozenset({"function_call", "tool_calls", "name", "refusal", "annotations", "audio"})


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
    if not isinstance(role, str) or role not in TRAINING_ROLES:
        return f"message {number} has an invalid 'role' {role!r}; expected one of {sorted(TRAINING_ROLES)}"
    msg = {key: value for key, value in msg.items() if value is not None or key not in _NULLABLE_KEYS}
    if "function_call" in msg:
        return f"message {number} has the deprecated 'function_call'; use {_LEGACY_KEYS['function_call']}"
    extra = sorted(set(msg) - _MESSAGE_KEYS)
    if extra:
        return f"message {number} has unrecognized keys {extra}"
    reason = _check_tool_keys(msg, number)
    if reason:
        return reason
    has_calls = "tool_calls" in msg
    if not isinstance(msg.get("content"), str) and not (has_calls and msg.get("content") is None):
        return f"message {number} needs a string 'content'" + (" or null" if has_calls else "")
    if "weight" in msg:
        if role != "assistant":
            return f"message {number} has a 'weight' but only assistant messages may have one"
        weight = msg["weight"]
        # `type is int`: bool is an int subclass and 1.0 == 1, but neither `true` nor `1.0` is a weight.
        if type(weight) is not int or weight not in (0, 1):
            return f"message {number} has 'weight' {weight!r}; it must be 0 or 1"
    return None


def _check_tool_keys(msg: dict[str, Any], number: int) -> str | None:
    """Why the tool keys of message `number` are invalid: `tool_calls` on assistant messages only
    (checked by `training_tools`), a string `tool_call_id` on every `tool` message and only there."""
    role = msg["role"]
    if "tool_calls" in msg:
        if role != "assistant":
            return f"message {number} has 'tool_calls' but only assistant messages may have them"
        return check_tool_calls(msg["tool_calls"], number)
    if role == "tool":
        if not isinstance(msg.get("tool_call_id"), str) or not msg["tool_call_id"]:
            return f"message {number} is a 'tool' message and needs a string 'tool_call_id'"
    elif "tool_call_id" in msg:
        return f"message {number} has a 'tool_call_id' but only 'tool' messages may have one"
    return None


def _check_row_tools(example: dict[str, Any]) -> str | None:
    """Why the row's `tools` / `parallel_tool_calls` and its calls do not fit, or None."""
    tools = example.get("tools")
    if "tools" in example:
        reason = check_tools(tools)
        if reason:
            return reason
    parallel = example.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        return f"'parallel_tool_calls' must be true or false, not {parallel!r}"
    return check_tool_flow(example["messages"], tools, parallel)


def _check_example(example: Any) -> str | None:
    """Why one parsed JSONL line is not a valid chat training example, or None."""
    if not isinstance(example, dict):
        return "expected a JSON object"
    messages = example.get("messages")
    if not isinstance(messages, list) or not messages:
        return "expected a non-empty 'messages' list"
    for key, replacement in _LEGACY_KEYS.items():
        if key in example:
            return f"the row has the deprecated {key!r}; use {replacement}"
    extra = sorted(set(example) - _ROW_KEYS)
    if extra:
        return f"the row has unrecognized keys {extra}"
    for number, msg in enumerate(messages, start=1):
        reason = _check_message(msg, number)
        if reason:
            return reason
    if not any(m["role"] == "assistant" for m in messages):
        return "the example has no assistant message"
    return _check_row_tools(example)


def _is_reinforcement_row(example: Any) -> bool:
    """A row whose `messages` end with a user message: a prompt for reinforcement fine-tuning."""
    messages = example.get("messages") if isinstance(example, dict) else None
    return isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict) \
        and messages[-1].get("role") == "user"


def _check_reinforcement_row(example: dict[str, Any]) -> str | None:
    """Why a reinforcement row's prompt is invalid (its other keys are item fields, any JSON), or None."""
    for number, msg in enumerate(example["messages"], start=1):
        reason = _check_message(msg, number)
        if reason:
            return reason
    return None


def _check_row(example: Any) -> tuple[TrainingFileKind, str | None]:
    if is_preference_row(example):
        reason = check_preference_row(example, _check_message)
        tools = example["input"].get("tools") if reason is None else None
        if reason is None and tools is not None:
            reason = check_tools(tools)
        return TrainingFileKind.PREFERENCE, reason
    if _is_reinforcement_row(example):
        return TrainingFileKind.REINFORCEMENT, _check_reinforcement_row(example)
    return TrainingFileKind.CHAT, _check_example(example)


def validate_finetune_jsonl(data: bytes) -> ParsedTrainingFile:
    """Parse and check a fine-tuning upload: its rows and their kind (every row of one kind), what later
    steps read instead of the bytes (`contract.training_rows`).

    Blank lines (a trailing newline, say) are skipped but still counted in line numbers.

    Raises:
        ProtocolError: 400 `invalid_file_format`, param `file`, naming the FIRST bad line (1-based);
            also when the file holds no example at all, or mixes kinds of rows. The minimum
            of 10 examples is checked when a job is created, as OpenAI does, not here.
    """
    rows: list[Any] = []
    kind = None
    try:
        for line_no, example in jsonl_rows(data):
            row_kind, reason = _check_row(example)
            if reason:
                raise _bad_line(line_no, reason)
            if kind is not None and row_kind != kind:
                raise _bad_line(line_no, f"a {row_kind.value} row in a file of {kind.value} rows; a file "
                                         f"holds one kind (chat rows for supervised jobs, preference rows "
                                         f"for DPO, reinforcement rows, whose messages end with the user's "
                                         f"prompt, for reinforcement)")
            kind = row_kind
            rows.append(example)
    except RowError as err:
        raise _bad_line(err.line, err.reason) from None
    if kind is None:
        raise ProtocolError("Invalid file format. The file contains no examples.", param="file",
                            code="invalid_file_format")
    return ParsedTrainingFile(kind, rows)

