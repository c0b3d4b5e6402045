"""Training data of a fine-tuning job: chat examples -> loss-masked token sequences, torch-free (the
scheduler's job manager prepares jobs in a process without torch; the engine's trainer makes its tensors
from these lists). "auto" hyperparameters: `coserve.contract.training_settings`.

Loss mask (issue 3, item 1). An example is rendered with the tokenizer's own chat template, so the
model trains on exactly the text it will see when served. The trained tokens are, for every assistant
message whose `weight` is not 0:

* the tokens of its `content`, and
* the end-of-turn marker that closes it: the first `tokenizer.eos_token` (ChatML's `<|im_end|>`) the
  template writes after the content, within that turn. The model must learn to stop, and generation
  stops at eos. Template text after the marker (ChatML's newline) and every role header
  (`<|im_start|>assistant\\n`) are untrained: the server writes them, the model never generates them.
  A template whose turn has no eos after the content trains the content only.
* Tool calls (issue 20 item 5): an assistant message with `tool_calls` trains the whole turn the
  template writes after the generation prompt: its content if any, the call text (Qwen's
  `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`) and the end-of-turn marker (or the
  turn's text to its end when it has none). The row's `tools` list is passed to the template; a
  template that drops tools, calls or tool results is refused (`frontend/chat_render.py`). Llama 3.x templates
  write the call as `{"name": ..., "parameters": ...}` and Mistral's as `[TOOL_CALLS][{...}]`, each
  closed by its eos (`<|eot_id|>`, `</s>`); the call ids are written as the template's family takes
  them (Mistral's 9 characters, `coserve.tools.call_ids`).

System, user, tool and developer messages are never trained. How spans are found: the template is
rendered for each prefix of the conversation (`messages[:i]` with the generation prompt, then
`messages[:i+1]`); the assistant content starts where the generation prompt ends. Every prefix
rendering must be a prefix of the full rendering (raise `TemplateError` otherwise: a template that
rewrites earlier turns, e.g. one that drops reasoning of past turns, has no fixed token mask), except
a cut between two `tool` messages, which templates write as one turn; the content must appear
verbatim there. Character spans become token masks through the fast tokenizer's
offsets on the full rendering, whose ids are checked equal to `apply_chat_template(tokenize=True)`.
A BPE token straddling a span edge (e.g. the header's newline merged with a content that starts with
newlines) is trained: every content character is then learned, at the cost of one header character.

Bad input (issue 3): an example longer than `max_len` is truncated to its first `max_len` tokens
(OpenAI's behaviour) and flagged; an example with no trained target left is skipped and counted.

Cut before tokenizing (issue 45): a token stands for at most `longest_token_chars` characters, so text past
`(max_len + CUT_MARGIN_TOKENS) x longest` characters of message content lies past the context for certain.
Such a conversation is rendered and tokenized only up to there (the message that reaches it cut, the later
ones left out): what it trains is the same, at the cost of the context rather than of the row (tokenizing
2 MB of text took 16 s and 800 MB; a row may hold 2 MiB). The cut's encoding must still run past the
context by half the margin, or the whole conversation is tokenized after all (a normalizer that shortens
text could make the bound loose).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coserve.contract.training_plan import TrainingExample
from coserve.frontend.chat_render import (
    TemplateError,
    Tools,
    content_text,
    render,
    require_calls_rendered,
    require_tool_results_rendered,
    require_tool_support,
    require_tools_rendered,
    template_messages,
    tool_calls,
)
from coserve.frontend.prompt_encoder import longest_token_chars
from coserve.frontend.template_family import call_id_rule

MAX_WARNED_INDICES = 20  # a warning names at most this many example indices
# Tokens kept past the context when a conversation is cut before tokenizing (module docstring).
CUT_MARGIN_TOKENS = 64


@dataclass(frozen=True, slots=True)
class EncodedConversation:
    """One tokenized conversation and which tokens are learned."""

    token_ids: list[int]  # L <= max_len
    trained: list[bool]  # token p is an assistant token (the target of position p - 1)
    truncated: bool  # the rendering had more than max_len tokens; the tail was cut
    full_length: int  # tokens before truncation (of the cut text, when it was cut before tokenizing)

    @property
    def num_trained(self) -> int:
        """Trained targets; token 0 is nobody's target, as in `TrainingSequence.num_trained`."""
        return sum(self.trained[1:])

    @property
    def skipped(self) -> bool:
        """No trained target: the example adds nothing to the loss and is left out of the job."""
        return self.num_trained == 0


def _is_trained(message: Mapping[str, Any], index: int) -> bool:
    """Assistant messages train unless `weight` is 0; any other weight value is an error."""
    if message.get("role") != "assistant":
        return False
    weight = message.get("weight", 1)
    if type(weight) is not int or weight not in (0, 1):  # bool and 1.0 are not weights (files.py)
        raise ValueError(f"message {index}: 'weight' must be 0 or 1, got {weight!r}")
    return weight == 1


def _require_prefix(prefix: str, text: str, what: str) -> None:
    if not text.startswith(prefix):
        raise TemplateError(f"the chat template is not prefix-stable: the rendering of {what} is not a "
                            "prefix of the longer conversation's rendering; no exact loss mask exists")


def _cut_inside_tool_group(messages: Sequence[Mapping[str, Any]], i: int) -> bool:
    """Whether the cut after message i falls between two `tool` messages: templates write a group of
    tool results as one turn (Qwen's one `user` turn), so the shorter rendering closes a turn the
    longer one keeps open; such a cut is not a turn boundary and no span ends there."""
    return (messages[i].get("role") == "tool" and i + 1 < len(messages)
            and messages[i + 1].get("role") == "tool")


def trained_char_spans(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Tools | None = None,
                       call_id: Callable[[str], str] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character spans to train (module docstring: the rule).
    Call ids are written by `call_id` (default: as the template's tool-call family takes them,
    `frontend.template_family.call_id_rule`).

    Raises:
        TemplateError: a prefix rendering is not a prefix of the full one, an assistant content
            does not appear verbatim where its turn starts, the template fails on the conversation,
            or it drops tools, tool calls or tool results (`chat_render`).
        ValueError: an assistant `weight` other than 0 or 1, tool-call arguments that are not JSON.
    """
    messages = template_messages(messages, call_id or call_id_rule(tokenizer, messages))
    if tools or any(tool_calls(m) for m in messages):
        require_tool_support(tokenizer, with_tools=bool(tools))
    full = render(tokenizer, messages, False, tools)
    if tools:
        require_tools_rendered(tokenizer, messages, tools, full)
    require_tool_results_rendered(messages, full)
    eos: str = getattr(tokenizer, "eos_token", None) or ""
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if _cut_inside_tool_group(messages, i):
            continue
        upto = render(tokenizer, messages[:i + 1], False, tools)
        _require_prefix(upto, full, f"messages[:{i + 1}]")
        trained = _is_trained(message, i)
        calls = tool_calls(message) if message.get("role") == "assistant" else []
        if not trained and not calls:  # an untrained tool-call turn is still checked to render
            continue
        prompt = render(tokenizer, messages[:i], True, tools)
        _require_prefix(prompt, upto, f"messages[:{i}] with the generation prompt")
        content = content_text(message)
        start, end = len(prompt), len(prompt) + len(content)
        if upto[start:end] != content:
            raise TemplateError(f"message {i}: the chat template does not write the assistant content "
                                "verbatim after the generation prompt")
        # The end-of-turn marker: the first eos inside this turn's own text after the content.
        marker = upto.find(eos, end) if eos else -1
        if calls:  # the calls are trained up to the marker, or to the end of the turn without one
            turn_end = marker + len(eos) if marker >= 0 else len(upto)
            require_calls_rendered(tokenizer, messages[:i + 1], tools, upto, end, turn_end)
            end = turn_end
        elif marker >= 0:
            end = marker + len(eos)
        if trained and end > start:
            spans.append((start, end))
    return full, spans


def cut_past_context(messages: Sequence[Mapping[str, Any]], max_len: int,
                     longest: int) -> list[Mapping[str, Any]] | None:
    """The messages up to the one whose text certainly reaches `max_len + CUT_MARGIN_TOKENS` tokens (a token
    stands for at most `longest` characters), that one's content cut there; None when none does."""
    budget = (max_len + CUT_MARGIN_TOKENS) * longest
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str):
            continue
        if len(content) >= budget:
            return [*messages[:i], {**message, "content": content[:budget]}]
        budget -= len(content)
    return None


def encode_conversation(tokenizer: Any, messages: Sequence[Mapping[str, Any]], max_len: int,
                        tools: Tools | None = None, longest: int | None = None) -> EncodedConversation:
    """Tokenize one conversation with the chat template and mask it to its trained assistant tokens.

    `tools` is the row's `tools` list (OpenAI's format), passed to the template. Returns an
    `EncodedConversation`; `.skipped` is true when no trained target is left (all assistant messages have
    weight 0, or truncation cut them off), and the caller counts it. A conversation far longer than the
    context is cut before it is tokenized (module docstring); `longest`: the tokenizer's
    `longest_token_chars`, when the caller has it.

    Raises:
        TemplateError, ValueError: see `trained_char_spans`; also a tokenizer without offsets.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (a target needs a preceding token), got {max_len}")
    cut = cut_past_context(messages, max_len, longest or longest_token_chars(tokenizer))
    if cut is not None:
        encoded = _encode(tokenizer, cut, max_len, tools)
        if encoded.full_length > max_len + CUT_MARGIN_TOKENS // 2:  # the cut lies past the context, as bounded
            return encoded
    return _encode(tokenizer, messages, max_len, tools)


def _encode(tokenizer: Any, messages: Sequence[Mapping[str, Any]], max_len: int,
            tools: Tools | None) -> EncodedConversation:
    call_id = call_id_rule(tokenizer, messages)
    full, spans = trained_char_spans(tokenizer, messages, tools, call_id)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    reference = tokenizer.apply_chat_template(template_messages(messages, call_id), tokenize=True, return_dict=False,
                                              tools=list(tools) if tools else None)
    if list(ids) != list(reference):
        raise TemplateError("tokenizing the rendered text does not give apply_chat_template's ids; "
                            "the character offsets would not map onto the trained tokens")
    # A token is trained when its characters overlap a trained span (edge tokens: module docstring).
    trained = [any(s < span_end and e > span_start for span_start, span_end in spans)
               for s, e in offsets]
    return EncodedConversation(token_ids=list(ids[:max_len]), trained=trained[:max_len],
                               truncated=len(ids) > max_len, full_length=len(ids))


@dataclass(slots=True)
class TrainingData:
    """The job's training examples (skipped ones left out) and what the preparation found."""

    examples: list[TrainingExample]
    num_examples: int  # examples given, skipped ones included
    num_skipped: int
    num_truncated: int
    trained_tokens: int  # trained targets of one epoch
    example_indices: list[int] = field(default_factory=list)  # input index of each sequence
    warnings: list[str] = field(default_factory=list)


def unencodable(err: TypeError) -> str:
    """Why the tokenizer could not encode a conversation's text: it raises TypeError on text no UTF-8 holds
    (a lone surrogate, in tool-call arguments or a file stored before uploads refused them)."""
    return f"the tokenizer cannot encode its text ({err}); text must be valid Unicode"


def indices_text(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:MAX_WARNED_INDICES])
    more = len(indices) - MAX_WARNED_INDICES
    return shown + (f" and {more} more" if more > 0 else "")


Example = Mapping[str, Any] | Sequence[Mapping[str, Any]]  # a JSONL object or a bare message list


def prepare_training_data(tokenizer: Any, examples: Sequence[Example], max_len: int,
                          what: str = "training example") -> TrainingData:
    """Encode every example (a JSONL object with `messages` and optional `tools`, or a bare message list).

    Truncated examples are kept and warned about; examples without a trained token are skipped,
    counted and warned about. Indices in warnings are 0-based positions in `examples`.

    Raises:
        TemplateError: as `encode_conversation`, or text the tokenizer cannot encode, its message starting
            with `what` and the example's 1-based position ("training example 4: ...").
        ValueError: as `encode_conversation`.
    """
    encoded_examples: list[TrainingExample] = []
    kept: list[int] = []
    truncated: list[int] = []
    skipped: list[int] = []
    longest = longest_token_chars(tokenizer)
    for index, example in enumerate(examples):
        messages = example["messages"] if isinstance(example, Mapping) else example
        tools = example.get("tools") if isinstance(example, Mapping) else None
        try:
            encoded = encode_conversation(tokenizer, messages, max_len, tools, longest)
        except TemplateError as err:  # name the example: the file may hold thousands
            raise TemplateError(f"{what} {index + 1}: {err}") from err
        except TypeError as err:
            raise TemplateError(f"{what} {index + 1}: {unencodable(err)}") from err
        if encoded.truncated:
            truncated.append(index)
        if encoded.skipped:
            skipped.append(index)
            continue
        encoded_examples.append(TrainingExample(encoded.token_ids, encoded.trained))
        kept.append(index)
    warnings = []
    if truncated:
        warnings.append(f"{len(truncated)} example(s) longer than {max_len} tokens were truncated to "
                        f"{max_len}: index {indices_text(truncated)}")
    if skipped:
        warnings.append(f"{len(skipped)} example(s) have no trainable assistant token and were "
                        f"skipped: index {indices_text(skipped)}")
    return TrainingData(examples=encoded_examples, num_examples=len(examples), num_skipped=len(skipped),
                        num_truncated=len(truncated),
                        trained_tokens=sum(sum(example.trained[1:]) for example in encoded_examples),
                        example_indices=kept, warnings=warnings)
