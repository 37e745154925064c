"""Training with groupshard on N ranks equals single-process training with plain torch."""

from __future__ import annotations

import pytest

from helpers import equivalence_case

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
