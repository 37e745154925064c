"""What a checkpoint holds of a model and its optimizer: pieces by entry name, and a
description (names, shapes, dtypes, groups) for ``groupshard.json``.

Entries, the same whoever saved them:

- ``model.<fqn>``: an original parameter, 1-D (its numel elements), under its canonical
  name (the description lists every name it is registered under);
- ``buffers.<name>``: a buffer, whole;
- ``optim.<fqn>.<key>``: a per-element optimizer state of a parameter (``exp_avg``...),
  1-D like the parameter; other tensor state (``step``) whole, under every parameter
  that shares it; non-tensor state goes to the description.

Two holders map what ranks hold onto entries, without communication:

- :class:`ShardedHolder`, a model from ``gs.shard`` and an optimizer over its shards:
  a rank holds, of each parameter and of each per-element state, the contiguous piece
  its shard contains (possibly none).
- :class:`ZeroHolder`, a plain or DDP model and a ``gs.ZeroRedundancyOptimizer``: every
  rank holds the whole model but only its slice of each bucket's optimizer state. A rank
  writes its slices of both (so the model's bytes are spread over the ranks too) and
  reads the whole model back, and its new slices of the state.

What every rank holds alike (a scalar state such as ``step``, a replicated flat buffer
of ``no_shard``, a parameter the ZeRO optimizer does not step) is offered by every rank
holding it and written once: DCP's planner keeps one copy of identical write items,
choosing the rank with the least to write (``DefaultSavePlanner``'s deduplication).
Buffers and tensor extras, which need not agree across ranks, are rank 0's.

Both write the same format: a ZeRO checkpoint converts with ``to_torch_save`` and loads
into a ``gs.shard`` model with the same param groups.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from groupshard import comm, flatten
from groupshard.api import ShardedModule
from groupshard.checkpoint import codec
from groupshard.checkpoint.planner import Piece
from groupshard.full_state import check_optimizer
from groupshard.optim.whole import WholeParamOptimizer
from groupshard.segments import ShardSegments, segments_of
from groupshard.writes import note_parameters_written
from groupshard.zero import ZeroRedundancyOptimizer


def flat_pieces(
    flat: torch.Tensor, segments: ShardSegments, names: Sequence[str]
) -> dict[str, Piece]:
    """Each parameter's piece of a shard-shaped tensor (a shard, or a per-element state
    laid out like it), by entry name (``names``: one per parameter of the flat buffer, in
    layout order). Pieces are views of ``flat``: DCP writes from and reads into it."""
    buffer = segments.buffer
    pieces: dict[str, Piece] = {}
    if not segments.needs_reduce:  # this rank holds the whole buffer (as every rank does)
        for slot, name in zip(buffer.params, names, strict=True):
            pieces[name] = Piece.whole(flat[slot.offset : slot.offset + slot.numel])
        return pieces
    local = {segment.param_index: segment for segment in segments.pieces}
    for index, (slot, name) in enumerate(zip(buffer.params, names, strict=True)):
        size = torch.Size([slot.numel])
        segment = local.get(index)
        if segment is None:  # none of it here (or an empty parameter, held alike by all)
            pieces[name] = Piece(flat[:0], size)
        else:
            data = flat[segment.shard_offset : segment.shard_offset + segment.numel]
            pieces[name] = Piece(data, size, segment.param_offset)
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


def _state_placement(
    key: str, saved: torch.dtype, shard: torch.Tensor, group: dict[str, Any]
) -> tuple[torch.dtype, torch.device]:
    """The dtype and device torch's ``Optimizer.load_state_dict`` gives a state tensor: the
    parameter's for floating parameters, except ``step`` (kept, or float32 on the
    parameter's device for fused and capturable optimizers)."""
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return torch.float32, shard.device
        return saved, torch.device("cpu")
    return (shard.dtype if shard.is_floating_point() else saved), shard.device


def optimizer_pieces(
    slices: Sequence[OptimizerSlice],
) -> tuple[dict[str, Piece], dict[str, dict[str, Any]]]:
    """The optimizer state's pieces by entry name, and the description of every state key
    of every parameter."""
    pieces: dict[str, Piece] = {}
    described: dict[str, dict[str, Any]] = {}
    for part in slices:
        for key, value in part.states.get(part.shard, {}).items():
            names = [f"optim.{fqn}.{key}" for fqn in part.fqns]
            if flatten.is_per_element(value, part.shard):
                pieces.update(flat_pieces(value.detach(), part.segments, names))
                kind = {"kind": "per_element", "dtype": codec.dtype_name(value.dtype)}
            elif isinstance(value, torch.Tensor):  # the same on every rank: written once
                pieces.update({name: Piece.whole(value.detach()) for name in names})
                kind = {"kind": "tensor", "shape": list(value.shape),
                        "dtype": codec.dtype_name(value.dtype)}  # fmt: skip
            else:
                kind = {"kind": "value", "value": codec.encode(value)}
            for fqn in part.fqns:
                described.setdefault(fqn, {})[key] = kind
    return pieces, described


def optimizer_destinations(
    slices: Sequence[OptimizerSlice], described: Mapping[str, dict[str, Any]]
) -> tuple[dict[str, Piece], list[tuple[OptimizerSlice, dict[str, Any]]]]:
    """Pieces for DCP to fill (cast to their dtype), and per slice the state they become."""
    pieces: dict[str, Piece] = {}
    states = []
    for part in slices:
        state: dict[str, Any] = {}
        for key, kind in described.get(part.fqns[0], {}).items():
            if kind["kind"] == "value":
                state[key] = codec.decode(kind["value"])
                continue
            saved = codec.dtype(kind["dtype"])
            dtype, device = _state_placement(key, saved, part.shard, part.group)
            if kind["kind"] == "per_element":
                state[key] = torch.zeros_like(part.shard, dtype=dtype)
                names = [f"optim.{fqn}.{key}" for fqn in part.fqns]
                pieces.update(flat_pieces(state[key], part.segments, names))
            else:
                state[key] = torch.zeros(kind["shape"], dtype=dtype, device=device)
                pieces[f"optim.{part.fqns[0]}.{key}"] = Piece.whole(state[key])
        states.append((part, state))
    return pieces, states


def install_states(states: Sequence[tuple[OptimizerSlice, dict[str, Any]]]) -> None:
    for part, state in states:
        part.states.pop(part.shard, None)
        if state:
            part.states[part.shard] = state


def _param_meta(shape: Sequence[int], dtype: torch.dtype, aliases: list[str]) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": codec.dtype_name(dtype), "aliases": aliases}


def _buffers_meta(module: nn.Module) -> dict[str, Any]:
    return {
        name: {"shape": list(b.shape), "dtype": codec.dtype_name(b.dtype)}
        for name, b in module.named_buffers()
    }


class Holder(ABC):
    """What one kind of training holds, as checkpoint entries (see the module's doc)."""

    ranks: comm.Ranks
    module: nn.Module  # whose buffers are saved
    optimizer: torch.optim.Optimizer | None

    @abstractmethod
    def model_meta(self) -> dict[str, Any]:
        """``{"params": {fqn: shape, dtype, aliases}, "buffers": {...}, "frozen": [...]}``."""

    @abstractmethod
    def param_pieces(self, loading: bool) -> tuple[dict[str, Piece], Callable[[], None]]:
        """The parameters' pieces (``model.<fqn>``), and what to run once they are read."""

    @abstractmethod
    def listed_groups(self) -> list[list[str]]:
        """Per param group, its parameters' names in the optimizer's order."""

    @abstractmethod
    def slices(self) -> list[OptimizerSlice]:
        """The tensors the (local) optimizer steps, each with its parameters."""

    @abstractmethod
    def hyperparameter_groups(self) -> list[list[dict[str, Any]]]:
        """Per param group, the group dicts a load updates with the saved hyperparameters."""

    def whole_state_pieces(self) -> tuple[dict[str, Piece], dict[str, dict[str, Any]]]:
        """Optimizer state kept whole on owner ranks (none but in ShardedHolder)."""
        return {}, {}

    def whole_state_destinations(
        self, described: Mapping[str, dict[str, Any]]
    ) -> tuple[dict[str, Piece], Callable[[], None]]:
        return {}, lambda: None

    def buffer_pieces(self) -> dict[str, Piece]:
        return {
            f"buffers.{name}": Piece.whole(buffer.detach(), write=self.ranks.rank == 0)
            for name, buffer in self.module.named_buffers()
        }

    def groups_meta(self) -> list[dict[str, Any]]:
        assert self.optimizer is not None
        return [
            {
                "params": listed,
                "hyperparameters": codec.encode({k: v for k, v in group.items() if k != "params"}),
            }
            for group, listed in zip(self.optimizer.param_groups, self.listed_groups(), strict=True)
        ]


class ShardedHolder(Holder):
    """A model returned by ``gs.shard`` and an optimizer over ``model.optimizer_groups()``."""

    def __init__(self, model: ShardedModule, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = self.module = model
        self.state = model.groupshard
        self.ranks = self.state.ranks
        self.optimizer = optimizer
        if optimizer is not None:
            check_optimizer(model, optimizer)

    def model_meta(self) -> dict[str, Any]:
        params = {}
        for storage in self.state.storages:
            for buffer in storage.layout.buffers:
                for slot in buffer.params:
                    aliases = [
                        f"{m}.{a}" if m else a for m, a in self.state.plan.registrations[slot.fqn]
                    ]
                    params[slot.fqn] = _param_meta(slot.shape, storage.layout.dtype, aliases)
        return {
            "params": params,
            "buffers": _buffers_meta(self.model),
            "frozen": list(self.state.groups.frozen),
        }

    def param_pieces(self, loading: bool) -> tuple[dict[str, Piece], Callable[[], None]]:
        pieces: dict[str, Piece] = {}
        for storage in self.state.storages:
            for shard in storage.shards:
                segments = segments_of(shard)
                assert segments is not None
                names = [f"model.{fqn}" for fqn in segments.fqns]
                pieces.update(flat_pieces(shard.detach(), segments, names))
        return pieces, note_parameters_written

    def listed_groups(self) -> list[list[str]]:
        return [list(group.listed) for group in self.state.groups.groups]

    def slices(self) -> list[OptimizerSlice]:
        assert self.optimizer is not None
        slices = []
        whole = isinstance(self.optimizer, WholeParamOptimizer)
        for group in self.optimizer.param_groups:
            if whole and group["whole"]:  # its state is the owners': whole_state_pieces
                continue
            for shard in group["params"]:
                segments = segments_of(shard)
                assert segments is not None
                slices.append(OptimizerSlice(shard, self.optimizer.state, group, segments.fqns))
        return slices

    def hyperparameter_groups(self) -> list[list[dict[str, Any]]]:
        assert self.optimizer is not None
        return [[group] for group in self.optimizer.param_groups]

    def whole_state_pieces(self) -> tuple[dict[str, Piece], dict[str, dict[str, Any]]]:
        """A ``gs.optim.WholeParamOptimizer``'s state of whole parameters, written by their
        owners (``optim.<fqn>.<key>``, in the parameter's state shapes), and its
        description from every rank (one gather)."""
        if not isinstance(self.optimizer, WholeParamOptimizer):
            return super().whole_state_pieces()
        pieces: dict[str, Piece] = {}
        described: dict[str, dict[str, Any]] = {}
        for fqn, (_, state, _) in self.optimizer.owned_states().items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    pieces[f"optim.{fqn}.{key}"] = Piece.whole(value.detach())
                    kind = {"kind": "tensor", "shape": list(value.shape),
                            "dtype": codec.dtype_name(value.dtype)}  # fmt: skip
                else:
                    kind = {"kind": "value", "value": codec.encode(value)}
                described.setdefault(fqn, {})[key] = kind
        for found in comm.gather_objects(described, self.ranks):
            for fqn, kinds in found.items():
                described.setdefault(fqn, kinds)
        return pieces, described

    def whole_state_destinations(
        self, described: Mapping[str, dict[str, Any]]
    ) -> tuple[dict[str, Piece], Callable[[], None]]:
        """Pieces to read the whole parameters' state this rank now steps into, and what
        installs it once read."""
        if not isinstance(self.optimizer, WholeParamOptimizer):
            return super().whole_state_destinations(described)
        optimizer = self.optimizer
        pieces: dict[str, Piece] = {}
        per_fqn: dict[str, dict[str, Any]] = {}
        for fqn, (whole, _, group) in optimizer.owned_states().items():
            state = per_fqn.setdefault(fqn, {})
            for key, kind in described.get(fqn, {}).items():
                if kind["kind"] == "value":
                    state[key] = codec.decode(kind["value"])
                    continue
                dtype, device = _state_placement(key, codec.dtype(kind["dtype"]), whole, group)
                state[key] = torch.zeros(kind["shape"], dtype=dtype, device=device)
                pieces[f"optim.{fqn}.{key}"] = Piece.whole(state[key])
        return pieces, lambda: optimizer.load_owned_state(per_fqn)


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

    def model_meta(self) -> dict[str, Any]:
        stepped = {fqn for listed in self.listed for fqn in listed}
        return {
            "params": {
                fqn: _param_meta(p.shape, p.dtype, self.aliases[fqn])
                for fqn, p in self.params.items()
            },
            "buffers": _buffers_meta(self.module),
            "frozen": [fqn for fqn in self.params if fqn not in stepped],
        }

    def param_pieces(self, loading: bool) -> tuple[dict[str, Piece], Callable[[], None]]:
        if loading:  # every rank reads every parameter whole
            return self._whole_params()
        # parameters the optimizer does not step: every rank holds them alike
        pieces = {
            f"model.{fqn}": Piece.whole(p.detach().reshape(-1)) for fqn, p in self.params.items()
        }
        for _, params, shard in self.zero.local_slices():
            segments = segments_of(shard)
            assert segments is not None
            if not segments.needs_reduce:  # one rank: the whole parameters, as above
                continue
            local = {segment.param_index: segment for segment in segments.pieces}
            for index, param in enumerate(params):
                size, segment = torch.Size([param.numel()]), local.get(index)
                if segment is None:  # none of it here
                    piece = Piece(param.detach().new_empty(0), size)
                else:
                    start = segment.param_offset
                    data = param.detach().reshape(-1)[start : start + segment.numel]
                    piece = Piece(data, size, start)
                pieces[f"model.{self.fqn_of[id(param)]}"] = piece
        return pieces, lambda: None

    def _whole_params(self) -> tuple[dict[str, Piece], Callable[[], None]]:
        pieces: dict[str, Piece] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for fqn, param in self.params.items():
            target = param.detach()
            if target.is_contiguous():
                data = target.view(-1)
            else:  # read into a copy, written back once read
                data = target.reshape(-1).clone()
                copies.append((target, data))
            pieces[f"model.{fqn}"] = Piece.whole(data)

        def write_back() -> None:
            with torch.no_grad():
                for target, data in copies:
                    target.copy_(data.view(target.shape))

        return pieces, write_back

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
