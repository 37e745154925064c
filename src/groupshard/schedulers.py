"""LR schedulers across ``gs.regroup``: carry each scheduler's per-group lists over a change
of param groups, as if the new groups had been there all along.

torch's schedulers keep one entry per param group, by position (``base_lrs``, ``_last_lr``,
``LambdaLR.lr_lambdas``, ``CyclicLR.max_lrs``...), made when they were built, and some keep
per-group keys in the groups themselves (``initial_lr``; ``OneCycleLR``'s ``max_lr`` and
``min_lr``). A regroup that adds, removes or reorders groups shifts those positions. This
module matches the new groups to the old ones by the parameters they hold, and plans, for
every scheduler, its lists in the new order: a group that stays keeps its entries and its
scheduled keys (its current learning rate included); a new group starts from its own
``lr`` as its base, with the entries every old group shares (the same lambda) or a
ValueError that says what to do. Pure: plans without changing anything, then applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.lr_scheduler import ChainedScheduler, LRScheduler, OneCycleLR, SequentialLR

# per-group lists a scheduler may keep, by position
_BASE = "base_lrs"
_LAST = "_last_lr"
_SHARED_LISTS = ("lr_lambdas", "min_lrs", "max_lrs", "base_momentums", "max_momentums")
# per-group keys schedulers keep in the groups themselves
_SCHEDULED_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum")

_REBUILD = (
    "rebuild the scheduler after gs.regroup instead (last_epoch= the steps so far, each "
    "group's 'initial_lr' in the dicts you pass), and pass schedulers=[] to gs.regroup"
)


def is_scheduled(optimizer: torch.optim.Optimizer) -> bool:
    """Whether an LR scheduler was built on ``optimizer`` (it wraps the optimizer's step)."""
    return hasattr(optimizer.step, "_wrapped_by_lr_sched")


def match_groups(
    old_members: Sequence[frozenset[str]], new_members: Sequence[frozenset[str]]
) -> list[int | None]:
    """For each new group, the old group it continues (the one, and only one, whose
    parameters it shares, sharing them with no other new group), or None for a new one.
    A new group that merges old groups, or an old group split over new ones, is refused."""
    matched: list[int | None] = []
    for index, members in enumerate(new_members):
        sources = [old for old, before in enumerate(old_members) if before & members]
        if len(sources) > 1:
            raise ValueError(
                f"New param group {index} takes parameters from the old groups {sources}: a "
                f"scheduler keeps one learning rate per group, so it cannot follow a merge; "
                f"{_REBUILD}."
            )
        if sources:
            source = old_members[sources[0]]
            heirs = [new for new, after in enumerate(new_members) if after & source]
            if len(heirs) > 1:
                raise ValueError(
                    f"The parameters of param group {sources[0]} went to the new groups {heirs}: "
                    f"a scheduler keeps one learning rate per group, so it cannot follow a "
                    f"split; {_REBUILD}."
                )
        matched.append(sources[0] if sources else None)
    return matched


def _flatten(schedulers: Sequence[Any]) -> list[LRScheduler]:
    """The schedulers and those inside ``SequentialLR`` and ``ChainedScheduler``."""
    flat: list[LRScheduler] = []
    for scheduler in schedulers:
        if not isinstance(scheduler, LRScheduler):
            raise TypeError(
                f"schedulers= takes torch.optim.lr_scheduler schedulers, got "
                f"{type(scheduler).__name__}"
            )
        flat.append(scheduler)
        if isinstance(scheduler, (SequentialLR, ChainedScheduler)):
            flat += _flatten(scheduler._schedulers)
    return flat


def _same(value: Any, first: Any) -> bool:
    if isinstance(value, float) and isinstance(first, float):  # ratios of learning rates
        return math.isclose(value, first, rel_tol=1e-9)
    return value is first or value == first


def _shared(values: list[Any], what: str) -> Any:
    """The value every old group has (one lambda for all groups, one ratio...)."""
    first = values[0]
    if all(_same(value, first) for value in values[1:]):
        return first
    raise ValueError(
        f"The scheduler's {what} differs between the old param groups, so a new group's is "
        f"unknown; {_REBUILD}."
    )


def _starting_lr(group: dict[str, Any]) -> float:
    return group["initial_lr"]


def _current_lr(group: dict[str, Any]) -> float:
    return group["lr"]


# a new group's entry in these lists comes from the group itself, once it is in place
_FROM_GROUP: dict[str, Callable[[dict[str, Any]], float]] = {
    _BASE: _starting_lr,
    _LAST: _current_lr,
}


@dataclass
class SchedulerPlan:
    """What ``apply`` does once the new param groups are in the optimizer."""

    matched: list[int | None]
    kept_keys: list[dict[str, Any]]  # per new group: the scheduled keys it keeps
    new_keys: dict[int, dict[str, Any]]  # per new group index: keys it starts with
    lists: list[tuple[LRScheduler, dict[str, list[Any]]]] = field(default_factory=list)

    def apply(self, param_groups: list[dict[str, Any]]) -> None:
        """Set the scheduled keys in the new groups and the schedulers' lists."""
        for index, group in enumerate(param_groups):
            group.update(self.kept_keys[index])
            if self.matched[index] is None:
                group.update(self.new_keys.get(index, {}))
                group.setdefault("initial_lr", group["lr"])
        for scheduler, lists in self.lists:
            for name, values in lists.items():
                from_group = _FROM_GROUP.get(name)
                setattr(scheduler, name, [
                    value(param_groups[index]) if from_group and value is from_group else value
                    for index, value in enumerate(values)
                ])  # fmt: skip


def plan_schedulers(
    schedulers: Sequence[Any],
    optimizer: torch.optim.Optimizer,
    old_members: Sequence[frozenset[str]],
    new_members: Sequence[frozenset[str]],
    new_options: Sequence[dict[str, Any]],
) -> SchedulerPlan:
    """Plan ``schedulers`` (built on ``optimizer``) over the new groups: raises, changing
    nothing, where one cannot carry over."""
    matched = match_groups(old_members, new_members)
    old_groups = optimizer.param_groups
    flat = _flatten(schedulers)
    for scheduler in flat:
        if scheduler.optimizer is not optimizer:
            raise ValueError(
                f"schedulers=: this {type(scheduler).__name__} steps another optimizer than "
                "the one passed to gs.regroup"
            )
    cycled = [s for s in flat if getattr(s, "cycle_momentum", False)]
    momentum_keys = ("betas",) if any(getattr(s, "use_beta1", False) for s in cycled) else ()
    momentum_keys += ("momentum",) if cycled and not momentum_keys else ()
    kept_keys = [
        {k: old_groups[old][k] for k in (*_SCHEDULED_KEYS, *momentum_keys) if k in old_groups[old]}
        if old is not None else {}
        for old in matched
    ]  # fmt: skip
    new_keys: dict[int, dict[str, Any]] = {}
    for scheduler in flat:
        if isinstance(scheduler, OneCycleLR):
            _plan_one_cycle(old_groups, matched, new_options, new_keys)
    plan = SchedulerPlan(matched, kept_keys, new_keys)
    for scheduler in flat:
        lists: dict[str, list[Any]] = {}
        for name in (_BASE, _LAST, *_SHARED_LISTS):
            old = getattr(scheduler, name, None)
            if not isinstance(old, list) or len(old) != len(old_groups):
                continue
            if name in _FROM_GROUP:  # a new group's base and last learning rates
                fresh: Any = _FROM_GROUP[name]
            elif None in matched:
                fresh = _shared(old, f"{type(scheduler).__name__}.{name}")
            else:
                fresh = None
            lists[name] = [old[index] if index is not None else fresh for index in matched]
        plan.lists.append((scheduler, lists))
    return plan


def _plan_one_cycle(
    old_groups: list[dict[str, Any]],
    matched: list[int | None],
    new_options: Sequence[dict[str, Any]],
    new_keys: dict[int, dict[str, Any]],
) -> None:
    """A new group under OneCycleLR: its ``max_lr`` (the dict's, else its ``lr``), its
    ``initial_lr`` and ``min_lr`` by the ratios every old group shares, its momenta too."""
    start = _shared([g["max_lr"] / g["initial_lr"] for g in old_groups], "OneCycleLR div_factor")
    end = _shared([g["initial_lr"] / g["min_lr"] for g in old_groups], "final_div_factor")
    momenta = {
        key: _shared([g[key] for g in old_groups], f"OneCycleLR {key}")
        for key in ("max_momentum", "base_momentum") if key in old_groups[0]
    }  # fmt: skip
    for index, old in enumerate(matched):
        if old is None:
            options = new_options[index]
            if "max_lr" not in options and "lr" not in options:
                raise ValueError(
                    f"New param group {index} under OneCycleLR needs its 'max_lr' (or 'lr') "
                    "in the dict passed to gs.regroup"
                )
            peak = options.get("max_lr", options.get("lr"))
            keys = {"max_lr": peak, "initial_lr": peak / start, "min_lr": peak / start / end}
            new_keys[index] = {**keys, **momenta}
