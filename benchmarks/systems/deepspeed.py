"""DeepSpeed ZeRO 1/2/3 (when installed: ``pip install -e ".[bench]"``): the engine runs its
own backward, step and gradient accumulation."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from optimizers import LR, decay_groups, muon_groups
from torch import nn

from .base import System, state_tensors


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class DeepSpeed(System):
    """DeepSpeed ZeRO-``stage`` with its AdamW; bf16: its ``"bf16"`` with its own defaults;
    accumulation: its ``gradient_accumulation_steps``. With ``muon``, DeepSpeed's own Muon
    (``"type": "Muon"``, its inline AdamW for the rest) on the Muon rows' groups, with its
    ``"standard"`` Newton-Schulz (torch.optim.Muon's bf16 quintic iteration; its default,
    ``"gram"``, is another algorithm): not torch.optim.Muon's result, so the row is compared
    for speed, its difference reported but not bounded. ``overlap_comm``: its reduction of
    gradient buckets on a side stream."""

    stage: int
    overlap_comm: bool = False

    accumulates = True

    def build(self, base: nn.Module) -> tuple[Any, Any]:
        import deepspeed

        model = copy.deepcopy(base)
        optimizer: dict[str, Any] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}
        groups = decay_groups(model)
        if self.muon:
            groups = muon_groups(model)
            for group in groups:
                for param in group["params"]:
                    param.use_muon = group["use_muon"]
            groups = [{k: v for k, v in g.items() if k != "use_muon"} for g in groups]
            optimizer = {"type": "Muon", "params": {
                "lr": LR, "momentum": 0.95, "ns_method": "standard",
                "betas": [0.9, 0.999], "eps": 1e-8,  # torch.optim.AdamW's (not Muon's own)
            }}  # fmt: skip
        zero: dict[str, Any] = {"stage": self.stage}
        if self.overlap_comm:
            zero["overlap_comm"] = True
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": self.micro_batches,
            "zero_optimization": zero,
            "optimizer": optimizer,
        }
        if self.bf16:
            config["bf16"] = {"enabled": True}
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, config=config, model_parameters=groups, dist_init_required=False
        )
        return engine, optimizer

    @contextlib.contextmanager
    def micro_batch(self, model: Any, last: bool) -> Iterator[None]:
        """DeepSpeed counts micro-batches itself, and wants a step after each (it steps the
        optimizer on the last)."""
        yield
        if not last:
            model.step()

    def backward(self, model: Any, loss: torch.Tensor) -> None:
        model.backward(loss)  # into its own gradient buffers, dividing by the micro-batches

    def optimizer_step(self, model: Any, optimizer: Any) -> None:
        model.step()

    def full_params(self, model: Any) -> dict[str, torch.Tensor]:
        if self.bf16:  # the fp32 masters
            from deepspeed.utils import safe_get_full_fp32_param

            return {
                k: safe_get_full_fp32_param(v).detach().clone()
                for k, v in model.module.named_parameters(remove_duplicate=False)
            }
        import deepspeed

        params = list(model.module.parameters())
        with deepspeed.zero.GatheredParameters(
            params, enabled=model.zero_optimization_stage() == 3
        ):
            return {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    def held_tensors(self, model: Any, optimizer: Any) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors(model, optimizer)
        if hasattr(optimizer, "fp32_partitioned_groups_flat") or hasattr(
            optimizer, "single_partition_of_fp32_groups"
        ):  # its ZeRO optimizers: the state of the torch optimizer inside
            held["state"] = state_tensors(optimizer.optimizer)
        return held
