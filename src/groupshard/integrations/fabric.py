"""Lightning Fabric over a sharded model: ``Fabric(strategy=GroupShardStrategy(unit=...))``.

Fabric's documented loop runs unchanged::

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=GroupShardStrategy(unit=Block))
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)  # the optimizer's param groups kept
    with fabric.no_backward_sync(model, enabled=accumulating):
        fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})

What the strategy does for a sharded model:
- ``fabric.setup(model, optimizer)`` shards the module in place with the optimizer's param
  groups and points that optimizer at the shards (the same object: a scheduler built on it
  stays bound); ``fabric.setup_module(model)`` shards with one group, for an optimizer then
  built on ``model.parameters()`` (or one built before on the whole model in one group);
- ``fabric.no_backward_sync`` is the model's ``no_sync``; ``fabric.clip_gradients`` by norm
  is exact (torch's norm of the shards' gradients, ``gs.ShardGrad``), by value elementwise;
- ``precision="bf16-mixed"``/``"16-mixed"``: Fabric's autocast, with the units gathering
  and computing in bf16/fp16 and reducing in fp32 (``gs.MixedPrecision``; the shards stay
  fp32, as FSDP's Fabric strategy does) and fp16's scaler a ``gs.GradScaler``;
- ``fabric.init_module(empty_init=True)`` builds the module on the meta device:
  ``fabric.setup`` initializes and shards it one unit at a time;
- ``fabric.save`` writes a ``gs.checkpoint`` folder (every rank its shards and optimizer
  state; the other entries beside them, no pickle) that ``fabric.load`` reads at any world
  size; ``fabric.load`` also reads a file ``fabric.save`` wrote under DDP or one process
  (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

from groupshard import checkpoint as gs_checkpoint
from groupshard.api import ShardedModule, shard
from groupshard.checkpoint import codec
from groupshard.full_state import load_optim_state_dict
from groupshard.integrations.common import (
    HALF_DTYPES,
    check_shard_options,
    half_precision,
    point_at_shards,
)
from groupshard.materialize import meta_parameters
from groupshard.scaler import GradScaler

FABRIC_STATE = "fabric"
"""The ``gs.checkpoint`` extra that holds what ``fabric.save`` got besides the model and
the optimizer, and under which keys those were."""


class GroupShardStrategy(DDPStrategy):
    """Fabric's strategy for a model sharded by groupshard.

    Args:
        unit, strategy and any other option of ``gs.shard`` (``mixed_precision``, ``mesh``,
            ``reduce_bucket_bytes``...), without ``param_groups``: those are the optimizer's
            given to ``fabric.setup``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision,
            process_group_backend, timeout, start_method: as for Fabric's DDPStrategy.
    """

    def __init__(
        self,
        unit: Any = None,
        strategy: str = "full",
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **shard_options: Any,
    ) -> None:
        self._shard_options = check_shard_options(
            {"unit": unit, "strategy": strategy, **shard_options}, "GroupShardStrategy"
        )
        self._sharded: list[ShardedModule] = []
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _NoSyncControl()

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        if plugin is not None and type(plugin) not in (
            Precision,
            HalfPrecision,
            DoublePrecision,
            MixedPrecision,
        ):
            raise ValueError(
                f"GroupShardStrategy does not support the precision plugin "
                f"{type(plugin).__name__}: use precision='32-true', 'bf16-mixed', '16-mixed', "
                "'bf16-true', '16-true' or '64-true'."
            )
        self._precision = plugin

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True`` builds the module on the meta device: ``setup_module``
        initializes each unit (``reset_parameters``) and shards it before the next, so no
        rank ever holds the whole model."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        """Move a real module to this rank's device; a meta-built one is materialized on it
        by ``setup_module``."""
        if not meta_parameters(dict(module.named_parameters())):
            module.to(self.root_device)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        """Shard ``module`` with the param groups of its one optimizer and point that
        optimizer (the same object) at the shards."""
        if len(optimizers) != 1:
            raise ValueError(
                f"fabric.setup got {len(optimizers)} optimizers; GroupShardStrategy shards a "
                "module with the param groups of one optimizer: put the parameters in param "
                "groups of one optimizer."
            )
        optimizer = optimizers[0]
        if isinstance(module, ShardedModule):
            raise ValueError(
                "fabric.setup got a model already sharded by gs.shard with an optimizer: pass "
                "the unsharded model and the optimizer built on it, and GroupShardStrategy "
                "shards it with the optimizer's param groups."
            )
        names = {id(p): fqn for fqn, p in module.named_parameters()}
        self._shard(module, optimizer.param_groups)
        # a meta-built module's parameters were replaced by real ones as it was sharded
        originals = module.groupshard.original_params  # type: ignore[union-attr]
        for group in optimizer.param_groups:
            group["params"] = [originals.get(names.get(id(p), ""), p) for p in group["params"]]
        point_at_shards(optimizer, module, _REBUILD_HINT)  # type: ignore[arg-type]
        return module, [optimizer], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` with one param group (unless ``gs.shard`` did already): for an
        optimizer built afterwards on ``model.parameters()``."""
        if isinstance(module, ShardedModule):
            self._adopt(module)
            return module
        return self._shard(module, None)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """An optimizer over a set-up model's shards as it is; one built on the unsharded
        model (one param group, as ``setup_module`` sharded it) pointed at the shards."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for model in self._sharded:
            shards = {id(p) for p in model.parameters()}
            originals = {id(p) for p in model.groupshard.original_params.values()}
            if all(id(p) in shards for p in params):
                return optimizer
            if all(id(p) in originals for p in params):
                try:
                    point_at_shards(optimizer, model, _REBUILD_HINT)
                except ValueError as error:
                    raise ValueError(
                        f"{error} fabric.setup_module shards the model with one param group: "
                        "for param groups, pass the model and the optimizer built on it "
                        "together to fabric.setup(model, optimizer)."
                    ) from error
                return optimizer
        raise ValueError(
            "fabric.setup_optimizers got an optimizer whose parameters are not those of a "
            "model set up by GroupShardStrategy: set up the model first "
            "(model = fabric.setup_module(model)) and build the optimizer on "
            "model.parameters(), or pass both to fabric.setup(model, optimizer)."
        )

    def _shard(self, module: nn.Module, param_groups: Any) -> ShardedModule:
        options = dict(self._shard_options)
        plugin = self.precision
        if isinstance(plugin, MixedPrecision) and options.get("mixed_precision") is None:
            options["mixed_precision"] = half_precision(HALF_DTYPES[plugin.precision])
        if meta_parameters(dict(module.named_parameters())):
            options.setdefault("device", self.root_device)
        sharded = shard(module, param_groups, **options)
        self._adopt(sharded)
        return sharded

    def _adopt(self, sharded: ShardedModule) -> None:
        """Keep ``sharded`` for ``setup_optimizers``; fp16's scaler becomes a ``gs.GradScaler``
        over it (torch's would skip a step on one rank only; gs's agrees over the ranks)."""
        plugin = self.precision
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            old = plugin.scaler
            if not isinstance(old, GradScaler):
                plugin.scaler = GradScaler(
                    sharded,
                    init_scale=old.get_scale(),
                    growth_factor=old.get_growth_factor(),
                    backoff_factor=old.get_backoff_factor(),
                    growth_interval=old.get_growth_interval(),
                    enabled=old.is_enabled(),
                )
        if sharded not in self._sharded:
            self._sharded.append(sharded)

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """A ``gs.checkpoint`` folder at ``path``: the model's shards, the optimizer's state
        and the other entries of ``state``. Collective."""
        if storage_options is not None:
            raise TypeError(
                "GroupShardStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                "the checkpoint is a gs.checkpoint folder, not written by a CheckpointIO."
            )
        if filter:
            raise ValueError(
                f"fabric.save(..., filter=...) for {sorted(filter)} is not supported by "
                "GroupShardStrategy: its folders hold the whole model and optimizer. For a "
                "subset of the weights, filter gs.full_state_dict(model, rank0_only=True) and "
                "torch.save it on rank 0."
            )
        self._check_checkpoint_io()
        parts = _Parts.of(state)
        others = {}
        for key, value in parts.others.items():
            value = value.state_dict() if _is_stateful(value) else value
            try:
                codec.encode(value)
            except TypeError as error:
                raise TypeError(
                    f"fabric.save's entry {key!r} cannot be stored in a gs.checkpoint folder "
                    f"({error}): give tensors, numbers, strings, lists and dicts of them, or "
                    "an object with state_dict() returning those."
                ) from error
            others[key] = value
        extra = {
            FABRIC_STATE: {
                "model": parts.model_key,
                "optimizer": parts.optimizer_key,
                "state": others,
            }
        }
        folder = Path(self.broadcast(str(path)))
        gs_checkpoint.save(folder, parts.model, parts.optimizer, extra=extra)

    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state``'s model, optimizer and other entries from a ``gs.checkpoint``
        folder (at any world size) or a file ``fabric.save`` wrote under DDP or one
        process; return what the checkpoint holds beyond ``state``."""
        if weights_only is False:
            raise ValueError(
                "GroupShardStrategy never unpickles a checkpoint (weights_only=False): its "
                "folders hold no pickle, and files are read with weights_only=True."
            )
        self._check_checkpoint_io()
        path = Path(self.broadcast(str(path)))
        if not state:
            raise ValueError(
                "fabric.load(path) without the objects to restore would return the whole "
                "checkpoint on every rank, which a sharded run does not gather: pass them, "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...}); read a "
                "folder in one process with gs.checkpoint.to_torch_save."
            )
        if isinstance(state, nn.Module):  # fabric.load_raw(path, model)
            state = {"model": state}
        elif isinstance(state, torch.optim.Optimizer):
            raise ValueError(
                "fabric.load_raw(path, optimizer) cannot restore a sharded optimizer without "
                "its model: fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        parts = _Parts.of(state)
        if path.is_file():
            return _load_file(path, state, parts, strict)
        return _load_folder(path, state, parts, strict)

    def _check_checkpoint_io(self) -> None:
        if type(self.checkpoint_io) is not TorchCheckpointIO:
            raise TypeError(
                f"GroupShardStrategy writes and reads gs.checkpoint folders itself and cannot "
                f"use the CheckpointIO {type(self.checkpoint_io).__name__}: drop that plugin."
            )


_REBUILD_HINT = "pass a torch.optim optimizer (or a gs.optim one) to fabric.setup."


class _NoSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the sharded model's ``no_sync``."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, ShardedModule):
            raise TypeError(
                "fabric.no_backward_sync needs a model set up by GroupShardStrategy, got "
                f"{type(module).__name__}."
            )
        return module.no_sync()


class _Parts:
    """A ``fabric.save``/``fabric.load`` state split into the sharded model, its optimizer
    and the other entries, or a ValueError naming the entry that cannot be."""

    def __init__(self) -> None:
        self.model: ShardedModule | None = None
        self.model_key: str | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_key: str | None = None
        self.others: dict[str, Any] = {}

    @classmethod
    def of(cls, state: dict[str, Any]) -> _Parts:
        parts = cls()
        for key, value in state.items():
            if isinstance(value, ShardedModule):
                if parts.model is not None:
                    raise ValueError(
                        f"fabric.save/load got two sharded models ({parts.model_key!r} and "
                        f"{key!r}); a gs.checkpoint folder holds one: save each in its own."
                    )
                parts.model, parts.model_key = value, key
            elif isinstance(value, nn.Module):
                raise ValueError(
                    f"fabric.save/load's entry {key!r} is a module that GroupShardStrategy did "
                    "not set up: set it up with fabric.setup, or save its state_dict() "
                    "yourself."
                )
            elif isinstance(value, torch.optim.Optimizer):
                if parts.optimizer is not None:
                    raise ValueError(
                        f"fabric.save/load got two optimizers ({parts.optimizer_key!r} and "
                        f"{key!r}); GroupShardStrategy saves the one optimizer of its model."
                    )
                parts.optimizer, parts.optimizer_key = value, key
            else:
                parts.others[key] = value
        if parts.model is None:
            raise ValueError(
                "fabric.save/load's state holds no model set up by GroupShardStrategy: a "
                "gs.checkpoint folder is the model's, put it in, e.g. {'model': model, "
                "'optimizer': optimizer, 'step': step}."
            )
        return parts


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _check_keys(requested: list[str], saved: list[str], strict: bool) -> None:
    """Fabric's strict loading: every key asked for is in the checkpoint."""
    missing = [key for key in requested if key not in saved]
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the "
            "loaded checkpoint. To disable strict loading, set `strict=False`."
        )


def _restore_others(state: dict[str, Any], others: dict[str, Any], saved: dict[str, Any]) -> None:
    """Each plain entry of ``state`` the checkpoint has: loaded into a stateful object,
    else put into ``state`` (Fabric's behaviour); removed from ``saved``."""
    for key, value in others.items():
        if key not in saved:
            continue
        if _is_stateful(value):
            value.load_state_dict(saved.pop(key))
        else:
            state[key] = saved.pop(key)


def _load_folder(path: Path, state: dict[str, Any], parts: _Parts, strict: bool) -> dict[str, Any]:
    """``state`` from a ``gs.checkpoint`` folder (``fabric.save``'s, or another writer's
    model and optimizer)."""
    assert parts.model is not None
    written = gs_checkpoint.read_extra(path).get(FABRIC_STATE, {})
    saved = dict(written.get("state", {}))
    with_optimizer = gs_checkpoint.holds_optimizer_state(path)
    keys = list(saved)
    if written:
        keys += [key for key in (written["model"], written["optimizer"]) if key is not None]
    else:  # another writer's folder: its model and optimizer under the keys asked for
        keys += [parts.model_key] + ([parts.optimizer_key] if with_optimizer else [])
    _check_keys(list(state), keys, strict)
    optimizer = parts.optimizer if with_optimizer and parts.optimizer_key in keys else None
    extra = gs_checkpoint.load(path, parts.model, optimizer)
    saved = dict(extra.get(FABRIC_STATE, {}).get("state", {}))
    _restore_others(state, parts.others, saved)
    return saved


def _load_file(path: Path, state: dict[str, Any], parts: _Parts, strict: bool) -> dict[str, Any]:
    """``state`` from a file ``fabric.save`` wrote under DDP or one process: full state
    dicts into the shards and the optimizer over them."""
    assert parts.model is not None
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path} does not hold a dict, as fabric.save writes.")
    if set(state) == {"model"} and parts.model_key == "model" and "model" not in checkpoint:
        checkpoint = {"model": checkpoint}  # fabric.load_raw: a raw state dict
    _check_keys(list(state), list(checkpoint), strict)
    if parts.model_key in checkpoint:
        parts.model.load_state_dict(checkpoint.pop(parts.model_key), strict=strict)
    if parts.optimizer is not None and parts.optimizer_key in checkpoint:
        load_optim_state_dict(parts.model, parts.optimizer, checkpoint.pop(parts.optimizer_key))
    _restore_others(state, parts.others, checkpoint)
    return checkpoint
