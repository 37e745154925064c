"""groupshard: ``gs.shard`` (full / grad_op / no_shard) and ``gs.ZeroRedundancyOptimizer`` + DDP."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from optimizers import LR, MUON_LR, MUON_WEIGHT_DECAY, adamw, decay_groups, muon_groups
from torch import nn

import groupshard as gs
from groupshard.cli.model import Block

from .base import System, unique_bytes


@dataclass(frozen=True)
class Groupshard(System):
    """``gs.shard`` with ``strategy``, one unit per block, the parameter groups of
    ``groups`` (the Muon rows': ``muon_groups``); bf16: ``gs.MixedPrecision`` gathering and
    computing in bf16, reducing in fp32. Its optimizers: AdamW, ``gs.optim.LAMB`` (``lamb``)
    or ``gs.optim.Muon`` (``muon``). ``overlap`` and ``reduce_bucket_bytes``: passed to
    ``gs.shard`` where set (else its defaults)."""

    strategy: str
    groups: Callable[[nn.Module], Any] = decay_groups
    prefetch_bytes: int = 25 * 2**20
    overlap: bool | None = None
    reduce_bucket_bytes: int | None = None

    accumulates = True
    prepares_blocks = True
    collectives_in_comm = True

    def build(self, base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        policy = gs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        optional = {"overlap": self.overlap, "reduce_bucket_bytes": self.reduce_bucket_bytes}
        model = self.prepare_blocks(copy.deepcopy(base))
        model = gs.shard(
            model, (muon_groups if self.muon else self.groups)(model), unit=Block,
            strategy=self.strategy, prefetch_bytes=self.prefetch_bytes,
            mixed_precision=policy if self.bf16 else None,
            **{k: v for k, v in optional.items() if v is not None},
        )  # fmt: skip
        if self.lamb:
            return model, gs.optim.LAMB(model.optimizer_groups(), lr=LR)
        if self.muon:
            return model, gs.optim.Muon(
                model.optimizer_groups(), lr=MUON_LR, weight_decay=MUON_WEIGHT_DECAY
            )
        return model, adamw(model.optimizer_groups())

    @contextlib.contextmanager
    def micro_batch(self, model: Any, last: bool) -> Iterator[None]:
        """Gradient sync on the last micro-batch only (``no_sync()`` for the others); kept
        gathered: no resharding after the others' backward."""
        if self.micro_batches > 1 and self.keep_gathered:
            model.set_reshard_after_backward(last)
        with contextlib.nullcontext() if last else model.no_sync():
            yield

    def full_params(self, model: Any) -> dict[str, torch.Tensor]:
        return dict(gs.full_state_dict(model))

    def local_params(self, model: Any) -> list[torch.Tensor]:
        return [s for storage in model.groupshard.storages for s in storage.shards]

    @contextlib.contextmanager
    def gathered_peak(self, model: Any) -> Iterator[Callable[[], int | None]]:
        """groupshard's own count."""
        gathers = model.groupshard.runtime.gathers
        gathers.peak_gathered_bytes = 0
        yield lambda: gathers.peak_gathered_bytes

    def accumulated_grad_bytes(self, model: Any) -> int | None:
        """Its local sums of the unsharded gradients (``storage.gradients.accumulated``)."""
        sums = [s.gradients.accumulated for s in model.groupshard.storages]
        return unique_bytes([g for g in sums if g is not None])


@dataclass(frozen=True)
class GroupshardZero(System):
    """``gs.ZeroRedundancyOptimizer`` (AdamW, or ``gs.optim.Muon`` with ``muon``) under DDP;
    it keeps its gradient slices between steps: counted with the gradients."""

    def build(self, base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.nn.parallel import DistributedDataParallel

        model = copy.deepcopy(base)
        if self.muon:
            optimizer = gs.ZeroRedundancyOptimizer(
                muon_groups(model), gs.optim.Muon, lr=MUON_LR, weight_decay=MUON_WEIGHT_DECAY,
                parameters_as_bucket_view=True,
            )  # fmt: skip
        else:
            optimizer = gs.ZeroRedundancyOptimizer(
                decay_groups(model), torch.optim.AdamW, lr=LR, parameters_as_bucket_view=True
            )
        return DistributedDataParallel(model), optimizer

    def held_tensors(self, model: Any, optimizer: Any) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors(model, optimizer)
        held["grads"] += optimizer.gradient_slices
        return held
