"""Parse and validate torch.optim-style parameter groups against a model.

Pure: no communication. A *resolved* group is the user's group with its tensors
replaced by fully qualified names (FQNs), so everything downstream is keyed by the
names of the unsharded model.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

NORM_MODULES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._NormBase,
)

ParamGroups = Iterable[torch.Tensor] | Iterable[Mapping[str, Any]]


@dataclass(frozen=True)
class ResolvedGroup:
    """One user group: its trainable parameters by FQN, in the user's order."""

    index: int
    fqns: tuple[str, ...]
    options: Mapping[str, Any]  # every key of the user's dict but "params"
    listed: tuple[str, ...] = ()  # every parameter the user listed, frozen ones included


@dataclass(frozen=True)
class ResolvedGroups:
    """Every trainable parameter in exactly one group; frozen ones kept apart."""

    groups: tuple[ResolvedGroup, ...]
    frozen: tuple[str, ...]

    def group_of(self) -> dict[str, int]:
        """Map each trainable FQN to its group index."""
        return {fqn: group.index for group in self.groups for fqn in group.fqns}


def check_parameter_kinds(model: nn.Module) -> None:
    """Reject parameters that cannot be flattened: sparse or not floating point."""
    for name, param in model.named_parameters():
        if param.is_sparse or param.layout != torch.strided:
            raise ValueError(
                f"Parameter {name!r} has layout {param.layout}; groupshard flattens dense "
                "(strided) parameters only. Make it dense or keep it out of the sharded model."
            )
        if not param.is_floating_point():
            raise ValueError(
                f"Parameter {name!r} has dtype {param.dtype}; groupshard shards floating-point "
                "parameters only. Register it as a buffer instead."
            )


def _group_dicts(
    param_groups: ParamGroups | None, params_by_name: Mapping[str, torch.Tensor]
) -> list[dict[str, Any]]:
    """Normalise the accepted input forms to a list of dicts, as torch.optim does."""
    if param_groups is None:
        return [{"params": [p for p in params_by_name.values() if p.requires_grad]}]
    if isinstance(param_groups, torch.Tensor):
        raise TypeError(
            "Expects param groups as an iterable of tensors or of dicts, but got a single "
            f"Tensor of shape {tuple(param_groups.shape)}; wrap it in a list."
        )
    if isinstance(param_groups, Mapping):
        raise TypeError(
            "Expects param groups as a list of dicts, but got one dict; wrap it in a list."
        )
    entries = list(param_groups)
    if not entries:
        raise ValueError("Expects at least one param group, but got an empty list.")
    if all(isinstance(entry, Mapping) for entry in entries):
        return [dict(entry) for entry in entries]
    if any(isinstance(entry, Mapping) for entry in entries):
        raise TypeError("Expects param groups to be all tensors or all dicts, not a mix of both.")
    return [{"params": entries}]


def _group_tensors(index: int, group: dict[str, Any]) -> list[Any]:
    if "params" not in group:
        raise ValueError(f"Param group {index} has no 'params' key; every group needs one.")
    params = group["params"]
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, (set, frozenset)):
        raise TypeError(
            f"Param group {index}: 'params' is a set, whose order changes between runs; "
            "use a list so every rank sees the same order."
        )
    return list(params)


def list_group_members(
    params_by_name: Mapping[str, torch.Tensor],
    param_groups: ParamGroups | None,
    not_a_parameter: str = "build the groups from this model before sharding it",
) -> list[tuple[list[str], dict[str, Any]]]:
    """Each group's listed parameters by FQN (matched by identity in ``params_by_name``)
    and its hyperparameters; a ValueError or TypeError names a tensor that is not one of
    them (``not_a_parameter``: what to do instead), or a parameter listed twice."""
    names = {id(param): name for name, param in params_by_name.items()}
    owner: dict[str, int] = {}
    members: list[tuple[list[str], dict[str, Any]]] = []
    for index, group in enumerate(_group_dicts(param_groups, params_by_name)):
        listed = []
        for position, tensor in enumerate(_group_tensors(index, group)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"Param group {index}, params[{position}]: expects a Tensor but got "
                    f"{type(tensor).__name__}."
                )
            fqn = names.get(id(tensor))
            if fqn is None:
                raise ValueError(
                    f"Param group {index}, params[{position}]: a tensor of shape "
                    f"{tuple(tensor.shape)} is not a parameter of the model (parameters are "
                    f"matched by identity; {not_a_parameter})."
                )
            if fqn in owner:
                where = (
                    "twice in that group" if owner[fqn] == index else f"also in group {owner[fqn]}"
                )
                raise ValueError(
                    f"Parameter {fqn!r} is in param group {index} and {where}; "
                    "each parameter must be in exactly one group."
                )
            owner[fqn] = index
            listed.append(fqn)
        options = {key: value for key, value in group.items() if key != "params"}
        members.append((listed, options))
    return members


def resolve_groups(
    model: nn.Module,
    param_groups: ParamGroups | None,
    default_group: Mapping[str, Any] | None = None,
) -> ResolvedGroups:
    """Match the user's groups to the model's parameters and validate them.

    Args:
        model: the unsharded module whose parameters the groups name.
        param_groups: tensors, or dicts with "params" plus hyperparameters (as
            ``torch.optim`` accepts, ``optimizer.param_groups`` included); ``None``
            puts every trainable parameter in one group.
        default_group: hyperparameters of an extra last group that collects the
            trainable parameters no group names; ``None`` makes leaving one out an error.
    """
    check_parameter_kinds(model)
    params_by_name = dict(model.named_parameters())
    groups: list[ResolvedGroup] = []
    for index, (listed, options) in enumerate(list_group_members(params_by_name, param_groups)):
        fqns = tuple(fqn for fqn in listed if params_by_name[fqn].requires_grad)
        groups.append(ResolvedGroup(index, fqns, options, tuple(listed)))
    owned = {fqn for group in groups for fqn in group.listed}
    missing = [n for n, p in params_by_name.items() if p.requires_grad and n not in owned]
    if missing and default_group is None:
        shown = ", ".join(repr(n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(
            f"{len(missing)} trainable parameter(s) are in no param group: {shown}. Add them to "
            "a group, freeze them (requires_grad_(False)), or pass default_group={...}."
        )
    if missing:
        extra = ResolvedGroup(
            len(groups), tuple(missing), dict(default_group or {}), tuple(missing)
        )
        groups.append(extra)
    frozen = tuple(n for n, p in params_by_name.items() if not p.requires_grad)
    return ResolvedGroups(tuple(groups), frozen)


def owning_modules(model: nn.Module) -> dict[int, nn.Module]:
    """``id(parameter) -> the module that registers it`` (first one for tied parameters)."""
    owners: dict[int, nn.Module] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), module)
    return owners


def decay_groups(
    model: nn.Module,
    weight_decay: float,
    decay_embeddings: bool = True,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    """The usual preset: weight decay on matrices, none on biases and norm weights.

    Args:
        model: the unsharded module.
        weight_decay: the decay of the first group; the second group gets 0.0.
        decay_embeddings: whether ``nn.Embedding`` weights are decayed.
        verbose: print how many tensors and elements each group got (as nanoGPT).

    Returns:
        ``[{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]``
        over the trainable parameters, ready for ``gs.shard`` or ``torch.optim``.
    """
    owners = owning_modules(model)

    def decay_key(name: str, param: torch.Tensor) -> str:
        module = owners[id(param)]
        if param.ndim < 2 or isinstance(module, NORM_MODULES):
            return "no_decay"
        if isinstance(module, nn.Embedding) and not decay_embeddings:
            return "no_decay"
        return "decay"

    return groups_by(
        model,
        decay_key,
        {"decay": {"weight_decay": weight_decay}, "no_decay": {"weight_decay": 0.0}},
        verbose=verbose,
    )


def groups_by(
    model: nn.Module,
    rule: Callable[[str, nn.Parameter], Hashable],
    options: Mapping[Hashable, Mapping[str, Any]] | None = None,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    """Group trainable parameters by ``rule(name, param)``, a key per group.

    Args:
        model: the unsharded module.
        rule: maps each trainable parameter to a hashable key.
        options: hyperparameters per key; its order is the group order (keys with
            no parameters give empty groups). ``None``: groups in order of first
            appearance, without hyperparameters.
        verbose: print a line per group.
    """
    keyed: dict[Hashable, list[nn.Parameter]] = {key: [] for key in (options or {})}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        key = rule(name, param)
        if options is not None and key not in options:
            raise ValueError(
                f"Rule put parameter {name!r} under key {key!r}, which has no entry in options "
                f"(keys: {list(options)})."
            )
        keyed.setdefault(key, []).append(param)
    groups = [{"params": params, **(options or {}).get(key, {})} for key, params in keyed.items()]
    if verbose:
        for key, group in zip(keyed, groups, strict=True):
            numel = sum(p.numel() for p in group["params"])
            hyper = {k: v for k, v in group.items() if k != "params"}
            print(f"group {key!r}: {len(group['params'])} tensors, {numel:,} parameters, {hyper}")
    return groups
