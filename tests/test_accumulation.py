"""Gradient accumulation without communication: K micro-batches per rank with no_sync (or
FSDP2's set_requires_gradient_sync) and one synced backward equal one process on the
global batch, and communicate exactly what one synced backward does."""

from __future__ import annotations

import copy
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import groupshard as gs
from groupshard import comm

from helpers import BATCH_PER_RANK, TINY, UNITS, EdgeGPT, max_difference, three_groups

TOLERANCE = 1e-5
MICRO_BATCHES = 3
COLLECTIVES = (
    "all_gather", "reduce_scatter_mean", "all_reduce_mean", "all_reduce_max", "all_reduce_sum",
    "broadcast", "gather_objects",
)  # fmt: skip


def _groups(model: nn.Module, kind: str) -> list[dict]:
    return [{"params": list(model.parameters())}] if kind == "one" else three_groups(model, 1e-3)


def _optimizer(name: str, groups: list[dict]) -> torch.optim.Optimizer:
    if name == "lamb":
        return gs.optim.LAMB(groups, lr=1e-2, weight_decay=0.01)
    return torch.optim.AdamW(groups, lr=3e-3)


def _global_batches(steps: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, ``world_size`` x ``MICRO_BATCHES`` micro-batches end to end (rank-major)."""
    generator = torch.Generator().manual_seed(5)
    size = (BATCH_PER_RANK * MICRO_BATCHES * world_size, TINY.block_size)
    return [
        tuple(torch.randint(0, TINY.vocab_size, size, generator=generator) for _ in range(2))
        for _ in range(steps)
    ]


def _my_micro_batches(
    batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``count`` micro-batches of a global batch (rank-major)."""
    inputs, targets = (t.chunk(world_size * count) for t in batch)
    mine = range(rank * count, (rank + 1) * count)
    return [(inputs[index], targets[index]) for index in mine]


def _reductions(counts: Counter[str]) -> int:
    """Collectives other than gathering parameters (which a sharded forward needs)."""
    return sum(count for name, count in counts.items() if name != "all_gather")


def _counting(counts: Counter[str]) -> dict[str, object]:
    def counted(name: str) -> object:
        original = getattr(comm, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            counts[name] += 1
            return original(*args, **kwargs)

        return wrapper

    return {name: counted(name) for name in COLLECTIVES}


def accumulation_case(
    rank: int,
    world_size: int,
    strategy: str,
    groups: str,
    optimizer: str,
    clip: bool,
    switch: str = "no_sync",
    reshard_after_backward: bool = True,
    steps: int = 4,
) -> tuple[float, list[Counter[str]], list[Counter[str]]]:
    """Train with accumulation beside one process; returns the largest difference and, per
    step, the collectives of the micro-batches without sync and of the synced one."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, _groups(model, groups), unit=UNITS, strategy=strategy)
    sharded.set_reshard_after_backward(reshard_after_backward)
    sharded_opt = _optimizer(optimizer, sharded.optimizer_groups())
    reference_opt = _optimizer(optimizer, _groups(reference, groups))
    unsynced_counts, synced_counts = [], []
    for inputs, targets in _global_batches(steps, world_size):
        mine = _my_micro_batches((inputs, targets), rank, world_size, MICRO_BATCHES)
        unsynced, synced = Counter(), Counter()
        with mock.patch.multiple(comm, **_counting(unsynced)):
            for micro_inputs, micro_targets in mine[:-1]:
                if switch in ("no_sync", "closure"):
                    with sharded.no_sync():
                        (sharded(micro_inputs, micro_targets) / MICRO_BATCHES).backward()
                else:
                    sharded.set_requires_gradient_sync(False)
                    (sharded(micro_inputs, micro_targets) / MICRO_BATCHES).backward()
        if switch == "set_requires_gradient_sync":
            sharded.set_requires_gradient_sync(True)

        def last_micro_batch(last: tuple = mine[-1]) -> torch.Tensor:
            loss = sharded(*last) / MICRO_BATCHES
            loss.backward()
            if clip:
                gs.clip_grad_norm_(sharded, 0.05)
            return loss

        with mock.patch.multiple(comm, **_counting(synced)):
            if switch == "closure":  # the backward runs inside step, as Lightning's
                sharded_opt.step(last_micro_batch)
            else:
                last_micro_batch()
                sharded_opt.step()
            sharded_opt.zero_grad()
        unsynced_counts.append(unsynced)
        synced_counts.append(synced)
        reference(inputs, targets).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        reference_opt.step()
        reference_opt.zero_grad()
    difference = max_difference(gs.full_state_dict(sharded), reference.state_dict())
    return difference, unsynced_counts, synced_counts


def one_synced_step_counts(rank: int, world_size: int, strategy: str, groups: str) -> Counter:
    """The collectives of one ordinary step (forward, synced backward, step) after a first."""
    torch.manual_seed(0)
    model = EdgeGPT()
    sharded = gs.shard(model, _groups(model, groups), unit=UNITS, strategy=strategy)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=1e-3)
    inputs, targets = _global_batches(1, world_size)[0]
    counts: Counter[str] = Counter()
    for counting in (False, True):
        with mock.patch.multiple(comm, **_counting(counts)) if counting else mock.patch.dict({}):
            sharded(inputs[:BATCH_PER_RANK], targets[:BATCH_PER_RANK]).backward()
            optimizer.step()
            optimizer.zero_grad()
    return counts


CASES = [("one", "adamw", False), ("three", "adamw", False), ("three", "lamb", True)]


@pytest.mark.parametrize("groups, optimizer, clip", CASES)
@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_accumulation_matches_global_batch(run_ranks, strategy, groups, optimizer, clip):
    results = run_ranks(2, accumulation_case, strategy, groups, optimizer, clip)
    for difference, unsynced, _ in results:
        assert difference <= TOLERANCE, difference
        assert all(_reductions(counts) == 0 for counts in unsynced), unsynced
    # a step with accumulation communicates exactly what an ordinary step does
    ordinary = run_ranks(2, one_synced_step_counts, strategy, groups)[0]
    if not clip:
        assert results[0][2][-1] == ordinary, (results[0][2][-1], ordinary)


@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_set_requires_gradient_sync_at_three_ranks(run_ranks, strategy):
    for difference, unsynced, _ in run_ranks(
        3, accumulation_case, strategy, "three", "adamw", False, "set_requires_gradient_sync"
    ):
        assert difference <= TOLERANCE, difference
        assert all(_reductions(counts) == 0 for counts in unsynced), unsynced


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_step_with_a_closure_that_runs_the_last_backward(run_ranks, optimizer):
    """``optimizer.step(closure)`` whose closure runs the last micro-batch's synced backward
    and the clipping (Lightning's automatic optimization): the step sees the reduced
    gradients, equal to one process."""
    for difference, unsynced, _ in run_ranks(
        2, accumulation_case, "full", "three", optimizer, True, "closure"
    ):
        assert difference <= TOLERANCE, difference
        assert all(_reductions(counts) == 0 for counts in unsynced), unsynced


def test_reshard_after_backward_off_gathers_less(run_ranks):
    """Units kept gathered between micro-batches: same training, fewer all-gathers, and
    gathered copies are refreshed after each optimizer step (else the result would drift)."""
    kept = run_ranks(2, accumulation_case, "full", "three", "adamw", False, "no_sync", False)
    freed = run_ranks(2, accumulation_case, "full", "three", "adamw", False, "no_sync", True)
    for (difference, kept_unsynced, _), (_, freed_unsynced, _) in zip(kept, freed, strict=True):
        assert difference <= TOLERANCE, difference
        # with units kept, later micro-batches gather nothing before forward or backward
        assert sum(c["all_gather"] for c in kept_unsynced) < sum(
            c["all_gather"] for c in freed_unsynced
        )


def unsynced_step_case(rank: int, world_size: int) -> tuple[str, float]:
    """An optimizer step while no_sync's sums wait raises; nothing is lost: the sums are
    reduced by the next synced backward and the training equals one process."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    reference_opt = torch.optim.AdamW(three_groups(reference, 1e-3), lr=3e-3)
    inputs, targets = _global_batches(1, world_size)[0]
    first, last = _my_micro_batches((inputs, targets), rank, world_size, 2)
    message = ""
    with sharded.no_sync():
        (sharded(*first) / 2).backward()
        try:
            optimizer.step()
        except RuntimeError as error:
            message = str(error)
    (sharded(*last) / 2).backward()
    optimizer.step()
    reference(inputs, targets).backward()
    reference_opt.step()
    return message, max_difference(gs.full_state_dict(sharded), reference.state_dict())


def test_step_inside_no_sync_raises_and_loses_nothing(run_ranks):
    for message, difference in run_ranks(2, unsynced_step_case):
        assert "optimizer.step() while units" in message and "no_sync" in message, message
        assert difference <= TOLERANCE, difference


def test_no_sync_misuse_is_refused():
    torch.manual_seed(0)
    model = gs.shard(EdgeGPT(), None, unit=UNITS)
    with model.no_sync():
        with pytest.raises(RuntimeError, match="do not nest"), model.no_sync():
            pass
        with pytest.raises(RuntimeError, match="one or the other"):
            model.set_requires_gradient_sync(False)
    model.set_requires_gradient_sync(False)
    with pytest.raises(RuntimeError, match="one or the other"), model.no_sync():
        pass
    with pytest.raises(TypeError, match="requires_gradient_sync"):
        model.set_requires_gradient_sync(0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="reshard_after_backward"):
        model.set_reshard_after_backward("no")  # type: ignore[arg-type]


def zero_with_ddp_no_sync_case(rank: int, world_size: int) -> float:
    """gs.ZeroRedundancyOptimizer under DDP's own no_sync: equal to one process."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    optimizer = gs.ZeroRedundancyOptimizer(
        three_groups(model, 1e-3), optimizer_class=torch.optim.AdamW, lr=3e-3
    )
    reference_opt = torch.optim.AdamW(three_groups(reference, 1e-3), lr=3e-3)
    for inputs, targets in _global_batches(3, world_size):
        mine = _my_micro_batches((inputs, targets), rank, world_size, MICRO_BATCHES)
        with ddp.no_sync():
            for micro_inputs, micro_targets in mine[:-1]:
                (ddp(micro_inputs, micro_targets) / MICRO_BATCHES).backward()
        (ddp(*mine[-1]) / MICRO_BATCHES).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference(inputs, targets).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    return max_difference(dict(model.named_parameters()), dict(reference.named_parameters()))


def test_zero_optimizer_with_ddp_no_sync(run_ranks):
    for difference in run_ranks(2, zero_with_ddp_no_sync_case):
        assert difference <= TOLERANCE, difference


def test_unused_unit_in_synced_backward_still_reduces_its_sum():
    """A storage reached only by micro-batches without sync is reduced at the end of the
    synced backward (one process: the sums must still land in the shards)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, None, unit=nn.Linear)
    x, y = torch.randn(3, 4), F.relu(torch.randn(3, 4))
    with sharded.no_sync():
        sharded(x).sum().backward()
    sharded[1](y).sum().backward()  # the synced backward reaches only the second Linear
    reference(x).sum().backward()
    reference[1](y).sum().backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    got = {}
    for storage in sharded.groupshard.storages:
        for shard, buffer in zip(storage.shards, storage.layout.buffers, strict=True):
            for slot in buffer.params:
                got[slot.fqn] = shard.grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
    assert sorted(got) == sorted(grads)
    for name, grad in grads.items():
        assert torch.allclose(got[name], grad), name
