"""summon_full_params, full_state_dict, shard_optimizer, eval and gradient accumulation."""

from __future__ import annotations

import copy

import pytest
import torch

import groupshard as gs

from helpers import (
    BATCH_PER_RANK,
    UNITS,
    EdgeGPT,
    global_batches,
    max_difference,
    three_groups,
    train_pair,
)


def summon_case(rank: int, world_size: int, strategy: str) -> dict[str, object]:
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, three_groups(model, 0.1), unit=UNITS, strategy=strategy)
    shard_names = sorted(n for n, _ in sharded.named_parameters())
    with sharded.summon_full_params():
        names = [(n, tuple(p.shape)) for n, p in sharded.named_parameters()]
        with torch.no_grad():
            sharded.ln_f.bias.add_(5.0)  # not written back
    unchanged = max_difference(gs.full_state_dict(sharded), reference.state_dict())
    with sharded.summon_full_params(writeback=True), torch.no_grad():
        sharded.ln_f.bias.add_(1.0)
        sharded.blocks[1].fc.weight.mul_(2.0)
    full = gs.full_state_dict(sharded)
    with torch.no_grad():
        reference.ln_f.bias.add_(1.0)
        reference.blocks[1].fc.weight.mul_(2.0)
    inputs, _ = global_batches(1, world_size)[0]
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    with torch.no_grad():  # eval forward uses the written-back values
        logits = sharded(inputs[local])
        expected = reference(inputs[local])
    return {
        "names": names,
        "reference names": [(n, tuple(p.shape)) for n, p in reference.named_parameters()],
        "shard names": shard_names,
        "after names": sorted(n for n, _ in sharded.named_parameters()),
        "unchanged": unchanged,
        "written back": max_difference(full, reference.state_dict()),
        "loads": str(reference.load_state_dict(full)),
        "eval": (logits - expected).abs().max().item(),
    }


@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_summon_full_params_and_writeback(run_ranks, strategy):
    for result in run_ranks(3, summon_case, strategy):
        assert result["names"] == result["reference names"]
        assert result["after names"] == result["shard names"]
        assert all("groupshard_" in n for n in result["shard names"])
        assert result["unchanged"] == 0.0
        assert result["written back"] == 0.0
        assert result["loads"] == "<All keys matched successfully>"
        assert result["eval"] <= 1e-6


def shard_optimizer_case(rank: int, world_size: int) -> float:
    def existing_optimizer(model):
        return torch.optim.AdamW(three_groups(model, 1e-2), lr=3e-3, weight_decay=0.05)

    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    existing = existing_optimizer(model)
    sharded = gs.shard(model, existing.param_groups, unit=UNITS)
    optimizer = gs.shard_optimizer(existing, sharded)
    assert type(optimizer) is torch.optim.AdamW and len(optimizer.param_groups) == 3
    assert optimizer.defaults["weight_decay"] == 0.05
    reference_optimizer = existing_optimizer(reference)
    for inputs, targets in global_batches(5, world_size):
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        sharded(inputs[local], targets[local]).backward()
        reference(inputs, targets).backward()
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    with pytest.raises(ValueError, match="already has state"):
        gs.shard_optimizer(reference_optimizer, sharded)
    return max_difference(gs.full_state_dict(sharded), reference.state_dict())


def test_shard_optimizer_rebuilds_an_existing_optimizer(run_ranks):
    assert max(run_ranks(2, shard_optimizer_case)) <= 1e-5


def accumulation_case(rank: int, world_size: int, strategy: str, zero_with_model: bool) -> float:
    """Two micro-batches per step (backward twice, then step) equal one big batch."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS, strategy=strategy)
    optimizer = torch.optim.SGD(sharded.optimizer_groups(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(three_groups(reference, 1e-3), lr=0.1, momentum=0.9)
    for inputs, targets in global_batches(4, 2 * world_size):
        halves = inputs.chunk(2), targets.chunk(2)
        for half_inputs, half_targets in zip(*halves, strict=True):
            local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
            (sharded(half_inputs[local], half_targets[local]) / 2).backward()
        reference(inputs, targets).backward()
        optimizer.step()
        reference_optimizer.step()
        if zero_with_model:
            sharded.zero_grad()
            assert all(p.grad is None for p in optimizer.param_groups[0]["params"])
        else:
            optimizer.zero_grad(set_to_none=False)
        reference_optimizer.zero_grad()
    return max_difference(gs.full_state_dict(sharded), reference.state_dict())


@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_gradient_accumulation_and_zero_grad(run_ranks, strategy):
    assert max(run_ranks(2, accumulation_case, strategy, True)) <= 1e-5
    assert max(run_ranks(2, accumulation_case, strategy, False)) <= 1e-5


def two_forwards_case(rank: int, world_size: int, strategy: str) -> tuple[float, int]:
    """Two forwards, then one backward through both graphs; and a forward whose loss is
    never backpropagated. The root, kept gathered after its forward, is gathered again
    by the next forward and freed at the end of the backward."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS, strategy=strategy)
    optimizer = torch.optim.SGD(sharded.optimizer_groups(), lr=0.1)
    reference_optimizer = torch.optim.SGD(three_groups(reference, 1e-3), lr=0.1)
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    for inputs, targets in global_batches(3, 2 * world_size):
        sharded(inputs[local], targets[local])  # a loss nobody backpropagates
        first, second = inputs.chunk(2), targets.chunk(2)
        loss = sum(sharded(x[local], y[local]) for x, y in zip(first, second, strict=True))
        (loss / 2).backward()
        reference(inputs, targets).backward()
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    gathered = sharded.groupshard.runtime.gathers.gathered_bytes()
    return max_difference(gs.full_state_dict(sharded), reference.state_dict()), gathered


@pytest.mark.parametrize("strategy", ["full", "grad_op"])
def test_two_forwards_then_one_backward(run_ranks, strategy):
    for difference, gathered in run_ranks(2, two_forwards_case, strategy):
        assert difference <= 1e-5
        assert gathered == 0  # nothing stays unsharded after the backward


def edge_layout_case(rank: int, world_size: int) -> dict[str, object]:
    sharded, _, losses, reference_losses = train_pair(rank, world_size, "full", "adamw", steps=3)
    buffers = {
        (s.layout.unit_name, b.group_index): (b.numel, b.padding_numel)
        for s in sharded.groupshard.storages
        for b in s.layout.buffers
    }
    return {"buffers": buffers, "losses": losses, "reference losses": reference_losses}


def test_edge_cases_are_in_the_test_model(run_ranks):
    """The equivalence tests cover tiny groups, padding and a bias-only unit."""
    result = run_ranks(4, edge_layout_case)[0]
    buffers = result["buffers"]
    assert buffers[("shift", 2)] == (1, 3)  # a unit's group with fewer elements than ranks
    assert {group for unit, group in buffers if unit == "shift"} == {1, 2}  # biases only
    assert any(padding for _, padding in buffers.values())  # sizes not divisible by 4
    assert buffers[("", -1)][0] == 8 * 16  # the frozen position embedding, in the root
    losses, reference_losses = result["losses"], result["reference losses"]
    assert losses[-1] < losses[0] or reference_losses[-1] < reference_losses[0]
