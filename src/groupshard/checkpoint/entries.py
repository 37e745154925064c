"""Checkpoint entries by the names torch's idiom gives them, and reading them back from any
folder written with that idiom.

``dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, o)})``
writes ``model.<name>``, ``optim.state.<fqn>.<key>`` and the param groups as
``optim.param_groups.<index>.<hyperparameter>`` with ``optim.param_groups.<index>.params``
(the parameters' names); with ``flatten_optimizer_state_dict=True`` (torchtitan's choice)
the groups are ``param_groups.<fqn>.<hyperparameter>`` instead. A groupshard checkpoint
holds both forms of the groups, so either idiom loads it; the per-parameter names are
aliases of the numbered entries in DCP's metadata (the same bytes), not entries written.

Folders written by others are read by their entry names (:class:`Prefixes`): torch's
recipe (``model.`` / ``optim.``) and torchtitan's (the model's names bare, the optimizer
under ``optimizer.``). What a parameter's optimizer state is (its keys, shapes, dtypes)
comes from the folder's DCP metadata, so a folder needs no description of groupshard's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from groupshard.checkpoint.pieces import Entry, Holder, Saved
from groupshard.checkpoint.planner import Piece

MODEL = "model."
OPTIM = "optim."
STATE = "state."
GROUPS = "param_groups."
EXTRA = "extra."
TITAN_OPTIM = "optimizer."  # torchtitan's optimizer entries (its model's names are bare)
# what else trainers keep in a DCP folder beside the model (torchtitan: bare model names)
_NOT_MODEL = (OPTIM, TITAN_OPTIM, "lr_scheduler.", "train_state.", "dataloader.", EXTRA)


def dcp_value(entry: Entry) -> Any:
    return entry.dcp_value() if isinstance(entry, Piece) else entry


def model_entries(holder: Holder, loading: bool) -> tuple[dict[str, Piece], Any]:
    entries, after = holder.model_entries(loading)
    return {MODEL + name: piece for name, piece in entries.items()}, after


def optimizer_entries(
    holder: Holder, prefix: str = OPTIM
) -> tuple[dict[str, Entry], dict[str, str]]:
    """The optimizer's entries this rank offers (its state, and each group's
    hyperparameters) and the aliases of :func:`group_entries`."""
    found: dict[str, Entry] = {}
    for fqn, state in holder.optimizer_entries().items():
        for key, entry in state.items():
            found[f"{prefix}{STATE}{fqn}.{key}"] = entry
    groups, aliases = group_entries(holder.listed_groups(), holder.hyperparameters(), prefix)
    found.update(groups)
    return found, aliases


def group_entries(
    listed: Sequence[Sequence[str]], hyperparameters: Sequence[Mapping[str, Any]], prefix: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The param groups in both forms torch's idiom writes: numbered
    (``param_groups.<index>.<key>`` and ``.params``, the parameters' names) as entries,
    and per parameter (``param_groups.<fqn>.<key>``) as aliases, name to numbered name,
    that the writer records as the same bytes (``folders.FileWriter``). The per-parameter
    form is about a thousand tiny entries, each costing DCP's planner and writer a fixed
    amount; an alias costs a line in the metadata. A tensor value has an entry per
    parameter (its chunks are no bytes to point at)."""
    found: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for index, (names, values) in enumerate(zip(listed, hyperparameters, strict=True)):
        for key, value in values.items():
            numbered = f"{prefix}{GROUPS}{index}.{key}"
            found[numbered] = value
            for fqn in names:
                if isinstance(value, torch.Tensor):
                    found[f"{prefix}{GROUPS}{fqn}.{key}"] = value
                else:
                    aliases[f"{prefix}{GROUPS}{fqn}.{key}"] = numbered
        found[f"{prefix}{GROUPS}{index}.params"] = list(names)
    return found, aliases


@dataclass(frozen=True)
class Prefixes:
    """Where a folder keeps the model's and the optimizer's entries."""

    model: str
    optim: str | None  # None: the folder holds no optimizer state


def find_prefixes(storage: Metadata, holder: Holder) -> Prefixes:
    """The prefixes a folder's entries use, found from the model's parameter names: torch's
    recipe keeps the model under ``model.``, torchtitan bare."""
    names = storage.state_dict_metadata
    aliases = [alias for _, _, found in holder.param_shapes().values() for alias in found]
    bare = not any(MODEL + a in names for a in aliases) and any(a in names for a in aliases)
    model = "" if bare else MODEL
    optim = None
    for candidate in (OPTIM, TITAN_OPTIM):
        if any(
            name.startswith(candidate + STATE) or name.startswith(candidate + GROUPS)
            for name in names
        ):
            optim = candidate
            break
    return Prefixes(model, optim)


def model_problems(storage: Metadata, holder: Holder, prefix: str) -> list[str]:
    """How the folder's model entries differ from the model's (empty if they match)."""
    names = storage.state_dict_metadata
    problems: list[str] = []
    missing, shapes = [], []
    ours: set[str] = set()
    for fqn, (shape, _, aliases) in holder.param_shapes().items():
        ours.update(aliases)
        present = [a for a in aliases if prefix + a in names]
        if not present:
            missing.append(fqn)
            continue
        entry = names[prefix + present[0]]
        saved = getattr(entry, "size", None)
        if saved != shape:
            shapes.append(
                f"parameter {fqn!r} has shape {list(saved) if saved is not None else 'none'} in "
                f"the checkpoint but {list(shape)} in the model"
            )
    buffers = holder.buffers()
    ours.update(buffers)
    missing_buffers = [name for name in buffers if prefix + name not in names]
    unexpected = [
        name[len(prefix) :]
        for name, entry in names.items()
        if name.startswith(prefix)
        and isinstance(entry, TensorStorageMetadata)
        and not (prefix == "" and name.startswith(_NOT_MODEL))
        and name[len(prefix) :] not in ours
    ]
    if missing:
        problems.append(f"{len(missing)} parameters missing from the checkpoint: {missing[:8]}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected parameters in the checkpoint: {sorted(unexpected)[:8]}"
        )
    if missing_buffers:
        problems.append(
            f"{len(missing_buffers)} buffers missing from the checkpoint: {missing_buffers[:8]}"
        )
    return problems + shapes


def model_destinations(
    holder: Holder, storage: Metadata, prefix: str
) -> tuple[dict[str, Piece], Any]:
    """Where each parameter (under the first of its names the folder holds) and buffer is
    read to, and what to run once read."""
    names = storage.state_dict_metadata
    pieces, after = holder.param_pieces(loading=True)
    found: dict[str, Piece] = {}
    for fqn, (_, _, aliases) in holder.param_shapes().items():
        present = next(a for a in aliases if prefix + a in names)
        found[prefix + present] = pieces[fqn]
    found.update({prefix + name: Piece.whole(b) for name, b in holder.buffers().items()})
    return found, after


def longest_first(names: Iterable[str]) -> list[str]:
    """Parameter names, longest first: ``split_name`` then finds ``a.b`` before ``a``."""
    return sorted(set(names), key=len, reverse=True)


def split_name(rest: str, fqns: Sequence[str]) -> tuple[str, str] | None:
    """``<fqn>.<key>`` split at the first of ``fqns`` (``longest_first``) it starts with."""
    fqn = next((f for f in fqns if rest.startswith(f + ".")), None)
    return None if fqn is None else (fqn, rest[len(fqn) + 1 :])


def saved_optimizer_state(
    storage: Metadata, prefix: str, fqns: Sequence[str]
) -> dict[str, dict[str, Saved]]:
    """What the folder holds of each parameter's optimizer state, per key."""
    found: dict[str, dict[str, Saved]] = {fqn: {} for fqn in fqns}
    start = prefix + STATE
    ordered = longest_first(fqns)
    for name, entry in storage.state_dict_metadata.items():
        split = split_name(name[len(start) :], ordered) if name.startswith(start) else None
        if split is None:
            continue
        fqn, key = split
        if isinstance(entry, TensorStorageMetadata):
            found[fqn][key] = Saved(entry.size, entry.properties.dtype)
        elif isinstance(entry, BytesStorageMetadata):
            found[fqn][key] = Saved()
    return {fqn: state for fqn, state in found.items() if state}


def group_destinations(storage: Metadata, prefix: str) -> dict[str, Entry]:
    """Slots for the folder's param-group entries (plain values, or whole tensors): those of
    the numbered form where the folder has it (a few per group), else every parameter's."""
    start = prefix + GROUPS
    names = storage.state_dict_metadata
    numbered = any(n.startswith(start) and n.endswith(".params") for n in names)

    def wanted(name: str) -> bool:
        if not name.startswith(start):
            return False
        index, _, key = name[len(start) :].partition(".")
        return not numbered or (index.isdigit() and "." not in key)

    found: dict[str, Entry] = {}
    for name, entry in names.items():
        if wanted(name):
            if isinstance(entry, TensorStorageMetadata):
                found[name] = Piece.whole(torch.zeros(entry.size, dtype=entry.properties.dtype))
            else:
                found[name] = None
    return found


def read_value(entry: Entry, read: Mapping[str, Any], name: str) -> Any:
    """A value after reading: a piece's tensor, or the plain value DCP decoded."""
    return entry.data if isinstance(entry, Piece) else read[name]


def saved_hyperparameters(
    listed: Sequence[Sequence[str]], values: Mapping[str, Any], prefix: str
) -> list[dict[str, Any]]:
    """Each of the optimizer's groups' hyperparameters from the folder's param-group
    entries (``values``: by name, read), in either form. A group whose parameters the
    folder keeps with different hyperparameters is a ValueError naming them."""
    start = prefix + GROUPS
    by_index: dict[str, dict[str, Any]] = {}
    by_fqn: dict[str, dict[str, Any]] = {}
    all_fqns = longest_first(f for names in listed for f in names)
    for name, value in values.items():
        rest = name[len(start) :]
        split = split_name(rest, all_fqns)
        if split is not None:
            by_fqn.setdefault(split[0], {})[split[1]] = value
            continue
        index, _, key = rest.partition(".")
        by_index.setdefault(index, {})[key] = value
    if not by_fqn:  # the nested form: find each parameter's group by the names listed
        for group in by_index.values():
            for fqn in group.get("params", []):
                if isinstance(fqn, str):
                    by_fqn[fqn] = {k: v for k, v in group.items() if k != "params"}
    result = []
    for index, names in enumerate(listed):
        found = [(fqn, by_fqn.get(fqn)) for fqn in names]
        absent = [fqn for fqn, values in found if values is None]
        if absent:
            raise ValueError(
                f"The checkpoint has no param-group hyperparameters for {absent[:4]} "
                f"(param group {index} of the optimizer)"
            )
        first_fqn, first = found[0] if found else ("", {})
        for fqn, values in found[1:]:
            if not _same(values, first):
                raise ValueError(
                    f"Param group {index} of the optimizer holds {first_fqn!r} and {fqn!r}, "
                    "which the checkpoint keeps in param groups with different "
                    "hyperparameters; build the optimizer with the checkpoint's groups"
                )
        result.append(dict(first or {}))
    return result


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b
