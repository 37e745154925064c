"""Mixed precision: the dtypes a unit computes and reduces in, while its shards stay masters.

Named and defaulted as FSDP2's ``MixedPrecisionPolicy`` so that its users recognise it.
Pure: no collectives, no module state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """How a sharded unit computes; the shards (and the optimizer) keep their own dtype.

    Attributes:
        param_dtype: the dtype a unit is gathered in and computes in (the all-gather moves
            this dtype: bf16 halves fp32's bytes). ``None``: the parameters' own dtype.
        reduce_dtype: the dtype gradients are reduced (and accumulated under ``no_sync``)
            in, before they land in the shards' dtype. ``None``: ``param_dtype``.
        output_dtype: cast the unit's floating-point outputs to this dtype (``None``: leave).
        cast_forward_inputs: cast the unit's floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is None:
                continue
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(
                    f"MixedPrecision expects {name} to be a floating-point torch.dtype (e.g. "
                    f"torch.bfloat16) or None but got {dtype!r}"
                )
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecision expects cast_forward_inputs to be a bool but got "
                f"{self.cast_forward_inputs!r}"
            )
        if (
            self.param_dtype is not None
            and self.reduce_dtype is not None
            and torch.finfo(self.reduce_dtype).bits < torch.finfo(self.param_dtype).bits
        ):
            warnings.warn(
                f"MixedPrecision(reduce_dtype={self.reduce_dtype}) is narrower than "
                f"param_dtype={self.param_dtype}: gradients computed in {self.param_dtype} lose "
                "precision in the reduction; use reduce_dtype=torch.float32 unless the "
                "bandwidth matters more.",
                UserWarning,
                stacklevel=2,
            )

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype parameters stored in ``dtype`` are gathered and computed in."""
        return self.param_dtype or dtype

    def gradient_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of parameters stored in ``dtype`` are reduced in."""
        return self.reduce_dtype or self.compute_dtype(dtype)

    def cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """``args`` and ``kwargs`` with floating-point tensors in ``param_dtype``."""
        if not (self.cast_forward_inputs and self.param_dtype is not None):
            return args, kwargs
        return _cast_floating(self.param_dtype, (args, kwargs))

    def cast_output(self, output: Any) -> Any:
        """``output`` with floating-point tensors in ``output_dtype``."""
        if self.output_dtype is None:
            return output
        return _cast_floating(self.output_dtype, output)


PrecisionSpec = MixedPrecision | Callable[[str, nn.Module], MixedPrecision | None] | None
"""What ``gs.shard`` accepts: one policy for every unit, or one per unit from
``f(unit_name, unit_module)`` (``None``: that unit computes in its parameters' dtype)."""


def _cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    return tree_map(cast, tree)


def unit_policy(spec: PrecisionSpec, unit_name: str, module: nn.Module) -> MixedPrecision | None:
    """The policy of one unit, checked."""
    if spec is None or isinstance(spec, MixedPrecision):
        return spec
    if not callable(spec):
        raise TypeError(
            "Expects mixed_precision to be a gs.MixedPrecision, a function "
            f"(unit_name, module) -> gs.MixedPrecision | None, or None, but got {spec!r}"
        )
    policy = spec(unit_name, module)
    if policy is not None and not isinstance(policy, MixedPrecision):
        raise TypeError(
            f"mixed_precision({unit_name or '<root>'!r}, ...) returned {policy!r}; expects a "
            "gs.MixedPrecision or None"
        )
    return policy
