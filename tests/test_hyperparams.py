"""Each group's hyperparameters reach exactly that group's parameters."""

from __future__ import annotations

import copy

import pytest
import torch

import groupshard as gs

from helpers import HEAD, UNITS, EdgeGPT, global_batches, three_groups, train_pair


def frozen_lr_case(rank: int, world_size: int, strategy: str) -> dict[str, float]:
    """Group 1 (no decay) has lr=0: its parameters must not move at all."""
    torch.manual_seed(0)
    model = EdgeGPT()
    before = copy.deepcopy(model.state_dict())
    groups = three_groups(model, head_lr=1e-2)
    groups[1]["lr"] = 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    still = {names[id(p)] for p in groups[1]["params"]}
    sharded = gs.shard(model, groups, unit=UNITS, strategy=strategy)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=1e-2)
    for inputs, targets in global_batches(3, world_size):
        sharded(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = gs.full_state_dict(sharded)
    return {
        name: (after[name] - before[name]).abs().max().item()
        for name in after
        if name in still or name == "blocks.0.fc.weight"
    }


@pytest.mark.parametrize("strategy", ["full", "no_shard"])
def test_group_with_zero_lr_does_not_move(run_ranks, strategy):
    for moved in run_ranks(2, frozen_lr_case, strategy):
        assert moved.pop("blocks.0.fc.weight") > 1e-3  # the decay group trains
        assert moved and max(moved.values()) == 0.0, moved


def decay_only_case(rank: int, world_size: int) -> dict[str, float]:
    """With zero gradients, SGD's weight decay alone changes parameters."""
    torch.manual_seed(0)
    model = EdgeGPT()
    before = copy.deepcopy(model.state_dict())
    sharded = gs.shard(model, three_groups(model, head_lr=0.1), unit=UNITS)
    optimizer = torch.optim.SGD(sharded.optimizer_groups(), lr=0.1)
    inputs, _ = global_batches(1, world_size)[0]
    for _ in range(2):
        (sharded(inputs) * 0.0).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    after = gs.full_state_dict(sharded)
    # the ratio of norms; a zero tensor (LayerNorm biases) must stay zero: ratio 1
    return {
        name: 1.0 + (after[name] - before[name]).norm().item()
        if before[name].norm() == 0
        else (after[name].norm() / before[name].norm()).item()
        for name in after
    }


def test_weight_decay_reaches_only_its_group(run_ranks):
    for ratios in run_ranks(3, decay_only_case):
        for name, ratio in ratios.items():
            decayed = name.endswith("weight") and "ln" not in name and name not in HEAD
            decayed = decayed and name not in ("wpe.weight", "lm_head.weight")
            expected = (1 - 0.1 * 0.1) ** 2 if decayed else 1.0
            assert ratio == pytest.approx(expected, abs=1e-6), name


def scheduler_case(rank: int, world_size: int, kind: str) -> tuple[float, list[float], list[float]]:
    schedulers = {
        "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, [lambda s: 1.0, lambda s: 0.5**s, lambda s: 1.0 + s]
        ),
    }
    sharded, reference, _, _ = train_pair(
        rank, world_size, "full", "adamw", steps=8, scheduler=schedulers[kind]
    )
    difference = max(
        (gs.full_state_dict(sharded)[k] - v).abs().max().item()
        for k, v in reference.state_dict().items()
    )
    return difference, sharded._lrs, reference._lrs


def test_lr_schedulers_change_exactly_their_groups(run_ranks):
    for kind in ("step", "lambda"):
        for difference, lrs, reference_lrs in run_ranks(2, scheduler_case, kind):
            assert difference <= 1e-5
            assert lrs == reference_lrs
        if kind == "lambda":
            assert lrs[0] == pytest.approx(3e-3) and lrs[1] == pytest.approx(3e-3 * 0.5**8)
            assert lrs[2] == pytest.approx(1e-3 * 9)
