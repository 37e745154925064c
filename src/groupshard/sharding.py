"""What ``gs.shard`` attached to a model (``model.groupshard``), and the swap between its
shards and the user's original parameters.

Below the front-end (``api``) and the functions that take a sharded model (state dicts,
safetensors, norms), which reach the state through ``sharding_state``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from groupshard import comm
from groupshard.groups import ResolvedGroups
from groupshard.layout import FROZEN_GROUP
from groupshard.mesh import MeshRanks
from groupshard.piece_params import release_piece
from groupshard.runtime import ShardedRuntime
from groupshard.storage import FlatStorage
from groupshard.tensor_parallel import TensorParallelism, refuse_under_tensor_parallelism
from groupshard.units import UnitPlan


class ShardingState:
    """Everything ``shard`` attached to a model (``model.groupshard``)."""

    def __init__(
        self,
        groups: ResolvedGroups,
        plan: UnitPlan,
        runtime: ShardedRuntime,
        original_params: dict[str, nn.Parameter],
        mesh: MeshRanks,
        tensor_parallel: TensorParallelism | None = None,
    ) -> None:
        self.groups = groups
        self.plan = plan
        self.runtime = runtime
        # FQN -> the user's tensor, now its piece (a DTensor's: a plain parameter instead)
        self.original_params = original_params
        self.mesh = mesh  # its world (with tensor parallelism: the data-parallel ranks)...
        self.tensor_parallel = tensor_parallel  # the DTensor parameters, or None
        self.originals_registered = False  # inside summon_full_params / originals_installed

    @property
    def ranks(self) -> comm.Ranks:
        """Every rank of the model (the world)."""
        return self.mesh.world

    @property
    def model_ranks(self) -> comm.Ranks:
        """Every rank holding part of the model: ``ranks``, times the tp ranks under tensor
        parallelism (what a checkpoint or a file of the whole model is written over)."""
        tensor_parallel = self.tensor_parallel
        return self.ranks if tensor_parallel is None else tensor_parallel.model_ranks

    @property
    def storages(self) -> list[FlatStorage]:
        return self.runtime.storages

    def shards_of_group(self, group_index: int) -> list[nn.Parameter]:
        """The shard parameters that hold group ``group_index``, in unit order."""
        return [
            shard
            for storage in self.storages
            for shard, buffer in zip(storage.shards, storage.layout.buffers, strict=True)
            if buffer.group_index == group_index
        ]


def is_sharded(model: object) -> bool:
    """Whether ``model`` was returned by ``gs.shard``."""
    return isinstance(getattr(model, "groupshard", None), ShardingState)


def sharding_state(
    model: nn.Module, what: str, tensor_parallel_after: str | None = None
) -> ShardingState:
    """``model.groupshard``; a TypeError naming ``what`` if ``gs.shard`` did not return it.
    ``tensor_parallel_after``: ``what`` is not built for tensor-parallel models yet, and
    this says when it will be (a ValueError for such a model)."""
    if not is_sharded(model):
        raise TypeError(f"{what} expects a model returned by gs.shard, got {type(model).__name__}")
    state: ShardingState = model.groupshard  # type: ignore[assignment]
    if tensor_parallel_after is not None and state.tensor_parallel is not None:
        refuse_under_tensor_parallelism(what, tensor_parallel_after)
    return state


def shard_attr_name(buffer_group: int, dtype: torch.dtype) -> str:
    """The attribute under which a unit's module registers one shard."""
    group = "frozen" if buffer_group == FROZEN_GROUP else f"group{buffer_group}"
    return f"groupshard_{group}_{str(dtype).removeprefix('torch.')}"


def register_shards(module: nn.Module, storage: FlatStorage) -> None:
    for shard, buffer in zip(storage.shards, storage.layout.buffers, strict=True):
        module.register_parameter(shard_attr_name(buffer.group_index, storage.layout.dtype), shard)


def swap_in_originals(state: ShardingState, data: Mapping[str, torch.Tensor]) -> None:
    """Register the user's original parameters again, holding ``data``, instead of the shards."""
    state.originals_registered = True
    for unit in state.runtime.units:
        for storage in unit.storages:
            for buffer in storage.layout.buffers:
                del unit.module._parameters[
                    shard_attr_name(buffer.group_index, storage.layout.dtype)
                ]
        for fqn, places in unit.places.items():
            original = state.original_params[fqn]
            release_piece(original)
            original.data = data[fqn]
            for module, attr in places:
                module.__dict__.pop(attr, None)
                module._parameters[attr] = original


def swap_out_originals(state: ShardingState) -> None:
    """Register the shards again; the original names show this rank's pieces."""
    state.originals_registered = False
    for unit in state.runtime.units:
        for storage in unit.storages:
            for fqn in storage.layout.fqns:
                for module, attr in unit.places[fqn]:
                    module._parameters.pop(attr, None)
            register_shards(unit.module, storage)
        unit.install_local_pieces()


@contextmanager
def originals_installed(model: nn.Module, data: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Within the block the model has its original parameters, holding ``data`` (by FQN)."""
    state = sharding_state(model, "originals_installed")
    swap_in_originals(state, data)
    try:
        yield
    finally:
        swap_out_originals(state)
