"""Overlap: asynchronous gathers and reductions give bit-for-bit the results of the
synchronous runtime, with the same collectives, bounded memory in flight, also when one
rank computes slower; and the native collectives NCCL uses work on gloo too."""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections import Counter
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import groupshard as gs
from groupshard import buckets, comm
from groupshard.cli.model import Block
from groupshard.gathers import unshard_storages

from helpers import (
    BATCH_PER_RANK,
    TINY,
    UNITS,
    EdgeGPT,
    equivalence_case,
    global_batches,
    max_difference,
    three_groups,
)

COUNTED = ("all_gather", "reduce_scatter_mean", "all_reduce_mean", "all_reduce_max")


class SlowOnRankOne(Block):
    """A block that takes longer on rank 1, so its collectives start late there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            time.sleep(0.01)
        return super().forward(x)


def train_case(
    rank: int,
    world_size: int,
    strategy: str,
    overlap: bool,
    bucket_bytes: int = 4096,
    prefetch_bytes: int = 8192,
    slow: bool = False,
    steps: int = 5,
) -> dict[str, Any]:
    """Train a few steps; the final weights, the collectives of the last step (and how
    many were asynchronous), and the runtime's peaks of memory in flight."""
    torch.manual_seed(0)
    model = EdgeGPT()
    if slow:
        for block in model.blocks:
            block.__class__ = SlowOnRankOne
    sharded = gs.shard(
        model, three_groups(model, 1e-3), unit=UNITS, strategy=strategy, overlap=overlap,
        reduce_bucket_bytes=bucket_bytes, prefetch_bytes=prefetch_bytes,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    counts: Counter[str] = Counter()

    def counted(name: str) -> Any:
        original = getattr(comm, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            if inspect.signature(original).bind(*args, **kwargs).arguments.get("async_op"):
                counts[f"{name} async"] += 1
            return original(*args, **kwargs)

        return wrapper

    batches = global_batches(steps, world_size)
    for step, (inputs, targets) in enumerate(batches):
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        last = step == len(batches) - 1
        patches = {name: counted(name) if last else getattr(comm, name) for name in COUNTED}
        with mock.patch.multiple(comm, **patches):
            sharded(inputs[local], targets[local]).backward()
            optimizer.step()
            optimizer.zero_grad()
    state = sharded.groupshard.runtime
    largest_unit = max(unit.unsharded_bytes for unit in state.units)
    return {
        "weights": gs.full_state_dict(sharded),
        "counts": dict(counts),
        "peak_gathered": state.gathers.peak_gathered_bytes,
        "peak_reducing": state.buckets.peak_reducing_bytes,
        "root_bytes": state.units[0].unsharded_bytes,
        "largest_unit": largest_unit,
        "largest_gradient": max(
            s.layout.trainable_unsharded_numel * 4 for s in sharded.groupshard.storages
        ),
    }


def _bitwise_equal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize(
    "world_size, strategy",
    [(2, "full"), (3, "full"), (2, "grad_op"), (3, "grad_op"), (2, "no_shard"), (3, "no_shard")],
)
def test_overlap_is_bitwise_the_same_training(run_ranks, world_size, strategy):
    on = run_ranks(world_size, train_case, strategy, True)
    off = run_ranks(world_size, train_case, strategy, False)
    for with_overlap, without in zip(on, off, strict=True):
        assert _bitwise_equal(with_overlap["weights"], without["weights"])
        # the same collectives; with overlap, reductions (and full's prefetches) run async
        plain = {k: v for k, v in with_overlap["counts"].items() if not k.endswith("async")}
        assert plain == without["counts"], (with_overlap["counts"], without["counts"])
        assert not any(k.endswith("async") for k in without["counts"])
        assert (
            with_overlap["counts"].get("reduce_scatter_mean async", 0)
            + with_overlap["counts"].get("all_reduce_mean async", 0)
            > 1
        )
        if strategy != "no_shard":
            assert with_overlap["counts"].get("all_gather async", 0) > 0


def test_a_slow_rank_changes_nothing(run_ranks):
    slow = run_ranks(2, train_case, "full", True, 4096, 8192, True)
    reference = run_ranks(2, train_case, "full", False)
    for with_slow, without in zip(slow, reference, strict=True):
        assert _bitwise_equal(with_slow["weights"], without["weights"])


@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_memory_in_flight_is_bounded(run_ranks, strategy):
    """Gathered: the root (kept), the unit computing and the next window (one unit, or
    several up to prefetch_bytes). Gradients reducing: at most REDUCES_IN_FLIGHT buckets,
    each less than reduce_bucket_bytes plus one unit's gradient."""
    prefetch, bucket = 8192, 4096
    for result in run_ranks(2, train_case, strategy, True, bucket, prefetch):
        if strategy == "full":
            largest = result["largest_unit"]
            bound = result["root_bytes"] + largest + max(largest, prefetch)
            assert result["peak_gathered"] <= bound, result
        gradient_bound = buckets.REDUCES_IN_FLIGHT * (bucket + result["largest_gradient"])
        assert 0 < result["peak_reducing"] <= gradient_bound, result


def prefetch_case(rank: int, world_size: int, strategy: str, prefetch_bytes: int) -> dict:
    """A few steps; each all-gather of the last step as (phase, asynchronous), the peak of
    gathered bytes, and each unit's unsharded bytes (the root first)."""
    torch.manual_seed(0)
    model = EdgeGPT(dataclasses.replace(TINY, n_layer=4))  # 3 blocks could be held at once
    sharded = gs.shard(
        model, three_groups(model, 1e-3), unit=UNITS, strategy=strategy,
        prefetch_bytes=prefetch_bytes,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    runtime = sharded.groupshard.runtime
    gathers: list[tuple[str, bool]] = []
    original = comm.all_gather

    def recorded(*args: Any, **kwargs: Any) -> Any:
        arguments = inspect.signature(original).bind(*args, **kwargs).arguments
        gathers.append((runtime.state.name, bool(arguments.get("async_op"))))
        return original(*args, **kwargs)

    for inputs, targets in global_batches(3, world_size):
        gathers.clear()
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        with mock.patch.object(comm, "all_gather", recorded):
            sharded(inputs[local], targets[local]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "gathers": Counter(gathers),
        "peak_gathered": runtime.gathers.peak_gathered_bytes,
        "unit_bytes": [unit.unsharded_bytes for unit in runtime.units],
    }


@pytest.mark.parametrize("strategy", ["full", "grad_op"])
def test_units_larger_than_prefetch_bytes_are_prefetched(run_ranks, strategy):
    """Every unit is larger than prefetch_bytes but one: each is still prefetched (one unit
    ahead, as FSDP2), in forward and (full) in backward; full holds at most the root, the
    unit computing and the next one at once."""
    for result in run_ranks(2, prefetch_case, strategy, 1024):
        units = result["unit_bytes"]
        assert sum(size > 1024 for size in units) == len(units) - 1  # Shift is the small one
        # the root's gather starts a forward, the others are prefetched
        expected = {("FORWARD", False): 1, ("FORWARD", True): len(units) - 1}
        if strategy == "full":  # the root stays gathered into backward, which starts with it
            expected[("BACKWARD", True)] = len(units) - 1
        assert dict(result["gathers"]) == expected, result
        root, *others = units
        if strategy == "full":  # grad_op keeps every unit from forward to backward's end
            assert result["peak_gathered"] <= root + 2 * max(others) < sum(units), result


def native_case(rank: int, world_size: int, strategy: str, overlap: bool) -> float:
    """gloo's all_gather_into_tensor / reduce_scatter_tensor, the path NCCL takes."""
    comm.GLOO_EMULATION["enabled"] = False
    try:
        original = gs.shard

        def shard(*args: Any, **kwargs: Any) -> Any:
            return original(*args, overlap=overlap, **kwargs)

        with mock.patch.object(gs, "shard", shard):
            return equivalence_case(rank, world_size, strategy, "adamw", 4)
    finally:
        comm.GLOO_EMULATION["enabled"] = True


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_native_collectives_on_gloo(run_ranks, strategy, overlap):
    assert max(run_ranks(3, native_case, strategy, overlap)) <= 1e-5


def test_overlap_must_be_a_bool():
    with pytest.raises(TypeError, match="overlap"):
        gs.shard(EdgeGPT(), None, unit=UNITS, overlap="yes")  # type: ignore[arg-type]


def test_equal_to_one_process_with_overlap(run_ranks):
    for result in run_ranks(2, train_case, "full", True):
        torch.manual_seed(0)
        reference = EdgeGPT()
        optimizer = torch.optim.AdamW(three_groups(reference, 1e-3), lr=3e-3)
        for inputs, targets in global_batches(5, 2):
            reference(inputs, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert max_difference(result["weights"], reference.state_dict()) <= 1e-5


def reshard_in_flight_case(rank: int, world_size: int, together: bool) -> dict:
    """A storage resharded while its asynchronous gather is still in flight (rank 1 joins
    it late), alone or gathered together with the next unit's storage: whether the gather
    was complete when the buffers were freed, their size then, and whether a gather
    afterwards gives the whole weights."""
    torch.manual_seed(0)
    model = EdgeGPT(TINY)
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS)
    runtime = sharded.groupshard.runtime
    storages = [unit.storages[0] for unit in runtime.units[1:3]]
    expected = gs.full_state_dict(sharded)
    if rank == 1:
        time.sleep(0.3)  # rank 0 frees its buffers while the collective waits for this rank
    if together:
        pending = unshard_storages(storages, async_op=True)
    else:
        pending = storages[0].unshard(async_op=True)
    storages[0].reshard()
    done, freed = pending.done, storages[0].trainable_data.untyped_storage().size()
    pending.wait()
    for storage in storages:
        storage.reshard()
    runtime.units[1].install_local_pieces()
    with sharded.summon_full_params():
        whole = {n: p.detach().clone() for n, p in sharded.named_parameters()}
    return {
        "done when freed": done,
        "bytes after": freed,
        "whole weights": all(torch.equal(whole[n], expected[n]) for n in whole),
    }


@pytest.mark.parametrize("together", [False, True], ids=["alone", "together"])
def test_buffers_are_not_freed_under_a_gather_in_flight(run_ranks, together):
    """gloo writes a gather's result through the buffers' address (and its copy-out into
    them follows): a storage freed under it would have that memory written after the
    allocator handed it out again (heap corruption). Resharding waits for it first."""
    for result in run_ranks(2, reshard_in_flight_case, together):
        assert result == {"done when freed": True, "bytes after": 0, "whole weights": True}
