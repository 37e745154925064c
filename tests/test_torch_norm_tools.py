"""torch's own norm tools on a sharded model's parameters see the whole model: a shard's
gradient takes its norm over the whole flat buffer (gloo ranks against one process)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

import groupshard as gs

from helpers import (
    BATCH_PER_RANK,
    UNITS,
    EdgeGPT,
    full_grads,
    global_batches,
    max_difference,
    three_groups,
)


def _clip_like_torch(rank: int, world_size: int, strategy: str, norm_type: float) -> dict:
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, three_groups(model, head_lr=1e-3), unit=UNITS, strategy=strategy)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    reference_optimizer = torch.optim.AdamW(three_groups(reference, head_lr=1e-3), lr=3e-3)
    totals = []
    for inputs, targets in global_batches(4, world_size):
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        sharded(inputs[local], targets[local]).backward()
        reference(inputs, targets).backward()
        grads = [p.grad for p in sharded.parameters() if p.grad is not None]
        reference_grads = [p.grad for p in reference.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        reference_total = torch.nn.utils.get_total_norm(reference_grads, norm_type)
        totals.append((total.item(), reference_total.item()))
        clipped = torch.nn.utils.clip_grad_norm_(sharded.parameters(), 0.05, norm_type)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type)
        assert clipped.item() == total.item()
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    difference = max_difference(gs.full_state_dict(sharded), reference.state_dict())
    return {"difference": difference, "totals": totals}


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_torch_clip_grad_norm_on_shards_equals_one_process(
    run_ranks, strategy, world_size, norm_type
):
    results = run_ranks(world_size, _clip_like_torch, strategy, norm_type)
    for result in results:
        assert result["difference"] <= 1e-5, result
        for total, reference_total in result["totals"]:
            assert total == pytest.approx(reference_total, rel=1e-5)
    assert all(r["totals"] == results[0]["totals"] for r in results)  # every rank alike


def _clip_with_a_given_norm(rank: int, world_size: int) -> float:
    """get_total_norm, then clip_grads_with_norm_ with that norm (torch's two-step form)."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, None, unit=UNITS)
    inputs, targets = global_batches(1, world_size)[0]
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    sharded(inputs[local], targets[local]).backward()
    reference(inputs, targets).backward()
    totals = []
    for m in (sharded, reference):
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        # foreach=True takes torch._foreach_norm, the path clip_grad_norm_ uses on GPUs
        totals.append(torch.nn.utils.get_total_norm(grads, foreach=True))
        torch.nn.utils.clip_grads_with_norm_(
            m.parameters(), 0.01, torch.nn.utils.get_total_norm(grads)
        )
    assert totals[0].item() == pytest.approx(totals[1].item(), rel=1e-5)
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    return max_difference(full_grads(sharded), expected)


def test_clip_grads_with_norm_of_get_total_norm_equals_one_process(run_ranks):
    assert max(run_ranks(2, _clip_with_a_given_norm)) <= 1e-6


def _norm_over_a_dimension(rank: int, world_size: int) -> str:
    sharded = gs.shard(EdgeGPT(), None, unit=UNITS)
    inputs, targets = global_batches(1, world_size)[0]
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    sharded(inputs[local], targets[local]).backward()
    grad = next(p.grad for p in sharded.parameters() if p.grad is not None)
    plain = grad.as_subclass(torch.Tensor)
    gathered = plain.new_empty(world_size * plain.numel())
    dist.all_gather_into_tensor(gathered, plain.contiguous())
    assert grad.norm().item() == pytest.approx(gathered.norm().item(), rel=1e-6)
    assert plain.norm().item() != pytest.approx(gathered.norm().item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"gs\.grad_norms"):
        grad.norm(dim=0)
    for negative in (-1, -math.inf):  # the padding would count as zeros
        with pytest.raises(ValueError, match="ord >= 0"):
            torch.linalg.vector_norm(grad, negative)
    return "ok"


def test_a_norm_over_a_dimension_of_a_shard_gradient_is_refused(run_ranks):
    assert run_ranks(2, _norm_over_a_dimension) == ["ok", "ok"]


def _counts(rank: int, world_size: int, strategy: str) -> tuple[int, int, int, int]:
    torch.manual_seed(0)
    model = EdgeGPT()
    unsharded = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sharded = gs.shard(model, None, unit=UNITS, strategy=strategy)
    counted = sharded.num_unsharded_parameters(), sharded.num_unsharded_parameters(True)
    return unsharded, trainable, *counted


@pytest.mark.parametrize("strategy", ["full", "no_shard"])
def test_the_unsharded_parameter_count_is_the_models(run_ranks, strategy):
    for unsharded, trainable, counted, counted_trainable in run_ranks(3, _counts, strategy):
        assert (counted, counted_trainable) == (unsharded, trainable)
        assert trainable < unsharded  # EdgeGPT has a frozen parameter
