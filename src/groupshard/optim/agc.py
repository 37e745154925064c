"""Adaptive gradient clipping (Brock et al., 2021, NFNets), unit-wise, exact on shards."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from groupshard.norms import SegmentReduction, expand
from groupshard.optim.wrapper import OptimizerWrapper


def adaptive_clip_grad_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, clipping: float = 0.01, eps: float = 1e-3
) -> None:
    """Clip each unit's gradient to ``clipping * max(||W_unit||, eps)``, in place.

    A unit is a row (``W[i]``) of a matrix or higher tensor and the whole tensor for
    vectors and scalars, as in NFNets; on shards, rows may straddle ranks and their
    norms come from one all-reduce for all parameters.
    """
    if clipping <= 0:
        raise ValueError(f"Expects clipping > 0 but got {clipping=}")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    reduction = SegmentReduction(2.0)
    pending = []
    for param in params:
        if param.grad is not None:
            handles = (
                reduction.add(param, by_rows=True),
                reduction.add(param.grad, param, by_rows=True),
            )
            pending.append((param, handles))
    totals = reduction.reduce()
    for param, (weight_handle, grad_handle) in pending:
        max_norm = totals[weight_handle].sqrt().clamp(min=eps) * clipping
        grad_norm = totals[grad_handle].sqrt()
        scale = torch.where(
            grad_norm < max_norm, torch.ones_like(grad_norm), max_norm / grad_norm.clamp(min=1e-6)
        )
        param.grad.mul_(expand(scale, param, by_rows=True, fill=1.0))


class AGC(OptimizerWrapper):
    """Adaptive gradient clipping before the inner optimizer's step.

    Groups with ``agc=False`` (e.g. the final classifier, as in NFNets) are not clipped.

    Args:
        optimizer: the inner optimizer.
        clipping: the clipping factor lambda.
        eps: the smallest weight norm a unit is credited with.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, clipping: float = 0.01, eps: float = 1e-3
    ) -> None:
        if clipping <= 0:
            raise ValueError(f"Expects clipping > 0 but got {clipping=}")
        self.clipping = clipping
        self.eps = eps
        super().__init__(optimizer, {"agc": True})

    def adjust_gradients(self) -> None:
        params = [p for g in self.param_groups if g.get("agc", True) for p in g["params"]]
        adaptive_clip_grad_(params, self.clipping, self.eps)
