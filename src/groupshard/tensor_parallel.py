"""Tensor-parallel parameters (torch's ``parallelize_module``) in groupshard's flat storage.

A parameter that ``parallelize_module`` split over a 1-D ``tp`` mesh is a DTensor. gs.shard
stores its *local piece* (``to_local()``): flat buffers hold each rank's local pieces and
shard them over the data-parallel ranks only, as FSDP2 shards a DTensor's local tensor
(``_fsdp_param.py``). After a gather, ``wrap`` rebuilds the DTensor around the gathered
piece with its mesh, placement, global shape and stride, so torch's TP hooks run unchanged;
``DTensor.from_local``'s backward brings a gradient to the parameter's placement (a Partial
one, from sequence parallelism's norms, is all-reduced over tp) before groupshard's
data-parallel reduction.

Everything that must know a parameter's place in the whole tensor lives here: which pieces
a norm counts (a Shard-placed parameter's pieces add over tp; a Replicate one, or a plain
parameter of a TP'd model, is the same on every tp rank and is counted by tp rank 0 only),
and how a whole parameter is put together from the tp ranks' pieces (``comm`` moves them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from groupshard import comm
from groupshard.layout import Box
from groupshard.mesh import MESH_DIM_NAMES, MeshRanks

SUPPORTED_PLACEMENTS = "Shard(0), Shard(1) or Replicate()"


@dataclass(frozen=True)
class TensorParallelParam:
    """How one DTensor parameter is split over the tp mesh."""

    mesh: Any  # the 1-D tp DeviceMesh
    placement: Any  # Shard(0), Shard(1) or Replicate()
    shape: torch.Size  # the whole parameter's
    stride: tuple[int, ...]

    @property
    def shard_dim(self) -> int | None:
        """The dimension its pieces split, or None when every tp rank holds all of it."""
        from torch.distributed.tensor import Shard

        return self.placement.dim if isinstance(self.placement, Shard) else None

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's piece, in the local shape) as the DTensor parameter."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, self.mesh, (self.placement,), run_check=False, shape=self.shape,
            stride=self.stride,
        )  # fmt: skip


@dataclass(frozen=True)
class TensorParallelism:
    """A model's tensor-parallel parameters (by FQN) and the tp ranks they are split over."""

    params: Mapping[str, TensorParallelParam]
    ranks: comm.Ranks  # the tp group
    model_ranks: comm.Ranks  # every rank the model lives on (dp x tp): a checkpoint's group

    def split_dim(self, fqn: str) -> int | None:
        """The dimension tp splits parameter ``fqn`` along; None where every tp rank holds
        all of it (a Replicate parameter, a plain one of the TP'd model)."""
        param = self.params.get(fqn)
        return None if param is None else param.shard_dim

    def counted(self, fqn: str) -> bool:
        """Whether this rank's piece of ``fqn`` counts in a norm over the whole model: a
        Shard-placed parameter's pieces differ and add up; anything else is the same on
        every tp rank, counted once (by tp rank 0), not tp times."""
        return self.split_dim(fqn) is not None or self.ranks.rank == 0

    def numel(self, fqn: str, local_numel: int) -> int:
        """The whole parameter's elements, from its local piece's."""
        param = self.params.get(fqn)
        return local_numel if param is None else param.shape.numel()

    def whole(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        """The whole parameter from every tp rank's ``local`` piece (collective over tp for a
        Shard-placed parameter; every tp rank must call it for the same ``fqn``)."""
        dim = self.split_dim(fqn)
        if dim is None:
            return local
        pieces = local.new_empty((self.ranks.size, *local.shape))
        comm.all_gather(pieces, local.contiguous(), self.ranks)
        return torch.cat(pieces.unbind(0), dim=dim)

    def region(self, fqn: str, local_shape: Sequence[int]) -> Box | None:
        """Where this rank's local piece (of ``local_shape``) lies in the whole parameter
        ``fqn``: ``(offsets, sizes)``; None where it is all of it."""
        dim = self.split_dim(fqn)
        if dim is None:
            return None
        offsets = [0] * len(local_shape)
        offsets[dim] = self.ranks.rank * local_shape[dim]
        return tuple(offsets), tuple(local_shape)

    def whole_state(
        self, fqn: str, local_shape: Sequence[int], state: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Parameter ``fqn``'s optimizer ``state`` with its per-element tensors (shaped like
        the local piece, ``local_shape``) made whole (collective over tp; every tp rank calls
        it for the same parameters and keys, in order); scalars (``step``) as they are."""
        if self.split_dim(fqn) is None:
            return dict(state)
        return {
            key: self.whole(fqn, value) if _is_per_element(value, local_shape) else value
            for key, value in state.items()
        }

    def local_state(self, fqn: str, state: Mapping[str, Any]) -> dict[str, Any]:
        """The inverse of ``whole_state``: this rank's pieces of the whole parameter's
        per-element state (no collective)."""
        param = self.params.get(fqn)
        if param is None or param.shard_dim is None:
            return dict(state)
        return {
            key: self.piece(fqn, value) if _is_per_element(value, param.shape) else value
            for key, value in state.items()
        }

    def piece(self, fqn: str, whole: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Tp rank ``rank``'s (default: this rank's) piece of ``whole``, a tensor shaped like
        parameter ``fqn`` (a view; the inverse of ``whole``)."""
        dim = self.split_dim(fqn)
        if dim is None:
            return whole
        return whole.chunk(self.ranks.size, dim=dim)[self.ranks.rank if rank is None else rank]


def _is_per_element(value: Any, shape: Sequence[int]) -> bool:
    """Whether an optimizer state value is laid out like a parameter of ``shape`` (a
    split parameter has a dimension; ``step`` has none)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == tuple(shape)


def whole_dims(
    tensor_parallel: TensorParallelism | None, fqn: str, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The whole parameter's shape for ``fqn`` whose local piece has ``shape``."""
    if tensor_parallel is None or fqn not in tensor_parallel.params:
        return tuple(shape)
    return tuple(tensor_parallel.params[fqn].shape)


def local_region(
    tensor_parallel: TensorParallelism | None, fqn: str, shape: Sequence[int]
) -> Box | None:
    """Where the local piece (of ``shape``) of ``fqn`` lies in the whole parameter; None
    where it is all of it (no tensor parallelism, or ``fqn`` not split)."""
    return None if tensor_parallel is None else tensor_parallel.region(fqn, shape)


def whole_tensor(
    tensor_parallel: TensorParallelism | None, fqn: str, local: torch.Tensor
) -> torch.Tensor:
    """The whole parameter ``fqn`` from its local pieces (collective over tp; ``local``
    itself without tensor parallelism)."""
    return local if tensor_parallel is None else tensor_parallel.whole(fqn, local)


def apply_to_wholes(
    tensor_parallel: TensorParallelism,
    items: Sequence[tuple[str, torch.Tensor]],
    fn: Callable[[int, torch.Tensor], torch.Tensor],
    cost: Callable[[torch.Size], float],
) -> list[torch.Tensor]:
    """This rank's piece of ``fn(item index, whole parameter)`` for each ``(fqn, local
    piece)`` of Shard-placed parameters (Muon's Newton-Schulz of whole matrices), the work
    shared over tp: one all-gather of every item's pieces over tp (placement order:
    Shard(0) by rows, Shard(1) by columns), each whole given to one tp rank (largest
    ``cost`` first to the least loaded, the same on every rank), and one all-to-all
    bringing each rank its pieces of the results. Collective over tp: every tp rank calls
    it with the same items. Returns the pieces in ``items``' order."""
    ranks = tensor_parallel.ranks
    size, me = ranks.size, ranks.rank
    numels = [local.numel() for _, local in items]
    gathered = items[0][1].new_empty((size, sum(numels)))
    comm.all_gather(gathered, torch.cat([local.reshape(-1) for _, local in items]), ranks)
    pieces = gathered.split(numels, dim=1)  # per item: (tp ranks, piece)
    loads, doer = [0.0] * size, [0] * len(items)
    by_cost = sorted(range(len(items)), key=lambda i: -cost(items[i][1].shape))  # stable
    for index in by_cost:
        doer[index] = min(range(size), key=lambda rank: loads[rank])
        loads[doer[index]] += cost(items[index][1].shape)
    mine = [index for index in range(len(items)) if doer[index] == me]
    send = []
    for index in mine:
        fqn, local = items[index]
        dim = tensor_parallel.split_dim(fqn)
        whole = torch.cat([piece.view(local.shape) for piece in pieces[index]], dim=dim)
        send.append((fqn, fn(index, whole)))
    values = torch.cat(
        [
            tensor_parallel.piece(fqn, result, rank).reshape(-1)
            for rank in range(size)
            for fqn, result in send
        ]
        or [gathered.new_empty(0)]
    )
    # from each rank, its results' pieces for this rank, in item order
    order = [index for rank in range(size) for index in range(len(items)) if doer[index] == rank]
    received = gathered.new_empty(sum(numels))
    from_each = [sum(numels[i] for i in order if doer[i] == rank) for rank in range(size)]
    to_each = sum(numels[index] for index in mine)
    comm.all_to_all(received, values, from_each, [to_each] * size, ranks)
    results: list[torch.Tensor] = [gathered.new_empty(0)] * len(items)
    for index, chunk in zip(order, received.split([numels[i] for i in order]), strict=True):
        results[index] = chunk.view(items[index][1].shape)
    return results


def local_parameters(
    params: Mapping[str, nn.Parameter], tensor_parallel: TensorParallelism | None
) -> dict[str, nn.Parameter]:
    """``params`` with each DTensor parameter replaced by a plain parameter holding its local
    piece: what the flat buffers store, and what the parameter's name shows outside
    forward (this rank's part of its piece, as for any sharded parameter)."""
    if tensor_parallel is None:
        return dict(params)
    return {
        fqn: nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
        if fqn in tensor_parallel.params
        else param
        for fqn, param in params.items()
    }


def find_tensor_parallelism(
    params: Mapping[str, nn.Parameter], mesh: Any, world: comm.Ranks, strategy: str
) -> TensorParallelism | None:
    """The model's tensor parallelism, checked, or None without DTensor parameters.

    Raises:
        ValueError: naming the parameter, for what gs.shard cannot shard: a DTensor on a
            mesh of more than one dimension (FSDP2's), a placement other than Shard(0),
            Shard(1) or Replicate, pieces of different sizes, parameters on different tp
            meshes; or a ``mesh`` that is not the data-parallel dimension of the tp mesh's
            mesh.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    found: dict[str, TensorParallelParam] = {}
    tp_mesh = None
    for fqn, param in params.items():
        if not isinstance(param, DTensor):
            continue
        where = (
            f"Parameter {fqn!r} is a DTensor on a mesh of shape "
            f"{tuple(param.device_mesh.mesh.shape)} (dims {param.device_mesh.mesh_dim_names}) "
            f"with placements {tuple(param.placements)}"
        )
        if param.device_mesh.ndim != 1:
            raise ValueError(
                f"{where}: gs.shard takes parameters split over one tensor-parallel dimension "
                "(parallelize_module(model, mesh['tp'], plan)); a model already sharded by "
                "FSDP2's fully_shard cannot be sharded again."
            )
        placement = param.placements[0]
        # type(), not isinstance: FSDP2's _StridedShard is a Shard
        if not (placement == Replicate() or (type(placement) is Shard and placement.dim in (0, 1))):
            raise ValueError(
                f"{where}: gs.shard takes tensor-parallel placements {SUPPORTED_PLACEMENTS} "
                "(torch's ColwiseParallel, RowwiseParallel and SequenceParallel give these)."
            )
        if tp_mesh is None:
            tp_mesh = param.device_mesh
        elif param.device_mesh != tp_mesh:
            raise ValueError(
                f"{where}, but other parameters are on the mesh {tp_mesh}: gs.shard takes "
                "parameters split over one tensor-parallel mesh."
            )
        size = tp_mesh.size()
        if type(placement) is Shard and param.shape[placement.dim] % size:
            raise ValueError(
                f"{where}: its dimension {placement.dim} ({param.shape[placement.dim]}) does "
                f"not divide evenly over the {size} tensor-parallel ranks; gs.shard takes "
                "even pieces (make that dimension a multiple of the tp size)."
            )
        found[fqn] = TensorParallelParam(
            tp_mesh, placement, param.shape, tuple(param.stride())
        )
    if tp_mesh is None:
        return None
    _check_data_parallel_mesh(next(iter(found)), tp_mesh, mesh, world, strategy)
    return TensorParallelism(
        found, comm.resolve_ranks(tp_mesh.get_group()), _model_ranks(tp_mesh)
    )


def _model_ranks(tp_mesh: Any) -> comm.Ranks:
    """The ranks of the whole mesh ``tp_mesh`` is a dimension of: the world, or a group
    of its ranks (torch's ``_flatten``) when the mesh spans only part of it."""
    root = tp_mesh._get_root_mesh()
    world = comm.resolve_ranks()
    if root.size() == world.size:
        return world
    return comm.resolve_ranks(root._flatten().get_group())


def _check_data_parallel_mesh(
    fqn: str, tp_mesh: Any, mesh: Any, world: comm.Ranks, strategy: str
) -> None:
    """A ValueError unless ``mesh`` is the 1-D data-parallel dimension of the mesh whose
    other dimension is ``tp_mesh``: their ranks cross in this rank alone and together
    cover the world."""
    from torch.distributed.device_mesh import DeviceMesh

    tp_names = tp_mesh.mesh_dim_names
    example = "mesh=mesh['dp'] of init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))"
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"Parameter {fqn!r} is split over the tensor-parallel mesh {tuple(tp_names or ())} "
            f"(ranks {tp_mesh.mesh.tolist()}); gs.shard then needs the data-parallel "
            f"dimension of the same mesh as {example}, not "
            f"{'a process group' if mesh is None else type(mesh).__name__}."
        )
    if mesh.ndim not in (1, 2) or (mesh.ndim == 2 and mesh.mesh_dim_names != MESH_DIM_NAMES):
        raise ValueError(
            f"gs.shard of a tensor-parallel model (parameter {fqn!r}) takes a 1-D data-parallel "
            f"mesh ({example}) or, to shard and replicate (3-D), its 2-D mesh with dims "
            f"{MESH_DIM_NAMES} (mesh['replicate', 'shard']); got a {mesh.ndim}-D mesh with "
            f"dims {mesh.mesh_dim_names}."
        )
    if strategy not in ("full", "grad_op", "no_shard"):
        return  # the strategy's own check names it
    dp_ranks = set(mesh.mesh.flatten().tolist())
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    me = world.rank
    if dp_ranks & tp_ranks != {me} or len(dp_ranks) * len(tp_ranks) != world.size:
        raise ValueError(
            f"mesh= holds ranks {sorted(dp_ranks)} and parameter {fqn!r} is split over ranks "
            f"{sorted(tp_ranks)} (tp): the data-parallel and tensor-parallel dimensions must "
            f"be the two dimensions of one mesh over all {world.size} ranks, crossing in "
            f"this rank ({me}) alone: pass {example}."
        )


def refuse_under_tensor_parallelism(what: str, when: str) -> None:
    """The one error for what is not built for tensor-parallel models yet."""
    raise ValueError(
        f"{what} with tensor parallelism (DTensor parameters from parallelize_module) is not "
        f"built yet ({when})."
    )


def tensor_parallel_signature(tensor_parallel: TensorParallelism | None) -> Any:
    """What ranks must pass alike: each DTensor parameter's placement and whole shape."""
    if tensor_parallel is None:
        return None
    return {
        fqn: (str(param.placement), tuple(param.shape))
        for fqn, param in tensor_parallel.params.items()
    }


def data_parallel_ranks(mesh: Any, strategy: str) -> MeshRanks:
    """The groups of a tensor-parallel model's data-parallel ``mesh`` (checked by
    ``find_tensor_parallelism``): a 1-D mesh shards over it; a 2-D ``("replicate",
    "shard")`` one shards over "shard" and replicates over "replicate", its ranks flattened
    into one group (torchtitan's ``_flatten``) as the model's world. ``no_shard``
    replicates over every data-parallel rank."""
    world = comm.resolve_ranks((mesh if mesh.ndim == 1 else mesh._flatten()).get_group())
    if mesh.ndim == 1 or strategy == "no_shard":
        return MeshRanks.flat(world)
    return MeshRanks(
        world, comm.resolve_ranks(mesh.get_group("shard")),
        comm.resolve_ranks(mesh.get_group("replicate")),
    )  # fmt: skip
