"""Which OpenAI request parameters coserve supports, supports with differences, or refuses.

One table per endpoint, keyed by the parameter's name in the official client's request types
(`openai.types.chat.completion_create_params.CompletionCreateParamsBase`, ...). The same tables
1. refuse, in the gateway, a parameter coserve cannot honour when it is sent with a value other than
   the ones that mean "not used" (`Param.accepts`): a 400 naming it, never a silent drop; a listed
   parameter the request model has no field for is accepted and not used, and one listed nowhere is a
   400 `Unrecognized request argument supplied` (`strict.RequestModel`);
2. are the docs' parameter table (`markdown()`; a test checks docs/openai-parameters.md holds exactly that text);
3. are checked by a test against the official client's request types: every field is listed.
So the behaviour, the docs and the list cannot drift apart.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticCustomError

from coserve.api.protocol.base import ProtocolError


class Support(enum.Enum):
    """How coserve treats a parameter."""

    SUPPORTED = "supported"
    DIFFERS = "supported, with differences"
    REFUSED = "refused"


def _unset(value: Any) -> bool:
    return value is None


@dataclass(frozen=True)
class Param:
    """One request parameter.

    Args:
        support: how coserve treats it.
        note: what differs, or why it is refused (the docs' wording).
        accepts: for a refused or partly supported parameter, which values are taken (the ones that mean
            "not used"); any other value is a 400 naming the parameter. None: every value the request
            model validates is taken.
    """

    support: Support
    note: str = ""
    accepts: Callable[[Any], bool] | None = None


def supported(note: str = "") -> Param:
    return Param(Support.SUPPORTED, note)


def differs(note: str, accepts: Callable[[Any], bool] | None = None) -> Param:
    return Param(Support.DIFFERS, note, accepts)


def refused(note: str, accepts: Callable[[Any], bool] = _unset) -> Param:
    return Param(Support.REFUSED, note, accepts)


@dataclass(frozen=True)
class EndpointParams:
    """The parameters of one endpoint's request body."""

    title: str  # the docs table's heading: the endpoint and the client call
    params: Mapping[str, Param]

    def problem(self, body: Any) -> ProtocolError | None:
        """The 400 for the first parameter in `body` whose value coserve does not take; None if none.

        It is `unsupported_parameter` for a refused parameter, `unsupported_value` for a value a partly
        supported one does not take; `param` names it.
        """
        if not isinstance(body, Mapping):
            return None
        for name, param in self.params.items():
            if param.accepts is None or name not in body or param.accepts(body[name]):
                continue
            note = param.note.replace("`", "")  # docs markdown, not for an error message
            if param.support is Support.REFUSED:
                return ProtocolError(f"Unsupported parameter: '{name}' is not supported by this server: "
                                     f"{note}.", param=name, code="unsupported_parameter")
            return ProtocolError(f"Unsupported value for '{name}': {note}.", param=name,
                                 code="unsupported_value")
        return None

    def check(self, body: Any) -> None:
        """Raise `problem(body)` if there is one (the multipart endpoints, outside pydantic)."""
        error = self.problem(body)
        if error is not None:
            raise error

    def validate(self, body: Any) -> Any:
        """`check` for a request model's `mode="before"` validator: the same 400, as a validation error
        (`error_from_validation` keeps its param and code). Returns `body`."""
        error = self.problem(body)
        if error is not None:
            raise PydanticCustomError("unsupported", error.message.replace("{", "(").replace("}", ")"),
                                      {"param": error.param, "code": error.code})
        return body

    def markdown(self) -> str:
        """The docs table: one row per parameter, in the order listed."""
        rows = [f"**{self.title}**", "", "| Parameter | Support | Notes |", "| --- | --- | --- |"]
        rows += [f"| `{name}` | {param.support.value} | {param.note} |" for name, param in self.params.items()]
        return "\n".join(rows)


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


_LEGACY_FUNCTIONS = "deprecated by OpenAI: use `tools` and `tool_choice`"
_IGNORED = "accepted and not used"

CHAT_COMPLETIONS = EndpointParams("`POST /v1/chat/completions` (`client.chat.completions.create`)", {
    "messages": differs("text only: `content` as a string or `text` parts (joined by newlines); image, audio "
                        "and file parts are a 400; an assistant message's `refusal` (and the `annotations` and "
                        "`parsed` of a reply sent back as is) are accepted and not used, its `audio` and "
                        "`function_call` refused"),
    "model": supported("the base model or one of the tenant's fine-tuned models / checkpoints"),
    "audio": refused("audio output is not supported"),
    "frequency_penalty": supported(),
    "function_call": refused(_LEGACY_FUNCTIONS),
    "functions": refused(_LEGACY_FUNCTIONS),
    "logit_bias": supported("keys are token ids of the model's tokenizer"),
    "logprobs": differs("under a grammar on `--engine vllm`, after the grammar's mask (over the tokens it "
                        "allows; see Structured output)"),
    "max_completion_tokens": supported(),
    "max_tokens": supported("deprecated alias of `max_completion_tokens`"),
    "metadata": differs(f"{_IGNORED}: nothing is stored (OpenAI keeps it only with `store`)"),
    "modalities": differs("`[\"text\"]` only", _is(None, ["text"])),
    "moderation": refused("no moderation is run"),
    "n": differs("up to `--max-n` (default 16)"),
    "parallel_tool_calls": differs("enforced when `tool_choice` forces calls (`required`, a named function); "
                                   "under `auto` the model's calls are returned as it wrote them"),
    "prediction": refused("predicted outputs are not supported"),
    "presence_penalty": supported(),
    "prompt_cache_key": differs(f"{_IGNORED}: prefix caching is automatic"),
    "prompt_cache_options": differs(f"{_IGNORED}: prefix caching is automatic"),
    "prompt_cache_retention": differs(f"{_IGNORED}: prefix caching is automatic"),
    "reasoning_effort": refused("no reasoning model is served"),
    "response_format": differs("`text`, `json_object`, `json_schema` (see Structured output), on both engines"),
    "safety_identifier": differs(_IGNORED),
    "seed": supported("the same seed gives the same tokens whatever else is batched (on `--engine vllm`, "
                      "unless the request is preempted)"),
    "service_tier": differs("one tier: `auto` or `default`", _is(None, "auto", "default")),
    "stop": supported("up to 4 strings"),
    "store": refused("completions are not stored (false is accepted)", _is(None, False)),
    "stream": supported(),
    "stream_options": differs("`include_usage`; `include_obfuscation` is accepted and not used"),
    "temperature": supported(),
    "tool_choice": differs("`none`, `auto`, `required`, a named function; `required` and a named function "
                           "are enforced by a grammar (see Tools), on both engines; on a template that "
                           "renders no tools, only those two"),
    "tools": differs("functions, rendered by the model's chat template; calls are read in its family's "
                     "format: hermes (Qwen2.5, Qwen3, Hermes), Llama 3.x JSON, Mistral `[TOOL_CALLS]` (see "
                     "Tools); a template that renders no tools takes them only with a forcing `tool_choice` "
                     "(described in a system message), otherwise a 400"),
    "top_logprobs": differs("under a grammar on `--engine vllm`, only tokens the grammar allows, so possibly "
                            "fewer than asked"),
    "top_p": supported(),
    "user": differs(_IGNORED),
    "verbosity": refused("no model served takes a verbosity"),
    "web_search_options": refused("web search is not supported"),
})

# The fields of a `messages` item that coserve knows without reading them (it reads `role`, `content`,
# `name`, `tool_calls`, `tool_call_id`): OpenAI's, and those of the official client's reply object, which a
# client appends to its conversation as is. Not a docs table: the `messages` row above says this.
CHAT_MESSAGE = EndpointParams("`messages[i]` of `POST /v1/chat/completions`", {
    "refusal": differs(_IGNORED),
    "annotations": differs(f"{_IGNORED} (the official client's reply object has it)"),
    "parsed": differs(f"{_IGNORED} (the official client's `parse` reply object has it)"),
    "audio": refused("audio is not supported"),
    "function_call": refused("deprecated by OpenAI: use `tool_calls`"),
})

COMPLETIONS = EndpointParams("`POST /v1/completions` (`client.completions.create`)", {
    "model": supported("the base model or one of the tenant's fine-tuned models / checkpoints"),
    "prompt": supported("a string, a list of strings, a list of token ids or a list of lists of token ids; "
                        "no chat template; choice `index` = prompt index x `n` + i"),
    "best_of": differs("only equal to `n` (no server-side ranking)"),
    "echo": differs("not with `logprobs` (the engine computes no prompt logprobs): a 400"),
    "frequency_penalty": supported(),
    "logit_bias": supported("keys are token ids of the model's tokenizer"),
    "logprobs": supported("0..5: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`"),
    "max_tokens": supported("default 16, as OpenAI"),
    "n": differs("`n` x the number of prompts up to `--max-n` (default 16)"),
    "presence_penalty": supported(),
    "seed": supported(),
    "stop": supported("up to 4 strings"),
    "stream": supported(),
    "stream_options": differs("`include_usage`; `include_obfuscation` is accepted and not used"),
    "suffix": refused("insertion (text after the completion) is not supported"),
    "temperature": supported(),
    "top_p": supported(),
    "user": differs(_IGNORED),
})

def _empty(value: Any) -> bool:
    """Null, or an object that sets nothing (`{"effort": null}`)."""
    return value is None or (isinstance(value, dict) and all(v is None for v in value.values()))


_PREFIX_CACHE = "accepted and not used: prefix caching is automatic, and a stored response's KV is kept for its " \
                "continuation (see [responses](responses.md#the-conversations-kv))"

RESPONSES = EndpointParams("`POST /v1/responses` (`client.responses.create`, `.stream`, `.parse`)", {
    "model": supported("the base model or one of the tenant's fine-tuned models / checkpoints"),
    "input": differs("a string, or items: `message` (roles `user`, `assistant`, `system`, `developer`; parts "
                     "`input_text`, `output_text`, `refusal`), `function_call`, `function_call_output`, "
                     "`reasoning` (taken and left out of the prompt); `item_reference`, images, files, audio and "
                     "hosted tools' items are a 400 naming them"),
    "instructions": supported("the first, system, message; not carried over by `previous_response_id`"),
    "tools": differs("`function` tools (as chat's `tools`: rendered by the chat template, calls read in its "
                     "family's format); hosted tools (`web_search`, `file_search`, `code_interpreter`, `mcp`, "
                     "...) are a 400 naming `tools[i].type`"),
    "tool_choice": differs("`none`, `auto`, `required`, a named function (as chat's: `required` and a named "
                           "function enforced by a grammar); `allowed_tools` and hosted tools' choices are a 400"),
    "parallel_tool_calls": differs("as chat's: enforced when `tool_choice` forces calls"),
    "text": differs("`format` `text`, `json_object`, `json_schema` (chat's structured output); `verbosity` is a 400"),
    "max_output_tokens": supported("when hit, `status: incomplete` with `incomplete_details.reason` "
                                   "`max_output_tokens`"),
    "temperature": supported(),
    "top_p": supported(),
    "top_logprobs": supported("returned with `include: [\"message.output_text.logprobs\"]`"),
    "include": differs("`message.output_text.logprobs`; `reasoning.encrypted_content` is accepted (no "
                       "reasoning items are made); hosted tools' and images' outputs are a 400"),
    "store": supported("default true: kept in the tenant's store, bounded and expiring (see "
                       "[responses](responses.md#the-store))"),
    "metadata": supported("stored and returned with the response"),
    "previous_response_id": supported("replays the earlier responses' input and output items, tool calls and "
                                      "their outputs included"),
    "background": supported("runs like any request; retrieve, stream from `starting_after`, cancel"),
    "stream": supported(),
    "stream_options": differs("`include_obfuscation` is accepted and not used"),
    "truncation": differs("`disabled` only: a conversation longer than the context is a 400",
                          _is(None, "disabled")),
    "user": differs(_IGNORED),
    "safety_identifier": differs(_IGNORED),
    "prompt_cache_key": differs(_PREFIX_CACHE),
    "prompt_cache_options": differs(_PREFIX_CACHE),
    "prompt_cache_retention": differs(_PREFIX_CACHE),
    "max_tool_calls": differs("accepted: it bounds hosted tools' calls, and none are run"),
    "service_tier": differs("one tier: `auto` or `default`", _is(None, "auto", "default")),
    "reasoning": refused("no model served reasons", _empty),
    "prompt": refused("stored prompt templates are not supported"),
    "conversation": refused("`/v1/conversations` is not served: use `previous_response_id`"),
    "context_management": refused("compaction is not supported"),
    "moderation": refused("no moderation is run"),
    "background_options": refused("completion windows are not offered", _empty),
    "access_programs": refused("no access programs"),
    "image": refused("images are not supported"),
})

# `text` of `POST /v1/responses` (not a docs table: the `text` row above says this).
RESPONSES_TEXT = EndpointParams("`text` of `POST /v1/responses`", {
    "verbosity": refused("no model served takes a verbosity"),
})

FILES = EndpointParams("`POST /v1/files` (`client.files.create`)", {
    "file": supported("fine-tuning JSONL is checked at upload (see Training files)"),
    "purpose": differs("`fine-tune` only"),
    "expires_after": refused("files are kept until deleted"),
})

FINE_TUNING_JOBS = EndpointParams("`POST /v1/fine_tuning/jobs` (`client.fine_tuning.jobs.create`)", {
    "model": supported("the base model or one of the tenant's fine-tuned models"),
    "training_file": supported(),
    "hyperparameters": supported("`n_epochs`, `batch_size`, `learning_rate_multiplier`, or `auto`"),
    "integrations": refused("no integrations (such as Weights & Biases)"),
    "metadata": supported(),
    "method": differs("`supervised` (hyperparameters `n_epochs`, `batch_size`, `learning_rate_multiplier`) "
                      "and `dpo` (the same and `beta` in (0, 10], `auto` 0.1; the reference is the base "
                      "model); `reinforcement` (`grader`: string_check, text_similarity, python, score_model "
                      "judged by a served model, multi; hyperparameters `compute_multiplier`, `eval_interval`, "
                      "`eval_samples`, `reasoning_effort` \"default\" only; extension `max_completion_tokens`: "
                      "[fine-tuning](fine-tuning.md#reinforcement-fine-tuning))"),
    "seed": supported(),
    "suffix": differs("`[A-Za-z0-9_-]`, 1..64 characters (it is part of the model id)"),
    "validation_file": supported(),
})

ENDPOINTS: tuple[EndpointParams, ...] = (CHAT_COMPLETIONS, COMPLETIONS, RESPONSES, FILES, FINE_TUNING_JOBS)


def markdown() -> str:
    """Every endpoint's table, as docs/openai-parameters.md holds it."""
    return "\n\n".join(endpoint.markdown() for endpoint in ENDPOINTS)
