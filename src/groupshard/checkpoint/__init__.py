"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), loadable at any scale.

Each rank writes only its own slices: every original parameter (and every
per-element optimizer state of it) is saved as a 1-D tensor under its own name, of
which a rank holds the contiguous piece its shards contain (a ``ShardedTensor``
whose metadata comes from the layout, no communication). DCP matches saved pieces
to the pieces the loading ranks hold, so a checkpoint loads at another world size,
with another unit choice or strategy. Names, shapes, group structure and
hyperparameters go to a JSON file beside the tensors: loading compares it with the
model and optimizer first. Nothing a checkpoint holds is run: DCP's pickled
``.metadata`` is decoded by an unpickler that builds only DCP's metadata classes, and
tensors only by ``torch.load(weights_only=True)`` (see ``reader``); a damaged, missing
or crafted file is a :class:`CheckpointError` naming it, on every rank.

Saving is atomic: everything is written to a temporary directory that replaces
``path`` only once complete, so a crash leaves the previous checkpoint intact; a load
finds the newest complete checkpoint even among leftovers of interrupted saves (see
``folders``). Optimizer state is cast to its parameter's dtype on load, as torch's
``Optimizer.load_state_dict`` does.
"""

from __future__ import annotations

import math
import os
import shutil
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
from torch.distributed.checkpoint.metadata import Metadata

from groupshard import comm, flatstate
from groupshard.api import ShardedModule
from groupshard.checkpoint import folders, reader
from groupshard.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from groupshard.checkpoint.folders import FORMAT, META_FILE
from groupshard.flat import ShardSegments, note_parameters_written, segments_of
from groupshard.statedict import check_optimizer, plain_optimizer_state

__all__ = [
    "FORMAT",
    "META_FILE",
    "CheckpointError",
    "UnsafeCheckpointError",
    "exists",
    "load",
    "read_extra",
    "save",
    "to_torch_save",
]


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
            return torch.tensor(value["__tensor__"], dtype=_dtype(value["dtype"]))
    return value


def _dtype(name: Any) -> torch.dtype:
    """The torch dtype a description names (never any other attribute of torch)."""
    dtype = vars(torch).get(str(name).removeprefix("torch."))
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"The checkpoint's {META_FILE} names an unknown dtype {name!r}")
    return dtype


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
    # the save counter orders checkpoints and leftovers of interrupted saves (see folders)
    serial = folders.next_serial(path) if ranks.rank == 0 else 0
    meta["serial"] = serial
    temporary = comm.gather_objects(folders.temporary_name(path, serial), ranks)[0]
    try:
        dcp.save(entries, checkpoint_id=temporary, **_dcp_kwargs(ranks))
        if ranks.rank == 0:
            folders.write_meta(temporary, meta)
        comm.gather_objects(None, ranks)  # every rank has finished writing
        if ranks.rank == 0:
            folders.replace(temporary, path, serial)
    except BaseException as error:
        if ranks.rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(error, dcp.CheckpointException):  # a BaseException: make it catchable
            raise RuntimeError(
                f"Saving the checkpoint {str(path)!r} failed on some rank; the previous "
                f"checkpoint there (if any) is intact. {_first_failure(error)}"
            ) from None
        raise
    comm.gather_objects(None, ranks)  # the checkpoint is in place before anyone goes on


def _first_failure(error: dcp.CheckpointException) -> str:
    """The first rank's failure inside DCP's exception, in one line (not its tracebacks)."""
    rank, wrapped = min(error.failures.items(), key=lambda item: item[0])
    cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return f"Rank {rank}: {reader.short(cause)}"


def _load_error(error: dcp.CheckpointException, folder: Path) -> CheckpointError:
    """One clear error for a failed DCP load: the first rank's own CheckpointError (which
    names the file) if it raised one."""
    for _, wrapped in sorted(error.failures.items(), key=lambda item: item[0]):
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(cause, CheckpointError):
            return type(cause)(str(cause))
    return CheckpointError(f"Loading the checkpoint {folder} failed. {_first_failure(error)}")


def exists(path: str | os.PathLike) -> bool:
    """Whether ``load`` finds a complete checkpoint at ``path`` (or, after an interrupted
    save, among the folders it left beside ``path``)."""
    try:
        folders.newest(Path(path))
    except FileNotFoundError:
        return False
    return True


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    """The plain-value ``extra`` a checkpoint was saved with (tensors given as extra are
    left out). Cheap: no tensors are read, but the checkpoint's files are checked (safe
    metadata, no data file missing or short), so a damaged or crafted checkpoint raises
    a CheckpointError here already."""
    folder, meta = folders.newest(Path(path))
    reader.check_files(folder, reader.read_metadata(folder))
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


def _optim_destinations(
    optimizer: torch.optim.Optimizer, meta: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, dict[str, Any]]]]:
    """Tensors for DCP to fill (DCP casts into their dtype), and per shard the state they
    will become."""
    entries: dict[str, torch.Tensor] = {}
    states = []
    for group in optimizer.param_groups:
        for shard in group["params"]:
            segments = segments_of(shard)
            assert segments is not None
            described = meta["optim_state"].get(segments.fqns[0], {})
            state: dict[str, Any] = {}
            for key, kind in described.items():
                if kind["kind"] == "value":
                    state[key] = _decode(kind["value"])
                    continue
                dtype, device = _state_placement(key, _dtype(kind["dtype"]), shard, group)
                if kind["kind"] == "per_element":
                    state[key] = torch.zeros_like(shard, dtype=dtype)
                    for fqn, piece in _pieces(state[key], segments).items():
                        entries[f"optim.{fqn}.{key}"] = piece
                else:
                    state[key] = torch.zeros(kind["shape"], dtype=dtype, device=device)
                    entries[f"optim.{segments.fqns[0]}.{key}"] = state[key]
            states.append((shard, state))
    return entries, states


def _check_storage(folder: Path, entries: dict[str, Any]) -> Metadata:
    """The checkpoint's DCP metadata, decoded safely, after checking that it holds every
    entry about to be read with the expected size and that no data file is missing or
    short (CheckpointError naming the file otherwise)."""
    storage = reader.read_metadata(folder)
    reader.check_entries(storage, entries, folder / reader.METADATA_FILE)
    reader.check_files(folder, storage)
    return storage


def _read_tensors(
    folder: Path, storage: Metadata, entries: dict[str, Any], ranks: comm.Ranks | None
) -> None:
    """Fill ``entries`` through the safe reader (one process if ``ranks`` is None); a
    failure on any rank is one CheckpointError on every rank."""
    kwargs = {"no_dist": True} if ranks is None else _dcp_kwargs(ranks)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # "torch.distributed is disabled, assuming the intent is to load in a single
            # process": yes
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(entries, storage_reader=reader.SafeFileSystemReader(folder, storage), **kwargs)
    except dcp.CheckpointException as failure:  # a BaseException with every rank's traceback
        raise _load_error(failure, folder) from None


def load(
    path: str | os.PathLike,
    model: ShardedModule,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by ``save`` (at any world size) into ``model`` and ``optimizer``.

    Collective. Loads the newest complete checkpoint at ``path`` (or left beside it by
    an interrupted save). Checks names, shapes and group structure first and raises a
    ValueError listing what differs; a missing, damaged or crafted file raises a
    :class:`CheckpointError` (a ValueError) naming it, on every rank, and nothing in the
    checkpoint is run. Optimizer state takes its parameter's dtype, as with
    ``Optimizer.load_state_dict``. Returns the ``extra`` given to ``save``.
    """
    if not isinstance(model, ShardedModule):
        raise TypeError(f"load expects a model returned by gs.shard, got {type(model).__name__}")
    ranks = model.groupshard.ranks
    error = None
    try:
        folder, meta = folders.newest(Path(path))
        _check_model(model, meta)
        entries = _model_entries(model)
        states: list[tuple[torch.Tensor, dict[str, Any]]] = []
        if optimizer is not None:
            check_optimizer(model, optimizer)
            _check_groups(model, meta)
            optim_entries, states = _optim_destinations(optimizer, meta)
            entries.update(optim_entries)
        extra_tensors = {
            name: torch.empty(spec["shape"], dtype=_dtype(spec["dtype"]))
            for name, spec in meta["extra_tensors"].items()
        }
        entries.update({f"extra.{name}": t for name, t in extra_tensors.items()})
        storage = _check_storage(folder, entries)
    except Exception as caught:  # every rank raises, none waits in DCP's collectives
        error = caught
    comm.raise_if_any_failed(error, ranks, others_raise=CheckpointError)  # no rank waits in DCP
    _read_tensors(folder, storage, entries, ranks)
    note_parameters_written()
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, meta["groups"], strict=True):
            group.update(_decode(saved["hyperparameters"]))
        for shard, state in states:
            optimizer.state.pop(shard, None)
            if state:
                optimizer.state[shard] = state
    return {**{k: _decode(v) for k, v in meta["extra"].items()}, **extra_tensors}


def _offline_entries(meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A whole tensor for every entry the description lists, as saved."""
    entries = {
        f"model.{fqn}": torch.empty(math.prod(spec["shape"]), dtype=_dtype(spec["dtype"]))
        for fqn, spec in meta["params"].items()
    }
    for prefix, specs in (("buffers", meta["buffers"]), ("extra", meta["extra_tensors"])):
        for name, spec in specs.items():
            entries[f"{prefix}.{name}"] = torch.empty(spec["shape"], dtype=_dtype(spec["dtype"]))
    for fqn, described in meta.get("optim_state", {}).items():
        for key, kind in described.items():
            if kind["kind"] == "per_element":
                numel = math.prod(meta["params"][fqn]["shape"])
                entries[f"optim.{fqn}.{key}"] = torch.empty(numel, dtype=_dtype(kind["dtype"]))
            elif kind["kind"] == "tensor":
                shape, dtype = kind["shape"], _dtype(kind["dtype"])
                entries[f"optim.{fqn}.{key}"] = torch.empty(shape, dtype=dtype)
    return entries


def to_torch_save(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Convert a checkpoint offline (one process) into one plain ``torch.save`` file.

    The file holds ``{"model": state dict of the unsharded model, "optim": plain
    torch.optim state dict (if saved), "extra": ...}`` and loads with
    ``torch.load(output, weights_only=True)``. Reads the checkpoint as safely as
    ``load`` does, with the same errors.
    """
    folder, meta = folders.newest(Path(path))
    tensors = _offline_entries(meta)
    _read_tensors(folder, _check_storage(folder, tensors), tensors, None)
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
