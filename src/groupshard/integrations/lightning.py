"""Lightning's Trainer over a sharded model: ``Trainer(strategy=GroupShardStrategy(unit=...))``.

The LightningModule is unchanged. Its ``configure_optimizers`` builds the optimizer (and
schedulers) on its own parameters, in its own param groups; the strategy shards the module
in place with exactly those groups and points that optimizer at the shards (the same
object, so its schedulers stay bound). Nothing is wrapped in DDP: the strategy is
Lightning's DDP strategy (launchers, process group, sampler, ``devices``/``num_nodes``)
with the model sharded instead of wrapped.

What it does differently for a sharded model:
- ``training_step`` and the other steps run through the module's own call, so the root
  unit's hooks gather its parameters (as Lightning routes them through DDP's forward);
- ``accumulate_grad_batches`` runs the micro-batches but the last inside the model's
  ``no_sync`` (no communication); clipping by norm is exact (torch's norm of the shards'
  gradients, ``gs.ShardGrad``), by value elementwise;
- ``precision="bf16-mixed"``/``"16-mixed"`` keep Lightning's autocast and shard with
  ``gs.MixedPrecision`` (the units compute in bf16/fp16 and reduce in fp32; the shards stay
  fp32), and fp16 scales the loss with a ``gs.GradScaler``; ``"bf16-true"``/``"16-true"`` convert
  the module before it is sharded;
- ``trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``) writes a ``gs.checkpoint``
  folder at ``path``: every rank its shards, the optimizer, and Lightning's own state (loops,
  callbacks, schedulers, the scaler) beside them, no pickle; ``fit(ckpt_path=path)``
  resumes from it at any world size, and from a Lightning ``.ckpt`` file written by one
  process or DDP (read with ``torch.load(weights_only=True)``); with Lightning's
  ``AsyncCheckpointIO`` plugin the folder is written in the background
  (``gs.checkpoint.async_save``) while training goes on;
- ``trainer.lightning_module.state_dict()`` is the full model under its original keys on
  every rank (a collective).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from groupshard import checkpoint as gs_checkpoint
from groupshard.api import ShardedModule, shard
from groupshard.checkpoint import codec
from groupshard.checkpoint.conversion import read_unsharded
from groupshard.full_state import load_optim_state_dict
from groupshard.groups import resolve_groups
from groupshard.integrations.common import (
    HALF_DTYPES,
    CheckpointWrites,
    check_shard_options,
    half_precision,
    point_at_shards,
)
from groupshard.regroup import regroup
from groupshard.scaler import GradScaler

LIGHTNING_STATE = "lightning"
"""The ``gs.checkpoint`` extra that holds Lightning's own part of a checkpoint."""


class GroupShardPrecision(MixedPrecision):
    """``"bf16-mixed"``/``"16-mixed"`` for a sharded model: Lightning's autocast (so a loss
    is computed in fp32, as under DDP) over units that gather and compute in the half dtype
    (``gs.MixedPrecision``; the shards stay fp32, as Lightning's FSDP does); ``"16-mixed"``
    scales the loss with a ``gs.GradScaler``, which the strategy gives it once the model is
    sharded (it agrees on infs over the ranks)."""

    def __init__(self, precision: Literal["bf16-mixed", "16-mixed"], device: str = "cpu") -> None:
        if precision not in HALF_DTYPES:
            raise ValueError(
                f"GroupShardPrecision takes 'bf16-mixed' or '16-mixed' but got {precision!r}"
            )
        self.precision = precision
        self.device = device  # autocast's device type
        self.scaler: GradScaler | None = None

    @property
    def dtype(self) -> torch.dtype:
        return HALF_DTYPES[self.precision]


class GroupShardStrategy(DDPStrategy):
    """Lightning's strategy for a model sharded by groupshard.

    Args:
        unit, strategy and any other option of ``gs.shard`` (``mixed_precision``, ``mesh``,
            ``reduce_bucket_bytes``...), without ``param_groups``: those are the
            optimizer's that ``configure_optimizers`` returns.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout, start_method: as for Lightning's DDPStrategy.
    """

    strategy_name = "groupshard"

    def __init__(
        self,
        unit: Any = None,
        strategy: str = "full",
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **shard_options: Any,
    ) -> None:
        self._checkpoint_writes = CheckpointWrites()
        self._shard_options = check_shard_options(
            {"unit": unit, "strategy": strategy, **shard_options}, "GroupShardStrategy"
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else _sharded_precision(plugin)

    @property
    def sharded_module(self) -> ShardedModule:
        module = self.lightning_module
        if not isinstance(module, ShardedModule):
            raise RuntimeError("GroupShardStrategy: the LightningModule is not sharded yet.")
        return module

    def setup(self, trainer: Any) -> None:
        """Shard the module with its ``configure_optimizers`` groups (when fitting; else
        with one group, unless an earlier fit sharded it) and point the optimizer at the
        shards. Nothing is wrapped."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()  # where the shards will live
        if trainer.state.fn == TrainerFn.FITTING:
            self._shard_with_optimizer()
        elif not isinstance(self.lightning_module, ShardedModule):
            shard(self.lightning_module, None, **self._options())
        plugin = self.precision_plugin
        fp16 = isinstance(plugin, GroupShardPrecision) and plugin.precision == "16-mixed"
        if fp16 and plugin.scaler is None:
            plugin.scaler = GradScaler(self.sharded_module)
        self.setup_precision_plugin()

    def _options(self) -> dict[str, Any]:
        options = dict(self._shard_options)
        plugin = self.precision_plugin
        if isinstance(plugin, GroupShardPrecision) and options.get("mixed_precision") is None:
            options["mixed_precision"] = half_precision(plugin.dtype)
        return options

    def _shard_with_optimizer(self) -> None:
        module = self.lightning_module
        assert module is not None
        if isinstance(module, ShardedModule):
            # sharded by an earlier fit, validate, test or predict: its optimizer is built
            # on the original parameters again (gathered for the moment)
            with module.summon_full_params():
                optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
                for optimizer in optimizers[:1]:  # its groups cover what trains, as for shard
                    if optimizer.param_groups:
                        resolve_groups(module, optimizer.param_groups)
        else:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1:
            raise ValueError(
                f"configure_optimizers returned {len(optimizers)} optimizers; "
                "GroupShardStrategy shards a module with the param groups of one optimizer: "
                "put the parameters in param groups of one optimizer."
            )
        optimizer = optimizers[0]
        groups = optimizer.param_groups if optimizer.param_groups else None  # Lightning's mock
        if not isinstance(module, ShardedModule):
            shard(module, groups, **self._options())
        elif groups is not None:
            # sharded by validate/test/predict with one group, or by an earlier fit: the
            # shards take this optimizer's groups (units whose layout stays are untouched)
            shards_optimizer = torch.optim.SGD(module.optimizer_groups(), lr=0.0)
            regroup(module, shards_optimizer, [dict(group) for group in groups])
        if groups is not None:
            point_at_shards(
                optimizer,
                self.sharded_module,
                "return a torch.optim optimizer (or a gs.optim one) from configure_optimizers.",
            )
        self.optimizers, self.lr_scheduler_configs = optimizers, schedulers

    def setup_optimizers(self, trainer: Any) -> None:
        """The optimizers are set up with the sharding (``setup``)."""

    def configure_ddp(self) -> None:
        raise RuntimeError("GroupShardStrategy never wraps the model in DDP.")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_module("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_module("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._through_module("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._through_module("predict_step", *args, **kwargs)

    def _through_module(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``module.<method>(...)`` called through the module's own ``__call__``, so the
        root unit's hooks gather and release its parameters around it."""
        module = self.lightning_module
        return self._forward_redirection(module, module, method, *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulation: backwards inside keep the gradients on this rank."""
        with self.sharded_module.no_sync():
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the checkpoint loads into the shards and the optimizer over them

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint loads the optimizer with the model

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: ``save_checkpoint`` writes the model's shards (``state_dict()`` on the
        module gives the full weights)."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Empty: ``save_checkpoint`` writes each rank's optimizer state."""
        return {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Loaded by ``load_checkpoint`` already."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Loaded by ``load_checkpoint`` already."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """A ``gs.checkpoint`` folder at ``filepath``: the shards, the optimizer's state
        (unless Lightning saves weights only) and Lightning's own state. Collective."""
        if storage_options is not None:
            raise TypeError(
                "GroupShardStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                "the checkpoint is a gs.checkpoint folder, not written by a CheckpointIO."
            )
        background = self._writes_in_background()
        path = Path(self.broadcast(str(filepath)))
        optimizer = self._optimizer() if "optimizer_states" in checkpoint else None
        state = {
            key: value
            for key, value in checkpoint.items()
            if key not in ("state_dict", "optimizer_states")
        }
        self._checkpoint_writes.save(
            path, self.sharded_module, optimizer, {LIGHTNING_STATE: _storable(state)}, background
        )

    def _writes_in_background(self) -> bool:
        """Whether checkpoints are written while training goes on: Lightning's
        ``AsyncCheckpointIO`` plugin (around its default CheckpointIO) asks for it. Another
        CheckpointIO is refused: the folder is written by gs.checkpoint, not by it."""
        io = self.checkpoint_io
        background = isinstance(io, AsyncCheckpointIO)
        inner = io.checkpoint_io if background else io
        if type(inner) is not TorchCheckpointIO:
            raise TypeError(
                f"GroupShardStrategy writes gs.checkpoint folders itself and cannot use the "
                f"CheckpointIO {type(inner).__name__}: drop that plugin (AsyncCheckpointIO "
                "around the default one writes them in the background)."
            )
        return background

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Load the model (and, when fitting, the optimizer) from a ``gs.checkpoint`` folder,
        or from a Lightning ``.ckpt`` file of one process or DDP; return Lightning's state."""
        if weights_only is False:
            raise ValueError(
                "GroupShardStrategy never unpickles a checkpoint (weights_only=False): its "
                "checkpoints hold no pickle, and .ckpt files are read with weights_only=True."
            )
        self._checkpoint_writes.finish()  # it may be the checkpoint asked for
        path = Path(self.broadcast(str(checkpoint_path)))
        optimizer = self._optimizer() if self.optimizers else None
        if path.is_file():
            return _load_lightning_file(path, self.sharded_module, optimizer)
        extra = gs_checkpoint.load(path, self.sharded_module, optimizer)
        if LIGHTNING_STATE not in extra:
            raise ValueError(
                f"{path} holds no Lightning state: it was not written by a Lightning Trainer "
                "with GroupShardStrategy. Load it with gs.checkpoint.load in the module's "
                "setup, or start from a checkpoint the Trainer wrote."
            )
        return extra[LIGHTNING_STATE]

    def _optimizer(self) -> torch.optim.Optimizer | None:
        if not self.optimizers or not self.optimizers[0].param_groups:
            return None
        return self.optimizers[0]

    def teardown(self) -> None:
        """Lightning's teardown without moving the module to the CPU (a sharded module
        stays on its device), once a checkpoint written in the background is complete."""
        self._checkpoint_writes.finish()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


def to_lightning_checkpoint(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """A folder ``GroupShardStrategy`` wrote (``trainer.save_checkpoint``,
    ``ModelCheckpoint``) as one Lightning ``.ckpt`` file, offline in one process:
    ``MyModule.load_from_checkpoint(output)`` loads it, and a Trainer with one process or
    DDP resumes from it (``fit(ckpt_path=output)``: the unsharded weights, the optimizer's
    state numbered as ``Optimizer.state_dict()`` does, Lightning's own state). Reads the
    folder as safely as ``gs.checkpoint.load``; loads with ``torch.load(weights_only=True)``.
    """
    converted = read_unsharded(path)
    if LIGHTNING_STATE not in converted["extra"]:
        raise ValueError(
            f"{path} holds no Lightning state: it was not written by a Lightning Trainer "
            "with GroupShardStrategy (gs.checkpoint.to_torch_save converts any folder)."
        )
    checkpoint = {**converted["extra"][LIGHTNING_STATE], "state_dict": converted["model"]}
    if "optim" in converted:
        checkpoint["optimizer_states"] = [converted["optim"]]
    torch.save(checkpoint, output)


def _sharded_precision(plugin: Precision) -> Precision:
    """Lightning's precision plugin as it runs on a sharded model, or a ValueError."""
    if isinstance(plugin, GroupShardPrecision):
        return plugin
    if type(plugin) is MixedPrecision:  # Lightning's autocast for "bf16-mixed"/"16-mixed"
        return GroupShardPrecision(plugin.precision, plugin.device)  # type: ignore[arg-type]
    if type(plugin) in (Precision, HalfPrecision, DoublePrecision):
        return plugin  # the module is converted before it is sharded
    raise ValueError(
        f"GroupShardStrategy does not support the precision plugin {type(plugin).__name__}: "
        "use precision='32-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'."
    )


def _storable(state: dict[str, Any]) -> dict[str, Any]:
    """Lightning's state, checked entry by entry to be storable without pickle."""
    for key, value in state.items():
        try:
            codec.encode(value)
        except TypeError as error:
            raise TypeError(
                f"Lightning's checkpoint entry {key!r} cannot be stored in a gs.checkpoint "
                f"folder ({error}); e.g. save_hyperparameters() of such values with "
                "ignore=[...]."
            ) from error
    return state


def _load_lightning_file(
    path: Path, model: ShardedModule, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """A ``.ckpt`` file written by Lightning with one process or DDP: its full state dict
    into the shards, its (torch, integer-keyed) optimizer state into the optimizer."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(checkpoint.pop("state_dict"))
    states = checkpoint.pop("optimizer_states", [])
    if optimizer is not None:
        if len(states) != 1:
            raise ValueError(
                f"{path} holds {len(states)} optimizer states; GroupShardStrategy resumes "
                "one optimizer."
            )
        load_optim_state_dict(model, optimizer, states[0])
    return checkpoint
