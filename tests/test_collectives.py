"""The number of collectives per step does not grow with the number of groups."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch

import groupshard as gs
from groupshard import buckets as bucketing
from groupshard import comm
from groupshard.cli.model import GPT, Block, GPTConfig

from helpers import BATCH_PER_RANK, UNITS, EdgeGPT, global_batches


def count_case(
    rank: int, world_size: int, strategy: str, group_count: int, bucket_bytes: int = 0
) -> dict[str, int]:
    torch.manual_seed(0)
    model = EdgeGPT()
    order = {name: index for index, (name, _) in enumerate(model.named_parameters())}
    groups = gs.groups_by(model, lambda name, p: order[name] % group_count)
    assert len(groups) == group_count
    sharded = gs.shard(
        model, groups, unit=UNITS, strategy=strategy, reduce_bucket_bytes=bucket_bytes,
        prefetch_bytes=bucket_bytes,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=1e-3)
    inputs, targets = global_batches(1, world_size)[0]
    counts: Counter[str] = Counter()

    def counted(name):
        original = getattr(comm, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return wrapper

    names = (
        "all_gather", "reduce_scatter_mean", "all_reduce_mean", "all_reduce_max", "broadcast",
        "gather_objects",
    )  # fmt: skip
    sharded(inputs, targets).backward()  # a first step records the order units run in
    optimizer.step()
    optimizer.zero_grad()
    with mock.patch.multiple(comm, **{name: counted(name) for name in names}):
        sharded(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    counts["units with parameters"] = sum(1 for u in sharded.groupshard.runtime.units if u.storages)
    counts["buffers"] = sum(len(s.layout.buffers) for s in sharded.groupshard.storages)
    return dict(counts)


@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_collective_count_is_independent_of_group_count(run_ranks, strategy):
    one = run_ranks(2, count_case, strategy, 1)[0]
    five = run_ranks(2, count_case, strategy, 5)[0]
    assert five["buffers"] > one["buffers"]  # more groups really means more flat buffers
    units = one["units with parameters"]
    expected = {
        # the root stays gathered from the end of forward into backward
        "full": {"all_gather": 2 * units - 1, "reduce_scatter_mean": units},
        # forward gathers in windows of prefetch_bytes (here 0: one unit each), kept for backward
        "grad_op": {"all_gather": units, "reduce_scatter_mean": units},
        "no_shard": {"all_reduce_mean": units},
    }[strategy]
    expected["all_reduce_max"] = 1  # which parameters had a gradient, for the whole model
    for counts in (one, five):
        step = {
            k: v for k, v in counts.items() if k in expected or k in ("broadcast", "gather_objects")
        }
        assert step == expected, (strategy, counts)


@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_buckets_merge_units(run_ranks, strategy):
    """With buckets larger than the model, all units' gradients go in one collective, and
    "full" gathers everything in one all-gather per pass (forward, backward)."""
    counts = run_ranks(2, count_case, strategy, 5, 2**30)[0]
    reductions = counts.get("reduce_scatter_mean", 0) + counts.get("all_reduce_mean", 0)
    assert reductions == 1, counts
    assert counts.get("all_gather", 0) == {"full": 2, "grad_op": 1, "no_shard": 0}[strategy]


# the root (embedding 256 x 16, tied to the head) is 1.3 blocks' worth of gradient
THREE_BLOCKS = GPTConfig(vocab_size=256, block_size=8, n_layer=3, n_head=2, n_embd=16)


def bucket_case(
    rank: int, world_size: int, strategy: str, bucket_blocks: float, first_blocks: float
) -> list[list[list[str]]]:
    """The units whose gradients went in each reduction, per step, with buckets and
    first buckets measured in blocks' gradients (every block has the same size)."""
    torch.manual_seed(0)
    model = GPT(THREE_BLOCKS)
    block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    sharded = gs.shard(
        model, None, unit=Block, strategy=strategy, prefetch_bytes=0,
        reduce_bucket_bytes=int(bucket_blocks * block_bytes),
        first_bucket_bytes=int(first_blocks * block_bytes),
    )  # fmt: skip
    state = sharded.groupshard.runtime
    unit_of = {id(s): unit.name or "<root>" for unit in state.units for s in unit.storages}
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=1e-3)
    steps: list[list[list[str]]] = []
    original = bucketing.reduce_gradients

    def recorded(storages, *args, **kwargs):
        steps[-1].append([unit_of[id(s)] for s in storages])
        return original(storages, *args, **kwargs)

    with mock.patch.object(bucketing, "reduce_gradients", recorded):
        for inputs, targets in global_batches(3, world_size):
            steps.append([])
            local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
            sharded(inputs[local], targets[local]).backward()
            optimizer.step()
            optimizer.zero_grad()
    return steps


@pytest.mark.parametrize("strategy", ["full", "no_shard"])
def test_the_last_gradients_are_not_held_back(run_ranks, strategy):
    """Backward reaches blocks 2, 1, 0, then the root (its embedding comes last).
    Buckets of 1.5 blocks: after the first backward a bucket is sent as soon as the
    gradient that came next last time would overfill it, so the root's reduction, which
    nothing hides, carries the root alone (the first backward, with no record, still
    sends block 0 with the root)."""
    for steps in run_ranks(2, bucket_case, strategy, 1.5, 1.5):
        first, *later = steps
        assert first == [["blocks.2", "blocks.1"], ["blocks.0", "<root>"]]
        for buckets in later:
            assert buckets == [["blocks.2"], ["blocks.1"], ["blocks.0"], ["<root>"]]


@pytest.mark.parametrize("strategy", ["full", "no_shard"])
def test_the_first_bucket_is_small(run_ranks, strategy):
    """Buckets of 2.5 blocks: with a first bucket of half a block, block 2's gradient goes
    alone (its reduction runs behind the rest of backward); without, with block 1's."""
    small_first = run_ranks(2, bucket_case, strategy, 2.5, 0.5)[0]
    assert small_first[-1] == [["blocks.2"], ["blocks.1", "blocks.0"], ["<root>"]]
    same_first = run_ranks(2, bucket_case, strategy, 2.5, 2.5)[0]
    assert same_first[-1] == [["blocks.2", "blocks.1"], ["blocks.0", "<root>"]]
