"""Activation checkpointing composes with every strategy: a unit recomputed in backward is
gathered for its recomputation, its gradients reduce as any other's, nothing stays gathered
after backward (gloo ranks against one process, and AC on against AC off)."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import groupshard as gs
from groupshard.cli.model import Block

from helpers import (
    BATCH_PER_RANK,
    EdgeGPT,
    Shift,
    global_batches,
    max_difference,
    three_groups,
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedBlock(Block):
    """A block whose forward runs under ``torch.utils.checkpoint`` (inside the unit)."""

    reentrant = False
    selective = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        options: dict[str, Any] = {"use_reentrant": self.reentrant}
        if self.selective:
            options["context_fn"] = functools.partial(
                create_selective_checkpoint_contexts, _save_matmuls
            )
        return checkpoint(super().forward, x, **options)


def _inside(reentrant: bool = False, selective: bool = False) -> Any:
    def build(model: nn.Module) -> Any:
        for block in model.blocks:
            block.__class__ = CheckpointedBlock
            block.reentrant, block.selective = reentrant, selective
        return (CheckpointedBlock, Shift)

    return build


def _wrapped(impl: CheckpointImpl, wrapper_is_unit: bool) -> Any:
    def build(model: nn.Module) -> Any:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda module: isinstance(module, Block),
        )
        return (CheckpointWrapper, Shift) if wrapper_is_unit else (Block, Shift)

    return build


STYLES = {
    "checkpoint inside the unit": _inside(),
    "reentrant checkpoint inside the unit": _inside(reentrant=True),
    "selective checkpoint inside the unit": _inside(selective=True),
    "checkpoint_wrapper as the unit": _wrapped(CheckpointImpl.NO_REENTRANT, True),
    "wrapped module as the unit": _wrapped(CheckpointImpl.NO_REENTRANT, False),
    "reentrant checkpoint_wrapper as the unit": _wrapped(CheckpointImpl.REENTRANT, True),
    "reentrant, wrapped module as the unit": _wrapped(CheckpointImpl.REENTRANT, False),
}


def _train_against_one_process(
    rank: int, world_size: int, strategy: str, style: str, steps: int = 3
) -> dict[str, float]:
    torch.manual_seed(0)
    model = EdgeGPT()
    units = STYLES[style](model)
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, three_groups(model, head_lr=1e-3), unit=units, strategy=strategy)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    reference_optimizer = torch.optim.AdamW(three_groups(reference, head_lr=1e-3), lr=3e-3)
    left_gathered = 0
    for inputs, targets in global_batches(steps, world_size):
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        sharded(inputs[local], targets[local]).backward()
        left_gathered = max(left_gathered, sharded.groupshard.runtime.gathers.gathered_bytes())
        reference(inputs, targets).backward()
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    difference = max_difference(gs.full_state_dict(sharded), reference.state_dict())
    return {"difference": difference, "left gathered": left_gathered}


def _all_styles(rank: int, world_size: int, strategy: str) -> dict[str, dict[str, float]]:
    return {
        style: _train_against_one_process(rank, world_size, strategy, style) for style in STYLES
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_every_form_of_activation_checkpointing_trains_as_one_process(
    run_ranks, world_size, strategy
):
    for result in run_ranks(world_size, _all_styles, strategy, timeout=240):
        for style, outcome in result.items():
            assert outcome["difference"] <= 1e-5, (style, outcome)
            assert outcome["left gathered"] == 0, (style, outcome)


def _bf16_accumulation(rank: int, world_size: int, style: str) -> float:
    """Two micro-batches (the first in no_sync) in bf16, with and without checkpointing:
    recomputation gives the same values, so both train to the same bits."""
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = EdgeGPT()
        units = STYLES[style](model) if checkpointed else (Block, Shift)
        sharded = gs.shard(
            model, three_groups(model, head_lr=1e-3), unit=units,
            mixed_precision=gs.MixedPrecision(torch.bfloat16, torch.float32),
        )  # fmt: skip
        optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
        for inputs, targets in global_batches(2, 2 * world_size):
            for micro in range(2):
                start = (micro * world_size + rank) * BATCH_PER_RANK
                local = slice(start, start + BATCH_PER_RANK)
                if micro == 0:
                    with sharded.no_sync():
                        (sharded(inputs[local], targets[local]) / 2).backward()
                else:
                    (sharded(inputs[local], targets[local]) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
        state = gs.full_state_dict(sharded)
        results.append({k.replace("._checkpoint_wrapped_module", ""): v for k, v in state.items()})
    dist.barrier()
    return max_difference(*results)


@pytest.mark.parametrize(
    "style", ["checkpoint inside the unit", "reentrant checkpoint_wrapper as the unit"]
)
def test_checkpointing_under_bf16_and_no_sync_changes_no_bit(run_ranks, style):
    assert run_ranks(2, _bf16_accumulation, style, timeout=180) == [0.0, 0.0]
