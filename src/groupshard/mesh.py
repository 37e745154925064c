"""The ranks a sharded model lives on: its whole world, the shard group its units are
sharded over, and the replicate group that holds the same shards (hybrid sharding, HSDP).

``gs.shard(..., mesh=...)`` takes a ``torch.distributed.device_mesh.DeviceMesh``: 1-D shards
over it; 2-D with dims ``("replicate", "shard")`` shards each unit within its row's shard
group and replicates it across the rows (FSDP2's HSDP mesh). ``no_shard`` is DDP over the
whole mesh. Without a mesh, the process group (default: the default group) is both the
world and the shard group, and there is no replica.

Note:
    Who uses which group: gathers, reduce-scatters, per-parameter norms and Muon's
    exchanges run over ``shard`` (replicas hold the same shards, so sums over the shard
    group are already the model's); gradients are then all-reduced over ``replicate``
    (one collective per bucket); the cross-rank checks, the used flags, the initial
    broadcast, full state dicts and checkpoints run over ``world``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from groupshard import comm

MESH_DIM_NAMES = ("replicate", "shard")
"""The dimension names of a 2-D (hybrid) mesh, outer first: FSDP2's."""


@dataclass(frozen=True)
class MeshRanks:
    """The three groups of a sharded model (see the module's doc)."""

    world: comm.Ranks  # every rank of the model
    shard: comm.Ranks  # a unit's shards are spread over these
    replicate: comm.Ranks  # the ranks holding this rank's shards alike (size 1: none)

    @classmethod
    def flat(cls, ranks: comm.Ranks) -> MeshRanks:
        """Shard over ``ranks``, no replicas (the default)."""
        return cls(ranks, ranks, comm.Ranks(None, 0, 1))

    @property
    def is_hybrid(self) -> bool:
        return self.replicate.size > 1

    @property
    def shape(self) -> tuple[int, int]:
        """``(replicas, shard size)``."""
        return (self.replicate.size, self.shard.size)


def mesh_signature(mesh: Any) -> dict[str, Any] | None:
    """What ranks must pass alike: the mesh's ranks and dimension names."""
    if mesh is None:
        return None
    return {"ranks": mesh.mesh.tolist(), "dim_names": mesh.mesh_dim_names}


def check_mesh(mesh: Any, world: comm.Ranks) -> None:
    """A ValueError (TypeError for a non-mesh) unless ``mesh`` is a 1-D mesh, or a 2-D
    ``("replicate", "shard")`` mesh, over every rank of ``world`` once. Local: every rank
    of a world passing the same mesh raises the same error."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"Expects mesh to be a torch.distributed.device_mesh.DeviceMesh but got "
            f"{type(mesh).__name__}; build one with init_device_mesh(device_type, (replicas, "
            f"shard_size), mesh_dim_names={MESH_DIM_NAMES})."
        )
    names = mesh.mesh_dim_names
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"Expects a 1-D mesh (shard over it) or a 2-D mesh with mesh_dim_names="
            f"{MESH_DIM_NAMES} (HSDP) but got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.mesh.shape)} with mesh_dim_names={names}; groupshard shards over "
            "one dimension and replicates over one (pass mesh[...] of the dimensions to use)."
        )
    if mesh.ndim == 2 and tuple(names or ()) != MESH_DIM_NAMES:
        raise ValueError(
            f"Expects a 2-D mesh with mesh_dim_names={MESH_DIM_NAMES} (replicate across the "
            f"outer dimension, shard within the inner) but got mesh_dim_names={names}."
        )
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks != list(range(world.size)):
        raise ValueError(
            f"Expects the mesh to hold every rank of the world ({world.size} ranks) once but "
            f"it holds ranks {mesh.mesh.tolist()}; build it over the whole world, e.g. "
            f"init_device_mesh(device_type, (replicas, {world.size} // replicas), "
            f"mesh_dim_names={MESH_DIM_NAMES})."
        )


def mesh_ranks(mesh: Any, world: comm.Ranks, strategy: str) -> MeshRanks:
    """The groups of ``mesh`` (checked by ``check_mesh``); ``no_shard`` replicates over the
    whole world, as DDP does."""
    if strategy == "no_shard":
        return MeshRanks.flat(world)
    if mesh.ndim == 1:
        return MeshRanks.flat(comm.resolve_ranks(mesh.get_group()))
    shard = comm.resolve_ranks(mesh.get_group("shard"))
    replicate = comm.resolve_ranks(mesh.get_group("replicate"))
    return MeshRanks(world, shard, replicate)
