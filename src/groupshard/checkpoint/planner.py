"""DCP planners over explicit pieces: each rank says which part of which entry it holds.

An entry is a tensor under its own name in the checkpoint: an original parameter or a
per-element optimizer state of it as a 1-D tensor of the parameter's numel, or a tensor
saved whole (a buffer, a scalar state such as ``step``, an extra). A :class:`Piece` is
one rank's contiguous part of an entry, with its offsets in the entry: the layout says
where a rank's shards lie, so no communication is needed to know it.

``PieceSavePlanner`` writes each piece a rank holds (``WriteItem`` with an explicit
``ChunkStorageMetadata``); DCP's global plan keeps one of identical items that several
ranks offer, collects the chunks into the checkpoint's metadata and checks that they
tile every entry exactly once. ``PieceLoadPlanner`` asks
for the part of every entry each rank holds now, whatever pieces the checkpoint was
saved in (``create_read_items_for_chunk_list``: DCP's resharding), so a checkpoint
loads at another world size, unit choice or strategy. Only public DCP classes are used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclass(frozen=True)
class Piece:
    """One rank's contiguous part of a checkpoint entry.

    ``data`` holds the elements ``[offset, offset + data.numel())`` of an entry of
    ``size`` (1-D), or is the whole entry (``offset`` 0, ``size == data.shape``). It may
    be empty (the rank holds none of the entry). When saving, it is offered for writing
    if ``write``; when loading, ``data`` is the destination, filled in place (cast to
    its dtype).
    """

    data: torch.Tensor
    size: torch.Size
    offset: int = 0
    write: bool = True

    @staticmethod
    def whole(data: torch.Tensor, write: bool = True) -> Piece:
        return Piece(data, data.shape, 0, write)

    @property
    def is_whole(self) -> bool:
        return self.data.shape == self.size

    @property
    def chunk(self) -> ChunkStorageMetadata:
        """Where the piece lies in its entry (offsets and sizes per dimension)."""
        if self.is_whole:
            offsets = torch.Size([0] * len(self.size))
            return ChunkStorageMetadata(offsets=offsets, sizes=self.size)
        return ChunkStorageMetadata(
            offsets=torch.Size([self.offset]), sizes=torch.Size([self.data.numel()])
        )

    def write_item(self, name: str) -> WriteItem:
        chunk = self.chunk
        return WriteItem(
            index=MetadataIndex(name, chunk.offsets),
            type=WriteItemType.TENSOR if self.is_whole else WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk, properties=TensorProperties(dtype=self.data.dtype), size=self.size
            ),
        )


def check_pieces(pieces: Mapping[str, Piece]) -> None:
    """Every piece is a 1-D part of a 1-D entry, inside it, or a whole tensor."""
    for name, piece in pieces.items():
        if piece.is_whole:
            continue
        if len(piece.size) != 1 or piece.data.dim() != 1:
            raise ValueError(f"Piece {name!r} of size {list(piece.size)} is not 1-D")
        if not 0 <= piece.offset <= piece.offset + piece.data.numel() <= piece.size[0]:
            raise ValueError(f"Piece {name!r} lies outside its entry of size {list(piece.size)}")


class PieceSavePlanner(DefaultSavePlanner):
    """Writes the pieces this rank holds, each with its chunk in its entry (empty ones
    only when they are the whole entry). DCP's global plan stays DCP's own: identical
    items offered by several ranks (what all hold alike) are written by one, and the
    chunks of every entry must cover it exactly once."""

    def __init__(self, pieces: Mapping[str, Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        check_pieces(pieces)
        self.pieces = {
            name: p for name, p in pieces.items() if p.write and (p.data.numel() or p.is_whole)
        }

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([piece.write_item(name) for name, piece in self.pieces.items()])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[index.fqn].data.detach()


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads into each piece the elements of its entry that it covers, from whichever
    saved pieces hold them (DCP's ``create_read_items_for_chunk_list``)."""

    def __init__(self, pieces: Mapping[str, Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        check_pieces(pieces)
        self.pieces = {name: p for name, p in pieces.items() if p.data.numel()}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        items = []
        for name, piece in self.pieces.items():
            items += create_read_items_for_chunk_list(name, saved[name], [piece.chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[index.fqn].data.detach()
