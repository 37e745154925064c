"""LAMB: Adam moments with a per-parameter trust ratio ||w|| / ||update||."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from groupshard.norms import SegmentReduction, scale_by_parameter_
from groupshard.optim.common import evaluate_closure, params_with_grad


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al., 2019) that is exact on flat shards.

    Per parameter: ``update = m_hat / (sqrt(v_hat) + eps) + weight_decay * w`` and
    ``w -= lr * trust * update`` with ``trust = ||w|| / ||update||`` (1 where either
    norm is 0, or when the group has ``trust_ratio=False``), optionally capped by
    ``max_trust_ratio``. The norms of every weight and update of all groups cost one
    all-reduce per step: updates are computed in a first pass, the reduction runs
    once, and a second pass applies them.

    Args:
        params: parameters or param groups (shards from ``model.optimizer_groups()`` or
            plain tensors).
        lr, betas, eps, weight_decay: as in Adam / AdamW.
        bias_correction: divide the moments by ``1 - beta^step``.
        trust_ratio: apply the layer-wise trust ratio (set False per group to exclude
            biases and norms).
        max_trust_ratio: clamp the trust ratio from above (None: no clamp).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        trust_ratio: bool = True,
        max_trust_ratio: float | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"Expects lr, eps, weight_decay >= 0 but got {lr=}, {eps=}, {weight_decay=}"
            )
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Expects betas in [0, 1) but got {betas=}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, trust_ratio=trust_ratio,
            max_trust_ratio=max_trust_ratio,
        )  # fmt: skip
        super().__init__(params, defaults)

    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Advance the moments of ``param`` and return its Adam-style update."""
        grad = param.grad
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"].item()
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        first_correction, second_correction = 1.0, 1.0
        if group["bias_correction"]:
            first_correction = 1 - beta1**step
            second_correction = math.sqrt(1 - beta2**step)
        # m_hat / (sqrt(v_hat) + eps) + wd * w, with the corrections as scalars: four
        # passes over the shard and one temporary besides the result
        denominator = state["exp_avg_sq"].sqrt().div_(second_correction).add_(group["eps"])
        if group["weight_decay"]:
            update = param.mul(group["weight_decay"])
            return update.addcdiv_(state["exp_avg"], denominator, value=1 / first_correction)
        return torch.div(state["exp_avg"], denominator).div_(first_correction)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = evaluate_closure(closure)
        reduction = SegmentReduction(2.0)
        pending = []
        for group, param in params_with_grad(self.param_groups):
            if param.grad.is_sparse:
                raise ValueError("LAMB does not support sparse gradients")
            update = self._update(param, group)
            handles = None
            if group["trust_ratio"]:
                handles = reduction.add(param), reduction.add(update, param)
            pending.append((param, update, group, handles))
        totals = reduction.reduce()
        for param, update, group, handles in pending:
            if handles is not None:
                weight_norm = totals[handles[0]].sqrt()
                update_norm = totals[handles[1]].sqrt()
                trust = torch.where(
                    (weight_norm > 0) & (update_norm > 0),
                    weight_norm / update_norm,
                    torch.ones_like(weight_norm),
                )
                if group["max_trust_ratio"] is not None:
                    trust = trust.clamp(max=group["max_trust_ratio"])
                scale_by_parameter_(update, trust, param)
            param.add_(update, alpha=-group["lr"])
        return loss
