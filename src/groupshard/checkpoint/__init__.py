"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), loadable at any scale.

Each rank writes only its own slices: every original parameter (and every per-element
optimizer state of it) is saved as a 1-D tensor under its own name, of which a rank
writes the contiguous piece its shards contain, with that piece's offsets given to DCP
explicitly (``planner``: a ``SavePlanner`` / ``LoadPlanner`` over such pieces; the
layout says where the pieces lie, no communication). DCP matches saved pieces to the
pieces the loading ranks hold, so a checkpoint loads at another world size, with
another unit choice or strategy. A ``gs.ZeroRedundancyOptimizer`` with the plain or
DDP model it steps saves the same format, its state in the slices each rank owns.
Names, shapes, group structure and hyperparameters go to a JSON file beside the
tensors (``codec``): loading compares it with the model and optimizer first. Nothing a
checkpoint holds is run: DCP's pickled ``.metadata`` is decoded by an unpickler that
builds only DCP's metadata classes, and tensors only by ``torch.load(weights_only=True)``
(``reader``); a damaged, missing or crafted file is a :class:`CheckpointError` naming
it, on every rank.

Saving is atomic: everything is written to a temporary directory that replaces
``path`` only once complete, so a crash leaves the previous checkpoint intact; a load
finds the newest complete checkpoint even among leftovers of interrupted saves
(``folders``). A save that finds the device full raises a :class:`NoSpaceError` on every
rank, with the bytes needed and free. Optimizer state is cast to its parameter's dtype on
load, as torch's ``Optimizer.load_state_dict`` does.

Modules: ``sharded`` (save, load, exists, read_extra), ``pieces`` (what a sharded
model, or a ZeRO optimizer and its model, holds as entries), ``planner`` (the DCP
planners), ``codec`` (JSON values), ``conversion`` (one plain ``torch.save`` file),
``reader`` (safe reading), ``folders`` (atomic folders), ``errors``.
"""

from __future__ import annotations

from groupshard.checkpoint.conversion import to_torch_save
from groupshard.checkpoint.errors import CheckpointError, NoSpaceError, UnsafeCheckpointError
from groupshard.checkpoint.folders import FORMAT, META_FILE
from groupshard.checkpoint.sharded import exists, load, read_extra, save

__all__ = [
    "FORMAT",
    "META_FILE",
    "CheckpointError",
    "NoSpaceError",
    "UnsafeCheckpointError",
    "exists",
    "load",
    "read_extra",
    "save",
    "to_torch_save",
]
