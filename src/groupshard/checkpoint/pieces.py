"""What a model and its optimizer hold, as the entries torch's checkpoint idiom names.

The names and shapes are those of ``get_state_dict(model, optimizer)`` on the unsharded
model (what FSDP2, DDP and one process write with ``dcp.save``):

- the model: every parameter under each name ``model.state_dict()`` gives it (tied ones
  under each), in its own shape, and the persistent buffers;
- the optimizer: ``state.<fqn>.<key>`` per parameter (its canonical name), per-element
  state (``exp_avg``...) in the parameter's shape, other tensors (``step``) and plain
  values as they are; the hyperparameters of each group.

Two holders map what ranks hold onto these entries, without communication:

- :class:`ShardedHolder`, a model from ``gs.shard`` and an optimizer over its shards: a
  rank holds, of each parameter and of each per-element state, the contiguous piece its
  shard contains (possibly none); a ``gs.optim.WholeParamOptimizer``'s owner holds the
  whole state of the parameters it steps.
- :class:`ZeroHolder`, a plain or DDP model and a ``gs.ZeroRedundancyOptimizer``: every
  rank holds the whole model but only its slice of each bucket's optimizer state. A rank
  offers its slices of both (so the model's bytes are spread over the ranks too) and
  reads the whole model back.

What every rank holds alike (``step``, a replicated flat buffer of ``no_shard``, the
replicas of a hybrid mesh) is offered by every rank holding it and written once (DCP's
planner keeps one of identical write items).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import increment_version
from torch.nn.parallel import DistributedDataParallel

from groupshard import comm, flatten
from groupshard.api import ShardedModule
from groupshard.checkpoint.planner import Piece
from groupshard.full_state import check_optimizer
from groupshard.optim.whole import WholeParamOptimizer
from groupshard.segments import ShardSegments, segments_of
from groupshard.sharding import sharding_state
from groupshard.tensor_parallel import local_region, whole_dims
from groupshard.writes import note_parameters_written
from groupshard.zero import ZeroRedundancyOptimizer

Entry = Any  # a Piece (tensor data) or a plain value (number, string, tuple...)


@dataclass(frozen=True)
class Saved:
    """What a checkpoint holds for one optimizer state key of one parameter: a tensor of
    ``shape`` and ``dtype``, or (``shape`` None) a plain value."""

    shape: torch.Size | None = None
    dtype: torch.dtype | None = None


def entry_shapes(segments: ShardSegments) -> list[torch.Size]:
    """The checkpoint shape of each parameter of a flat buffer, in layout order: its own, or
    under tensor parallelism the whole parameter's (the buffer holds local pieces)."""
    return [
        torch.Size(whole_dims(segments.tensor_parallel, slot.fqn, slot.shape))
        for slot in segments.buffer.params
    ]


def flat_pieces(flat: torch.Tensor, segments: ShardSegments) -> list[Piece]:
    """Each parameter's piece of a shard-shaped tensor (a shard, or a per-element state
    laid out like it), in layout order. Pieces are views of ``flat``: DCP writes from and
    reads into it. Under tensor parallelism a piece lies in the rank's local piece of the
    whole parameter (its ``region``)."""
    buffer, tensor_parallel = segments.buffer, segments.tensor_parallel
    shapes = entry_shapes(segments)
    regions = [local_region(tensor_parallel, slot.fqn, slot.shape) for slot in buffer.params]
    if not segments.needs_reduce:  # this rank holds the whole buffer (as every rank does)
        return [
            Piece(flat[slot.offset : slot.offset + slot.numel], shape, 0, region)
            if region is not None
            else Piece.whole(flat[slot.offset : slot.offset + slot.numel].view(shape))
            for slot, shape, region in zip(buffer.params, shapes, regions, strict=True)
        ]
    local = {segment.param_index: segment for segment in segments.pieces}
    pieces = []
    for index, (shape, region) in enumerate(zip(shapes, regions, strict=True)):
        segment = local.get(index)
        if segment is None:  # none of it here (or an empty parameter, held alike by all)
            pieces.append(
                Piece(flat[:0], shape) if shape.numel() else Piece.whole(flat[:0].view(shape))
            )
        else:
            data = flat[segment.shard_offset : segment.shard_offset + segment.numel]
            pieces.append(Piece(data, shape, segment.param_offset, region))
    return pieces


@dataclass(frozen=True)
class OptimizerSlice:
    """One tensor a (local) optimizer steps: a flat slice over consecutive parameters."""

    shard: torch.Tensor  # the optimizer's parameter, with its segment map
    states: Any  # the optimizer's ``state`` mapping, keyed by ``shard``
    group: dict[str, Any]  # the optimizer's param group that holds ``shard``
    fqns: tuple[str, ...]  # the parameters of its flat buffer, in layout order

    @property
    def segments(self) -> ShardSegments:
        segments = segments_of(self.shard)
        assert segments is not None
        return segments

    @property
    def shapes(self) -> list[torch.Size]:
        return entry_shapes(self.segments)


def state_placement(
    key: str, saved: torch.dtype, like: torch.Tensor, group: Mapping[str, Any]
) -> tuple[torch.dtype, torch.device]:
    """The dtype and device torch's ``Optimizer.load_state_dict`` gives a state tensor: the
    parameter's for floating parameters, except ``step`` (kept, or float32 on the
    parameter's device for fused and capturable optimizers)."""
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return torch.float32, like.device
        return saved, torch.device("cpu")
    return (like.dtype if like.is_floating_point() else saved), like.device


def is_per_element(key: str, saved: Saved, shape: torch.Size) -> bool:
    """Whether a saved state tensor is laid out like its parameter (vs ``step``)."""
    if saved.shape is None or saved.shape != shape:
        return False
    return len(shape) > 0 or key not in flatten.SCALAR_STATE


def slice_entries(part: OptimizerSlice) -> dict[str, dict[str, Entry]]:
    """A slice's optimizer state per parameter and key: pieces of per-element state,
    whole tensors (the same object under every parameter) and plain values."""
    per_fqn: dict[str, dict[str, Entry]] = {fqn: {} for fqn in part.fqns}
    for key, value in part.states.get(part.shard, {}).items():
        if flatten.is_per_element(value, part.shard):
            pieces = flat_pieces(value.detach(), part.segments)
            for fqn, piece in zip(part.fqns, pieces, strict=True):
                per_fqn[fqn][key] = piece
        else:
            entry = Piece.whole(value.detach()) if isinstance(value, torch.Tensor) else value
            for fqn in part.fqns:
                per_fqn[fqn][key] = entry
    return {fqn: state for fqn, state in per_fqn.items() if state}


class SliceDestination:
    """Where a slice's state is read to (pieces and value slots per parameter and key), and
    how it becomes the optimizer's state once read."""

    def __init__(self, part: OptimizerSlice, saved: Mapping[str, Mapping[str, Saved]]) -> None:
        self.part = part
        self.entries: dict[str, dict[str, Entry]] = {}
        self.state: dict[str, Any] = {}
        keys = [tuple(sorted(saved.get(fqn, {}))) for fqn in part.fqns]
        if len(set(keys)) > 1:
            have = [f for f, k in zip(part.fqns, keys, strict=True) if k]
            lack = [f for f, k in zip(part.fqns, keys, strict=True) if k != keys[0] or not k]
            raise ValueError(
                f"The checkpoint has optimizer state {sorted(set(keys[0]) | set(keys[-1]))} for "
                f"some parameters of one flat buffer ({have[:4]}) but not alike for others "
                f"({lack[:4]}); a flat buffer keeps all of its parameters' state or none"
            )
        shard, group = part.shard, part.group
        current = part.states.get(shard, {})
        for key in keys[0]:
            first = saved[part.fqns[0]][key]
            if all(
                is_per_element(key, saved[f][key], s)
                for f, s in zip(part.fqns, part.shapes, strict=True)
            ):
                assert first.dtype is not None
                dtype, _ = state_placement(key, first.dtype, shard, group)
                self.state[key] = reuse_or_new(current.get(key), shard.shape, dtype, shard.device)
                for fqn, piece in zip(
                    part.fqns, flat_pieces(self.state[key], part.segments), strict=True
                ):
                    self.entries.setdefault(fqn, {})[key] = piece
                continue
            for fqn in part.fqns:  # each parameter's own copy: they must agree (checked after)
                spec = saved[fqn][key]
                if spec.shape is None:
                    self.entries.setdefault(fqn, {})[key] = None
                else:
                    assert spec.dtype is not None
                    dtype, device = state_placement(key, spec.dtype, shard, group)
                    tensor = torch.zeros(spec.shape, dtype=dtype, device=device)
                    self.entries.setdefault(fqn, {})[key] = Piece.whole(tensor)

    def scalar_keys(self) -> list[str]:
        """Keys each parameter keeps its own copy of (``step``...): they must agree."""
        keys = {key for entries in self.entries.values() for key in entries}
        return sorted(keys - set(self.state))

    def check(self, value_of: ValueOf) -> None:
        """A ValueError naming the parameters if a flat buffer's parameters were saved with
        different values of a key it keeps one of (before anything is installed)."""
        for key in self.scalar_keys():
            found = [value_of(fqn, key, self.entries[fqn][key]) for fqn in self.part.fqns]
            flatten.check_one_scalar(key, found, self.part.segments.buffer)

    def install(self, value_of: ValueOf) -> None:
        """Become the optimizer's state (``check`` first)."""
        part = self.part
        state = dict(self.state)
        for key in self.scalar_keys():
            fqn = part.fqns[0]
            state[key] = value_of(fqn, key, self.entries[fqn][key])
        part.states.pop(part.shard, None)
        if state:
            part.states[part.shard] = state


ValueOf = Callable[[str, str, Entry], Any]
"""The value read for a parameter's key: its piece's tensor, or the plain value."""


@dataclass
class OptimizerDestinations:
    """Where a load puts the optimizer's state, before it becomes the optimizer's.

    ``entries``: per parameter and key, a piece to read into (or None for a plain value);
    ``per_element``: the (parameter, key) entries laid out like the parameter, the bulk
    of the bytes (a load reads the rest first and checks it before any of these);
    ``check`` and ``install`` take the values read."""

    entries: dict[str, dict[str, Entry]]
    per_element: set[tuple[str, str]]
    check: Callable[[ValueOf], None]
    install: Callable[[ValueOf], None]


def reuse_or_new(
    current: Any, shape: torch.Size, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The optimizer's current state tensor if it fits (a load then holds no second copy of
    the state: it reads into the one there is), else a new one of zeros."""
    if (
        isinstance(current, torch.Tensor)
        and current.shape == shape
        and current.dtype == dtype
        and current.device == device
    ):
        return current
    return torch.zeros(shape, dtype=dtype, device=device)


def source_problem(destination: Piece, value: Any, name: str) -> str | None:
    """Why ``value`` cannot fill ``destination`` (None if it can): it must be a piece of
    the same elements (a ParamPiece of torch's sharded state dict of this model) or the
    whole tensor (a full state dict)."""
    source = getattr(value, "piece", None)
    if source is not None:
        if source.boxes != destination.boxes:
            return (
                f"The state dict entry {name!r} holds elements {_range(source)} but this rank "
                f"holds {_range(destination)}: pass a sharded state dict to the model it was "
                "taken from, or a full one (StateDictOptions(full_state_dict=True))"
            )
        return None
    if not isinstance(value, torch.Tensor):
        return f"The state dict entry {name!r} is a {type(value).__name__}, not a tensor"
    if value.shape != destination.shape:
        return (
            f"The state dict entry {name!r} has shape {list(value.shape)}, but the model's is "
            f"{list(destination.shape)}"
        )
    return None


def copy_into(destination: Piece, value: Any) -> None:
    """Fill ``destination`` from ``value`` (``source_problem`` said it can; onto itself when
    ``dcp.load`` read into it, which counts as a write)."""
    source = getattr(value, "piece", None)
    target = destination.data
    if source is not None:
        target.copy_(source.data)
    else:
        target.copy_(destination.elements_of(value))


def _range(piece: Piece) -> str:
    elements = f"[{piece.offset}, {piece.offset + piece.data.numel()})"
    if piece.region is None:
        return elements
    origin, sizes = piece.region
    return f"{elements} of its block at {list(origin)} of size {list(sizes)}"


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds, by name."""
    found = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                found.setdefault(f"{prefix}.{name}" if prefix else name, buffer)
    return found


class Holder(ABC):
    """What one kind of training holds, as checkpoint entries (see the module's doc)."""

    ranks: comm.Ranks
    module: nn.Module  # whose buffers are saved
    optimizer: torch.optim.Optimizer | None

    @abstractmethod
    def param_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype, list[str]]]:
        """Every parameter by canonical name: its shape, dtype and every name it has in
        ``model.state_dict()``."""

    @abstractmethod
    def frozen(self) -> list[str]:
        """The parameters no optimizer group steps."""

    @abstractmethod
    def param_pieces(self, loading: bool) -> tuple[dict[str, Piece], Callable[[], None]]:
        """The parameters' pieces by canonical name, and what to run once they are read."""

    @abstractmethod
    def listed_groups(self) -> list[list[str]]:
        """Per param group, its parameters' names in the optimizer's order."""

    @abstractmethod
    def slices(self) -> list[OptimizerSlice]:
        """The tensors the (local) optimizer steps, each with its parameters."""

    @abstractmethod
    def hyperparameter_groups(self) -> list[list[dict[str, Any]]]:
        """Per param group, the group dicts a load updates with the saved hyperparameters."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the shards live: the device of this rank's collectives (NCCL: the GPU)."""

    def buffers(self) -> dict[str, torch.Tensor]:
        return {name: b.detach() for name, b in _persistent_buffers(self.module).items()}

    def model_entries(self, loading: bool) -> tuple[dict[str, Piece], Callable[[], None]]:
        """The model's entries under every name ``model.state_dict()`` gives (a tied
        parameter's pieces under each), and what to run once they are read."""
        pieces, after = self.param_pieces(loading)
        entries = {}
        for fqn, (_, _, aliases) in self.param_shapes().items():
            for alias in aliases:
                entries[alias] = pieces[fqn]
        entries.update({name: Piece.whole(b) for name, b in self.buffers().items()})
        return entries, after

    def optimizer_entries(self) -> dict[str, dict[str, Entry]]:
        """The optimizer's state this rank holds, per parameter and key."""
        per_fqn: dict[str, dict[str, Entry]] = {}
        for part in self.slices():
            per_fqn.update(slice_entries(part))
        return per_fqn

    def optimizer_destinations(
        self, saved: Mapping[str, Mapping[str, Saved]]
    ) -> OptimizerDestinations:
        """Where the saved optimizer state (``saved``: per parameter and key, what the
        checkpoint holds) is read to on this rank, and how it is checked and installed."""
        slices = [SliceDestination(part, saved) for part in self.slices()]
        entries: dict[str, dict[str, Entry]] = {}
        per_element: set[tuple[str, str]] = set()
        for destination in slices:
            entries.update(destination.entries)
            per_element.update((f, k) for f in destination.part.fqns for k in destination.state)

        def check(value_of: ValueOf) -> None:
            for destination in slices:
                destination.check(value_of)

        def install(value_of: ValueOf) -> None:
            for destination in slices:
                destination.install(value_of)

        return OptimizerDestinations(entries, per_element, check, install)

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Each param group's hyperparameters (everything but ``params``)."""
        assert self.optimizer is not None
        return [
            {k: v for k, v in group.items() if k != "params"}
            for group in self.optimizer.param_groups
        ]

    def set_hyperparameters(self, per_group: Sequence[Mapping[str, Any]]) -> None:
        for targets, values in zip(self.hyperparameter_groups(), per_group, strict=True):
            for group in targets:
                group.update(values)


class ShardedHolder(Holder):
    """A model returned by ``gs.shard`` and an optimizer over ``model.optimizer_groups()``."""

    def __init__(self, model: ShardedModule, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = self.module = model
        self.state = sharding_state(model, "Checkpoints (gs.checkpoint, torch's get_state_dict)")
        self.ranks = self.state.model_ranks  # under tensor parallelism: dp x tp ranks save
        self.optimizer = optimizer
        if optimizer is not None:
            check_optimizer(model, optimizer)

    def param_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype, list[str]]]:
        found = {}
        for storage in self.state.storages:
            for buffer in storage.layout.buffers:
                for slot in buffer.params:
                    aliases = [
                        f"{m}.{a}" if m else a for m, a in self.state.plan.registrations[slot.fqn]
                    ]
                    shape = whole_dims(self.state.tensor_parallel, slot.fqn, slot.shape)
                    found[slot.fqn] = (torch.Size(shape), storage.layout.dtype, aliases)
        return found

    def frozen(self) -> list[str]:
        return list(self.state.groups.frozen)

    @property
    def device(self) -> torch.device:
        return self.state.storages[0].local.device

    def param_pieces(self, loading: bool) -> tuple[dict[str, Piece], Callable[[], None]]:
        pieces: dict[str, Piece] = {}
        for storage in self.state.storages:
            for shard in storage.shards:
                segments = segments_of(shard)
                assert segments is not None
                found = flat_pieces(shard.detach(), segments)
                pieces.update(zip(segments.fqns, found, strict=True))
        if not loading:
            return pieces, lambda: None

        def mark_written() -> None:
            # DCP wrote through aliases (planner.exact_alias): tell autograd's version
            # counters (which WholeParamOptimizer watches) and the gathered copies
            for storage in self.state.storages:
                for shard in storage.shards:
                    increment_version(shard)
            note_parameters_written()

        return pieces, mark_written

    def listed_groups(self) -> list[list[str]]:
        return [list(group.listed) for group in self.state.groups.groups]

    def slices(self) -> list[OptimizerSlice]:
        assert self.optimizer is not None
        slices = []
        whole = isinstance(self.optimizer, WholeParamOptimizer)
        for group in self.optimizer.param_groups:
            if whole and group["whole"]:  # its state is the owners': see owned_* below
                continue
            for shard in group["params"]:
                segments = segments_of(shard)
                assert segments is not None
                slices.append(OptimizerSlice(shard, self.optimizer.state, group, segments.fqns))
        return slices

    def hyperparameter_groups(self) -> list[list[dict[str, Any]]]:
        assert self.optimizer is not None
        return [[group] for group in self.optimizer.param_groups]

    def optimizer_entries(self) -> dict[str, dict[str, Entry]]:
        """Besides the slices' state, a ``gs.optim.WholeParamOptimizer``'s state of whole
        parameters, offered by their owners in the state's own shapes."""
        per_fqn = super().optimizer_entries()
        if isinstance(self.optimizer, WholeParamOptimizer):
            for fqn, (_, state, _) in self.optimizer.owned_states().items():
                entries = {
                    key: Piece.whole(value.detach()) if isinstance(value, torch.Tensor) else value
                    for key, value in state.items()
                }
                if entries:
                    per_fqn[fqn] = entries
        return per_fqn

    def optimizer_destinations(
        self, saved: Mapping[str, Mapping[str, Saved]]
    ) -> OptimizerDestinations:
        """Besides the slices', the whole state of the parameters a
        ``gs.optim.WholeParamOptimizer`` owner steps, read into its own tensors."""
        slices = super().optimizer_destinations(saved)
        if not isinstance(self.optimizer, WholeParamOptimizer):
            return slices
        optimizer = self.optimizer
        owned: dict[str, dict[str, Entry]] = {}
        for fqn, (whole, current, group) in optimizer.owned_states().items():
            for key, spec in saved.get(fqn, {}).items():
                if spec.shape is None:
                    owned.setdefault(fqn, {})[key] = None
                    continue
                assert spec.dtype is not None
                dtype, device = state_placement(key, spec.dtype, whole, group)
                tensor = reuse_or_new(current.get(key), spec.shape, dtype, device)
                owned.setdefault(fqn, {})[key] = Piece.whole(tensor)
                slices.per_element.add((fqn, key))

        def install(value_of: ValueOf) -> None:
            slices.install(value_of)
            optimizer.load_owned_state(
                {
                    fqn: {key: value_of(fqn, key, entry) for key, entry in state.items()}
                    for fqn, state in owned.items()
                }
            )

        return OptimizerDestinations(
            {**slices.entries, **owned}, slices.per_element, slices.check, install
        )


class ZeroHolder(Holder):
    """A plain or DDP-wrapped model and a ``gs.ZeroRedundancyOptimizer`` over its parameters
    (under the unwrapped model's names, so the checkpoint is the unsharded model's)."""

    def __init__(self, model: nn.Module, optimizer: ZeroRedundancyOptimizer) -> None:
        module = model.module if isinstance(model, DistributedDataParallel) else model
        if isinstance(module, ShardedModule):
            raise TypeError(
                "A model returned by gs.shard is stepped by a torch optimizer over "
                "model.optimizer_groups(), not by gs.ZeroRedundancyOptimizer; save the "
                "ZeRO optimizer with the plain (or DDP) model it steps"
            )
        self.module = module
        self.optimizer = self.zero = optimizer
        # the whole world saves: with a process_group per replica (ZeRO-1 within, DDP across)
        # the replicas offer the same pieces, and DCP's planner writes each once
        self.ranks = comm.resolve_ranks() if optimizer.ranks.group is not None else optimizer.ranks
        names: dict[int, list[str]] = {}
        self.params: dict[str, nn.Parameter] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
            self.params.setdefault(names[id(param)][0], param)
        self.aliases = {aliases[0]: aliases for aliases in names.values()}
        self.fqn_of = {id(p): fqn for fqn, p in self.params.items()}
        self.listed: list[list[str]] = []
        for index, group in enumerate(optimizer.param_groups):
            listed = []
            for position, param in enumerate(group["params"]):
                if id(param) not in self.fqn_of:
                    raise ValueError(
                        f"param_groups[{index}]['params'][{position}] of the "
                        "ZeroRedundancyOptimizer is not a parameter of the model "
                        f"({type(module).__name__}) given with it"
                    )
                listed.append(self.fqn_of[id(param)])
            self.listed.append(listed)

    def param_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype, list[str]]]:
        return {fqn: (p.shape, p.dtype, self.aliases[fqn]) for fqn, p in self.params.items()}

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def frozen(self) -> list[str]:
        stepped = {fqn for listed in self.listed for fqn in listed}
        return [fqn for fqn in self.params if fqn not in stepped]

    def param_pieces(self, loading: bool) -> tuple[dict[str, Piece], Callable[[], None]]:
        # every rank reads every parameter whole; parameters the optimizer does not step
        # are held alike by every rank
        pieces = {fqn: Piece.whole(p.detach()) for fqn, p in self.params.items()}
        if loading:
            return pieces, lambda: None
        for _, params, shard in self.zero.local_slices():
            segments = segments_of(shard)
            assert segments is not None
            if not segments.needs_reduce:  # one rank: the whole parameters, as above
                continue
            local = {segment.param_index: segment for segment in segments.pieces}
            for index, param in enumerate(params):
                segment, data = local.get(index), param.detach().reshape(-1)
                if segment is None:  # none of it here
                    piece = (
                        Piece(data[:0], param.shape)
                        if param.numel()
                        else pieces[self.fqn_of[id(param)]]
                    )
                else:
                    start = segment.param_offset
                    piece = Piece(data[start : start + segment.numel], param.shape, start)
                pieces[self.fqn_of[id(param)]] = piece
        return pieces, lambda: None

    def listed_groups(self) -> list[list[str]]:
        return [list(listed) for listed in self.listed]

    def slices(self) -> list[OptimizerSlice]:
        local = self.zero.optim
        slices = []
        for index, params, shard in self.zero.local_slices():
            fqns = tuple(self.fqn_of[id(p)] for p in params)
            slices.append(OptimizerSlice(shard, local.state, local.param_groups[index], fqns))
        return slices

    def hyperparameter_groups(self) -> list[list[dict[str, Any]]]:
        return [
            [group, local]
            for group, local in zip(
                self.zero.param_groups, self.zero.optim.param_groups, strict=True
            )
        ]


def holder_of(model: nn.Module, optimizer: torch.optim.Optimizer | None, what: str) -> Holder:
    """The holder for ``model`` and ``optimizer``, or a TypeError saying what is expected."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return ZeroHolder(model, optimizer)
    if not isinstance(model, ShardedModule):
        raise TypeError(
            f"{what} expects a model returned by gs.shard (with an optimizer over "
            "model.optimizer_groups(), or None), or a plain or DDP model with the "
            f"gs.ZeroRedundancyOptimizer that steps it; got {type(model).__name__}"
            + (f" with {type(optimizer).__name__}" if optimizer is not None else "")
        )
    return ShardedHolder(model, optimizer)
