"""Small pieces shared by the optimizers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def evaluate_closure(closure: Callable[[], Any] | None) -> Any:
    """Run an optimizer closure with gradients enabled (``step`` itself runs without)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def params_with_grad(
    param_groups: list[dict[str, Any]],
) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    """``(group, parameter)`` for every parameter that has a gradient, in group order."""
    for group in param_groups:
        for param in group["params"]:
            if param.grad is not None:
                yield group, param
