"""What DCP writes and reads of a sharded parameter: its pieces, in the parameter's shape.

An entry is a tensor under its own name in the checkpoint, in its own shape: an original
parameter, a per-element optimizer state of it (``exp_avg``...), or a tensor saved whole
(a buffer, a scalar state such as ``step``, an extra). A :class:`Piece` is one rank's
part of an entry: a contiguous range of its row-major elements (a flat shard holds a
parameter's elements ``[offset, offset + n)``), which DCP sees as the rectangular blocks
the range covers (``layout.flat_range_boxes``: a partial first row, whole rows, a partial
last row). The layout says where a rank's shards lie, so no communication is needed.

:class:`ParamPiece` hands a piece to DCP through the protocol DCP's default planners
ask of a tensor that is one rank's part of a larger one (the protocol DTensor
implements): ``__create_write_items__`` (one SHARD item per block), ``__create_chunk_list__``
(the blocks it holds, for DCP's resharding on load) and ``__get_tensor_shard__`` (a view of
one block). Its ``size()`` is the whole entry's, as a DTensor's is. DCP's global plan
then keeps one of identical items several ranks offer (replicas, ``step``), and checks
that the blocks tile every entry exactly once: a dropped piece fails the save.

``EntriesSavePlanner`` is DCP's default save planner for entries by their full names,
handed to DCP a level deep (:func:`by_first_name`). ``SafeLoadPlanner`` is DCP's default
load planner, but decodes non-tensor values (the hyperparameters of param groups, plain
optimizer state) with ``torch.load(..., weights_only=True)``: nothing a checkpoint holds
is run.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from groupshard.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from groupshard.layout import Box, flat_range_boxes


@dataclass(frozen=True)
class Piece:
    """One rank's part of a checkpoint entry of shape ``shape``.

    ``data`` holds the row-major elements ``[offset, offset + data.numel())`` of the entry
    (1-D), or is the whole entry (``offset`` 0, ``data.shape == shape``). It may be empty
    (the rank holds none of the entry). When loading, ``data`` is the destination, filled
    in place (cast to its dtype).

    ``region``: the block of the entry whose row-major elements ``offset`` counts, when
    that is not the whole entry: a tensor-parallel rank's local piece of a parameter
    (``TensorParallelism.region``), of which a flat shard holds a range.
    """

    data: torch.Tensor
    shape: torch.Size
    offset: int = 0
    region: Box | None = None
    boxes: tuple[Box, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.is_whole:
            boxes = [((0,) * len(self.shape), tuple(self.shape))]
        else:
            if self.data.dim() != 1:
                raise ValueError(f"a piece of an entry of shape {list(self.shape)} is not 1-D")
            origin, sizes = self.region or ((0,) * len(self.shape), tuple(self.shape))
            boxes = [
                (tuple(o + at for o, at in zip(offsets, origin, strict=True)), box_sizes)
                for offsets, box_sizes in flat_range_boxes(
                    sizes, self.offset, self.offset + self.data.numel()
                )
            ]
        object.__setattr__(self, "boxes", tuple(boxes))

    @staticmethod
    def whole(data: torch.Tensor) -> Piece:
        return Piece(data, data.shape)

    @property
    def is_whole(self) -> bool:
        return self.data.shape == self.shape

    @property
    def chunks(self) -> list[ChunkStorageMetadata]:
        """Where the piece lies in its entry: one block per chunk."""
        return [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in self.boxes
        ]

    def block(self, offsets: Sequence[int]) -> torch.Tensor:
        """The block starting at ``offsets``, in its shape, sharing the piece's memory."""
        if self.is_whole:
            return exact_alias(self.data)
        start = 0
        for box_offsets, sizes in self.boxes:
            numel = _numel(sizes)
            if tuple(box_offsets) == tuple(offsets):
                return exact_alias(self.data[start : start + numel].view(sizes))
            start += numel
        raise ValueError(f"no block of this piece starts at {list(offsets)}")

    def elements_of(self, whole: torch.Tensor) -> torch.Tensor:
        """The piece's elements of ``whole`` (a tensor of the entry's shape), as ``data``
        holds them."""
        if self.is_whole:
            return whole
        if self.region is not None:
            origin, sizes = self.region
            for dim, (start, size) in enumerate(zip(origin, sizes, strict=True)):
                whole = whole.narrow(dim, start, size)
        return whole.reshape(-1)[self.offset : self.offset + self.data.numel()]

    def write_items(self, name: str) -> list[WriteItem]:
        kind = WriteItemType.TENSOR if self.is_whole else WriteItemType.SHARD
        properties = TensorProperties(dtype=self.data.dtype)
        return [
            WriteItem(
                index=MetadataIndex(name, chunk.offsets),
                type=kind,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape),
            )
            for chunk in self.chunks
        ]

    def dcp_value(self) -> torch.Tensor:
        """What DCP is handed: the whole tensor, or a :class:`ParamPiece`."""
        return exact_alias(self.data) if self.is_whole else ParamPiece(self)


def exact_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` over a storage of exactly its bytes, sharing its memory (no copy).

    A piece is a view into a unit's shards, whose storage holds the whole unit. DCP's file
    writer copies every tensor whose storage is larger than it, and keeps each copy until
    its file is written: a save would hold a second copy of all of this rank's shards and
    state. Over a storage of its own size (a slice of the shard's storage) it is written
    as it is. Writes through it (a load) do not count in the shard's autograd version
    counter: loads mark the shards written afterwards (``mark_written``).
    """
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    storage = tensor.untyped_storage()[start : start + tensor.nbytes]
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(storage, 0, tensor.shape, tensor.stride())


def _numel(sizes: Sequence[int]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


class ParamPiece(torch.Tensor):
    """A rank's piece of a parameter (or of a per-element state), for DCP and torch's
    state-dict API: the size, dtype and device of the whole entry, the data of the piece.

    It is no tensor to compute with (any operation raises, naming what to use instead);
    ``piece`` and ``local()`` give the rank's elements. ``dcp.save`` writes its blocks,
    ``dcp.load`` reads into them in place.
    """

    piece: Piece

    @staticmethod
    def __new__(cls, piece: Piece) -> ParamPiece:
        data = piece.data
        made = torch.Tensor._make_wrapper_subclass(
            cls, piece.shape, dtype=data.dtype, device=data.device, requires_grad=False
        )
        made.piece = piece
        return made

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        if func is torch.ops.aten.new_empty.default:
            # DCP's staging (dcp.async_save's StateDictStager) copies a tensor subclass as
            # an empty one of its kind whose attributes it then deep-copies: the piece,
            # its elements staged into CPU memory. A placeholder until then: no allocation.
            return ParamPiece(args[0].piece)
        raise TypeError(
            f"{func} on a piece of a sharded parameter: this rank holds only a range of its "
            "elements (ParamPiece.local()). For whole tensors ask torch's state-dict API for "
            "StateDictOptions(full_state_dict=True), or use gs.full_state_dict / "
            "gs.optim_state_dict."
        )

    def __repr__(self) -> str:  # type: ignore[override]
        piece = self.piece
        return (
            f"ParamPiece(shape={list(piece.shape)}, elements [{piece.offset}, "
            f"{piece.offset + piece.data.numel()}), dtype={piece.data.dtype})"
        )

    def local(self) -> torch.Tensor:
        """This rank's elements (1-D), a view of the shard they live in."""
        return self.piece.data

    # DCP's protocol for a tensor that is one rank's part of a larger one
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return self.piece.write_items(fqn)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self.piece.chunks

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is None:
            raise ValueError(f"a piece of {index.fqn!r} is asked for without offsets")
        return self.piece.block(index.offset)


def by_first_name(entries: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``entries`` under the first part of their names (``{"model.": {"wte.weight": ...}}``),
    for :class:`EntriesSavePlanner`. DCP logs, times and inspects every top-level key of the
    state dict it is handed (0.1 ms each): a few keys, not one per entry."""
    nested: dict[str, dict[str, Any]] = {}
    for name, value in entries.items():
        head, dot, rest = name.partition(".")
        nested.setdefault(head + dot, {})[rest] = value
    return nested


class EntriesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner over entries handed a level deep (:func:`by_first_name`):
    each is saved under its full name, and a value that is a list stays one entry (DCP's own
    flattening would split a list of tensors)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        entries = {
            head + rest: v for head, nested in state_dict.items() for rest, v in nested.items()
        }
        super().set_up_planner(entries, storage_meta, is_coordinator)


def decode_value(data: bytes, name: str) -> Any:
    """A non-tensor checkpoint value, decoded without running anything it holds."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        text = str(error)
        if "Unsupported global" in text or "WeightsUnpickler" in text:
            raise UnsafeCheckpointError(
                f"The checkpoint entry {name!r} holds a pickle of something other than plain "
                f"values; refused, nothing in it was run ({text.splitlines()[0][:200]})"
            ) from None
        raise CheckpointError(f"The checkpoint entry {name!r} is damaged ({error})") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner over a flat state dict (names as the checkpoint's), decoding
    non-tensor values with ``weights_only=True``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = decode_value(value.getvalue(), fqn)
