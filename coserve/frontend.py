"""The tokenizer side of generation, shared by the offline `LLM` and the `SchedulerActor`.

- `expand_request`: one prompt with `n` completions -> `n` scheduler requests (seeds `seed + i`,
  the model's extra EOS ids as stop tokens).
- `OutputTracker`: per child request, incremental text, stop strings, logprobs and the stop reason.
- `encode_chat`: messages -> prompt text and token ids through the tokenizer's chat template;
  `chat_template_refusal` says why in the client's terms when that fails.
- `AdapterChecker`: reads a LoRA adapter once on the CPU, so that a bad adapter is refused at submit
  time with its own error instead of failing an engine iteration.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import jinja2

from coserve.detokenizer import TextTracker, to_logprob_dict
from coserve.outputs import SampleLogprobs
from coserve.policies.plan import TokenLogprobs
from coserve.policies.request import AdapterRef, Request, SamplingParams


@dataclass(frozen=True, slots=True)
class EosIds:
    """The EOS id the scheduler stops on, and the model's other end-of-turn ids (stop tokens)."""

    eos: int | None
    extra: tuple[int, ...]

    @classmethod
    def resolve(cls, tokenizer: object, model_eos_ids: Sequence[int]) -> EosIds:
        """The tokenizer's EOS (else the model's first), the model's other EOS ids as extras."""
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None and model_eos_ids:
            eos = model_eos_ids[0]
        return cls(eos=eos, extra=tuple(t for t in model_eos_ids if t != eos))


def encode_chat(tokenizer: object, messages: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """The conversation as prompt text and token ids (the template already holds any BOS).

    Raises:
        whatever the template raises for a conversation it does not accept (jinja2 errors,
        ValueError, TypeError): callers report it as a bad `messages` parameter.
    """
    text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return text, tokenizer.encode(text, add_special_tokens=False)


def chat_template_refusal(error: Exception) -> str:
    """What to tell a client whose messages `encode_chat` could not render.

    A template's own `raise_exception(...)` (jinja2's plain `TemplateError`) is written for users
    ("Conversation roles must alternate user/assistant/...") and is passed on. Anything else (a missing
    key or a type error inside the template, the tokenizer) would show the server's internals
    (`'dict object' has no attribute ...`), so it is described instead; the caller logs the details.
    """
    if type(error) is jinja2.exceptions.TemplateError:
        return f"The model's chat template does not accept these messages: {error}"
    return ("The model's chat template cannot render these messages: this model expects another "
            "conversation (check the roles, their order and the fields of each message).")


def expand_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos: EosIds,
                   adapter: AdapterRef | None = None, tenant: str = "default",
                   arrival_time: float | None = None) -> list[Request]:
    """The `params.n` scheduler requests of one prompt, ids `{request_id}-{i}`.

    Child i samples with `seed + i` (a seeded request with n > 1 gives n different, reproducible
    completions) and stops on the model's extra EOS ids unless `ignore_eos`. With n > 1 the children
    name `request_id` as their `parent_id` (a fan-out, `coserve.policies.fanouts`).
    """
    arrival = time.monotonic() if arrival_time is None else arrival_time
    children = []
    for index in range(params.n):
        child = replace(params, n=1, seed=None if params.seed is None else params.seed + index)
        if eos.extra and not child.ignore_eos:
            child.stop_token_ids = child.stop_token_ids + list(eos.extra)
        children.append(Request(request_id=f"{request_id}-{index}", prompt_token_ids=list(prompt_token_ids),
                                sampling=child, eos_token_id=eos.eos, adapter=adapter, tenant=tenant,
                                arrival_time=arrival, parent_id=request_id if params.n > 1 else None))
    return children


class OutputTracker:
    """Front-end state of one child request: its text, stop strings and logprobs.

    Args:
        request: the scheduler request (its output tokens are read, never changed).
        tokenizer: decodes tokens.
    """

    def __init__(self, request: Request, tokenizer: object) -> None:
        self.request = request
        self._tokenizer = tokenizer
        self.text = TextTracker(tokenizer, request.sampling)
        want = request.sampling.logprobs is not None
        self.logprobs: SampleLogprobs | None = [] if want else None
        self.cumulative_logprob: float | None = 0.0 if want else None

    def on_token(self, lp: TokenLogprobs | None) -> bool:
        """Take the request's newest token (and its logprobs).

        Returns:
            True when the text now contains a stop string and the request is not finished yet: the
            caller finishes it with `FINISHED_STOPPED`.
        """
        if self.logprobs is not None and lp is not None:
            self.logprobs.append(to_logprob_dict(lp, self._tokenizer))
            self.cumulative_logprob += lp.logprob
        stopped = self.text.check_stop(self.request.output_token_ids)
        return stopped is not None and not self.request.is_finished

    @property
    def stop_reason(self) -> int | str | None:
        """The stop string or stop token id that ended the output, if any."""
        if self.text.stopped is not None:
            return self.text.stopped.stop
        outputs = self.request.output_token_ids
        if outputs and outputs[-1] in self.request.sampling.stop_token_ids:
            return outputs[-1]
        return None

    def final_text(self) -> str:
        return self.text.final_text(self.request.output_token_ids)


class AdapterChecker:
    """Checks each LoRA adapter once (on the CPU, no device memory) and keeps ids unique per path.

    Args:
        model_config: the base model's `ModelConfig`.
        max_rank: the engine bank's largest rank.
    """

    def __init__(self, model_config: object, max_rank: int) -> None:
        self._model_config = model_config
        self._max_rank = max_rank
        self._paths: dict[int, str] = {}

    def check(self, adapter_id: int, path: str) -> None:
        """Read the adapter at `path` unless already done for this id.

        Raises:
            AdapterError: the adapter cannot be served on this model.
            ValueError: `adapter_id` is already used for another path.
        """
        known = self._paths.get(adapter_id)
        if known == path:
            return
        if known is not None:
            raise ValueError(f"lora_int_id {adapter_id} is already used for {known}")
        import torch

        from coserve.platform.lora import load_peft_adapter

        load_peft_adapter(path, adapter_id, self._model_config, self._max_rank, torch.float32,
                          torch.device("cpu"))
        self._paths[adapter_id] = path
