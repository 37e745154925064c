"""torch's state-dict API on groupshard's models and optimizers, exact.

``get_model_state_dict``, ``get_optimizer_state_dict``, ``get_state_dict`` and their
``set_*`` counterparts (``torch.distributed.checkpoint.state_dict``) see a ``gs.shard``
model's flat shards as its parameters, and would take each rank's optimizer shard for a
replicated tensor: ``dcp.save`` would then write one rank's copy for all. torch has no
extension point for that (it special-cases FSDP), so ``groupshard.torch_hook`` wraps
the four functions that do the work (``_get_model_state_dict``, ``_load_model_state_dict``,
``_get_optim_state_dict``, ``_load_optim_state_dict``) with these; for any other model and
optimizer they call torch's own. What they return is what the same call returns on the
unsharded model, with each rank's part of a sharded tensor as a :class:`ParamPiece`:

- default (sharded) options: the model under ``model.state_dict()``'s names, each
  parameter a ParamPiece of its shape (or the whole tensor where a rank holds it whole);
  the optimizer as ``{"state": {fqn: {key: ...}}, "param_groups": [{..., "params":
  [fqn, ...]}]}`` (``flatten_optimizer_state_dict=True``: ``state.<fqn>.<key>`` and
  ``param_groups.<fqn>.<hyperparameter>``), per-element state as ParamPieces.
  ``dcp.save`` writes every rank's blocks once, ``dcp.load`` reads into them at any
  world size, ``set_*`` installs them;
- ``full_state_dict=True``: whole tensors on every rank (``cpu_offload=True``: on rank 0,
  in CPU memory, the other ranks get ``{}``, as torch does); ``set_*`` takes whole
  tensors (``broadcast_from_rank0=True``: rank 0's, broadcast);
- ``cpu_offload=True`` alone: the pieces copied to CPU memory.

Models: a ``gs.shard`` model (any strategy, a 1-D or hybrid mesh; also compiled), with
one optimizer over ``model.optimizer_groups()`` (torch.optim, ``gs.optim``,
``gs.optim.WholeParamOptimizer``); a plain or DDP model with a
``gs.ZeroRedundancyOptimizer`` (its model goes through torch's own path). A module that
holds a sharded module inside is refused: pass the sharded module itself.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from groupshard import comm, flatten
from groupshard.api import ShardedModule
from groupshard.checkpoint.entries import (
    GROUPS,
    STATE,
    dcp_value,
    longest_first,
    saved_hyperparameters,
    split_name,
)
from groupshard.checkpoint.pieces import (
    Holder,
    Saved,
    ShardedHolder,
    ZeroHolder,
    copy_into,
    source_problem,
)
from groupshard.checkpoint.planner import ParamPiece, Piece
from groupshard.full_state import full_state_dict, load_full_state_dict, optim_state_dict
from groupshard.optim.whole import WholeParamOptimizer
from groupshard.zero import ZeroRedundancyOptimizer

_WRAPPED = (
    "_get_model_state_dict",
    "_load_model_state_dict",
    "_get_optim_state_dict",
    "_load_optim_state_dict",
)
_MARK = "_groupshard_wrapped"


def wrap_torch_state_dict(module: ModuleType) -> None:
    """Wrap torch's state-dict functions in ``module`` (once)."""
    if getattr(module, _MARK, False):
        return
    missing = [name for name in _WRAPPED if not hasattr(module, name)]
    if missing:
        warnings.warn(
            f"torch {torch.__version__} has no {missing} in {module.__name__}: torch's "
            "state-dict API on groupshard models is not supported with it; use "
            "gs.checkpoint, gs.full_state_dict and gs.optim_state_dict",
            stacklevel=2,
        )
        return
    ours = {
        "_get_model_state_dict": _get_model_state_dict,
        "_load_model_state_dict": _load_model_state_dict,
        "_get_optim_state_dict": _get_optim_state_dict,
        "_load_optim_state_dict": _load_optim_state_dict,
    }
    for name, function in ours.items():
        original = getattr(module, name)
        wrapper = functools.wraps(original)(functools.partial(function, original, module))
        setattr(module, name, wrapper)
    setattr(module, _MARK, True)


def sharded_model(model: nn.Module) -> ShardedModule | None:
    """The ``gs.shard`` model ``model`` is (or compiles), None for other models; a model
    holding a sharded module inside is refused (ValueError naming it)."""
    if isinstance(model, ShardedModule):
        return model
    inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(inner, ShardedModule):
        return inner
    for name, module in model.named_modules():
        if isinstance(module, ShardedModule):
            raise ValueError(
                f"{type(model).__name__} holds a module sharded by gs.shard ({name!r}); torch's "
                "state-dict functions would take its shards for whole parameters. Pass the "
                "sharded module itself (and an optimizer over its optimizer_groups())."
            )
    return None


def _holder(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Holder | None:
    ours = [o for o in optimizers if isinstance(o, ZeroRedundancyOptimizer)]
    sharded = sharded_model(model)
    if not ours and sharded is None:
        return None
    if len(optimizers) != 1:
        raise ValueError(
            f"torch's state-dict functions were given {len(optimizers)} optimizers for a "
            "groupshard model; a sharded model (or gs.ZeroRedundancyOptimizer) has one "
            "optimizer over all its groups"
        )
    if ours:
        inner = getattr(model, "_orig_mod", model)
        return ZeroHolder(inner, ours[0])
    assert sharded is not None
    return ShardedHolder(sharded, optimizers[0])


def _refuse_submodules(info: Any) -> None:
    if info.submodule_prefixes:
        raise ValueError(
            "submodules= (deprecated by torch) is not supported on a groupshard model; take "
            "the whole state dict and keep the entries you need"
        )


def _on_cpu(entry: Any) -> Any:
    if isinstance(entry, Piece):
        return dataclasses.replace(entry, data=entry.data.cpu())
    return entry.cpu() if isinstance(entry, torch.Tensor) else entry


def _frozen_names(holder: Holder) -> set[str]:
    shapes = holder.param_shapes()
    return {alias for fqn in holder.frozen() for alias in shapes[fqn][2]}


def _get_model_state_dict(
    original: Callable[..., Any], module: ModuleType, model: nn.Module, info: Any
) -> dict[str, Any]:
    sharded = sharded_model(model)
    if sharded is None:
        return original(model, info)
    if not info.handle_model:
        return {}
    _refuse_submodules(info)
    holder = ShardedHolder(sharded, None)
    skip = _frozen_names(holder) if info.ignore_frozen_params else set()
    if info.full_state_dict:
        full = full_state_dict(sharded, rank0_only=info.cpu_offload, cpu_offload=info.cpu_offload)
        return {name: value for name, value in full.items() if name not in skip}
    entries, _ = holder.model_entries(loading=False)
    return {
        name: (_on_cpu(piece) if info.cpu_offload else piece).dcp_value()
        for name, piece in entries.items()
        if name not in skip
    }


@torch.no_grad()
def _load_model_state_dict(
    original: Callable[..., Any],
    module: ModuleType,
    model: nn.Module,
    state_dict: dict[str, Any],
    info: Any,
) -> Any:
    sharded = sharded_model(model)
    if sharded is None:
        return original(model, state_dict, info)
    if not info.handle_model or (not state_dict and not info.broadcast_from_rank0):
        return _IncompatibleKeys([], [])
    if info.broadcast_from_rank0:  # rank 0's whole tensors, one broadcast per flat buffer
        load_full_state_dict(sharded, state_dict, broadcast_from_rank0=True)
        return _IncompatibleKeys([], [])
    holder = ShardedHolder(sharded, None)
    pieces, after_load = holder.param_pieces(loading=True)
    known: set[str] = set()
    sources: list[tuple[Piece, Any, str]] = []
    missing: list[str] = []
    for fqn, (_, _, aliases) in holder.param_shapes().items():
        known.update(aliases)
        found = next((a for a in aliases if a in state_dict), None)
        if found is None:
            missing += aliases
        else:
            sources.append((pieces[fqn], state_dict[found], found))
    for name, buffer in holder.buffers().items():
        known.add(name)
        if name in state_dict:
            sources.append((Piece.whole(buffer), state_dict[name], name))
        else:
            missing.append(name)
    unexpected = [name for name in state_dict if name not in known]
    problem = None
    if info.strict and (missing or unexpected):
        problem = RuntimeError(
            "Error(s) in loading the state dict of a groupshard model: "
            + (f"missing keys {missing[:8]}; " if missing else "")
            + (f"unexpected keys {unexpected[:8]}" if unexpected else "")
        )
    problem = problem or _first_problem(sources)
    comm.raise_if_any_failed(problem, holder.ranks)  # before anything changes, on every rank
    for destination, value, _ in sources:
        copy_into(destination, value)
    after_load()
    return _IncompatibleKeys(missing, unexpected)


def _first_problem(sources: Sequence[tuple[Piece, Any, str]]) -> ValueError | None:
    for destination, value, name in sources:
        problem = source_problem(destination, value, name)
        if problem is not None:
            return ValueError(problem)
    return None


def _initialize_state(holder: Holder) -> None:
    """Give an optimizer without state its state, as torch's ``_init_optim_state`` does (a
    step of zero gradients at learning rate 0), when no rank has state or gradients: the
    step is collective, so every rank decides alike (torch's own check is per rank)."""
    optimizer = holder.optimizer
    assert optimizer is not None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    mine = bool(optimizer.state) or any(part.states.get(part.shard) for part in holder.slices())
    if isinstance(optimizer, WholeParamOptimizer):
        mine = mine or any(state for _, state, _ in optimizer.owned_states().values())
    mine = mine or any(p.grad is not None for p in params)
    found = torch.tensor([float(mine)], device=holder.device)
    comm.all_reduce_max(found, holder.ranks)
    if found.item():
        return
    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    rates = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        if rate is not None:
            group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def _full_optimizer_state(holder: Holder) -> dict[str, dict[str, Any]]:
    """Every parameter's state, whole, on every rank (collective)."""
    if isinstance(holder, ShardedHolder):
        assert holder.optimizer is not None
        return optim_state_dict(holder.model, holder.optimizer)["state"]
    per_fqn: dict[str, dict[str, Any]] = {}
    for part in holder.slices():
        segments = part.segments
        entries = flatten.gather_shard_state(
            part.states.get(part.shard, {}), part.shard, segments.buffer, segments.ranks,
            segments.replicated,
        )  # fmt: skip
        per_fqn.update((f, e) for f, e in zip(part.fqns, entries, strict=True) if e)
    return per_fqn


def _get_optim_state_dict(
    original: Callable[..., Any],
    module: ModuleType,
    model: nn.Module,
    optimizers: tuple[torch.optim.Optimizer, ...],
    info: Any,
) -> dict[str, Any]:
    holder = _holder(model, optimizers)
    if holder is None:
        return original(model, optimizers, info)
    if not info.handle_optim:
        return {}
    _refuse_submodules(info)
    _initialize_state(holder)
    state: dict[str, dict[str, Any]] = {}
    if info.full_state_dict:
        full = _full_optimizer_state(holder)
        if info.cpu_offload and holder.ranks.rank != 0:
            return {}
        for fqn, keys in full.items():
            state[fqn] = {k: _on_cpu(v) if info.cpu_offload else v for k, v in keys.items()}
    else:
        for fqn, keys in holder.optimizer_entries().items():
            state[fqn] = {
                key: dcp_value(_on_cpu(entry) if info.cpu_offload else entry)
                for key, entry in keys.items()
            }
    groups = [
        {**values, "params": listed}
        for listed, values in zip(holder.listed_groups(), holder.hyperparameters(), strict=True)
    ]
    if not info.flatten_optimizer_state_dict:
        return {"state": state, "param_groups": groups}
    flat: dict[str, Any] = {}
    for fqn, keys in state.items():
        flat.update({f"{STATE}{fqn}.{key}": value for key, value in keys.items()})
    for group in groups:
        for fqn in group["params"]:
            flat.update({f"{GROUPS}{fqn}.{k}": v for k, v in group.items() if k != "params"})
    return flat


def _nested(
    state_dict: Mapping[str, Any], listed: Sequence[Sequence[str]]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each parameter's state, and the param-group entries by flat name (``param_groups.
    <index or fqn>.<key>``), from either form torch's API gives (or an optimizer's own
    ``state_dict()``, numbered)."""
    if "state" in state_dict and "param_groups" in state_dict:
        groups = state_dict["param_groups"]
        names = [n for names in listed for n in names]
        numbered = [p for g in groups for p in g["params"]]
        rename = {p: p for p in numbered}
        if numbered and not isinstance(numbered[0], str):  # Optimizer.state_dict()'s numbers
            if len(numbered) != len(names):
                raise ValueError(
                    f"The optimizer state dict lists {len(numbered)} parameters but the "
                    f"optimizer has {len(names)}"
                )
            rename = dict(zip(numbered, names, strict=True))
        state = {rename.get(k, k): dict(v) for k, v in state_dict["state"].items()}
        values: dict[str, Any] = {}
        for index, group in enumerate(groups):
            for key, value in group.items():
                values[f"{GROUPS}{index}.{key}"] = (
                    [rename[p] for p in value] if key == "params" else value
                )
        return state, values
    fqns = longest_first(n for names in listed for n in names)
    state = {}
    values = {}
    for name, value in state_dict.items():
        if name.startswith(GROUPS):
            values[name] = value
            continue
        if not name.startswith(STATE):
            raise ValueError(f"{name!r} is no entry of an optimizer state dict")
        split = split_name(name[len(STATE) :], fqns)
        if split is None:
            raise ValueError(f"{name!r} names no parameter of the optimizer")
        state.setdefault(split[0], {})[split[1]] = value
    return state, values


def _from_rank0(state_dict: Mapping[str, Any], holder: Holder) -> dict[str, Any]:
    """Rank 0's (flat or nested) optimizer state dict on every rank: its structure in one
    broadcast, then each tensor, on the shards' device (NCCL broadcasts only there). Each
    rank holds the whole state for a moment, as torch does for tensors that are not
    DTensors."""
    ranks = holder.ranks
    tensors: list[torch.Tensor] = []

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return ("__tensor__", tuple(value.shape), value.dtype)
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    structure = comm.broadcast_object(strip(dict(state_dict)) if ranks.rank == 0 else None, ranks)
    position = iter(range(1 << 62))

    def rebuild(value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 3 and value[0] == "__tensor__":
            index = next(position)
            if ranks.rank == 0:
                tensor = tensors[index].detach().to(holder.device).contiguous()
            else:
                tensor = torch.empty(value[1], dtype=value[2], device=holder.device)
            comm.broadcast(tensor, ranks)
            return tensor
        if isinstance(value, dict):
            return {k: rebuild(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rebuild(v) for v in value]
        return value

    return rebuild(structure)


@torch.no_grad()
def _load_optim_state_dict(
    original: Callable[..., Any],
    module: ModuleType,
    model: nn.Module,
    optimizers: tuple[torch.optim.Optimizer, ...],
    state_dict: dict[str, Any],
    info: Any,
) -> None:
    holder = _holder(model, optimizers)
    if holder is None:
        return original(model, optimizers, state_dict, info)
    if not info.handle_optim:
        return None
    if info.broadcast_from_rank0:
        state_dict = _from_rank0(state_dict, holder)
    if not state_dict:
        return None
    listed = holder.listed_groups()
    problem: Exception | None = None
    try:  # everything checked before anything changes, and any rank's failure is everyone's
        state, values = _nested(state_dict, listed)
        hyperparameters = saved_hyperparameters(listed, values, "")
        saved = {
            fqn: {
                key: Saved(value.shape, value.dtype) if isinstance(value, torch.Tensor) else Saved()
                for key, value in keys.items()
            }
            for fqn, keys in state.items()
        }
        destinations = holder.optimizer_destinations(saved)
        sources = [
            (entry, state[fqn][key], f"{STATE}{fqn}.{key}")
            for fqn, keys in destinations.entries.items()
            for key, entry in keys.items()
            if isinstance(entry, Piece)
        ]
        problem = _first_problem(sources)
        if problem is None:
            destinations.check(lambda fqn, key, entry: state[fqn][key])
    except (ValueError, TypeError) as error:
        problem = error
    comm.raise_if_any_failed(problem, holder.ranks)
    for destination, value, _ in sources:
        copy_into(destination, value)
    destinations.install(
        lambda fqn, key, entry: entry.data if isinstance(entry, Piece) else state[fqn][key]
    )
    holder.set_hyperparameters(hyperparameters)
    return None


__all__ = ["ParamPiece", "sharded_model", "wrap_torch_state_dict"]
