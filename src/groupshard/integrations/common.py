"""What every trainer integration does the same way: check ``gs.shard``'s options, point an
optimizer built on the unsharded model at the shards, and the mixed precision of a
trainer's ``bf16``/``fp16`` setting. Imports no trainer library."""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch

from groupshard import checkpoint as gs_checkpoint
from groupshard.api import ShardedModule, shard, shard_optimizer
from groupshard.precision import MixedPrecision

SHARD_OPTIONS = tuple(
    name for name in inspect.signature(shard).parameters if name not in ("model", "param_groups")
)
"""The options a trainer integration passes on to ``gs.shard`` (the groups are the
trainer's optimizer's)."""


def check_shard_options(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``options`` as a dict, or a ValueError naming those ``gs.shard`` does not take."""
    unknown = [name for name in options if name not in SHARD_OPTIONS]
    if unknown:
        raise ValueError(
            f"{where} has {unknown}, which gs.shard does not take (it takes "
            f"{list(SHARD_OPTIONS)}; the param groups are the optimizer's)."
        )
    return dict(options)


def point_at_shards(optimizer: torch.optim.Optimizer, model: ShardedModule, hint: str) -> None:
    """``gs.shard_optimizer``'s groups, put into ``optimizer`` itself: a scheduler built on
    it, and a trainer's wrapper around it, stay bound to the optimizer that steps.
    ``hint`` says what to do instead when the optimizer cannot be rebuilt."""
    try:
        rebuilt = shard_optimizer(optimizer, model)
    except TypeError as error:
        raise ValueError(
            f"The optimizer {type(optimizer).__name__} cannot be rebuilt over the shards "
            f"({error}); {hint}"
        ) from error
    optimizer.param_groups.clear()
    for group in rebuilt.param_groups:
        optimizer.add_param_group(group)


HALF_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
"""Lightning's and Fabric's mixed precision settings, by the dtype the units compute in."""


def half_precision(dtype: torch.dtype) -> MixedPrecision:
    """A trainer's ``bf16``/``fp16`` mixed precision as groupshard runs it: the units gather
    and compute in ``dtype`` and reduce gradients in fp32; the shards stay fp32."""
    return MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)


class CheckpointWrites:
    """A door's ``gs.checkpoint`` saves, each written now or in the background
    (``gs.checkpoint.async_save``), one at a time: a save first waits for the one in
    flight and raises its error, as Lightning's ``AsyncCheckpointIO`` does."""

    def __init__(self) -> None:
        self._in_flight: gs_checkpoint.AsyncSave | None = None

    def save(
        self,
        path: str | os.PathLike,
        model: ShardedModule,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any] | None = None,
        background: bool = False,
    ) -> None:
        self.finish()
        if background:
            self._in_flight = gs_checkpoint.async_save(path, model, optimizer, extra=extra)
        else:
            gs_checkpoint.save(path, model, optimizer, extra=extra)

    def finish(self, raise_error: bool = True) -> None:
        """Wait for the write in flight, if any; raise its error (the same on every rank)
        unless ``raise_error`` is False (after another error)."""
        write, self._in_flight = self._in_flight, None
        if write is not None:
            write.result() if raise_error else write.wait()
