"""A Tinker `Tensor` message (`tinker_wire`) as a flat numpy array, bounded before anything is allocated.

Everything in a tensor comes from the client: its dtype, its bytes and, for a CSR tensor, its `shape`
and index arrays. A tensor of a datum's `loss_fn_inputs` has exactly one entry per input token, so the
caller passes that `length` and nothing is allocated before the tensor is known to describe that many
entries: a dense tensor is a view of its bytes (`np.frombuffer`, no copy), a CSR tensor's `shape` must
multiply to `length` (each dimension at least 1) and its index arrays must be consistent with it before
the dense array of `length` entries is made. The CSR scatter is vectorized (no loop over rows in
Python), so the time it takes is linear in the body's bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DTYPES: dict[int, type[np.generic]] = {1: np.float32, 2: np.int64, 3: np.int32}
_DTYPE_NAMES = "float32 (1), int64 (2) or int32 (3)"


class TensorError(ValueError):
    """A tensor that does not describe `length` entries of a known dtype (the message says why)."""


def tensor_values(tensor: Any, length: int) -> np.ndarray:
    """The tensor as a flat array of `length` entries (CSR made dense, missing entries 0).

    Raises:
        TensorError: an unknown dtype, bytes that are not whole entries, a shape that is not `length`
            entries, or CSR indices that do not fit the shape.
    """
    dtype = DTYPES.get(int(tensor.dtype))
    if dtype is None:
        raise TensorError(f"tensor dtype {int(tensor.dtype)} is not {_DTYPE_NAMES}")
    shape = [int(d) for d in tensor.shape]
    if len(shape) > 8 or any(d < 0 for d in shape):
        raise TensorError(f"a tensor shape has at most 8 dimensions, none negative; got {shape[:9]}")
    if tensor.WhichOneof("encoding") != "sparse_csr":
        values = _frombuffer(tensor.dense, dtype, "dense")
        if shape and _product(shape) != len(values):
            raise TensorError(f"its shape {shape} does not hold its {len(values)} values")
        if len(values) != length:
            raise TensorError(f"it has {len(values)} entries for {length} input tokens")
        return values
    return _csr(tensor.sparse_csr, dtype, shape, length)


def _csr(csr: Any, dtype: type[np.generic], shape: list[int], length: int) -> np.ndarray:
    """A CSR tensor's dense form, each bound checked before the `length` entries are allocated."""
    if len(shape) != 2 or min(shape) < 1 or _product(shape) != length:
        raise TensorError(f"a sparse (CSR) tensor is 2-D with one entry per input token ({length}), "
                          f"each dimension at least 1; its shape is {shape}")
    rows, cols = shape
    values = _frombuffer(csr.values, dtype, "values")
    crow = _frombuffer(csr.crow_indices, np.int64, "crow_indices")
    col = _frombuffer(csr.col_indices, np.int64, "col_indices")
    if len(crow) != rows + 1 or len(col) != len(values) or len(values) > length:
        raise TensorError(f"a sparse tensor of shape {shape} has {rows + 1} crow_indices and as many "
                          f"col_indices as values (at most {length}); got {len(crow)}, {len(col)} and "
                          f"{len(values)}")
    counts = np.diff(crow)
    if crow[0] != 0 or crow[-1] != len(values) or (counts < 0).any():
        raise TensorError("a sparse tensor's crow_indices rise from 0 to its number of values")
    if len(col) and (col.min() < 0 or col.max() >= cols):
        raise TensorError(f"a sparse tensor's col_indices are in 0..{cols - 1}")
    dense = np.zeros(length, dtype=dtype)
    dense[np.repeat(np.arange(rows, dtype=np.int64), counts) * cols + col] = values
    return dense


def _frombuffer(data: bytes, dtype: type[np.generic], what: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise TensorError(f"its {what} bytes ({len(data)}) are not whole {np.dtype(dtype).name} entries")
    return np.frombuffer(data, dtype=dtype)


def _product(shape: list[int]) -> int:
    """The product of `shape` as a Python int (no overflow, whatever the client sent)."""
    total = 1
    for d in shape:
        total *= d
    return total
