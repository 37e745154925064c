"""LARS: SGD with momentum and a per-parameter local learning rate."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from groupshard.norms import SegmentReduction, scale_by_parameter_
from groupshard.optim.common import evaluate_closure, params_with_grad


def lars_local_lr(
    weight_norm: torch.Tensor,
    grad_norm: torch.Tensor,
    trust_coefficient: float,
    weight_decay: float,
    eps: float,
) -> torch.Tensor:
    """``trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)``, 1 where a norm is 0."""
    ratio = trust_coefficient * weight_norm / (grad_norm + weight_decay * weight_norm + eps)
    return torch.where((weight_norm > 0) & (grad_norm > 0), ratio, torch.ones_like(ratio))


class LARS(torch.optim.Optimizer):
    """LARS (You et al., 2017) that is exact on flat shards.

    Per parameter: ``d = (g + weight_decay * w) * local_lr`` with the local LR above
    (1 when the group has ``trust_ratio=False``), then SGD momentum on ``d``. The
    weight and gradient norms of all groups cost one all-reduce per step.

    Args:
        params: parameters or param groups (shards or plain tensors).
        lr: the global learning rate.
        momentum, dampening-free, nesterov: as in ``torch.optim.SGD``.
        weight_decay: L2 penalty added to the gradient before scaling.
        trust_coefficient: eta of the paper.
        eps: keeps the local LR finite.
        trust_ratio: set False per group to exclude biases and norms.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        nesterov: bool = False,
        trust_ratio: bool = True,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0:
            raise ValueError(
                "Expects lr, momentum, weight_decay >= 0 and trust_coefficient > 0 but got "
                f"{lr=}, {momentum=}, {weight_decay=}, {trust_coefficient=}"
            )
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay,
            trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
            trust_ratio=trust_ratio,
        )  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = evaluate_closure(closure)
        reduction = SegmentReduction(2.0)
        pending = []
        for group, param in params_with_grad(self.param_groups):
            handles = None
            if group["trust_ratio"]:
                handles = reduction.add(param), reduction.add(param.grad, param)
            pending.append((param, group, handles))
        totals = reduction.reduce()
        for param, group, handles in pending:
            direction = param.grad.add(param, alpha=group["weight_decay"])
            if handles is not None:
                local_lr = lars_local_lr(
                    totals[handles[0]].sqrt(),
                    totals[handles[1]].sqrt(),
                    group["trust_coefficient"],
                    group["weight_decay"],
                    group["eps"],
                )
                scale_by_parameter_(direction, local_lr, param)
            self._apply_momentum(param, direction, group)
        return loss

    def _apply_momentum(self, param: torch.Tensor, direction: torch.Tensor, group: dict) -> None:
        momentum = group["momentum"]
        if momentum:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = direction.clone()
            else:
                state["momentum_buffer"].mul_(momentum).add_(direction)
            buffer = state["momentum_buffer"]
            direction = direction.add(buffer, alpha=momentum) if group["nesterov"] else buffer
        param.add_(direction, alpha=-group["lr"])
