"""Wrappers that would corrupt a sharded model raise on every rank before any step (DDP at
its construction, or at the first forward when it holds the sharded model inside another
module; FSDP1 and FSDP2 at the first forward), and moves to the device the shards already
live on are no-ops whatever their spelling."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import groupshard as gs
from groupshard.cli.model import GPT, Block

from helpers import TINY, global_batches, max_difference

INTEGRATION = "groupshard.integrations.transformers.Trainer"


def _sharded() -> gs.ShardedModule:
    torch.manual_seed(0)
    model = GPT(TINY)
    return gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, strategy="full")


def _shards(model: gs.ShardedModule) -> list[torch.Tensor]:
    return [storage.local.clone() for storage in model.groupshard.storages]


class Holder(nn.Module):
    """A parent module around a sharded one (as a user's wrapper or a peft model is)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner(inputs, targets)


def ddp_case(rank: int, world_size: int) -> tuple[str, bool]:
    model = _sharded()
    before = _shards(model)
    with pytest.raises(TypeError) as refused:
        DistributedDataParallel(model)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _shards(model), strict=True))
    return str(refused.value), unchanged


def test_ddp_around_a_sharded_model_raises_at_construction_on_every_rank(run_ranks):
    for message, unchanged in run_ranks(2, ddp_case):
        assert "DistributedDataParallel around a model sharded by gs.shard" in message
        assert INTEGRATION in message
        assert unchanged  # refused before DDP's broadcast of rank 0's parameters


def _first_forward_error(wrapped: nn.Module, rank: int, world_size: int) -> str:
    inputs, targets = global_batches(1, world_size)[0]
    with pytest.raises(TypeError) as refused:
        wrapped(inputs[rank::world_size], targets[rank::world_size])
    return str(refused.value)


def ddp_parent_case(rank: int, world_size: int) -> str:
    return _first_forward_error(DistributedDataParallel(Holder(_sharded())), rank, world_size)


def fully_shard_case(rank: int, world_size: int) -> str:
    from torch.distributed.fsdp import fully_shard

    return _first_forward_error(fully_shard(_sharded()), rank, world_size)


def fsdp1_case(rank: int, world_size: int) -> str:
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation and CPU notices
        wrapped = FullyShardedDataParallel(Holder(_sharded()), device_id=torch.device("cpu"))
    return _first_forward_error(wrapped, rank, world_size)


@pytest.mark.parametrize(
    "case, wrapper",
    [
        (ddp_parent_case, "DistributedDataParallel"),
        (fully_shard_case, "FSDP2 (fully_shard)"),
        (fsdp1_case, "FSDP1 (FullyShardedDataParallel)"),
    ],
    ids=["ddp-around-a-parent", "fully_shard", "fsdp1"],
)
def test_wrappers_that_hold_a_sharded_model_raise_at_the_first_forward(run_ranks, case, wrapper):
    for message in run_ranks(2, case):
        assert message.startswith(wrapper), message
        assert "around a model sharded by gs.shard would corrupt its shards" in message
        assert INTEGRATION in message


def same_device_case(rank: int, world_size: int) -> tuple[list[bool], float, str]:
    """Moves to the shards' own device, in every spelling, leave the shards in place, and
    training goes on equal to one process; a real conversion raises with nothing changed."""
    model = _sharded()
    torch.manual_seed(0)
    reference = GPT(TINY)
    reference_opt = torch.optim.AdamW(gs.decay_groups(reference, 0.1), lr=1e-2)
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1e-2)
    pointers = [storage.local.data_ptr() for storage in model.groupshard.storages]
    kept = []
    for move in (
        lambda m: m.to("cpu:0"),
        lambda m: m.to(torch.device("cpu", 0)),
        lambda m: m.to("cpu"),
        lambda m: m.cpu(),
        lambda m: m.to(torch.float32),
        lambda m: m.to_empty(device="cpu:0"),
    ):
        returned = move(model)
        kept.append(
            returned is model
            and [s.local.data_ptr() for s in model.groupshard.storages] == pointers
            and all(
                shard.data_ptr() >= storage.local.data_ptr()
                for storage in model.groupshard.storages
                for shard in storage.shards
            )
        )
    for inputs, targets in global_batches(3, world_size):
        model(inputs[rank::world_size], targets[rank::world_size]).backward()
        model.to("cpu:0")  # with gradients present: they stay the ones the optimizer steps
        optimizer.step()
        optimizer.zero_grad()
        reference(inputs, targets).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    difference = max_difference(model.state_dict(), reference.state_dict())
    before = _shards(model)
    with pytest.raises(ValueError) as refused:
        model.to(torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(before, _shards(model), strict=True))
    return kept, difference, str(refused.value)


def test_moves_to_the_shards_own_device_are_no_ops(run_ranks):
    for kept, difference, refusal in run_ranks(2, same_device_case):
        assert all(kept), kept
        assert difference < 1e-5
        assert "would convert the sharded parameters" in refusal


def test_a_plain_model_under_ddp_is_untouched_by_the_guards(run_ranks):
    """The guards look at sharded models only: DDP of an unsharded model still trains."""
    assert run_ranks(2, plain_ddp_case) == [True, True]


def plain_ddp_case(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    model = GPT(TINY)
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    inputs, targets = global_batches(1, world_size)[0]
    ddp(inputs[rank::world_size], targets[rank::world_size]).backward()
    reference(inputs, targets).backward()
    return all(
        torch.allclose(p.grad, q.grad, atol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
