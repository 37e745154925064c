"""Tensor parallelism (torch's ``parallelize_module``) and groupshard (issue 52).

Until gs.shard shards DTensor parameters, a tensor-parallel model is refused before
anything is sharded, with the parameter named, on every rank, whichever way the
data-parallel ranks are passed (before: a misleading "every rank of the world" mesh
error, or a failure copying a DTensor into a flat buffer)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import groupshard as gs


def tensor_parallel_case(rank: int, world_size: int) -> dict[str, str]:
    """gs.shard of a model whose Linears are split over ``mesh["tp"]`` of a 2 x 2 mesh, the
    data-parallel ranks given as ``mesh["dp"]`` or as its process group: each error."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    errors = {}
    for door in ("mesh", "process_group"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        dp = {"mesh": mesh["dp"]} if door == "mesh" else {"process_group": mesh["dp"].get_group()}
        try:
            gs.shard(model, gs.decay_groups(model, 0.1), unit=nn.Linear, **dp)
            errors[door] = "no error"
        except (ValueError, TypeError) as error:
            errors[door] = f"{type(error).__name__}: {error}"
    return errors


def test_a_tensor_parallel_model_is_refused_naming_its_parameter_on_every_rank(run_ranks):
    for rank, errors in enumerate(run_ranks(4, tensor_parallel_case)):
        for door, error in errors.items():
            assert error.startswith("ValueError: Parameter '0.weight' is a DTensor"), (
                rank, door, error)  # fmt: skip
            assert "placements (Shard(dim=0),)" in error and "parallelize_module" in error
