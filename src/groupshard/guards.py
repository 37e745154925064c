"""Refusals of data-parallel wrappers around a sharded model.

DDP's constructor broadcasts rank 0's parameters over every rank's: around a sharded model
those are rank 0's shards, so every rank's own shards are overwritten and training goes on,
silently wrong. FSDP1 and FSDP2 would replace the shards by their own parameters, which the
model no longer reads. groupshard already shards the model and reduces its gradients, so
any of them is an error: these checks raise on every rank, at DDP's construction for a
sharded model itself, at the first forward for a module holding one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WHAT_TO_DO = (
    "groupshard already shards the model and reduces its gradients: train the sharded model "
    "as it is, each rank with its own batch. With Hugging Face's Trainer use "
    "groupshard.integrations.transformers.Trainer, with an accelerate loop "
    "groupshard.integrations.accelerate.prepare, with Lightning or Fabric their "
    "groupshard.integrations.lightning or .fabric GroupShardStrategy (docs/integrations.md, "
    "docs/lightning.md)."
)


def wrapped_error(wrapper: str) -> TypeError:
    """The error for ``wrapper`` applied to a sharded model."""
    return TypeError(
        f"{wrapper} around a model sharded by gs.shard would corrupt its shards. " + WHAT_TO_DO
    )


def check_not_wrapped(
    module: nn.Module, shards: Sequence[torch.Tensor], root: nn.Module | None
) -> None:
    """Raise if a unit's shards are no longer its registered parameters (FSDP1 or FSDP2
    replaced them), or, with ``root`` (the first unit's forward), if this forward runs
    inside a DDP holding the sharded model."""
    registered = module._parameters.values()
    for shard in shards:
        if not any(parameter is shard for parameter in registered):
            raise wrapped_error(_replacer(module))
    if root is None:
        return
    ddp = DistributedDataParallel._active_ddp_module
    if ddp is not None and any(submodule is root for submodule in ddp.module.modules()):
        raise wrapped_error("DistributedDataParallel")


def _replacer(module: nn.Module) -> str:
    from torch.distributed.tensor import DTensor

    if any(isinstance(parameter, DTensor) for parameter in module.parameters()):
        return "FSDP2 (fully_shard)"
    if type(module).__name__.startswith("FSDP"):
        return "FSDP2 (fully_shard)"
    return "FSDP1 (FullyShardedDataParallel), or another wrapper that replaces parameters,"


PARALLELIZED_ATTR = "_distribute_module_applied"
"""Set on a module by torch's ``distribute_module``, which every ``parallelize_module`` style
that splits parameters (ColwiseParallel, RowwiseParallel, SequenceParallel) goes through."""


def parallelized_modules(root: nn.Module) -> frozenset[str]:
    """The names of ``root``'s modules that tensor parallelism distributed."""
    return frozenset(
        name for name, module in root.named_modules() if getattr(module, PARALLELIZED_ATTR, False)
    )


def check_not_parallelized_since(root: nn.Module, before: frozenset[str]) -> None:
    """A ValueError naming the first module that ``parallelize_module`` reached after
    gs.shard: it found flat shards (or no parameters) where the module's weights were, so
    it split nothing, or a shard, and forward would fail on mixed tensors, or compute with
    a split the flat buffers do not know."""
    for name, module in root.named_modules():
        if getattr(module, PARALLELIZED_ATTR, False) and name not in before:
            raise ValueError(
                f"Module {name or '<root>'!r} was parallelized (parallelize_module or "
                "distribute_module) after gs.shard; the model's parameters were flat shards "
                "by then, which tensor parallelism cannot split. Parallelize first, then "
                "shard: parallelize_module(model, mesh['tp'], plan); gs.shard(model, groups, "
                "mesh=mesh['dp']) (docs/tensor-parallel.md)."
            )
