"""Training with groupshard on N ranks equals single-process training with plain torch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import groupshard as gs

from helpers import equivalence_case, max_difference

TOLERANCE = 1e-5


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_matches_single_process(run_ranks, world_size, strategy, optimizer):
    differences = run_ranks(world_size, equivalence_case, strategy, optimizer, 12)
    assert max(differences) <= TOLERANCE, differences


@pytest.mark.parametrize(
    "optimizer", ["adamw_fused", "adamw_foreach", "adam_loop", "adagrad", "rmsprop"]
)
def test_any_torch_optimizer(run_ranks, optimizer):
    differences = run_ranks(2, equivalence_case, "full", optimizer, 10)
    assert max(differences) <= TOLERANCE, differences


@pytest.mark.parametrize("bucket_bytes", [0, 4096])
@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_gradient_bucket_sizes(run_ranks, strategy, bucket_bytes):
    """Per-unit reduction (0) and buckets of a few units give the same training."""
    differences = run_ranks(3, equivalence_case, strategy, "adamw", 6, "blocks", bucket_bytes)
    assert max(differences) <= TOLERANCE, differences


@pytest.mark.parametrize("units", ["nested", "root only"])
@pytest.mark.parametrize("strategy", ["full", "grad_op"])
def test_unit_choices(run_ranks, units, strategy):
    differences = run_ranks(3, equivalence_case, strategy, "adamw", 6, units)
    assert max(differences) <= TOLERANCE, differences


class MixedPrecisionBlock(nn.Module):
    """A unit with float32 and float64 parameters: two storages, one per dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=torch.float64))
        self.shift = nn.Parameter(torch.zeros(5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x)) * self.scale.float()
        return y + nn.functional.pad(self.shift.float(), (0, 1))


def mixed_dtype_case(rank: int, world_size: int, strategy: str) -> tuple[float, int]:
    torch.manual_seed(0)
    model = nn.Sequential(MixedPrecisionBlock(), MixedPrecisionBlock(), nn.Linear(6, 1))
    reference = copy.deepcopy(model)

    def groups(m):
        return gs.groups_by(m, lambda n, p: p.ndim, {2: {"weight_decay": 0.1}, 1: {"lr": 0.02}})

    sharded = gs.shard(model, groups(model), unit=MixedPrecisionBlock, strategy=strategy)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(groups(reference), lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    for _ in range(6):
        inputs = torch.randn(4 * world_size, 6, generator=generator)
        local = inputs.chunk(world_size)[rank]
        sharded(local).square().mean().backward()
        reference(inputs).square().mean().backward()
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    difference = max_difference(gs.full_state_dict(sharded), reference.state_dict())
    return difference, len(sharded.groupshard.storages)


@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_mixed_dtypes_in_one_unit(run_ranks, strategy):
    for difference, storages in run_ranks(2, mixed_dtype_case, strategy):
        assert storages == 5  # two units x (float32, float64) + the root's float32
        assert difference <= TOLERANCE
