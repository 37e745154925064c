"""An accelerate loop over a sharded model: ``prepare(accelerator, model, optimizer, ...)``.

``accelerator.prepare`` would wrap a model in DDP in its distributed modes, and DDP around a
sharded model overwrites every rank's shards with rank 0's. ``prepare`` hands accelerate
the sharded model as already prepared (accelerate's own mark, which it sets on what it
has prepared), so accelerate registers it without wrapping it, and prepares everything
else as usual: the dataloaders split by rank, ``accelerator.accumulate`` calls the model's
``no_sync``, ``accelerator.clip_grad_norm_`` takes torch's norms of the shards' gradients
(exact: ``gs.ShardGrad``), ``accelerator.backward`` and the schedulers are accelerate's.

What accelerate would do differently for a sharded model, ``prepare`` does itself:
- the optimizer's ``state_dict()`` is the whole optimizer's under the parameters' names
  (``gs.optim_state_dict``, identical on every rank), so ``accelerator.save_state``, which
  writes rank 0's, writes all of it, and ``load_state`` loads it at any world size;
- with ``mixed_precision="fp16"`` the loss scaler is a ``gs.GradScaler``, which agrees on
  every rank whether a step has infs;
- with ``"bf16"`` or ``"fp16"`` and a model sharded without ``mixed_precision=``, forward
  runs under accelerate's autocast, as accelerate does for DDP; a model sharded with
  ``gs.MixedPrecision`` computes in its ``param_dtype`` and is not autocast.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from groupshard.api import ShardedModule
from groupshard.full_state import load_optim_state_dict, optim_state_dict
from groupshard.scaler import GradScaler


class ShardedAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper for an optimizer over a sharded model's shards, whose
    state dict is the whole optimizer's, keyed by parameter name (a collective: every rank
    calls it, as ``save_state``/``load_state`` do)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: ShardedModule, **kwargs: Any):
        super().__init__(optimizer, **kwargs)
        self.sharded_model = model

    def state_dict(self) -> dict[str, Any]:
        return optim_state_dict(self.sharded_model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_optim_state_dict(self.sharded_model, self.optimizer, state_dict)


def prepare(accelerator: Accelerator, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)`` for objects among which are models sharded by
    ``gs.shard`` and optimizers over their shards: those are never wrapped in DDP; the
    rest is prepared by accelerate. Returns what ``accelerator.prepare`` returns."""
    models = [obj for obj in objects if isinstance(obj, ShardedModule)]
    if not models:
        raise TypeError(
            "groupshard.integrations.accelerate.prepare expects a model sharded by gs.shard "
            "among its arguments; prepare other models with accelerator.prepare."
        )
    if accelerator.mixed_precision == "fp16" and not isinstance(accelerator.scaler, GradScaler):
        accelerator.scaler = GradScaler(models[0], **_scaler_options(accelerator.scaler))
    prepared = []
    for obj in objects:
        if isinstance(obj, ShardedModule):
            obj = _prepare_model(accelerator, obj)
        elif isinstance(obj, torch.optim.Optimizer):
            obj = _prepare_optimizer(accelerator, obj, models)
        prepared.append(obj)
    return accelerator.prepare(*prepared)


def _prepare_model(accelerator: Accelerator, model: ShardedModule) -> ShardedModule:
    devices = {storage.local.device for storage in model.groupshard.storages}
    if not all(_same_device(device, accelerator.device) for device in devices):
        raise ValueError(
            f"The sharded model's parameters are on {sorted(map(str, devices))} and the "
            f"accelerator's device is {accelerator.device}: move the model to "
            "accelerator.device before gs.shard."
        )
    mixed = any(unit.policy is not None for unit in model.groupshard.runtime.units)
    if accelerator.native_amp and not mixed:
        # accelerate's autocast and compilation, without its DDP: its evaluation mode
        return accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    model._is_accelerate_prepared = True
    return model


def _prepare_optimizer(
    accelerator: Accelerator, optimizer: torch.optim.Optimizer, models: list[ShardedModule]
) -> Any:
    if isinstance(optimizer, AcceleratedOptimizer):
        return optimizer
    owner = _owner(optimizer, models)
    if owner is None:
        return optimizer  # an optimizer of another model: accelerate's
    wrapped = ShardedAcceleratedOptimizer(
        optimizer, owner, device_placement=accelerator.device_placement, scaler=accelerator.scaler
    )
    wrapped._is_accelerate_prepared = True
    return wrapped


def _owner(optimizer: torch.optim.Optimizer, models: list[ShardedModule]) -> ShardedModule | None:
    """The sharded model whose shards ``optimizer`` steps; an error if it mixes them with
    other tensors or with another model's shards."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        shards = {id(p) for p in model.parameters()}
        if params & shards:
            if not params <= shards:
                raise ValueError(
                    "The optimizer holds some of a sharded model's shards and other tensors; "
                    "build it from model.optimizer_groups() alone."
                )
            return model
    return None


def _same_device(first: torch.device, second: torch.device) -> bool:
    if first.type != second.type:
        return False
    return first.index is None or second.index is None or first.index == second.index


def _scaler_options(scaler: Any) -> dict[str, Any]:
    """The options accelerate built its loss scaler with (its ``GradScalerKwargs``)."""
    if scaler is None:
        return {}
    return {
        "init_scale": scaler.get_scale() if scaler.is_enabled() else 2.0**16,
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
        "enabled": scaler.is_enabled(),
    }
