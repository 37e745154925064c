"""gs.regroup: param groups changed after sharding (unfreeze, move, freeze) train as one
process does with torch's idiom (requires_grad_, add_param_group, edited param_groups);
errors on every rank; checkpoints across a regroup."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import groupshard as gs
from groupshard.cli.model import GPT, Block

from helpers import BATCH_PER_RANK, TINY, global_batches, max_difference

STEPS = 8
UNFREEZE_AT, MOVE_AT, FREEZE_AT = 2, 4, 6
NEW_BLOCK = {"lr": 2e-3, "weight_decay": 0.05}
BIASES = {"lr": 5e-3, "weight_decay": 0.0}

OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=3e-3),
    "lamb": lambda groups: gs.optim.LAMB(groups, lr=3e-3),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = GPT(TINY)
    for param in model.blocks[1].parameters():
        param.requires_grad_(False)  # frozen at shard time, unfrozen after UNFREEZE_AT steps
    return model


def _names(model: nn.Module, prefix: str) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.startswith(prefix)]


def _phase_groups(names: list[str], phase: int) -> list[tuple[list[str], dict[str, Any]]]:
    """The groups by name after ``phase`` changes: 0 decay / no-decay without blocks.1;
    1 plus blocks.1 in a group of its own; 2 the biases moved to a group of their own;
    3 blocks.0 frozen."""
    frozen = {"blocks.1."} if phase == 0 else {"blocks.0."} if phase == 3 else set()
    kept = [n for n in names if not any(n.startswith(f) for f in frozen)]
    new_block = [n for n in kept if n.startswith("blocks.1.")] if phase >= 1 else []
    biases = [n for n in kept if n.endswith(".bias")] if phase >= 2 else []
    rest = [n for n in kept if n not in new_block and n not in biases]
    groups = [
        ([n for n in rest if not _is_vector(n)], {"weight_decay": 0.1}),
        ([n for n in rest if _is_vector(n)], {"weight_decay": 0.0}),
    ]
    if phase >= 1:
        groups.append(([n for n in new_block if n not in biases], NEW_BLOCK))
    if phase >= 2:
        groups.append((biases, BIASES))
    return groups


def _is_vector(name: str) -> bool:
    return name.endswith(".bias") or ".ln_" in name


def _as_dicts(groups: list[tuple[list[str], dict[str, Any]]], model: nn.Module) -> list[dict]:
    return [{"params": [model.get_parameter(n) for n in names], **o} for names, o in groups]


def _torch_idiom(model: nn.Module, opt: torch.optim.Optimizer, names: list[str], phase: int):
    """One process changes its groups the way torch users do."""
    params = dict(model.named_parameters())
    if phase == 1:  # unfreeze blocks.1 into a new group
        block = [params[n] for n in _names(model, "blocks.1.")]
        for param in block:
            param.requires_grad_(True)
        opt.add_param_group({"params": block, **NEW_BLOCK})
    if phase == 2:  # move every bias into a new group, keeping its state
        biases = [params[n] for n in names if n.endswith(".bias")]
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if all(p is not b for b in biases)]
        opt.add_param_group({"params": biases, **BIASES})
    if phase == 3:  # freeze blocks.0, dropping its state
        block = [params[n] for n in _names(model, "blocks.0.")]
        for param in block:
            param.requires_grad_(False)
            opt.state.pop(param, None)
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if all(p is not b for b in block)]


def _regroup_case(rank: int, world_size: int, strategy: str, optimizer: str) -> float:
    model = _model()
    reference = copy.deepcopy(model)
    names = [n for n, _ in reference.named_parameters()]
    sharded = gs.shard(model, _as_dicts(_phase_groups(names, 0), model), unit=Block,
                       strategy=strategy)  # fmt: skip
    opt = OPTIMIZERS[optimizer](sharded.optimizer_groups())
    reference_opt = OPTIMIZERS[optimizer](_as_dicts(_phase_groups(names, 0), reference))
    phase_at = {UNFREEZE_AT: 1, MOVE_AT: 2, FREEZE_AT: 3}
    worst = 0.0
    for step, (inputs, targets) in enumerate(global_batches(STEPS, world_size)):
        if step in phase_at:
            phase = phase_at[step]
            gs.regroup(sharded, opt, _as_dicts(_phase_groups(names, phase), sharded))
            _torch_idiom(reference, reference_opt, names, phase)
            assert len(opt.param_groups) == len(reference_opt.param_groups)
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        loss = sharded(inputs[local], targets[local])
        loss.backward()
        reference(inputs, targets).backward()
        for o in (opt, reference_opt):
            o.step()
            o.zero_grad()
        worst = max(worst, max_difference(gs.full_state_dict(sharded), reference.state_dict()))
    frozen = [n for n, p in reference.named_parameters() if not p.requires_grad]
    assert frozen == _names(reference, "blocks.0.")
    assert [n for n in names if not sharded.get_parameter(n).requires_grad] == frozen
    return worst


@pytest.mark.parametrize("world_size", [2, 3])
def test_regroup_trains_as_torch_idiom(run_ranks, world_size: int) -> None:
    """Unfreeze a block into a new group, move the biases, freeze a block: every step
    equal to one process doing the same with torch's idiom, for every strategy, AdamW and
    LAMB (all cases in one task on the rank pool)."""
    differences = run_ranks(world_size, _all_regroup_cases, timeout=240)
    for case, difference in differences[0].items():
        assert difference < 1e-5, (case, difference)


def _all_regroup_cases(rank: int, world_size: int) -> dict[str, float]:
    return {
        f"{strategy}/{optimizer}": _regroup_case(rank, world_size, strategy, optimizer)
        for strategy in ("full", "grad_op", "no_shard")
        for optimizer in OPTIMIZERS
    }
