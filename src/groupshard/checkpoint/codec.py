"""JSON for what a checkpoint's description holds besides names and shapes: hyperparameters,
non-tensor optimizer state and extras (tensors, numbers, strings, None, and lists, tuples
and dicts of them). No pickle: decoding builds nothing but these values."""

from __future__ import annotations

from typing import Any

import torch

from groupshard.checkpoint.errors import CheckpointError
from groupshard.checkpoint.folders import META_FILE


def encode(value: Any) -> Any:
    """``value`` as JSON-compatible data that :func:`decode` turns back into it."""
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        encoded = {"__tensor__": value.tolist(), "dtype": dtype_name(value.dtype)}
        if not value.is_contiguous():  # e.g. QR's column-major Q: matmuls round by layout
            encoded["stride"] = list(value.stride())
        return encoded
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"Cannot store a {type(value).__name__} in a checkpoint; use tensors, numbers, "
        "strings, None, and lists, tuples or dicts of them"
    )


def decode(value: Any) -> Any:
    """The value :func:`encode` was given."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {decode(k): decode(v) for k, v in value["__dict__"]}
        if "__tensor__" in value:
            tensor = torch.tensor(value["__tensor__"], dtype=dtype(value["dtype"]))
            if "stride" not in value:
                return tensor
            return _strided(tensor, value["stride"])
    return value


def _strided(tensor: torch.Tensor, stride: Any) -> torch.Tensor:
    """``tensor`` laid out with ``stride`` (a permutation of a dense layout), else as is."""
    stride = [int(s) for s in stride]
    if len(stride) != tensor.dim():
        return tensor
    expected, ok = 1, True
    for d in sorted(range(tensor.dim()), key=lambda d: stride[d]):
        ok = ok and stride[d] == expected
        expected *= tensor.shape[d]
    if not ok:
        return tensor
    return torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype).copy_(tensor)


def dtype_name(value: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(value).removeprefix("torch.")


def dtype(name: Any) -> torch.dtype:
    """The torch dtype a description names (never any other attribute of torch)."""
    found = vars(torch).get(str(name).removeprefix("torch."))
    if not isinstance(found, torch.dtype):
        raise CheckpointError(f"The checkpoint's {META_FILE} names an unknown dtype {name!r}")
    return found
