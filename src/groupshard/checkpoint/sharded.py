"""``save``, ``load``, ``exists`` and ``read_extra``: sharded checkpoints in a folder.

A save gathers nothing: each rank hands DCP its entries (``entries``: torch's names, its
pieces as ``ParamPiece`` blocks) through DCP's default planner into a temporary folder,
rank 0 writes the description last, and the folder replaces ``path`` (``folders``). A load
reads the folder's DCP metadata safely (``reader``), finds where it keeps the model and the
optimizer (groupshard's, torch's recipe's or torchtitan's names), compares it with the model
(a ValueError listing the differences, on every rank before any rank reads), then reads
through the safe reader and installs the optimizer's state and hyperparameters.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from groupshard import comm
from groupshard.checkpoint import codec, folders, reader
from groupshard.checkpoint.entries import (
    EXTRA,
    MODEL,
    OPTIM,
    STATE,
    TITAN_OPTIM,
    dcp_value,
    find_prefixes,
    group_destinations,
    model_destinations,
    model_entries,
    model_problems,
    optimizer_entries,
    read_value,
    saved_hyperparameters,
    saved_optimizer_state,
)
from groupshard.checkpoint.errors import CheckpointError, NoSpaceError
from groupshard.checkpoint.folders import FORMAT
from groupshard.checkpoint.pieces import Holder, holder_of
from groupshard.checkpoint.planner import (
    EntriesSavePlanner,
    Piece,
    SafeLoadPlanner,
    by_first_name,
)


@contextmanager
def _single_process_is_meant() -> Iterator[None]:
    # DCP warns "torch.distributed is disabled, ... assuming the intent is to save (load)
    # in a single process" when given no process group: yes, it is
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_kwargs(ranks: comm.Ranks | None) -> dict[str, Any]:
    if ranks is None or ranks.group is None:
        return {"no_dist": True}
    return {"process_group": ranks.group}


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


def check_storage(folder: Path, sizes: Mapping[str, torch.Size]) -> Metadata:
    """The checkpoint's DCP metadata, decoded safely, after checking that it holds every
    entry about to be read with the expected size and that no data file is missing or
    short (CheckpointError naming the file otherwise)."""
    storage = reader.read_metadata(folder)
    reader.check_entries(storage, sizes, folder / reader.METADATA_FILE)
    reader.check_files(folder, storage)
    return storage


def read_entries(
    folder: Path, storage: Metadata, entries: Mapping[str, Any], ranks: comm.Ranks | None
) -> dict[str, Any]:
    """Fill ``entries`` (pieces, read in place; plain values, returned by name) through the
    safe reader (one process if ``ranks`` is None); a failure on any rank is one
    CheckpointError on every rank."""
    state_dict = {name: dcp_value(entry) for name, entry in entries.items()}
    try:
        with torch.no_grad(), _single_process_is_meant():
            dcp.load(
                state_dict,
                storage_reader=reader.SafeFileSystemReader(folder, storage),
                planner=SafeLoadPlanner(),
                **_dcp_kwargs(ranks),
            )
    except dcp.CheckpointException as failure:  # a BaseException with every rank's traceback
        raise _load_error(failure, folder) from None
    return state_dict


def _extra_entries(extra: Mapping[str, Any], rank: int) -> tuple[dict[str, Piece], dict, dict]:
    pieces: dict[str, Piece] = {}
    plain: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    for name, value in extra.items():
        if isinstance(value, torch.Tensor):
            if rank == 0:  # tensors given as extra need not agree across ranks: rank 0's
                pieces[EXTRA + name] = Piece.whole(value.detach())
            tensors[name] = {"shape": list(value.shape), "dtype": codec.dtype_name(value.dtype)}
        else:
            plain[name] = codec.encode(value)
    return pieces, plain, tensors


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``) to the directory ``path``.

    Collective: call on every rank. Each rank writes only its slices. Args:
        path: a directory (shared by all ranks); replaced atomically when complete.
        model: a model returned by ``gs.shard``; or, with a ``gs.ZeroRedundancyOptimizer``,
            the plain or DDP model it steps.
        optimizer: an optimizer over ``model.optimizer_groups()``, a
            ``gs.ZeroRedundancyOptimizer``, or None.
        extra: tensors and plain values (numbers, strings, lists...) to store too,
            e.g. the step count or RNG states; ``load`` returns them.

    A failed save raises on every rank and leaves the previous checkpoint intact: a
    :class:`NoSpaceError` (an OSError, errno ENOSPC) naming the folder and the bytes
    needed and free if the device (or a quota) is full, else a RuntimeError.
    """
    planned = plan_save(path, model, optimizer, extra)
    write_save(planned, planned.ranks)


@dataclass
class PlannedSave:
    """A save's entries (pieces of this rank's tensors, plain values) and where they go:
    everything ``write_save`` needs, found collectively by ``plan_save``."""

    path: Path
    ranks: comm.Ranks  # the model's ranks
    entries: dict[str, Any]
    aliases: dict[str, str]
    meta: dict[str, Any]
    temporary: Path


def plan_save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any] | None,
) -> PlannedSave:
    """What ``save`` writes and where (collective over the model's ranks: rank 0 finds the
    save counter and the temporary folder)."""
    holder = holder_of(model, optimizer, "save")
    ranks = holder.ranks
    path = Path(path)
    entries: dict[str, Any]
    entries, _ = model_entries(holder, loading=False)
    aliases: dict[str, str] = {}
    if ranks.rank != 0:  # buffers need not agree across ranks: rank 0's are saved
        for name in holder.buffers():
            entries.pop(MODEL + name)
    meta: dict[str, Any] = {"format": FORMAT, "world_size": ranks.size, **_model_meta(holder)}
    if optimizer is not None:
        optimizer_found, aliases = optimizer_entries(holder)
        entries.update(optimizer_found)
        meta["groups"] = [
            {"params": listed, "hyperparameters": codec.encode(values)}
            for listed, values in zip(holder.listed_groups(), holder.hyperparameters(), strict=True)
        ]
    extra_entries, meta["extra"], meta["extra_tensors"] = _extra_entries(extra or {}, ranks.rank)
    entries.update(extra_entries)
    # the save counter orders checkpoints and leftovers of interrupted saves (see folders);
    # rank 0 finds it, and a failure there (an unreadable folder) fails every rank
    found: tuple[int, Path] | None = None
    problem = None
    if ranks.rank == 0:
        try:
            serial = folders.next_serial(path)
            found = (serial, folders.temporary_name(path, serial))
        except OSError as error:
            problem = RuntimeError(f"Cannot save the checkpoint {str(path)!r}: {error}")
    comm.raise_if_any_failed(problem, ranks)
    serial, temporary = comm.broadcast_object(found, ranks)
    meta["serial"] = serial
    return PlannedSave(path, ranks, entries, aliases, meta, temporary)


def write_save(planned: PlannedSave, ranks: comm.Ranks) -> None:
    """Write ``planned`` into its temporary folder, then (rank 0) put it in place; collective
    over ``ranks`` (the model's, or a group of the same ranks for a background write). A
    failure raises on every rank, the previous checkpoint intact."""
    path, entries, temporary = planned.path, planned.entries, planned.temporary
    failure: BaseException | None = None
    try:
        state_dict = by_first_name({name: dcp_value(e) for name, e in entries.items()})
        try:
            with _single_process_is_meant():
                dcp.save(
                    state_dict,
                    checkpoint_id=temporary,
                    storage_writer=folders.FileWriter(temporary, planned.aliases),
                    planner=EntriesSavePlanner(),
                    **_dcp_kwargs(ranks),
                )
        except dcp.CheckpointException as error:  # a BaseException, raised on every rank
            failure = error
        if failure is None:  # all have written; rank 0 puts it in place, then all go on
            failure = _on_rank_0(_complete, ranks, temporary, planned.meta, path,
                                 planned.meta["serial"])  # fmt: skip
    except BaseException:
        if ranks.rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    if failure is not None:
        if ranks.rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        error = _save_error(failure, path, entries, ranks)
        raise error from (None if isinstance(failure, dcp.CheckpointException) else failure)


def _complete(temporary: Path, meta: dict[str, Any], path: Path, serial: int) -> None:
    folders.write_meta(temporary, meta)
    folders.replace(temporary, path, serial)


def _on_rank_0(function: Any, ranks: comm.Ranks, *args: Any) -> BaseException | None:
    """Run ``function(*args)`` on rank 0; return its exception (None if none) on every rank:
    rank 0's own, the others a copy (an OSError with its errno, else a RuntimeError)."""
    failure, copy = None, None
    if ranks.rank == 0:
        try:
            function(*args)
        except Exception as error:
            failure, found = error, folders.os_error_in(error)
            copy = RuntimeError(reader.short(error)) if found is None else OSError(*found.args)
    shared = comm.broadcast_object(copy, ranks)
    return failure if ranks.rank == 0 else shared


def _save_error(
    failure: BaseException, path: Path, entries: Mapping[str, Any], ranks: comm.Ranks
) -> Exception:
    """The error every rank raises for a failed save (``failure``, alike on each): a
    NoSpaceError if a write found no space left, else a RuntimeError naming the first
    failed rank's error. Rank 0 has removed the temporary folder."""
    if isinstance(failure, dcp.CheckpointException):
        causes = [c[0] if isinstance(c, tuple) else c for c in failure.failures.values()]
        first = _first_failure(failure)
    else:
        causes, first = [failure], f"Rank 0: {reader.short(failure)}"
    if any(folders.no_space(cause) for cause in causes):
        space = None
        if ranks.rank == 0:  # about what it takes: the previous checkpoint's files, or more
            tensors = sum(
                p.shape.numel() * p.data.element_size()
                for p in entries.values()
                if isinstance(p, Piece)
            )
            space = (max(tensors, folders.size(path)), folders.free_bytes(path.parent))
        needed, free = comm.broadcast_object(space, ranks)
        return NoSpaceError(str(path), needed, free)
    return RuntimeError(
        f"Saving the checkpoint {str(path)!r} failed on some rank; the previous "
        f"checkpoint there (if any) is intact. {first}"
    )


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
    return {k: codec.decode(v) for k, v in meta["extra"].items()} if meta else {}


def holds_optimizer_state(path: str | os.PathLike) -> bool:
    """Whether the newest checkpoint at ``path`` (any writer) holds optimizer state; reads
    only its (safely decoded) metadata."""
    folder, _ = folders.newest(Path(path))
    names = reader.read_metadata(folder).state_dict_metadata
    return any(name.startswith((OPTIM + STATE, TITAN_OPTIM + STATE)) for name in names)


def _model_meta(holder: Holder) -> dict[str, Any]:
    """Names, shapes and dtypes, for people and tools reading the folder (a load reads the
    DCP metadata, which every writer of torch's idiom leaves)."""
    return {
        "params": {
            fqn: {"shape": list(shape), "dtype": codec.dtype_name(dtype), "aliases": aliases}
            for fqn, (shape, dtype, aliases) in holder.param_shapes().items()
        },
        "buffers": {
            name: {"shape": list(b.shape), "dtype": codec.dtype_name(b.dtype)}
            for name, b in holder.buffers().items()
        },
        "frozen": holder.frozen(),
    }


def _check_groups(ours: list[list[str]], meta: dict[str, Any]) -> None:
    """A groupshard checkpoint's groups against the optimizer's: the same structure."""
    saved = [g["params"] for g in meta["groups"]]
    if len(ours) != len(saved):
        raise ValueError(
            f"The checkpoint has {len(saved)} param groups but the optimizer has {len(ours)}"
        )
    for index, (mine, theirs) in enumerate(zip(ours, saved, strict=True)):
        missing = [n for n in mine if n not in theirs]
        unexpected = [n for n in theirs if n not in mine]
        problems = []
        if missing:
            problems.append(f"{len(missing)} parameters missing from the checkpoint: {missing[:8]}")
        if unexpected:
            problems.append(
                f"{len(unexpected)} unexpected parameters in the checkpoint: {unexpected[:8]}"
            )
        if problems:
            raise ValueError(f"Param group {index} differs: " + "; ".join(problems))


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` and ``optimizer``, at any world size: one written by
    ``save``, or a folder written with torch's idiom (``dcp.save`` of ``get_state_dict``) by
    FSDP2, DDP, one process or torchtitan.

    Collective. Loads the newest complete checkpoint at ``path`` (or left beside it by
    an interrupted save). ``model`` and ``optimizer`` as for ``save``: a ``gs.shard``
    model (any unit choice and strategy) or a plain/DDP model with its
    ``gs.ZeroRedundancyOptimizer``. The optimizer keeps its groups; each takes the
    hyperparameters the checkpoint has for its parameters, as ``Optimizer.load_state_dict``
    does. Checks names and shapes first and raises a ValueError listing what differs; a
    missing, damaged or crafted file raises a :class:`CheckpointError` (a ValueError)
    naming it, on every rank, and nothing in the checkpoint is run. Optimizer state takes
    its parameter's dtype, as with ``Optimizer.load_state_dict``. Returns the ``extra``
    given to ``save`` (empty for folders written by others).
    """
    holder = holder_of(model, optimizer, "load")
    ranks = holder.ranks
    error = None
    small: dict[str, Any] = {}  # read first and checked before anything changes
    try:
        folder, meta = folders.newest(Path(path))
        storage = reader.read_metadata(folder)
        prefixes = find_prefixes(storage, holder)
        problems = model_problems(storage, holder, prefixes.model)
        if problems:
            raise ValueError("The checkpoint does not match the model: " + "; ".join(problems))
        entries: dict[str, Any]
        entries, after_read = model_destinations(holder, storage, prefixes.model)
        if optimizer is not None:
            if prefixes.optim is None:
                raise ValueError(
                    "The checkpoint has no optimizer state; load it without an optimizer"
                )
            if meta is not None:
                _check_groups(holder.listed_groups(), meta)
            state_prefix = f"{prefixes.optim}{STATE}"
            saved = saved_optimizer_state(storage, prefixes.optim, list(holder.param_shapes()))
            destinations = holder.optimizer_destinations(saved)
            for fqn, keys in destinations.entries.items():
                for key, entry in keys.items():
                    name = f"{state_prefix}{fqn}.{key}"
                    target = entries if (fqn, key) in destinations.per_element else small
                    target[name] = entry
            groups = group_destinations(storage, prefixes.optim)
            small.update(groups)
        extra_tensors = {}
        if meta is not None:
            extra_tensors = {
                name: torch.empty(spec["shape"], dtype=codec.dtype(spec["dtype"]))
                for name, spec in meta["extra_tensors"].items()
            }
        entries.update({EXTRA + name: Piece.whole(t) for name, t in extra_tensors.items()})
        sizes = {n: e.shape for n, e in {**entries, **small}.items() if isinstance(e, Piece)}
        reader.check_entries(storage, sizes, folder / reader.METADATA_FILE)
        reader.check_files(folder, storage)
    except Exception as caught:  # every rank raises, none waits in DCP's collectives
        error = caught
    comm.raise_if_any_failed(error, ranks, others_raise=CheckpointError)  # no rank waits in DCP
    if optimizer is not None:
        # the groups' hyperparameters and the values each parameter keeps (step...) first:
        # a folder whose groups or steps do not fit fails here, the model and state intact
        assert prefixes.optim is not None
        read_small = read_entries(folder, storage, small, ranks)

        def value_of(fqn: str, key: str, entry: Any) -> Any:
            name = f"{state_prefix}{fqn}.{key}"
            return read_value(entry, read_small, name)

        error = None
        try:
            values = {n: read_value(e, read_small, n) for n, e in groups.items()}
            hyperparameters = saved_hyperparameters(holder.listed_groups(), values, prefixes.optim)
            destinations.check(value_of)
        except ValueError as caught:
            error = caught
        comm.raise_if_any_failed(error, ranks)
    read_entries(folder, storage, entries, ranks)
    after_read()
    if optimizer is not None:
        holder.set_hyperparameters(hyperparameters)
        destinations.install(value_of)
    plain_extra = {k: codec.decode(v) for k, v in meta["extra"].items()} if meta else {}
    return {**plain_extra, **extra_tensors}
