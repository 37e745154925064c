"""The number of collectives per step does not grow with the number of groups."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch

import groupshard as gs
from groupshard import comm

from helpers import UNITS, EdgeGPT, global_batches


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
        "grad_op": {"all_gather": 1, "reduce_scatter_mean": units},  # all units gathered at once
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
