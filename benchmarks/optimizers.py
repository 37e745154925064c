"""The benchmarks' optimizers and parameter groups: the same for every system and reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import groupshard as gs

LR = 1e-3
MUON_LR, MUON_WEIGHT_DECAY = 0.02, 0.1
"""The Muon group's hyperparameters in the Muon rows (weight decay: torch.optim.Muon's default)."""


def adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR)


def decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The two groups every AdamW row gets: decay (weight decay 0.1) and no decay."""
    return gs.decay_groups(model, 0.1)


def eight_groups(model: nn.Module) -> list[dict[str, Any]]:
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return [
        {**group, "params": [p for p in group["params"]]}
        for group in gs.groups_by(
            model,
            lambda name, p: (p.ndim >= 2, order[name] % 4),
            {(d, k): {"weight_decay": 0.1 if d else 0.0} for d in (True, False) for k in range(4)},
        )
    ]


def muon_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The hidden matrices in Muon, the rest in AdamW in the AdamW rows' two groups (2-D
    embeddings with weight decay, vectors without)."""
    muon, rest = gs.muon_groups(model)
    no_decay = {id(p) for p in decay_groups(model)[1]["params"]}
    adamw = {"use_muon": False, "lr": LR}
    return [
        {**muon, "lr": MUON_LR, "weight_decay": MUON_WEIGHT_DECAY},
        {**adamw, "params": [p for p in rest["params"] if id(p) not in no_decay],
         "weight_decay": 0.1},
        {**adamw, "params": [p for p in rest["params"] if id(p) in no_decay],
         "weight_decay": 0.0},
    ]  # fmt: skip


def plain(group: dict[str, Any]) -> dict[str, Any]:
    """A Muon rows' group without its ``use_muon`` flag (for torch's optimizers)."""
    return {k: v for k, v in group.items() if k != "use_muon"}


class Optimizers:
    """Several torch optimizers stepped as one (torch's Muon takes matrices only)."""

    def __init__(self, *optimizers: Any) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # the local optimizers' (inside torch's ZeRO)
        return {k: v for o in self.optimizers for k, v in getattr(o, "optim", o).state.items()}

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def torch_muon(groups: list[dict[str, Any]], muon_class: Any = None) -> Optimizers:
    """torch.optim.Muon (or ``muon_class``) for the Muon group, AdamW for the rest."""
    muon, *rest = groups
    muon_class = muon_class or torch.optim.Muon
    return Optimizers(muon_class([plain(muon)]), torch.optim.AdamW(list(map(plain, rest))))


class PerParameterLAMB(torch.optim.Optimizer):
    """A straightforward LAMB, one tensor at a time; on DTensors each norm is a collective."""

    def __init__(self, params: Any, lr: float = LR, eps: float = 1e-6, weight_decay: float = 0.01):
        super().__init__(
            params, dict(lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=weight_decay)
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1 ** state["step"])
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                if hasattr(w_norm, "full_tensor"):
                    w_norm, u_norm = w_norm.full_tensor(), u_norm.full_tensor()
                trust = (w_norm / u_norm).item() if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)


class FullTensorMuon(torch.optim.Optimizer):
    """torch.optim.Muon's math on FSDP2's DTensors, one matrix at a time: the momentum
    update on the local shard, one ``full_tensor()`` all-gather of the updated matrix,
    Newton-Schulz on every rank, and each rank keeps the rows of its own shard."""

    def __init__(self, params: Any, lr: float = MUON_LR, weight_decay: float = MUON_WEIGHT_DECAY):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=0.95))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        from torch.distributed.tensor import distribute_tensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        from groupshard.optim.muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS

        for group in self.param_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                buffer.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buffer, momentum).full_tensor()  # nesterov
                update = _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, NS_STEPS, NS_EPS)
                local = distribute_tensor(
                    update, p.device_mesh, p.placements, src_data_rank=None
                )  # this rank's rows, no communication
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(local, alpha=-_adjust_lr(group["lr"], None, p.shape))
