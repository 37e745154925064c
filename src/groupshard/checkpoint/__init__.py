"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), loadable at any scale.

Each rank writes only its own slices: every original parameter (and every
per-element optimizer state of it) is saved as a 1-D tensor under its own name, of
which a rank holds the contiguous piece its shards contain (a ``ShardedTensor``
whose metadata comes from the layout, no communication). DCP matches saved pieces
to the pieces the loading ranks hold, so a checkpoint loads at another world size,
with another unit choice or strategy. Names, shapes, group structure and
hyperparameters go to a JSON file beside the tensors: loading compares it with the
model and optimizer first, and nothing is unpickled.

Saving is atomic: everything is written to a temporary directory that replaces
``path`` only once complete, so a crash leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from groupshard import comm, flatstate
from groupshard.api import ShardedModule
from groupshard.flat import ShardSegments, segments_of
from groupshard.statedict import check_optimizer, plain_optimizer_state

META_FILE = "groupshard.json"
FORMAT = "groupshard-checkpoint-1"

__all__ = ["load", "read_extra", "save", "to_torch_save"]


# --- JSON for hyperparameters and extras (no pickle) ------------------------------


def _encode(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"Cannot store a {type(value).__name__} in a checkpoint; use tensors, numbers, "
        "strings, None, and lists, tuples or dicts of them"
    )


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {_decode(k): _decode(v) for k, v in value["__dict__"]}
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    return value


# --- pieces of original parameters ----------------------------------------------------


def _pieces(flat: torch.Tensor, segments: ShardSegments) -> dict[str, torch.Tensor]:
    """Each original parameter's piece of a shard-shaped tensor, as a 1-D tensor by FQN.

    Pieces are views of ``flat``, so DCP reads into and writes from it in place.
    """
    buffer = segments.buffer
    if not segments.needs_reduce:  # this rank holds everything: plain tensors
        return {slot.fqn: flat[slot.offset : slot.offset + slot.numel] for slot in buffer.params}
    ranks = segments.ranks
    placements: dict[str, list[ShardMetadata]] = {slot.fqn: [] for slot in buffer.params}
    device = flat.device.type
    for rank in range(buffer.world_size):
        global_rank = torch.distributed.get_global_rank(ranks.group, rank)
        for segment in buffer.segments(rank):
            placements[segment.fqn].append(
                ShardMetadata(
                    [segment.param_offset], [segment.numel], f"rank:{global_rank}/{device}"
                )
            )
    local = {s.fqn: s for s in segments.pieces}
    properties = TensorProperties(dtype=flat.dtype, requires_grad=False)
    pieces: dict[str, torch.Tensor] = {}
    for slot in buffer.params:
        metadata = ShardedTensorMetadata(placements[slot.fqn], torch.Size([slot.numel]), properties)
        shards = []
        if slot.fqn in local:
            segment = local[slot.fqn]
            shard_md = next(
                m for m in placements[slot.fqn] if m.shard_offsets == [segment.param_offset]
            )
            view = flat[segment.shard_offset : segment.shard_offset + segment.numel]
            shards.append(Shard(view, shard_md))
        pieces[slot.fqn] = ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, metadata, process_group=ranks.group
        )
    return pieces


def _model_entries(model: ShardedModule) -> dict[str, torch.Tensor]:
    entries: dict[str, torch.Tensor] = {}
    for storage in model.groupshard.storages:
        for shard in storage.shards:
            segments = segments_of(shard)
            assert segments is not None
            for fqn, piece in _pieces(shard.data, segments).items():
                entries[f"model.{fqn}"] = piece
    for name, buffer in model.named_buffers():
        entries[f"buffers.{name}"] = buffer
    return entries


def _model_meta(model: ShardedModule) -> dict[str, Any]:
    state = model.groupshard
    params = {}
    for storage in state.storages:
        for buffer in storage.layout.buffers:
            for slot in buffer.params:
                aliases = [f"{m}.{a}" if m else a for m, a in state.plan.registrations[slot.fqn]]
                params[slot.fqn] = {
                    "shape": list(slot.shape),
                    "dtype": str(storage.layout.dtype).removeprefix("torch."),
                    "aliases": aliases,
                }
    buffers = {
        name: {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
        for name, b in model.named_buffers()
    }
    return {"params": params, "buffers": buffers, "frozen": list(state.groups.frozen)}


def _optim_entries(
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Tensors of the optimizer state by name, and the description of every state key."""
    entries: dict[str, torch.Tensor] = {}
    described: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for shard in group["params"]:
            segments = segments_of(shard)
            assert segments is not None
            for key, value in optimizer.state.get(shard, {}).items():
                if flatstate.is_per_element(value, shard):
                    for fqn, piece in _pieces(value, segments).items():
                        entries[f"optim.{fqn}.{key}"] = piece
                    kind = {"kind": "per_element", "dtype": str(value.dtype)}
                elif isinstance(value, torch.Tensor):
                    for fqn in segments.fqns:
                        entries[f"optim.{fqn}.{key}"] = value
                    kind = {"kind": "tensor", "shape": list(value.shape), "dtype": str(value.dtype)}
                else:
                    kind = {"kind": "value", "value": _encode(value)}
                for fqn in segments.fqns:
                    described.setdefault(fqn, {})[key] = kind
    return entries, described


def _groups_meta(model: ShardedModule, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        {
            "params": list(resolved.listed),
            "hyperparameters": _encode({k: v for k, v in group.items() if k != "params"}),
        }
        for group, resolved in zip(
            optimizer.param_groups, model.groupshard.groups.groups, strict=True
        )
    ]


def _dcp_kwargs(ranks: comm.Ranks) -> dict[str, Any]:
    return {"no_dist": True} if ranks.group is None else {"process_group": ranks.group}


def save(
    path: str | os.PathLike,
    model: ShardedModule,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``) to the directory ``path``.

    Collective: call on every rank. Args:
        path: a directory (shared by all ranks); replaced atomically when complete.
        model: a model returned by ``gs.shard``.
        optimizer: an optimizer over ``model.optimizer_groups()`` (or None).
        extra: tensors and plain values (numbers, strings, lists...) to store too,
            e.g. the step count or RNG states; ``load`` returns them.
    """
    if not isinstance(model, ShardedModule):
        raise TypeError(f"save expects a model returned by gs.shard, got {type(model).__name__}")
    ranks = model.groupshard.ranks
    path = Path(path)
    entries = _model_entries(model)
    meta: dict[str, Any] = {"format": FORMAT, "world_size": ranks.size, **_model_meta(model)}
    if optimizer is not None:
        check_optimizer(model, optimizer)
        optim_entries, meta["optim_state"] = _optim_entries(optimizer)
        entries.update(optim_entries)
        meta["groups"] = _groups_meta(model, optimizer)
    meta["extra"], meta["extra_tensors"] = {}, {}
    for name, value in (extra or {}).items():
        if isinstance(value, torch.Tensor):
            entries[f"extra.{name}"] = value
            meta["extra_tensors"][name] = {"shape": list(value.shape), "dtype": str(value.dtype)}
        else:
            meta["extra"][name] = _encode(value)
    temporary = path.with_name(f"{path.name}.tmp-{comm.gather_objects(uuid.uuid4().hex, ranks)[0]}")
    try:
        dcp.save(entries, checkpoint_id=temporary, **_dcp_kwargs(ranks))
        if ranks.rank == 0:
            (temporary / META_FILE).write_text(json.dumps(meta, indent=1))
        comm.gather_objects(None, ranks)  # every rank has finished writing
        if ranks.rank == 0:
            _replace(temporary, path)
    except BaseException as error:
        if ranks.rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(error, dcp.CheckpointException):  # a BaseException: make it catchable
            raise RuntimeError(
                f"Saving the checkpoint {str(path)!r} failed on some rank; the previous "
                f"checkpoint there (if any) is intact. {error}"
            ) from error
        raise
    comm.gather_objects(None, ranks)  # the checkpoint is in place before anyone goes on


def _replace(temporary: Path, path: Path) -> None:
    """Put the finished checkpoint at ``path``; the old one is removed only afterwards."""
    if path.exists():
        previous = path.with_name(f"{path.name}.old-{uuid.uuid4().hex}")
        os.replace(path, previous)
        os.replace(temporary, path)
        shutil.rmtree(previous, ignore_errors=True)
    else:
        os.replace(temporary, path)


def _resolve(path: Path) -> Path:
    """``path``, or the previous checkpoint if a save was cut between its two renames."""
    if (path / META_FILE).exists():
        return path
    previous = sorted(path.parent.glob(f"{path.name}.old-*"))
    if previous and (previous[-1] / META_FILE).exists():
        return previous[-1]
    raise FileNotFoundError(f"No groupshard checkpoint at {str(path)!r} (no {META_FILE})")


def _read_meta(path: Path) -> dict[str, Any]:
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{str(path)!r} is not a {FORMAT} checkpoint (format {meta.get('format')!r})"
        )
    return meta


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    """The plain-value ``extra`` a checkpoint was saved with, from its metadata alone
    (cheap: no tensors are read; tensors given as extra are left out)."""
    meta = _read_meta(_resolve(Path(path)))
    return {k: _decode(v) for k, v in meta["extra"].items()}


def _differences(kind: str, expected: list[str], found: list[str]) -> list[str]:
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    out = []
    if missing:
        out.append(f"{len(missing)} {kind} missing from the checkpoint: {missing[:8]}")
    if unexpected:
        out.append(f"{len(unexpected)} unexpected {kind} in the checkpoint: {unexpected[:8]}")
    return out


def _check_model(model: ShardedModule, meta: dict[str, Any]) -> None:
    ours = _model_meta(model)
    problems = _differences("parameters", list(ours["params"]), list(meta["params"]))
    problems += _differences("buffers", list(ours["buffers"]), list(meta["buffers"]))
    for name, entry in ours["params"].items():
        saved = meta["params"].get(name)
        if saved and saved["shape"] != entry["shape"]:
            problems.append(f"parameter {name!r} has shape {saved['shape']} in the checkpoint "
                            f"but {entry['shape']} in the model")  # fmt: skip
    if problems:
        raise ValueError("The checkpoint does not match the model: " + "; ".join(problems))


def _check_groups(model: ShardedModule, meta: dict[str, Any]) -> None:
    if "groups" not in meta:
        raise ValueError("The checkpoint has no optimizer state; load it without an optimizer")
    ours = [list(g.listed) for g in model.groupshard.groups.groups]
    saved = [g["params"] for g in meta["groups"]]
    if len(ours) != len(saved):
        raise ValueError(
            f"The checkpoint has {len(saved)} param groups but the optimizer has {len(ours)}"
        )
    for index, (mine, theirs) in enumerate(zip(ours, saved, strict=True)):
        problems = _differences("parameters", mine, theirs)
        if problems:
            raise ValueError(f"Param group {index} differs: " + "; ".join(problems))


def _optim_destinations(
    optimizer: torch.optim.Optimizer, meta: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, dict[str, Any]]]]:
    """Tensors for DCP to fill, and per shard the state they will become."""
    entries: dict[str, torch.Tensor] = {}
    states = []
    for group in optimizer.param_groups:
        for shard in group["params"]:
            segments = segments_of(shard)
            assert segments is not None
            described = meta["optim_state"].get(segments.fqns[0], {})
            state: dict[str, Any] = {}
            for key, kind in described.items():
                if kind["kind"] == "per_element":
                    state[key] = torch.zeros_like(
                        shard, dtype=getattr(torch, kind["dtype"].removeprefix("torch."))
                    )
                    for fqn, piece in _pieces(state[key], segments).items():
                        entries[f"optim.{fqn}.{key}"] = piece
                elif kind["kind"] == "tensor":
                    dtype = getattr(torch, kind["dtype"].removeprefix("torch."))
                    state[key] = torch.zeros(kind["shape"], dtype=dtype)
                    entries[f"optim.{segments.fqns[0]}.{key}"] = state[key]
                else:
                    state[key] = _decode(kind["value"])
            states.append((shard, state))
    return entries, states


def load(
    path: str | os.PathLike,
    model: ShardedModule,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by ``save`` (at any world size) into ``model`` and ``optimizer``.

    Collective. Checks names, shapes and group structure first and raises a
    ValueError listing what differs. Returns the ``extra`` given to ``save``.
    """
    if not isinstance(model, ShardedModule):
        raise TypeError(f"load expects a model returned by gs.shard, got {type(model).__name__}")
    ranks = model.groupshard.ranks
    path = _resolve(Path(path))
    meta = _read_meta(path)
    _check_model(model, meta)
    entries = _model_entries(model)
    states: list[tuple[torch.Tensor, dict[str, Any]]] = []
    if optimizer is not None:
        check_optimizer(model, optimizer)
        _check_groups(model, meta)
        optim_entries, states = _optim_destinations(optimizer, meta)
        entries.update(optim_entries)
    extra_tensors = {
        name: torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"].removeprefix("torch.")))
        for name, spec in meta["extra_tensors"].items()
    }
    entries.update({f"extra.{name}": t for name, t in extra_tensors.items()})
    with torch.no_grad():
        dcp.load(entries, checkpoint_id=path, **_dcp_kwargs(ranks))
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, meta["groups"], strict=True):
            group.update(_decode(saved["hyperparameters"]))
        for shard, state in states:
            optimizer.state.pop(shard, None)
            if state:
                optimizer.state[shard] = state
    return {**{k: _decode(v) for k, v in meta["extra"].items()}, **extra_tensors}


def to_torch_save(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Convert a checkpoint offline (one process) into one plain ``torch.save`` file.

    The file holds ``{"model": state dict of the unsharded model, "optim": plain
    torch.optim state dict (if saved), "extra": ...}`` and loads with
    ``torch.load(output, weights_only=True)``.
    """
    path = _resolve(Path(path))
    meta = _read_meta(path)
    storage = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {
        name: torch.empty(md.size, dtype=md.properties.dtype)
        for name, md in storage.items()
        if hasattr(md, "size")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=path, no_dist=True)
    model_state = {}
    for fqn, spec in meta["params"].items():
        value = tensors[f"model.{fqn}"].view(spec["shape"])
        for alias in spec["aliases"]:
            model_state[alias] = value
    for name in meta["buffers"]:
        model_state[name] = tensors[f"buffers.{name}"]
    result: dict[str, Any] = {"model": model_state}
    if "groups" in meta:
        result["optim"] = _plain_optim(meta, tensors)
    result["extra"] = {
        **{k: _decode(v) for k, v in meta["extra"].items()},
        **{name: tensors[f"extra.{name}"] for name in meta["extra_tensors"]},
    }
    torch.save(result, output)


def _plain_optim(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    per_fqn: dict[str, dict[str, Any]] = {}
    for fqn, described in meta["optim_state"].items():
        entry = per_fqn.setdefault(fqn, {})
        for key, kind in described.items():
            if kind["kind"] == "per_element":
                entry[key] = tensors[f"optim.{fqn}.{key}"].view(meta["params"][fqn]["shape"])
            elif kind["kind"] == "tensor":
                entry[key] = tensors[f"optim.{fqn}.{key}"]
            else:
                entry[key] = _decode(kind["value"])
    groups = [(g["params"], _decode(g["hyperparameters"])) for g in meta["groups"]]
    return plain_optimizer_state(groups, per_fqn)
