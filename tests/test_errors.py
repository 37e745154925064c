"""Bad input fails fast on every rank with an error naming the parameter or group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import groupshard as gs

from helpers import UNITS, EdgeGPT, three_groups


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


BAD_INPUTS = {
    "in two groups": lambda m, rank: [{"params": _trainable(m)}, {"params": [m.logit_scale]}],
    "not in the model": lambda m, rank: [*_trainable(m), nn.Parameter(torch.ones(2))],
    "left out": lambda m, rank: _trainable(m)[1:],
    "empty list": lambda m, rank: [],
    "different groups per rank": lambda m, rank: (
        three_groups(m, 0.1)[: 3 - (rank % 2)]
        + ([] if rank % 2 == 0 else [{"params": three_groups(m, 0.1)[2]["params"]}])
    ),
    "moved between groups on one rank": lambda m, rank: _moved(m, rank),
    "other lr on one rank": lambda m, rank: [
        {**g, "lr": 0.5 if rank == _last_rank() and "lr" in g else g.get("lr", 0.1)}
        for g in three_groups(m, 0.1)
    ],
    "bad only on the last rank": lambda m, rank, ws=None: (
        _trainable(m)[1:] if rank == _last_rank() else _trainable(m)
    ),
}


def _last_rank() -> int:
    return torch.distributed.get_world_size() - 1


def _moved(model, rank):
    groups = three_groups(model, 0.1)
    if rank == _last_rank():
        groups[1]["params"] = list(groups[1]["params"])
        groups[0]["params"] = [*groups[0]["params"], groups[1]["params"].pop()]
    return groups


def bad_input_case(rank: int, world_size: int, kind: str) -> tuple[str, str]:
    torch.manual_seed(0)
    model = EdgeGPT()
    if kind == "integer parameter":
        model.steps = nn.Parameter(torch.zeros(1, dtype=torch.long), requires_grad=False)
        groups = None
    else:
        groups = BAD_INPUTS[kind](model, rank)
    try:
        gs.shard(model, groups, unit=UNITS)
    except (ValueError, TypeError) as error:
        return type(error).__name__, str(error)
    return "no error", ""


EXPECTED = {
    "in two groups": "'logit_scale' is in param group 1 and also in group 0",
    "not in the model": "is not a parameter of the model",
    "left out": "in no param group: 'logit_scale'",
    "empty list": "empty list",
    "different groups per rank": "Ranks disagree",
    "moved between groups on one rank": "Ranks disagree on how to shard the model: param group 0",
    "bad only on the last rank": "in no param group: 'logit_scale'",
    "other lr on one rank": "Ranks disagree on how to shard the model: param group 2",
    "integer parameter": "'steps' has dtype torch.int64",
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_error_on_every_rank(run_ranks, world_size, kind):
    outcomes = run_ranks(world_size, bad_input_case, kind, timeout=90)
    for rank, (error_type, message) in enumerate(outcomes):
        assert error_type == "ValueError", (rank, error_type, message)
        assert EXPECTED[kind] in message, (rank, message)
    if kind == "bad only on the last rank":
        assert f"rank {world_size - 1} failed" in outcomes[0][1]


def strategy_mismatch_case(rank: int, world_size: int) -> str:
    model = EdgeGPT()
    try:
        gs.shard(model, None, strategy="full" if rank == 0 else "grad_op")
    except ValueError as error:
        return str(error)
    return "no error"


def test_ranks_with_different_strategies_fail_together(run_ranks):
    for message in run_ranks(2, strategy_mismatch_case):
        assert "strategy on rank 0 is 'full' but on rank 1 is 'grad_op'" in message
