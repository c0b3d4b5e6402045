"""A Tinker `forward_backward` body as coserve's call: its data as training sequences, its loss.

A Tinker datum is `model_input` (tokens x_0..x_{N-1}) and `loss_fn_inputs`, arrays of N entries each:
`target_tokens` (y_i: the token position i predicts), `weights` (cross-entropy), `logprobs` (the
sampler's, for the policy-gradient losses) and `advantages`. coserve trains next-token targets, so
y_i must be x_{i+1} for i < N - 1 (every Tinker recipe builds them so); the datum is then the sequence
x_0..x_{N-1}, y_{N-1}, and its arrays shift by one to align with it (`contract.training_calls`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.tinker_wire import tensor_values
from coserve.contract.loss_spec import DEFAULT_CLIP_HIGH, DEFAULT_CLIP_LOW, LossKind, LossSpec, TokenInputs
from coserve.contract.training_calls import ForwardBackwardCall, TrainingDatum
from coserve.contract.training_settings import SettingsError

_LOSSES = {kind.value: kind for kind in LossKind if kind is not LossKind.DPO}
_INPUTS = {LossKind.CROSS_ENTROPY: ("target_tokens", "weights"),
           LossKind.IMPORTANCE_SAMPLING: ("target_tokens", "logprobs", "advantages"),
           LossKind.PPO: ("target_tokens", "logprobs", "advantages"),
           LossKind.CISPO: ("target_tokens", "logprobs", "advantages")}
_CONFIG = {"clip_low_threshold", "clip_high_threshold"}


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


def datum(message: Any, index: int, kind: LossKind, max_len: int) -> TrainingDatum:
    """One protobuf `Datum` as a training sequence (module docstring)."""
    where = f"data[{index}]"
    tokens: list[int] = []
    for chunk in message.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise bad(f"{where}: coserve serves text models; only encoded_text chunks are accepted.",
                      f"{where}.model_input")
        tokens.extend(int(t) for t in np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    arrays = _inputs(message, where, kind, len(tokens))
    targets = arrays["target_tokens"].astype(np.int64)
    if len(tokens) < 1 or len(tokens) + 1 > max_len:
        raise bad(f"{where}: a datum has 1 to {max_len - 1} input tokens, got {len(tokens)}.", f"{where}.model_input")
    if not np.array_equal(targets[:-1], np.asarray(tokens[1:], dtype=np.int64)):
        raise bad(f"{where}: target_tokens must be model_input shifted by one (target i is input i + 1): "
                  "coserve trains next-token targets.", f"{where}.loss_fn_inputs.target_tokens")
    ids = tokens + [int(targets[-1])]

    def aligned(name: str) -> list[float] | None:
        values = arrays.get(name)
        return None if values is None else [0.0] + [float(v) for v in values]

    weights = aligned("weights") if kind is LossKind.CROSS_ENTROPY else None
    if weights is None and kind is LossKind.CROSS_ENTROPY:
        weights = [0.0] + [1.0] * len(tokens)
    inputs = TokenInputs(weights=weights, sampling_logprobs=aligned("logprobs"), advantages=aligned("advantages"))
    try:
        inputs.check(kind, len(ids))
    except SettingsError as error:
        raise bad(f"{where}: {error}", f"{where}.loss_fn_inputs.{error.param}") from None
    return TrainingDatum(ids, inputs)


def _inputs(message: Any, where: str, kind: LossKind, length: int) -> dict[str, np.ndarray]:
    allowed = _INPUTS[kind]
    arrays = {}
    for name, tensor in message.loss_fn_inputs.items():
        if name not in allowed:
            raise bad(f"{where}: loss_fn {kind.value!r} takes loss_fn_inputs {list(allowed)}, not {name!r}.",
                      f"{where}.loss_fn_inputs.{name}")
        try:
            values = tensor_values(tensor)
        except ValueError as error:
            raise bad(f"{where}.{name}: {error}", f"{where}.loss_fn_inputs.{name}") from None
        if len(values) != length or not all(math.isfinite(float(v)) for v in values):
            raise bad(f"{where}.{name} has {len(values)} finite entries for {length} input tokens.",
                      f"{where}.loss_fn_inputs.{name}")
        arrays[name] = values
    required = [n for n in allowed if n != "weights" and n not in arrays]
    if required:
        raise bad(f"{where}: loss_fn {kind.value!r} needs loss_fn_inputs {required}.", f"{where}.loss_fn_inputs")
    return arrays


def forward_backward_call(message: Any, max_len: int) -> ForwardBackwardCall:
    """The whole request as a call (400 for anything coserve cannot train)."""
    config = {k: v.number for k, v in message.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"}
    texts = [k for k, v in message.loss_fn_config_v2.items() if v.WhichOneof("value") == "text"]
    if texts:
        raise bad(f"loss_fn_config {texts}: coserve's losses take numbers only.", "loss_fn_config")
    config = config or dict(message.loss_fn_config)
    loss = loss_spec(message.loss_fn, config)
    if not message.data:
        raise bad("forward_backward needs at least one datum.", "data")
    data = [datum(d, i, loss.kind, max_len) for i, d in enumerate(message.data)]
    return ForwardBackwardCall(data, loss, backward=not message.forward_only)
