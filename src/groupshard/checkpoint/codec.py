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
        return {"__tensor__": value.tolist(), "dtype": dtype_name(value.dtype)}
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
            return torch.tensor(value["__tensor__"], dtype=dtype(value["dtype"]))
    return value


def dtype_name(value: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(value).removeprefix("torch.")


def dtype(name: Any) -> torch.dtype:
    """The torch dtype a description names (never any other attribute of torch)."""
    found = vars(torch).get(str(name).removeprefix("torch."))
    if not isinstance(found, torch.dtype):
        raise CheckpointError(f"The checkpoint's {META_FILE} names an unknown dtype {name!r}")
    return found
