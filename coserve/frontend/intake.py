"""What a chat or completions submission becomes in the gateway, before the scheduler's quotas and
queueing: the prompt's token ids, the sampling settings and the adapter, or the reason it is refused.

`PromptIntake` holds the tokenizer side of admission: the `logit_bias` check against the vocabulary,
tools (`tool_admission`), the grammars' check in a budgeted worker (`grammar_admission`), rendering and
tokenizing off the event loop (`prompt_encoder`), the context length checks and the adapter check. The
`SchedulerActor` keeps what needs its state: quotas, the policy and the streams.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from coserve.contract.messages import AdapterSpec, Rejection
from coserve.contract.sampling import SamplingParams
from coserve.frontend.adapter_check import AdapterChecker
from coserve.frontend.chat_template import chat_template_refusal
from coserve.frontend.grammar_admission import grammar_rejection
from coserve.frontend.messages import ChatSubmission
from coserve.frontend.prompt_encoder import PromptEncoder, PromptRefused
from coserve.frontend.tool_admission import PreparedChat, ToolSupport
from coserve.model.config import ModelConfig
from coserve.structured.guarded_check import GrammarCheck
from coserve.tools.family import ToolFamily

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Intake:
    """An admissible submission: its prompt, sampling (`max_tokens` always set) and adapter."""

    prompt: list[int]
    sampling: SamplingParams
    adapter: AdapterSpec | None  # checked: it fits the model and the engine's bank
    tool_family: ToolFamily | None
    prompt_text: str | None  # a raw prompt's text, for `echo`


class PromptIntake:
    """The tokenizer side of admission, for one base model.

    Args:
        tokenizer: the model's tokenizer (chat template included).
        model_config: the model's config (`vocab_size`, for the adapter check too).
    """

    def __init__(self, tokenizer: Any, model_config: ModelConfig) -> None:
        self._model_config = model_config
        self._encoder = PromptEncoder(tokenizer)
        self._tools = ToolSupport(tokenizer)
        self._grammars = GrammarCheck()
        self._max_model_len = 0
        self._adapters: AdapterChecker | None = None
        self._structured_output = True

    def attach(self, max_model_len: int, max_lora_rank: int, structured_output: bool = True) -> None:
        """Take the (re)registered engine's context length, adapter rank limit and whether it enforces
        grammars (`RuntimeLayout.structured_output`; requests that need one are refused here if not)."""
        self._max_model_len = max_model_len
        self._adapters = AdapterChecker(self._model_config, max_lora_rank)
        self._structured_output = structured_output

    def close(self) -> None:
        """Stop the encoder's threads and the grammar check's workers."""
        self._encoder.close()
        self._grammars.close()

    async def prepare(self, sub: ChatSubmission) -> Intake | Rejection:
        """Check `logit_bias` against the vocabulary, render and tokenize the chat (or take the raw prompt)
        off the loop, check the context length and the adapter."""
        try:  # before the template: a cheap refusal first
            sub.sampling.check_vocab(self._model_config.vocab_size)
        except ValueError as error:
            return Rejection(400, f"{error}.", param="logit_bias", code="invalid_value")
        prepared = self._tools.prepare(sub)
        if not isinstance(prepared, PreparedChat):
            return prepared
        if prepared.sampling.structured_output is not None and not self._structured_output:
            return _no_grammar(sub)
        refused = await grammar_rejection(self._grammars, sub, prepared)
        if refused is not None:
            return refused
        sampling = prepared.sampling
        room = self._max_model_len - (sampling.max_tokens or 1)
        source = "messages" if sub.raw is None else "prompt"  # the param a refusal names
        try:
            # In the encoder's threads: the loop (every other request, /health) goes on meanwhile.
            encoded = await (self._encoder.encode(prepared.messages, room, prepared.tools) if sub.raw is None
                             else self._encoder.encode_raw(sub.raw, room, self._model_config.vocab_size))
        except PromptRefused as error:
            return Rejection(400, str(error), param="prompt", code="invalid_value")
        except Exception as error:  # noqa: BLE001 - any template failure is the messages' fault
            logger.info("chat template refused a request of tenant %s: %r", sub.tenant, error)
            return Rejection(400, chat_template_refusal(error), param="messages", code="invalid_value")
        if encoded.ids is None:
            too_long = context_rejection(encoded.min_tokens, sampling.max_tokens, self._max_model_len,
                                         at_least=True, param=source)
            assert too_long is not None  # the encoder stopped because the prompt exceeds `room`
            return too_long
        too_long = context_rejection(len(encoded.ids), sampling.max_tokens, self._max_model_len, param=source)
        if too_long is not None:
            return too_long
        if sampling.max_tokens is None:
            sampling = replace(sampling, max_tokens=self._max_model_len - len(encoded.ids))
        refused = self._check_adapter(sub.adapter)
        if refused is not None:
            return refused
        return Intake(encoded.ids, sampling, sub.adapter, prepared.family, encoded.text)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return int(self._model_config.vocab_size)

    def check_tokens(self, prompt: list[int], sampling: SamplingParams,
                     adapter: AdapterSpec | None) -> SamplingParams | Rejection:
        """A prompt given as token ids (the Tinker API's `sample`): its ids in the vocabulary, the context
        length, the adapter; returns the sampling with `max_tokens` set (the room left when None)."""
        vocab = self._model_config.vocab_size
        too_long = context_rejection(len(prompt), sampling.max_tokens, self._max_model_len, param="prompt")
        if too_long is not None:  # first: the ids below are then at most the context length
            return too_long
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            return Rejection(400, f"The prompt needs at least one token, each an id below the vocabulary "
                             f"size {vocab}.", param="prompt", code="invalid_value")
        stops = [t for t in sampling.stop_token_ids or () if not 0 <= t < vocab]
        if stops:
            return Rejection(400, f"Stop token id {stops[0]} is not in the model's vocabulary (ids 0..{vocab - 1}).",
                             param="stop", code="invalid_value")
        refused = self._check_adapter(adapter)
        if refused is not None:
            return refused
        if sampling.max_tokens is None:
            sampling = replace(sampling, max_tokens=self._max_model_len - len(prompt))
        return sampling

    def _check_adapter(self, spec: AdapterSpec | None) -> Rejection | None:
        if spec is None:
            return None
        assert self._adapters is not None  # `attach` ran: before it no prompt fits (`_max_model_len` 0)
        try:
            self._adapters.check_path(spec.path)
        except (OSError, ValueError) as error:
            logger.warning("adapter of %s at %s cannot be served: %s", spec.name, spec.path, error)
            # The reason names the server's folders: it goes to the log above, not to the client.
            return Rejection(400, f"The model `{spec.name}` cannot be served: its adapter on this server "
                                  "is missing or does not fit the base model.", param="model",
                             code="model_not_available")
        return None


def context_rejection(prompt_len: int, max_tokens: int | None, max_model_len: int, *,
                      at_least: bool = False, param: str = "messages") -> Rejection | None:
    """400 `context_length_exceeded` when the prompt plus the requested output (at least one token)
    does not fit the context; None when it does. `at_least`: `prompt_len` is a lower bound (the prompt
    was too long to be worth encoding), and the message says so. `param`: where the prompt came from
    (`messages` for chat, `prompt` for completions)."""
    wanted = prompt_len + (max_tokens or 1)
    if wanted <= max_model_len:
        return None
    some = "at least " if at_least else ""
    detail = f"{some}{prompt_len} in the {param}" + (f", {max_tokens} in the completion" if max_tokens else "")
    return Rejection(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                          f"requested {some}{wanted} tokens ({detail}). Please reduce the length of the "
                          f"{param} or completion.", param=param, code="context_length_exceeded")


def _no_grammar(sub: ChatSubmission) -> Rejection:
    """The 400 for a request that needs a grammar on an engine that enforces none."""
    if sub.sampling.structured_output is not None:
        return Rejection(400, "'response_format' other than 'text' is not supported by this server's engine "
                              "(it enforces no grammar).",
                         param="response_format", code="unsupported_value")
    return Rejection(400, "'tool_choice' 'required' or naming a function is not supported by this server's "
                          "engine (it enforces no grammar); use 'auto' or 'none'.",
                     param="tool_choice", code="unsupported_value")
