"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), in torch's own layout.

A folder holds the model and the optimizer under the names and shapes torch's idiom
(``get_state_dict`` + ``dcp.save``) writes: ``model.<name>`` in the parameter's shape,
``optim.state.<fqn>.<key>``, ``optim.param_groups...`` (``entries``). Each rank writes only
its pieces: the contiguous range of a parameter's elements its flat shard holds, handed to
DCP as the rectangular blocks it covers (``planner``: ``Piece`` and ``ParamPiece``; the
layout says where the pieces lie, no communication); DCP reads at any world size, unit
choice or strategy. So FSDP2, DDP, torchtitan and one process read a groupshard folder,
and ``load`` reads theirs (what to read comes from the folder's DCP metadata).
``torch_api`` makes torch's state-dict API itself exact on sharded models (wrapped into
torch by ``groupshard.torch_hook``). A ``gs.ZeroRedundancyOptimizer`` with the plain or
DDP model it steps saves the same layout (``pieces``). groupshard's own description
(groups, extras, a save counter) goes to ``groupshard.json`` beside, where torch's loader
does not look (``codec``, ``folders``). Nothing a checkpoint holds is run: DCP's pickled
``.metadata`` is decoded by an unpickler that builds only DCP's metadata classes, tensors
and plain values only by ``torch.load(weights_only=True)`` (``reader``); a damaged,
missing or crafted file is a :class:`CheckpointError` naming it, on every rank.

Saving is atomic: everything is written to a temporary directory that replaces
``path`` only once complete, so a crash leaves the previous checkpoint intact; a load
finds the newest complete checkpoint even among leftovers of interrupted saves
(``folders``). A save that finds the device full raises a :class:`NoSpaceError` on every
rank, with the bytes needed and free. Optimizer state is cast to its parameter's dtype on
load, as torch's ``Optimizer.load_state_dict`` does.

Modules: ``sharded`` (save, load, exists, read_extra), ``background`` (async_save: the
save written by a thread while training goes on), ``entries`` (torch's names; reading
others' folders), ``pieces`` (what a sharded model, or a ZeRO optimizer and its model,
holds as entries), ``planner`` (pieces as DCP sees them), ``torch_api`` (torch's
state-dict API), ``codec`` (JSON values), ``conversion`` (one plain ``torch.save`` file;
the first layout converted), ``reader`` (safe reading), ``folders`` (atomic folders),
``errors``.
"""

from __future__ import annotations

from groupshard.checkpoint.background import AsyncSave, async_save
from groupshard.checkpoint.conversion import to_torch_save, upgrade
from groupshard.checkpoint.errors import CheckpointError, NoSpaceError, UnsafeCheckpointError
from groupshard.checkpoint.folders import FORMAT, META_FILE
from groupshard.checkpoint.sharded import exists, holds_optimizer_state, load, read_extra, save

__all__ = [
    "FORMAT",
    "META_FILE",
    "AsyncSave",
    "CheckpointError",
    "NoSpaceError",
    "UnsafeCheckpointError",
    "async_save",
    "exists",
    "holds_optimizer_state",
    "load",
    "read_extra",
    "save",
    "to_torch_save",
    "upgrade",
]
