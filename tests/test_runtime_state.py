"""The options gs.shard runs with (one frozen dataclass, checked once) and the training
state the hooks keep (one process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import groupshard as gs
from groupshard.options import ShardOptions
from groupshard.runtime import TrainingState


def test_options_are_checked_once_and_frozen():
    options = ShardOptions(strategy="grad_op", reduce_bucket_bytes=10, first_bucket_bytes=100)
    assert options.first_bucket_limit == 10  # at most a whole bucket
    assert options.signature()["strategy"] == "grad_op"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.strategy = "full"  # type: ignore[misc]
    with pytest.raises(ValueError, match="strategy"):
        ShardOptions(strategy="zero3")
    with pytest.raises(ValueError, match="prefetch_bytes=-1"):
        ShardOptions(prefetch_bytes=-1)
    with pytest.raises(TypeError, match="overlap"):
        ShardOptions(overlap=1)  # type: ignore[arg-type]


def test_training_state_follows_forward_backward_and_summon():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    sharded = gs.shard(model, None, unit=nn.Linear)
    runtime = sharded.groupshard.runtime
    assert runtime.options.strategy == "full"
    seen = []

    def note(module: nn.Module, args: object, output: torch.Tensor) -> None:
        seen.append(runtime.state)
        output.register_hook(lambda grad: seen.append(runtime.state))  # inside backward

    model[0].register_forward_hook(note)
    loss = sharded(torch.randn(3, 4)).sum()
    assert seen == [TrainingState.FORWARD] and runtime.state is TrainingState.IDLE
    loss.backward()
    assert seen == [TrainingState.FORWARD, TrainingState.BACKWARD]
    assert runtime.state is TrainingState.IDLE
    with sharded.summon_full_params():
        assert runtime.state is TrainingState.SUMMONED
    assert runtime.state is TrainingState.IDLE
