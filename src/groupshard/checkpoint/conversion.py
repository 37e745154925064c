"""Offline conversions (one process): a checkpoint folder to one plain ``torch.save`` file,
and a folder of groupshard's first layout (every tensor 1-D) to today's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from groupshard.checkpoint import codec, folders, reader
from groupshard.checkpoint.entries import EXTRA, MODEL, OPTIM, STATE, group_entries
from groupshard.checkpoint.errors import CheckpointError
from groupshard.checkpoint.planner import EntriesSavePlanner, Piece, by_first_name
from groupshard.checkpoint.sharded import _single_process_is_meant, read_entries
from groupshard.flatten import plain_optimizer_state


def read_whole(folder: Path, storage: Metadata) -> dict[str, Any]:
    """Every entry of a checkpoint folder, whole (tensors) or decoded (plain values)."""
    entries: dict[str, Any] = {
        name: Piece.whole(torch.empty(entry.size, dtype=entry.properties.dtype))
        if isinstance(entry, TensorStorageMetadata)
        else None
        for name, entry in storage.state_dict_metadata.items()
    }
    reader.check_files(folder, storage)
    read = read_entries(folder, storage, entries, None)
    return {n: e.data if isinstance(e, Piece) else read[n] for n, e in entries.items()}


def to_torch_save(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Convert a checkpoint offline (one process) into one plain ``torch.save`` file.

    The file holds ``{"model": state dict of the unsharded model, "optim": plain
    torch.optim state dict, keyed as ``Optimizer.state_dict()`` numbers the parameters
    (if saved), "extra": ...}`` and loads with ``torch.load(output, weights_only=True)``.
    Reads the checkpoint as safely as ``load`` does, with the same errors.
    """
    torch.save(read_unsharded(path), output)


def read_unsharded(path: str | os.PathLike) -> dict[str, Any]:
    """What ``to_torch_save`` writes, read in this process: the unsharded model, the
    plain optimizer state (if saved) and the extras."""
    folder, meta = folders.newest(Path(path))
    if meta is None:
        raise CheckpointError(
            f"{path} has no groupshard description; load it with gs.checkpoint.load, or "
            "torch's torch.distributed.checkpoint.format_utils.dcp_to_torch_save"
        )
    values = read_whole(folder, reader.read_metadata(folder))
    model_state = {n[len(MODEL) :]: v for n, v in values.items() if n.startswith(MODEL)}
    result: dict[str, Any] = {"model": model_state}
    if "groups" in meta:
        per_fqn: dict[str, dict[str, Any]] = {}
        start = OPTIM + STATE
        for listed in (g["params"] for g in meta["groups"]):
            for fqn in listed:
                prefix = f"{start}{fqn}."
                state = {n[len(prefix) :]: v for n, v in values.items() if n.startswith(prefix)}
                if state:
                    per_fqn[fqn] = state
        groups = [(g["params"], codec.decode(g["hyperparameters"])) for g in meta["groups"]]
        result["optim"] = plain_optimizer_state(groups, per_fqn)
    result["extra"] = {
        **{k: codec.decode(v) for k, v in meta["extra"].items()},
        **{name: values[EXTRA + name] for name in meta["extra_tensors"]},
    }
    return result


def upgrade(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Rewrite a checkpoint of groupshard's first layout (parameters and per-element state
    1-D, ``optim.<fqn>.<key>``, ``buffers.<name>``) in today's: torch's names and the
    parameters' shapes. Offline, one process; reads as safely as ``load``."""
    folder = Path(path)
    file = folder / folders.META_FILE
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"Cannot read {file} ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != folders.FIRST_FORMAT:
        raise CheckpointError(f"{file} does not describe a {folders.FIRST_FORMAT} checkpoint")
    values = read_whole(folder, reader.read_metadata(folder))
    try:
        entries, aliases = _first_layout_entries(meta, values)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(
            f"{file} does not describe the checkpoint beside it ({type(error).__name__}: {error})"
        ) from None
    output = Path(output)
    temporary = folders.temporary_name(output, 0)
    try:
        with _single_process_is_meant():
            dcp.save(
                by_first_name(entries),
                storage_writer=folders.FileWriter(temporary, aliases),
                planner=EntriesSavePlanner(),
                no_dist=True,
            )
        meta.pop("optim_state", None)
        meta.update(format=folders.FORMAT, serial=1)
        folders.write_meta(temporary, meta)
        folders.replace(temporary, output, 1)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _first_layout_entries(
    meta: dict[str, Any], values: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Today's entries and aliases (``group_entries``) from the first layout's description
    and (whole, 1-D) tensors."""
    entries: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for fqn, spec in meta["params"].items():
        for alias in spec["aliases"]:
            entries[MODEL + alias] = values[f"model.{fqn}"].view(spec["shape"])
    for name in meta["buffers"]:
        entries[MODEL + name] = values[f"buffers.{name}"]
    for fqn, described in meta.get("optim_state", {}).items():
        for key, kind in described.items():
            name = f"{OPTIM}{STATE}{fqn}.{key}"
            if kind["kind"] == "per_element":
                entries[name] = values[f"optim.{fqn}.{key}"].view(meta["params"][fqn]["shape"])
            elif kind["kind"] == "tensor":
                entries[name] = values[f"optim.{fqn}.{key}"]
            else:
                entries[name] = codec.decode(kind["value"])
    if "groups" in meta:
        listed = [g["params"] for g in meta["groups"]]
        hyperparameters = [codec.decode(g["hyperparameters"]) for g in meta["groups"]]
        groups, aliases = group_entries(listed, hyperparameters, OPTIM)
        entries.update(groups)
    entries.update({EXTRA + name: values[EXTRA + name] for name in meta["extra_tensors"]})
    return entries, aliases
