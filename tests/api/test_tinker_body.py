"""A forward_backward body checked before the engine (`tinker_body`, `tinker_data`, `tinker_tensors`): token
ids against the vocabulary, tensors against their datum's length, CSR shapes bounded before allocation,
zstd capped whatever the frame declares; each refusal a ProtocolError naming the field."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import zstandard

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.tinker_tensors import TensorError, tensor_values
from coserve.api.protocol.tinker_wire import ForwardBackwardRequest
from coserve.api.serving.tinker_body import decompress, parse_call
from coserve.api.serving.tinker_data import MAX_CALL_TOKENS, MAX_DATA, ModelBounds

BOUNDS = ModelBounds(max_len=512, vocab_size=100)


def body(tokens: list[int], targets: list[int] | None = None, loss_fn: str = "cross_entropy",
         **inputs: Any) -> Any:
    """A ForwardBackwardRequest message of one datum (targets: tokens shifted by one, then 7)."""
    message = ForwardBackwardRequest(model_id="run", loss_fn=loss_fn)
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    targets = [*tokens[1:], 7] if targets is None else targets
    datum.loss_fn_inputs["target_tokens"].dense = np.asarray(targets, np.int64).tobytes()
    datum.loss_fn_inputs["target_tokens"].dtype = 2
    for name, tensor in inputs.items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    return message


def parsed(message: Any, zstd: bool = False) -> Any:
    raw = message.SerializeToString()
    return parse_call(zstandard.ZstdCompressor().compress(raw) if zstd else raw, zstd, 2**20, BOUNDS)


def refused(message: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        parsed(message)
    assert caught.value.status == 400
    return caught.value


def test_a_good_body_is_a_call_compressed_or_not() -> None:
    for zstd in (False, True):
        run_id, call = parsed(body([5, 6, 7]), zstd)
        assert run_id == "run" and call.data[0].token_ids == [5, 6, 7, 7]


@pytest.mark.parametrize("tokens,targets,param", [
    ([5, 100, 7], None, "data[0].model_input"),
    ([5, -1, 7], None, "data[0].model_input"),
    ([5, 6, 7], [6, 7, 100], "data[0].loss_fn_inputs.target_tokens"),
    ([5, 6, 7], [6, 7, 2**40], "data[0].loss_fn_inputs.target_tokens"),
])
def test_token_ids_outside_the_vocabulary_are_a_400(tokens: list[int], targets: list[int] | None,
                                                     param: str) -> None:
    error = refused(body(tokens, targets))
    assert error.param == param and "vocabulary" in str(error), error


def test_a_weights_tensor_of_another_length_is_a_400() -> None:
    weights = ForwardBackwardRequest().data.add().loss_fn_inputs["weights"]
    weights.dtype, weights.dense = 1, np.ones(5, np.float32).tobytes()
    error = refused(body([5, 6, 7], weights=weights))
    assert error.param == "data[0].loss_fn_inputs.weights" and "3 input tokens" in str(error)


def csr(shape: list[int], crow: list[int], cols: list[int], values: list[float]) -> Any:
    tensor = ForwardBackwardRequest().data.add().loss_fn_inputs["weights"]
    tensor.dtype = 1
    tensor.shape.extend(shape)
    tensor.sparse_csr.values = np.asarray(values, np.float32).tobytes()
    tensor.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
    tensor.sparse_csr.col_indices = np.asarray(cols, np.int64).tobytes()
    return tensor


def test_a_csr_tensor_is_made_dense_without_a_loop() -> None:
    values = tensor_values(csr([2, 3], [0, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0]), 6)
    assert values.tolist() == [1.0, 0.0, 2.0, 0.0, 3.0, 0.0]


@pytest.mark.parametrize("shape,crow,cols,values", [
    ([2**40, 1], [0, 0], [], []),  # the 2^40: refused before any allocation
    ([2**20, 2**20], [0], [], []),
    ([3, 2], [0, 0, 0, 0], [], []),  # the wrong number of entries for the datum (3)
    ([3, 1], [0, 1, 1], [0], [1.0]),  # crow_indices of the wrong length
    ([3, 1], [0, 2, 1, 1], [0], [1.0]),  # falling crow_indices
    ([3, 1], [0, 1, 1, 1], [5], [1.0]),  # a column outside the shape
    ([3, 1], [0, 1, 1, 1], [-1], [1.0]),
    ([0, 3], [0], [], []),
    ([-3, -1], [0], [], []),
])
def test_a_csr_shape_that_is_not_the_datum_is_refused_before_allocation(
        shape: list[int], crow: list[int], cols: list[int], values: list[float]) -> None:
    with pytest.raises(TensorError):
        tensor_values(csr(shape, crow, cols, values), 3)
    error = refused(body([5, 6, 7], weights=csr(shape, crow, cols, values)))
    assert error.param == "data[0].loss_fn_inputs.weights", error


def test_a_large_csr_body_decodes_in_linear_time() -> None:
    """A datum of 100k tokens, its weights a CSR of 100k rows: vectorized, well under a second."""
    n = 100_000
    tokens = list(np.random.default_rng(0).integers(0, 100, n))
    weights = csr([n, 1], list(range(n + 1)), [0] * n, [1.0] * n)
    started = time.perf_counter()
    _, call = parse_call(body(tokens, weights=weights).SerializeToString(), False, 2**24,
                         ModelBounds(n + 2, 100))
    assert time.perf_counter() - started < 1.0 and len(call.data[0].token_ids) == n + 1


def test_the_call_sizes_are_bounded() -> None:
    many = ForwardBackwardRequest(model_id="run", loss_fn="cross_entropy")
    for _ in range(MAX_DATA + 1):
        many.data.add()
    assert refused(many).param == "data"
    big = body(list(range(10)))
    big.data[0].model_input[0].encoded_text.tokens = np.zeros(MAX_CALL_TOKENS + 1, np.int32).tobytes()
    assert refused(big).param == "data"


def test_a_zstd_bomb_declaring_1_gib_is_a_413_at_the_cap() -> None:
    """python-zstandard's one-shot decompress trusts a declared content size over `max_output_size`; the
    streamed read stops at the cap whatever the header says."""
    stream = zstandard.ZstdCompressor(level=3).compressobj(size=2**30)  # declares its 1 GiB content size
    zeros = bytes(2**24)
    bomb = b"".join(stream.compress(zeros) for _ in range(64)) + stream.flush()
    assert zstandard.frame_content_size(bomb) == 2**30 and len(bomb) < 64 * 2**10
    started = time.perf_counter()
    with pytest.raises(ProtocolError) as caught:
        decompress(bomb, 4 * 2**20)
    assert caught.value.status == 413 and time.perf_counter() - started < 1.0
    with pytest.raises(ProtocolError) as caught:
        decompress(b"not zstd at all", 2**20)
    assert caught.value.status == 400


def test_a_zstd_frame_asking_for_a_huge_window_is_refused() -> None:
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=27, write_content_size=False)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    framed = stream.compress(b"x" * 2**20) + stream.flush()
    with pytest.raises(ProtocolError) as caught:
        decompress(framed, 2**22)
    assert caught.value.status == 400 and "memory" in str(caught.value).lower()
