"""LARC: layer-wise adaptive rate control around any optimizer (as NVIDIA apex's LARC)."""

from __future__ import annotations

import torch

from groupshard.norms import SegmentReduction, expand, scale_by_parameter_
from groupshard.optim.lars import lars_local_lr
from groupshard.optim.wrapper import OptimizerWrapper


class LARC(OptimizerWrapper):
    """Scale each parameter's gradient by its LARS local LR, then step the inner optimizer.

    Follows apex's ``LARC``: the group's ``weight_decay`` is folded into the gradient
    and hidden from the inner optimizer during the step; with ``clip=True`` the local
    LR is ``min(local_lr / lr, 1)`` (LARC clipping), else it scales the gradient
    directly. Where a weight or gradient norm is 0 the gradient is left as it is.
    Groups with ``trust_ratio=False`` are left entirely to the inner optimizer. All
    norms of a step cost one all-reduce.

    Args:
        optimizer: the inner optimizer (e.g. SGD over ``model.optimizer_groups()``).
        trust_coefficient: eta.
        clip: clipping mode (True) or scaling mode (False).
        eps: keeps the local LR finite.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        trust_coefficient: float = 0.02,
        clip: bool = True,
        eps: float = 1e-8,
    ) -> None:
        if trust_coefficient <= 0:
            raise ValueError(f"Expects trust_coefficient > 0 but got {trust_coefficient=}")
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.eps = eps
        super().__init__(optimizer, {"trust_ratio": True})

    def adjust_gradients(self) -> None:
        reduction = SegmentReduction(2.0)
        pending = []
        for group in self.param_groups:
            if not group.get("trust_ratio", True):
                continue
            for param in group["params"]:
                if param.grad is not None:
                    handles = reduction.add(param), reduction.add(param.grad, param)
                    pending.append((param, group, handles))
        totals = reduction.reduce()
        for param, group, (weight_handle, grad_handle) in pending:
            weight_norm, grad_norm = totals[weight_handle].sqrt(), totals[grad_handle].sqrt()
            weight_decay = group.get("weight_decay", 0.0)
            local_lr = lars_local_lr(
                weight_norm, grad_norm, self.trust_coefficient, weight_decay, self.eps
            )
            if self.clip:
                local_lr = torch.clamp(local_lr / group["lr"], max=1.0)
            adjusted = (weight_norm > 0) & (grad_norm > 0)
            scale = torch.where(adjusted, local_lr, torch.ones_like(local_lr))
            decay = torch.where(adjusted, weight_decay, 0.0)
            param.grad.add_(param * expand(decay, param))
            scale_by_parameter_(param.grad, scale, param)

    def inner_step(self) -> None:
        """Step the inner optimizer with the adjusted groups' weight decay hidden."""
        decays = [group.get("weight_decay") for group in self.param_groups]
        for group in self.param_groups:
            if group.get("trust_ratio", True) and "weight_decay" in group:
                group["weight_decay"] = 0.0
        try:
            self.optimizer.step()
        finally:
            for group, decay in zip(self.param_groups, decays, strict=True):
                if decay is not None:
                    group["weight_decay"] = decay
