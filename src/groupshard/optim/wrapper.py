"""A base for optimizers that adjust gradients, then call an inner optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from groupshard.optim.common import evaluate_closure


class OptimizerWrapper(torch.optim.Optimizer):
    """Shares the inner optimizer's param groups and state (so LR schedulers, ``zero_grad``
    and ``state_dict`` act on the inner one); subclasses implement ``adjust_gradients``."""

    def __init__(self, optimizer: torch.optim.Optimizer, defaults: dict[str, Any]) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Expects a torch.optim.Optimizer to wrap but got {type(optimizer).__name__}"
            )
        # Optimizer.__init__ re-adds the inner groups (the same dicts) before we link.
        super().__init__(optimizer.param_groups, {**optimizer.defaults, **defaults})
        self.optimizer = optimizer
        self._link()

    def _link(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def adjust_gradients(self) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = evaluate_closure(closure)
        self.adjust_gradients()
        self.inner_step()
        return loss

    def inner_step(self) -> None:
        """Step the inner optimizer (subclasses may change what it sees)."""
        self.optimizer.step()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self, "optimizer"):  # during Optimizer.__init__
            super().add_param_group(param_group)
            return
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self._link()
