"""Hugging Face's ``Trainer`` over a sharded model: ``Trainer(..., groupshard={...})``.

The model is given unsharded (a peft model too). The Trainer builds its optimizer as it
always does, on the unsharded model — ``weight_decay`` on its decay names, the ``optim=``
choice, or ``optimizers=(optimizer, scheduler)`` built by the user — and the model is
sharded with exactly that optimizer's param groups; the optimizer is then pointed at the
shards in place (``gs.shard_optimizer``'s groups, the same object, so a scheduler built on
it stays bound). Nothing is wrapped in DDP: the model and optimizer go to accelerate through
``groupshard.integrations.accelerate.prepare``.

What the Trainer does differently for a sharded model:
- ``bf16``/``fp16`` shard with ``gs.MixedPrecision`` (fp32 gradient reduction) unless
  ``groupshard`` gives ``mixed_precision``; fp16's loss scaler is a ``gs.GradScaler``;
- checkpoints (``save_steps``) hold the model and optimizer as ``gs.checkpoint`` in
  ``<checkpoint>/groupshard`` (every rank writes its shards), beside Trainer's own files
  (the full model for ``from_pretrained``, scheduler, RNG, trainer state), and
  ``resume_from_checkpoint`` loads them at any world size;
- ``save_model`` gathers the full model on rank 0 and writes it as Trainer does
  (safetensors; the adapter for a peft model); every rank calls it, as with FSDP;
- ``Trainer(..., async_checkpoint=True)`` writes each checkpoint's ``groupshard/`` folder in
  the background while training goes on (those checkpoints hold no full model file).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate.optimizer import AcceleratedOptimizer

from groupshard import checkpoint as gs_checkpoint
from groupshard.api import shard
from groupshard.full_state import full_state_dict
from groupshard.integrations.accelerate import prepare
from groupshard.integrations.common import (
    CheckpointWrites,
    check_shard_options,
    half_precision,
    point_at_shards,
)
from groupshard.precision import MixedPrecision

CHECKPOINT_FOLDER = "groupshard"
"""Where a Trainer checkpoint keeps the sharded model and optimizer."""


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that shards its model with groupshard.

    Args:
        groupshard: the options of ``gs.shard`` (``unit``, ``strategy``, ``mixed_precision``,
            ``mesh``...), without ``param_groups``: those are the Trainer's optimizer's.
        async_checkpoint: write each checkpoint's ``groupshard/`` folder in the background
            (``gs.checkpoint.async_save``) while training goes on. Such checkpoints hold the
            model in that folder only (no full ``model.safetensors``, whose gather would stop
            training): ``save_model`` at the end writes the full model, and
            ``gs.checkpoint.to_torch_save`` converts a checkpoint's folder.
        Everything else: ``transformers.Trainer``'s arguments.
    """

    def __init__(
        self,
        *args: Any,
        groupshard: Mapping[str, Any] | None = None,
        async_checkpoint: bool = False,
        **kwargs: Any,
    ):
        options = _shard_options(groupshard)
        self.async_checkpoint = async_checkpoint
        self._checkpoint_writes = CheckpointWrites()
        if kwargs.get("model_init") is not None:
            raise ValueError(
                "groupshard's Trainer does not take model_init (the model would be built "
                "again unsharded at train()): pass the model."
            )
        super().__init__(*args, **kwargs)
        if self.model is None:
            raise ValueError("groupshard's Trainer needs model=, the unsharded model.")
        _refuse_what_cannot_apply(self.args, self.accelerator)
        for name in ("load_best_model_at_end", "save_only_model", "push_to_hub"):
            if async_checkpoint and getattr(self.args, name):
                raise ValueError(
                    f"Trainer(async_checkpoint=True) writes the model of a checkpoint in the "
                    f"background, into its groupshard/ folder only, which "
                    f"TrainingArguments({name}=True) cannot take: set one of them to False."
                )
        if "mixed_precision" not in options:
            options["mixed_precision"] = _precision(self.args)
        optimizer = self.optimizer if self.optimizer is not None else self.create_optimizer()
        model = shard(self.model, optimizer.param_groups, **options)
        point_at_shards(
            optimizer,
            model,
            f"with optim={self.args.optim!r} use a torch.optim optimizer (optim='adamw_torch', "
            "'adamw_torch_fused', 'sgd', 'rmsprop'...) or pass optimizers=(optimizer, scheduler).",
        )
        self.model = self.model_wrapped = model
        self.optimizer = prepare(self.accelerator, model, optimizer)[1]
        self.callback_handler.model = model
        self.callback_handler.optimizer = self.optimizer

    def get_num_trainable_parameters(self) -> int:
        """The unsharded model's trainable parameter count (not this rank's shards')."""
        return self.model.num_unsharded_parameters(trainable_only=True)

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        return model  # never DDP, DataParallel or FSDP: the model is sharded

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``transformers.Trainer.train``; then waits for a checkpoint being written in the
        background and raises its error (after an error of training, only waits)."""
        try:
            output = super().train(*args, **kwargs)
        except BaseException:
            self._checkpoint_writes.finish(raise_error=False)
            raise
        self._checkpoint_writes.finish()
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The full model on rank 0, written as Trainer writes it (``from_pretrained`` loads
        it; a peft model writes its adapter). A collective: every rank calls it. In a
        checkpoint with ``async_checkpoint``, nothing: its ``groupshard/`` folder holds the
        model."""
        if _internal_call and self.async_checkpoint:
            return
        state_dict = full_state_dict(self.model, rank0_only=True, cpu_offload=True)
        self._save(output_dir, state_dict=state_dict if self.args.should_save else None)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self.args.should_save:
            return  # transformers' _save would gather the model again on other ranks
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)  # for the Trainer's files beside (no save_model)
        self._checkpoint_writes.save(
            os.path.join(output_dir, CHECKPOINT_FOLDER), self.model, _unwrapped(self.optimizer),
            background=self.async_checkpoint,
        )  # fmt: skip
        if self.args.should_save:
            scheduler_file = os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME)
            torch.save(self.lr_scheduler.state_dict(), scheduler_file)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_FOLDER)):
            return  # the model is loaded with the optimizer, from the sharded checkpoint
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._checkpoint_writes.finish()  # it may be the checkpoint asked for
        folder = os.path.join(checkpoint, CHECKPOINT_FOLDER)
        if not os.path.isdir(folder):
            raise ValueError(
                f"{checkpoint} has no {CHECKPOINT_FOLDER}/ folder: it was not written by "
                "groupshard's Trainer, so it holds no optimizer state of a sharded model. "
                "Load its weights with from_pretrained and start a new run."
            )
        gs_checkpoint.load(folder, self.model, _unwrapped(self.optimizer))
        scheduler_file = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def _shard_options(groupshard: Mapping[str, Any] | None) -> dict[str, Any]:
    if groupshard is None:
        raise TypeError(
            "groupshard's Trainer needs groupshard={'unit': ..., 'strategy': ...} (gs.shard's "
            "options); without it use transformers.Trainer."
        )
    if not isinstance(groupshard, Mapping):
        raise TypeError(f"groupshard= expects a dict of gs.shard's options but got {groupshard!r}")
    return check_shard_options(groupshard, "groupshard=")


def _refuse_what_cannot_apply(args: transformers.TrainingArguments, accelerator: Any) -> None:
    """TrainingArguments that would shard or wrap the model another way, or leave the data
    unsplit, raise."""
    for name in ("fsdp", "deepspeed"):
        if getattr(args, name, None):
            raise ValueError(
                f"TrainingArguments({name}=...) and groupshard both shard the model: remove "
                f"{name}= (groupshard= gives the sharding)."
            )
    if args.n_gpu > 1:
        raise ValueError(
            f"TrainingArguments sees {args.n_gpu} GPUs in one process (torch.nn.DataParallel); "
            "launch one process per GPU with torchrun or accelerate launch."
        )
    if getattr(args, "parallelism_config", None) is not None:
        raise ValueError(
            "TrainingArguments(parallelism_config=...) is not supported with groupshard's "
            "Trainer: groupshard= gives the data-parallel sharding."
        )
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if accelerator.num_processes != world:
            raise ValueError(
                f"The Trainer runs {accelerator.num_processes} process(es) in a process group "
                f"of {world}: every rank would train on the same batches. On the CPU pass "
                "TrainingArguments(use_cpu=True) under torchrun (accelerate's distributed CPU "
                "mode)."
            )


def _precision(args: transformers.TrainingArguments) -> MixedPrecision | None:
    if args.bf16:
        return half_precision(torch.bfloat16)
    if args.fp16:
        return half_precision(torch.float16)
    return None


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer
