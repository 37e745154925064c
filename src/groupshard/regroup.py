"""``gs.regroup``: change a sharded model's param groups between steps (unfreeze, move,
freeze), keeping each parameter's optimizer state (FairScale's "reflattening").

Plan first, change second. The plan resolves the new groups by FQN, lays out each unit
anew (``api.plan_storages``) and finds, for every new flat buffer, where its parameters'
optimizer state comes from; it changes nothing, and any failure is raised on every rank
(then one agreement that the ranks planned the same). The execution rebuilds only the
storages whose layout changed, one at a time: gather its parameters and per-parameter
state (one unit's worth, never the whole model), lay them out in the new flat buffers,
put the new storage in the old one's place, and rewrite ``optimizer.param_groups`` and
``optimizer.state`` in place on the same optimizer object.

Note: state
    A parameter that stays trainable keeps its per-element state (``exp_avg``...) and
    its scalar state (``step``). A flat buffer keeps one scalar per key for all its
    parameters, so parameters whose ``step`` differs, or a newly trainable parameter
    (no state, as after torch's ``add_param_group``) and one with state, cannot share a
    new flat buffer: a ValueError names them (put them in groups of their own).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from groupshard import comm, flatten
from groupshard.api import check_same_structure, plan_storages, structure_signature
from groupshard.full_state import check_optimizer
from groupshard.gradients import was_stepped
from groupshard.groups import ParamGroups, ResolvedGroup, ResolvedGroups, list_group_members
from groupshard.layout import FlatBufferLayout, StorageLayout
from groupshard.optim.whole import WholeParamOptimizer
from groupshard.piece_params import release_piece
from groupshard.runtime import TrainingState
from groupshard.schedulers import SchedulerPlan, is_scheduled, match_groups, plan_schedulers
from groupshard.sharding import ShardingState, register_shards, shard_attr_name, sharding_state
from groupshard.storage import FlatStorage
from groupshard.unit_runtime import UnitRuntime
from groupshard.zero import ZeroRedundancyOptimizer

_NOT_A_PARAMETER = (
    "pass the model's own parameters, model.get_parameter(name) (a sharded model's "
    "model.parameters() are its flat shards)"
)


@dataclass(frozen=True)
class _Rebuild:
    """One storage whose layout changes: ``unit.storages[index]`` becomes ``layout``."""

    unit: UnitRuntime
    index: int
    layout: StorageLayout


def regroup(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    param_groups: ParamGroups,
    *,
    default_group: Mapping[str, Any] | None = None,
    schedulers: Sequence[LRScheduler] | None = None,
) -> None:
    """Give a sharded model and its optimizer new param groups, between steps.

    Args:
        model: a model returned by ``gs.shard``.
        optimizer: its optimizer, built from ``model.optimizer_groups()`` (a
            ``torch.optim`` optimizer or a ``gs.optim`` one); changed in place. Or a
            ``gs.ZeroRedundancyOptimizer`` with the plain or DDP model it steps.
        param_groups: ``gs.shard``'s format: dicts with "params" holding the user's own
            parameters (``model.get_parameter(name)``) plus hyperparameters. A listed
            parameter is trainable (a frozen one is unfrozen, with no optimizer state, as
            after torch's ``add_param_group``); one left out of every group is frozen
            (``requires_grad=False``, state dropped), unless ``default_group`` is given.
        default_group: hyperparameters of an extra last group collecting the parameters
            that are trainable now and that no group lists.
        schedulers: the LR schedulers built on ``optimizer``, carried over the new groups
            (``SequentialLR`` and ``ChainedScheduler`` with the ones inside): a group that
            stays keeps its place in them and its scheduled learning rate; a new one starts
            from its dict's ``lr``. Required, or ``[]``, when a scheduler steps the
            optimizer and groups are added, removed or reordered.

    Every rank must pass the same groups (a ValueError on every rank otherwise). Call it
    between steps: after ``optimizer.step()`` (the gradients it used are dropped, as
    ``zero_grad`` would) or ``optimizer.zero_grad()``; gradients no step has used yet are
    refused. Only the units whose layout changes are re-laid out; each parameter that
    stays trainable keeps its optimizer state and takes its new group's hyperparameters.
    docs/regroup.md has the details.
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        _regroup_zero(model, optimizer, param_groups, default_group, schedulers)
        return
    state = sharding_state(model, "gs.regroup", "part 2, issue 53")
    error: BaseException | None = None
    try:
        groups, layouts, rebuilds = _plan(model, state, optimizer, param_groups, default_group)
        carry = _plan_schedulers(
            schedulers,
            optimizer,
            [frozenset(group.fqns) for group in state.groups.groups],
            [frozenset(group.fqns) for group in groups.groups],
            [dict(group.options) for group in groups.groups],
        )
    except Exception as caught:  # every rank must hear of any failure
        error = caught
    comm.raise_if_any_failed(error, state.ranks)
    signature = structure_signature(
        groups,
        {name: list(by_dtype.values()) for name, by_dtype in layouts.items()},
        model,
        {"sync_module_states": False, "default_group": repr(default_group)},
    )
    check_same_structure(
        signature, state.ranks, "regroup the model", "the same param groups to gs.regroup"
    )
    state.runtime.reshard()
    _drop_stepped_gradients(state)
    for rebuild in rebuilds:
        _rebuild_storage(state, optimizer, rebuild)
    trainable = {fqn for group in groups.groups for fqn in group.fqns}
    for fqn, original in state.original_params.items():
        original.requires_grad_(fqn in trainable)
    state.groups = groups
    _rewrite_param_groups(state, optimizer)
    if carry is not None:
        carry.apply(optimizer.param_groups)


def _plan(
    model: nn.Module,
    state: ShardingState,
    optimizer: torch.optim.Optimizer,
    param_groups: ParamGroups,
    default_group: Mapping[str, Any] | None,
) -> tuple[ResolvedGroups, dict[str, dict[torch.dtype, StorageLayout]], list[_Rebuild]]:
    """The new groups, every unit's new layouts and the storages to rebuild, after every
    check that can fail (this rank's; nothing changes)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"gs.regroup expects the model's torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, WholeParamOptimizer):
        raise TypeError(
            "gs.regroup does not support gs.optim.WholeParamOptimizer: its state lives whole on "
            "owner ranks planned from the old groups. gs.regroup carries the state of "
            "optimizers that step the shards (torch.optim, gs.optim's LAMB, LARS, LARC, AGC "
            "and Muon, gs.ZeroRedundancyOptimizer)."
        )
    check_optimizer(model, optimizer)
    _check_between_steps(state)
    groups = _resolve(state, param_groups, default_group)
    layouts = _plan_layouts(state, groups)
    rebuilds = [
        _Rebuild(unit, index, layouts[unit.name][storage.layout.dtype])
        for unit in state.runtime.units
        for index, storage in enumerate(unit.storages)
        if layouts[unit.name][storage.layout.dtype] != storage.layout
    ]
    for rebuild in rebuilds:
        _check_state_carries(rebuild, optimizer)
    _check_optimizer_accepts(optimizer, groups, layouts)
    return groups, layouts, rebuilds


def _regroup_zero(
    model: nn.Module,
    optimizer: ZeroRedundancyOptimizer,
    param_groups: ParamGroups,
    default_group: Mapping[str, Any] | None,
    schedulers: Sequence[LRScheduler] | None,
) -> None:
    """``gs.ZeroRedundancyOptimizer`` over a plain (or DDP) model: the same rules, its
    buckets rebuilt (``ZeroRedundancyOptimizer.regroup``)."""
    error: BaseException | None = None
    groups: list[dict[str, Any]] = []
    try:
        named = dict(model.named_parameters())
        members = list_group_members(named, param_groups, _NOT_A_PARAMETER)
        groups = [{"params": [named[f] for f in fqns], **options} for fqns, options in members]
        if default_group is not None:
            listed = {fqn for fqns, _ in members for fqn in fqns}
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            rest = [p for n, p in named.items() if id(p) in stepped and n not in listed]
            if rest:
                groups.append({"params": rest, **default_group})
        names = {id(p): n for n, p in named.items()}
        old_members = [frozenset(names[id(p)] for p in g["params"]) for g in optimizer.param_groups]
        new = [frozenset(names[id(p)] for p in g["params"]) for g in groups]
        options = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        carry = _plan_schedulers(schedulers, optimizer, old_members, new, options)
    except Exception as caught:  # every rank must hear of any failure
        error = caught
    comm.raise_if_any_failed(error, optimizer.ranks)
    optimizer.regroup(groups)
    if carry is not None:
        carry.apply(optimizer.param_groups)
    trainable = {id(p) for group in groups for p in group["params"]}
    for param in named.values():
        param.requires_grad_(id(param) in trainable)


def _plan_schedulers(
    schedulers: Sequence[LRScheduler] | None,
    optimizer: torch.optim.Optimizer,
    old_members: list[frozenset[str]],
    new_members: list[frozenset[str]],
    new_options: list[dict[str, Any]],
) -> SchedulerPlan | None:
    """The schedulers' carry-over (None: none to carry). Without ``schedulers``, refuse a
    change of group positions under a scheduler, which its next step() would trip on."""
    if (not is_scheduled(optimizer) if schedulers is None else len(schedulers) == 0):
        return None  # none, or the user rebuilds them
    if len(optimizer.param_groups) != len(old_members):
        raise ValueError(
            f"The optimizer has {len(optimizer.param_groups)} param groups and the model "
            f"{len(old_members)}: its LR schedulers cannot be carried over (build the "
            "optimizer from model.optimizer_groups())"
        )
    if schedulers is None:
        if match_groups(old_members, new_members) != list(range(len(old_members))):
            raise ValueError(
                "gs.regroup adds, removes or reorders param groups of an optimizer that an "
                "LR scheduler steps, whose per-group lists would no longer fit: pass it, "
                "gs.regroup(..., schedulers=[scheduler]), to carry it over, or "
                "schedulers=[] if you rebuild it yourself."
            )
        return None
    return plan_schedulers(schedulers, optimizer, old_members, new_members, new_options)


def _check_between_steps(state: ShardingState) -> None:
    """Refuse a regroup inside a forward or backward, or with gradients it would drop."""
    if state.runtime.state is not TrainingState.IDLE or state.originals_registered:
        raise ValueError(
            f"gs.regroup during {state.runtime.state.name.lower()} (or inside "
            "summon_full_params): call it between optimizer steps."
        )
    accumulating = sorted({
        storage.layout.unit_name or "<root>"
        for storage in state.storages
        if storage.gradients.holds_unreduced
    })  # fmt: skip
    if accumulating:
        raise ValueError(
            f"gs.regroup while a gradient accumulation is in progress in units {accumulating} "
            "(backwards under no_sync() or set_requires_gradient_sync(False), or not yet "
            "all-reduced across replicas): their sums are not reduced yet, and re-laying out "
            "the flat buffers would lose them. Finish the accumulation (a synced backward, "
            "then optimizer.step()) and regroup before the next one."
        )
    pending = sorted({
        storage.layout.unit_name or "<root>"
        for storage in state.storages
        for shard in storage.trainable_shards
        if shard.grad is not None and not was_stepped(shard.grad)
    })  # fmt: skip
    if pending:
        raise ValueError(
            f"gs.regroup with gradients in units {pending} that no optimizer step has used "
            "yet, which re-laying out the flat buffers would drop: call optimizer.step() "
            "first (gradients a step has used are dropped, as optimizer.zero_grad() would), "
            "or optimizer.zero_grad() to drop them."
        )


def _drop_stepped_gradients(state: ShardingState) -> None:
    """The gradients an optimizer step has consumed go, as ``zero_grad`` would drop them
    (``_check_between_steps`` refused any other)."""
    for storage in state.storages:
        for shard in storage.trainable_shards:
            shard.grad = None


def _resolve(
    state: ShardingState, param_groups: ParamGroups, default_group: Mapping[str, Any] | None
) -> ResolvedGroups:
    """The new groups by FQN: every listed parameter trainable, the rest frozen (or in
    ``default_group`` if trainable now)."""
    originals = state.original_params
    members = list_group_members(originals, param_groups, _NOT_A_PARAMETER)
    groups = [
        ResolvedGroup(index, tuple(fqns), options, tuple(fqns))
        for index, (fqns, options) in enumerate(members)
    ]
    listed = {fqn for fqns, _ in members for fqn in fqns}
    if default_group is not None:
        trainable_now = state.groups.group_of()
        rest = tuple(fqn for fqn in originals if fqn in trainable_now and fqn not in listed)
        if rest:
            groups.append(ResolvedGroup(len(groups), rest, dict(default_group), rest))
    trainable = {fqn for group in groups for fqn in group.fqns}
    frozen = tuple(fqn for fqn in originals if fqn not in trainable)
    return ResolvedGroups(tuple(groups), frozen)


def _plan_layouts(
    state: ShardingState, groups: ResolvedGroups
) -> dict[str, dict[torch.dtype, StorageLayout]]:
    """Each unit's storage layouts under ``groups``, by dtype (the same units and world
    size; shapes from the current layouts, as the user's parameters hold pieces)."""
    stand_ins: dict[str, torch.Tensor] = {}
    world_size = 1
    for storage in state.storages:
        world_size = storage.layout.world_size
        for buffer in storage.layout.buffers:
            for slot in buffer.params:
                stand_ins[slot.fqn] = torch.empty(
                    slot.shape, dtype=storage.layout.dtype, device="meta"
                )
    planned = plan_storages(groups, state.plan, stand_ins, world_size)
    return {name: {layout.dtype: layout for layout in layouts} for name, layouts in planned.items()}


def _old_buffers(
    storage: FlatStorage, optimizer: torch.optim.Optimizer
) -> dict[str, tuple[torch.Tensor, FlatBufferLayout, dict[str, Any]]]:
    """Per trainable FQN of ``storage``: its shard, that shard's buffer and state."""
    found = {}
    for shard, buffer in zip(storage.shards, storage.layout.buffers, strict=True):
        if buffer.group_index < 0:
            continue
        shard_state = optimizer.state.get(shard, {})
        for slot in buffer.params:
            found[slot.fqn] = (shard, buffer, shard_state)
    return found


def _check_state_carries(rebuild: _Rebuild, optimizer: torch.optim.Optimizer) -> None:
    """Fail if a new flat buffer would need several values of one scalar state, or state
    for some parameters and none for others (see the module's note)."""
    old = _old_buffers(rebuild.unit.storages[rebuild.index], optimizer)
    for buffer in rebuild.layout.trainable_buffers:
        fqns = [slot.fqn for slot in buffer.params]
        states = [old[fqn][2] if fqn in old else {} for fqn in fqns]
        where = f"param group {buffer.group_index} of unit {rebuild.layout.unit_name or '<root>'!r}"
        without = [fqn for fqn, s in zip(fqns, states, strict=True) if not s]
        if without and len(without) < len(fqns):
            raise ValueError(
                f"Parameters {without} have no optimizer state (newly trainable, or never "
                f"stepped) but would share the flat buffer of {where} with parameters that have "
                f"state ({[f for f in fqns if f not in without][:3]}...); a flat buffer keeps "
                "one 'step' for all its parameters. Put them in a param group of their own."
            )
        if not states or not states[0]:
            continue
        keys = {tuple(sorted(s)) for s in states}
        if len(keys) > 1:
            raise ValueError(
                f"The parameters of {where} come with different optimizer state keys {keys}; "
                "put parameters from groups with different optimizer options apart."
            )
        shards = [old[fqn][0] for fqn in fqns]  # each parameter's own old shard
        for key in sorted(states[0]):
            values = {
                _scalar_text(s[key])
                for s, shard in zip(states, shards, strict=True)
                if not flatten.is_per_element(s[key], shard)
            }
            if len(values) > 1:
                raise ValueError(
                    f"The parameters of {where} come with different values of optimizer state "
                    f"{key!r} ({sorted(values)}); a flat buffer keeps one {key!r} for all its "
                    "parameters. Put the parameters that differ in a param group of their own."
                )


def _check_optimizer_accepts(
    optimizer: torch.optim.Optimizer,
    groups: ResolvedGroups,
    layouts: Mapping[str, Mapping[torch.dtype, StorageLayout]],
) -> None:
    """Run the optimizer's own ``add_param_group`` on a shallow copy, with meta stand-ins
    shaped like the parameters, so that a group it refuses (e.g. a vector in a Muon group)
    fails before anything changes. A wrapper (LARC, AGC) is probed through its inner one."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer  # type: ignore[assignment]
    probe = copy.copy(inner)
    probe.param_groups, probe.state = [], defaultdict(dict)
    slots = {
        slot.fqn: (slot.shape, layout.dtype)
        for by_dtype in layouts.values()
        for layout in by_dtype.values()
        for buffer in layout.buffers
        for slot in buffer.params
    }
    for group in groups.groups:
        stand_ins = [
            torch.empty(slots[fqn][0], dtype=slots[fqn][1], device="meta", requires_grad=True)
            for fqn in group.fqns
        ]
        try:
            probe.add_param_group({"params": stand_ins, **group.options})
        except (ValueError, TypeError) as error:
            raise type(error)(
                f"{type(optimizer).__name__} refuses param group {group.index} of gs.regroup "
                f"(params {list(group.fqns)}): {error}"
            ) from error


def _scalar_text(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return repr(float(value.item()))
    return repr(value)


@torch.no_grad()
def _rebuild_storage(
    state: ShardingState, optimizer: torch.optim.Optimizer, rebuild: _Rebuild
) -> None:
    """Re-lay out one storage: gather its parameters and per-parameter state (collective),
    build the new storage from them, and move the optimizer state to the new shards."""
    unit, old = rebuild.unit, rebuild.unit.storages[rebuild.index]
    staying = {slot.fqn for b in rebuild.layout.trainable_buffers for slot in b.params}
    per_fqn, per_element = _gather_state(old, optimizer, staying)
    originals = state.original_params
    gathered = old.gather_params()
    for fqn, full in gathered.items():
        release_piece(originals[fqn])
        originals[fqn].data = full  # what the new storage copies its slices from
    _free_old_shards(old, gathered.values())
    new = FlatStorage(
        rebuild.layout,
        state.mesh,
        originals,
        sync_from_rank0=False,
        compute_dtype=old.compute_dtype,
        reduce_dtype=old.reduce_dtype,
    )
    for shard, buffer in zip(new.shards, rebuild.layout.buffers, strict=True):
        entries = [per_fqn.pop(slot.fqn, None) for slot in buffer.params]
        if buffer.group_index >= 0 and entries and all(entries):
            optimizer.state[shard] = _local_state(
                entries, per_element, shard, buffer, new.shard_rank
            )
    stale = {id(shard) for shard in old.shards}
    for group in optimizer.param_groups:  # the old shards would keep the old storage alive
        group["params"] = [p for p in group["params"] if id(p) not in stale]
    for buffer in old.layout.buffers:
        del unit.module._parameters[shard_attr_name(buffer.group_index, old.layout.dtype)]
    register_shards(unit.module, new)
    state.runtime.replace_storage(unit, rebuild.index, new)
    unit.install_local_pieces()  # the user's parameters hold this rank's pieces again


def _free_old_shards(old: FlatStorage, gathered: Iterable[torch.Tensor]) -> None:
    """Free the old storage's shards before the new one is built, so that the call never
    holds one unit's old and new shards at once (the bound: the shards plus one unit's
    unsharded parameters and state). Kept where a gathered parameter is a view of them
    (a replicated storage: nothing was gathered)."""
    local = old.local.untyped_storage()
    if all(tensor.untyped_storage().data_ptr() != local.data_ptr() for tensor in gathered):
        local.resize_(0)


def _gather_state(
    old: FlatStorage, optimizer: torch.optim.Optimizer, staying: set[str]
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """The optimizer state of ``old``'s shards (removed from the optimizer) per parameter
    in ``staying``, and the keys laid out like the parameters: per-element state as views
    of one unsharded tensor per key (one all-gather each, no copies), scalar state as it
    is. State of parameters that leave the trainable groups is dropped without a gather."""
    per_fqn: dict[str, dict[str, Any]] = {}
    per_element: set[str] = set()
    for shard, buffer in zip(old.shards, old.layout.buffers, strict=True):
        shard_state = optimizer.state.pop(shard, None)
        if buffer.group_index < 0 or not shard_state:
            continue
        if not any(slot.fqn in staying for slot in buffer.params):
            continue
        for key, value in sorted(shard_state.items()):
            if flatten.is_per_element(value, shard):
                per_element.add(key)
                full = value if old.replicated else flatten.unshard(value, buffer, old.ranks, False)
                pieces: list[Any] = flatten.split(full.detach().view(-1), buffer)
            else:
                pieces = [value] * len(buffer.params)
            for slot, piece in zip(buffer.params, pieces, strict=True):
                if slot.fqn in staying:
                    per_fqn.setdefault(slot.fqn, {})[key] = piece
    return per_fqn, per_element


def _local_state(
    entries: list[dict[str, Any]],
    per_element: set[str],
    shard: torch.Tensor,
    buffer: FlatBufferLayout,
    rank: int,
) -> dict[str, Any]:
    """A new shard's state: per-element state copied segment by segment from each
    parameter's (no unsharded temporary), scalar state from the first parameter (the
    plan checked that they agree)."""
    state: dict[str, Any] = {}
    for key, first in entries[0].items():
        if key not in per_element:
            state[key] = first.clone() if isinstance(first, torch.Tensor) else first
            continue
        local = torch.zeros(shard.shape, dtype=first.dtype, device=shard.device)
        for segment in buffer.segments(rank):
            source = entries[segment.param_index][key].reshape(-1)
            local[segment.shard_offset : segment.shard_offset + segment.numel].copy_(
                source[segment.param_offset : segment.param_offset + segment.numel]
            )
        state[key] = local
    return state


def _rewrite_param_groups(state: ShardingState, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.param_groups`` over the new shards, in place, through the optimizer's
    own ``add_param_group`` (its defaults for keys a group does not set; Muon re-plans its
    owners from the new groups)."""
    param_groups = optimizer.param_groups
    param_groups.clear()
    for group in state.groups.groups:
        optimizer.add_param_group({"params": state.shards_of_group(group.index), **group.options})
    shards = {id(shard) for storage in state.storages for shard in storage.shards}
    for stale in [p for p in optimizer.state if id(p) not in shards]:
        del optimizer.state[stale]
