"""A sharded checkpoint to one plain ``torch.save`` file, offline (one process)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from groupshard.checkpoint import codec, folders
from groupshard.checkpoint.planner import Piece
from groupshard.checkpoint.sharded import check_storage, read_pieces
from groupshard.flatten import plain_optimizer_state


def _whole(shape: list[int], dtype: Any) -> Piece:
    return Piece.whole(torch.empty(shape, dtype=codec.dtype(dtype)))


def _all_entries(meta: dict[str, Any]) -> dict[str, Piece]:
    """A whole tensor for every entry the description lists, as saved."""
    pieces = {
        f"model.{fqn}": _whole([math.prod(spec["shape"])], spec["dtype"])
        for fqn, spec in meta["params"].items()
    }
    for prefix, specs in (("buffers", meta["buffers"]), ("extra", meta["extra_tensors"])):
        for name, spec in specs.items():
            pieces[f"{prefix}.{name}"] = _whole(spec["shape"], spec["dtype"])
    for fqn, described in meta.get("optim_state", {}).items():
        for key, kind in described.items():
            if kind["kind"] == "per_element":
                numel = math.prod(meta["params"][fqn]["shape"])
                pieces[f"optim.{fqn}.{key}"] = _whole([numel], kind["dtype"])
            elif kind["kind"] == "tensor":
                pieces[f"optim.{fqn}.{key}"] = _whole(kind["shape"], kind["dtype"])
    return pieces


def to_torch_save(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Convert a checkpoint offline (one process) into one plain ``torch.save`` file.

    The file holds ``{"model": state dict of the unsharded model, "optim": plain
    torch.optim state dict (if saved), "extra": ...}`` and loads with
    ``torch.load(output, weights_only=True)``. Reads the checkpoint as safely as
    ``load`` does, with the same errors.
    """
    folder, meta = folders.newest(Path(path))
    pieces = _all_entries(meta)
    storage = check_storage(folder, {name: piece.size for name, piece in pieces.items()})
    read_pieces(folder, storage, pieces, None)
    tensors = {name: piece.data for name, piece in pieces.items()}
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
        **{k: codec.decode(v) for k, v in meta["extra"].items()},
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
                entry[key] = codec.decode(kind["value"])
    groups = [(g["params"], codec.decode(g["hyperparameters"])) for g in meta["groups"]]
    return plain_optimizer_state(groups, per_fqn)
