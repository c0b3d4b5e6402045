"""A Tinker `forward_backward` body as coserve's call: its data as training sequences, its loss.

A Tinker datum is `model_input` (tokens x_0..x_{N-1}) and `loss_fn_inputs`, arrays of N entries each:
`target_tokens` (y_i: the token position i predicts), `weights` (cross-entropy), `logprobs` (the
sampler's, for the policy-gradient losses) and `advantages`. coserve trains next-token targets, so
y_i must be x_{i+1} for i < N - 1 (every Tinker recipe builds them so); the datum is then the sequence
x_0..x_{N-1}, y_{N-1}, and its arrays shift by one to align with it (`contract.training_calls`).

Everything is checked here, before the call reaches the scheduler or the engine (docs/limits.md): every
token id (`model_input` and `target_tokens`) against the model's vocabulary, every array against its
datum's length, the number of data and the call's tokens against `MAX_DATA` and `MAX_CALL_TOKENS`.
A refusal is a 400 naming the datum and the field. The checks are vectorized (numpy): the time they
take is linear in the body's bytes, and they run off the event loop (`tinker_body`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.tinker_tensors import TensorError, tensor_values
from coserve.contract.loss_spec import DEFAULT_CLIP_HIGH, DEFAULT_CLIP_LOW, LossKind, LossSpec, TokenInputs
from coserve.contract.training_calls import ForwardBackwardCall, TrainingDatum
from coserve.contract.training_settings import SettingsError

_LOSSES = {kind.value: kind for kind in LossKind if kind is not LossKind.DPO}
_INPUTS = {LossKind.CROSS_ENTROPY: ("target_tokens", "weights"),
           LossKind.IMPORTANCE_SAMPLING: ("target_tokens", "logprobs", "advantages"),
           LossKind.PPO: ("target_tokens", "logprobs", "advantages"),
           LossKind.CISPO: ("target_tokens", "logprobs", "advantages")}
_CONFIG = {"clip_low_threshold", "clip_high_threshold"}
MAX_DATA = 4096  # data in one forward_backward / forward call
MAX_CALL_TOKENS = 2**18  # input tokens of one call, all its data together
MAX_CHUNKS = 4 * MAX_DATA  # model_input chunks of one call, all its data together


@dataclass(frozen=True, slots=True)
class ModelBounds:
    """What a datum is checked against: the model's context length and vocabulary size."""

    max_len: int
    vocab_size: int


def bad(message: str, param: str, code: str = "invalid_value") -> ProtocolError:
    return ProtocolError(message, param=param, code=code)


def loss_spec(name: str, config: dict[str, float]) -> LossSpec:
    """The loss `name` with its config (`clip_low_threshold`, `clip_high_threshold`)."""
    kind = _LOSSES.get(name)
    if kind is None:
        raise bad(f"Unknown loss_fn {name!r}: coserve trains with {sorted(_LOSSES)}.", "loss_fn")
    unknown = sorted(set(config) - _CONFIG) if kind in (LossKind.PPO, LossKind.CISPO) else sorted(config)
    if unknown:
        raise bad(f"loss_fn {name!r} takes no loss_fn_config {unknown}.", "loss_fn_config")
    try:
        return LossSpec(kind, config.get("clip_low_threshold", DEFAULT_CLIP_LOW),
                        config.get("clip_high_threshold", DEFAULT_CLIP_HIGH))
    except SettingsError as error:
        raise bad(str(error), "loss_fn_config") from None


def datum(message: Any, index: int, kind: LossKind, bounds: ModelBounds) -> TrainingDatum:
    """One protobuf `Datum` as a training sequence (module docstring)."""
    where = f"data[{index}]"
    chunks = []
    for chunk in message.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise bad(f"{where}: coserve serves text models; only encoded_text chunks are accepted.",
                      f"{where}.model_input")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise bad(f"{where}: an encoded_text chunk's tokens are int32 ({len(raw)} bytes).", f"{where}.model_input")
        chunks.append(np.frombuffer(raw, dtype=np.int32))
    tokens = np.concatenate(chunks).astype(np.int64) if chunks else np.zeros(0, np.int64)
    if len(tokens) < 1 or len(tokens) + 1 > bounds.max_len:
        raise bad(f"{where}: a datum has 1 to {bounds.max_len - 1} input tokens, got {len(tokens)}.",
                  f"{where}.model_input")
    _check_ids(tokens, bounds.vocab_size, where, f"{where}.model_input")
    arrays = _inputs(message, where, kind, len(tokens))
    targets = arrays["target_tokens"].astype(np.int64)
    _check_ids(targets, bounds.vocab_size, where, f"{where}.loss_fn_inputs.target_tokens")
    if not np.array_equal(targets[:-1], tokens[1:]):
        raise bad(f"{where}: target_tokens must be model_input shifted by one (target i is input i + 1): "
                  "coserve trains next-token targets.", f"{where}.loss_fn_inputs.target_tokens")
    ids = [*tokens.tolist(), int(targets[-1])]

    def aligned(name: str) -> list[float] | None:
        values = arrays.get(name)
        return None if values is None else [0.0, *values.astype(np.float64).tolist()]

    weights = aligned("weights") if kind is LossKind.CROSS_ENTROPY else None
    if weights is None and kind is LossKind.CROSS_ENTROPY:
        weights = [0.0] + [1.0] * len(tokens)
    inputs = TokenInputs(weights=weights, sampling_logprobs=aligned("logprobs"), advantages=aligned("advantages"))
    try:
        inputs.check(kind, len(ids))
    except SettingsError as error:
        raise bad(f"{where}: {error}", f"{where}.loss_fn_inputs.{error.param}") from None
    return TrainingDatum(ids, inputs)


def _check_ids(ids: np.ndarray, vocab_size: int, where: str, param: str) -> None:
    """Every id in `ids` is a token of the model (0..vocab_size - 1); a 400 naming the first one that is not."""
    outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(outside):
        first = int(outside[0])
        raise bad(f"{where}: token id {int(ids[first])} at position {first} is not in the model's vocabulary "
                  f"(ids 0..{vocab_size - 1}).", param)


def _inputs(message: Any, where: str, kind: LossKind, length: int) -> dict[str, np.ndarray]:
    allowed = _INPUTS[kind]
    arrays = {}
    for name, tensor in message.loss_fn_inputs.items():
        if name not in allowed:
            raise bad(f"{where}: loss_fn {kind.value!r} takes loss_fn_inputs {list(allowed)}, not {name!r}.",
                      f"{where}.loss_fn_inputs.{name}")
        try:
            values = tensor_values(tensor, length)
        except TensorError as error:
            raise bad(f"{where}.loss_fn_inputs.{name}: {error}.", f"{where}.loss_fn_inputs.{name}") from None
        if not np.isfinite(values).all():
            raise bad(f"{where}.loss_fn_inputs.{name} holds a value that is not a finite number.",
                      f"{where}.loss_fn_inputs.{name}")
        arrays[name] = values
    required = [n for n in allowed if n != "weights" and n not in arrays]
    if required:
        raise bad(f"{where}: loss_fn {kind.value!r} needs loss_fn_inputs {required}.", f"{where}.loss_fn_inputs")
    return arrays


def forward_backward_call(message: Any, bounds: ModelBounds) -> ForwardBackwardCall:
    """The whole request as a call (400 for anything coserve cannot train)."""
    config = {k: v.number for k, v in message.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"}
    texts = [k for k, v in message.loss_fn_config_v2.items() if v.WhichOneof("value") == "text"]
    if texts:
        raise bad(f"loss_fn_config {texts}: coserve's losses take numbers only.", "loss_fn_config")
    config = config or dict(message.loss_fn_config)
    loss = loss_spec(message.loss_fn, config)
    if not message.data:
        raise bad("forward_backward needs at least one datum.", "data")
    if len(message.data) > MAX_DATA:
        raise bad(f"a call has at most {MAX_DATA} data, got {len(message.data)}.", "data")
    chunks = sum(len(d.model_input) for d in message.data)
    if chunks > MAX_CHUNKS:
        raise bad(f"a call has at most {MAX_CHUNKS} model_input chunks over all its data, got {chunks}.", "data")
    total = sum(len(c.encoded_text.tokens) // 4 for d in message.data for c in d.model_input)
    if total > MAX_CALL_TOKENS:
        raise bad(f"a call has at most {MAX_CALL_TOKENS} input tokens over all its data, got {total}: split it "
                  "into several calls.", "data")
    data = [datum(d, i, loss.kind, bounds) for i, d in enumerate(message.data)]
    return ForwardBackwardCall(data, loss, backward=not message.forward_only)
