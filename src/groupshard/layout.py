"""Pure arithmetic of flat buffers, shards and segment maps.

Note: vocabulary
    A *flat buffer* holds one group's parameters of one unit (and one dtype), laid
    end to end in a fixed order and zero-padded to a multiple of the shard world
    size. Rank ``r`` holds the *shard* ``[r * shard_numel, (r + 1) * shard_numel)``
    of it. A *segment* is the piece of one parameter that falls inside one shard.
    A *storage* is what one collective moves: all flat buffers of a (unit, dtype),
    whose shards sit end to end in one local tensor, trainable buffers first.

Nothing here communicates; ``torch`` is used only to build index tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

FROZEN_GROUP = -1
"""Group index of the buffer that holds a unit's frozen parameters."""


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives inside its unsharded flat buffer."""

    fqn: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that lies inside one rank's shard.

    Note:
        A parameter that straddles a shard boundary has one segment on each rank
        it touches; each segment is owned by exactly one rank.
    """

    param_index: int  # index into FlatBufferLayout.params
    fqn: str
    param_offset: int  # start inside the flattened parameter
    shard_offset: int  # start inside the rank's shard
    numel: int


def padded_size(numel: int, world_size: int) -> int:
    """Smallest multiple of ``world_size`` that is >= ``numel`` (and >= world_size)."""
    if world_size < 1:
        raise ValueError(f"Expects world_size >= 1 but got {world_size=}")
    return max(1, -(-numel // world_size)) * world_size


@dataclass(frozen=True)
class FlatBufferLayout:
    """One group's parameters of one unit and dtype, and how ranks share them."""

    group_index: int  # FROZEN_GROUP for frozen parameters
    params: tuple[ParamSlot, ...]
    world_size: int

    @property
    def numel(self) -> int:
        """Elements of real parameters, without padding."""
        return sum(slot.numel for slot in self.params)

    @property
    def padded_numel(self) -> int:
        return padded_size(self.numel, self.world_size)

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - self.numel

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def split_sizes(self) -> list[int]:
        """Sizes that split the unsharded buffer into its parameters and the padding."""
        return [slot.numel for slot in self.params] + [self.padding_numel]

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard inside the unsharded buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Expects 0 <= rank < {self.world_size} but got {rank=}")
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """The segment map of ``rank``'s shard: which parameters intersect it, and where."""
        shard_start, shard_end = self.shard_range(rank)
        found = []
        for index, slot in enumerate(self.params):
            start = max(slot.offset, shard_start)
            end = min(slot.offset + slot.numel, shard_end)
            if start < end:
                found.append(
                    Segment(index, slot.fqn, start - slot.offset, start - shard_start, end - start)
                )
        return tuple(found)

    def segment_ids(self, rank: int) -> torch.Tensor:
        """Per shard element, the index of its parameter; padding gets ``len(params)``.

        Lets per-parameter reductions be one ``index_add_`` over the whole shard.
        """
        ids = torch.full((self.shard_numel,), len(self.params), dtype=torch.int64)
        for segment in self.segments(rank):
            ids[segment.shard_offset : segment.shard_offset + segment.numel] = segment.param_index
        return ids

    def row_numels(self) -> tuple[int, ...]:
        """Elements per row of each parameter: a row is ``param[i]`` for a matrix or
        higher, the whole tensor for a vector or scalar (the units of unit-wise norms)."""
        return tuple(
            slot.numel // slot.shape[0] if len(slot.shape) >= 2 and slot.shape[0] else slot.numel
            for slot in self.params
        )

    def row_counts(self) -> tuple[int, ...]:
        """Rows of each parameter (see ``row_numels``)."""
        return tuple(
            slot.numel // row if row else 0
            for slot, row in zip(self.params, self.row_numels(), strict=True)
        )

    def row_ids(self, rank: int) -> torch.Tensor:
        """Per shard element, its row's index over the whole buffer; padding gets the
        number of rows. Lets row-wise reductions be one ``index_add_`` too."""
        counts = self.row_counts()
        total_rows = sum(counts)
        ids = torch.full((self.shard_numel,), total_rows, dtype=torch.int64)
        row_numels = self.row_numels()
        first_rows = [sum(counts[:index]) for index in range(len(counts))]
        for segment in self.segments(rank):
            positions = torch.arange(segment.param_offset, segment.param_offset + segment.numel)
            rows = positions // row_numels[segment.param_index] + first_rows[segment.param_index]
            ids[segment.shard_offset : segment.shard_offset + segment.numel] = rows
        return ids


def build_flat_buffer(
    group_index: int, named_shapes: Sequence[tuple[str, tuple[int, ...]]], world_size: int
) -> FlatBufferLayout:
    """Lay parameters ``(fqn, shape)`` end to end in the given order."""
    slots = []
    offset = 0
    for fqn, shape in named_shapes:
        numel = 1
        for dim in shape:
            numel *= dim
        slots.append(ParamSlot(fqn, tuple(shape), offset, numel))
        offset += numel
    return FlatBufferLayout(group_index, tuple(slots), world_size)


@dataclass(frozen=True)
class StorageLayout:
    """All flat buffers of one (unit, dtype); their shards share one local tensor.

    Note:
        Trainable buffers come first, in group order, then the frozen buffer (if
        any), so gradients are the contiguous prefix ``[0, trainable_shard_numel)``
        of the local tensor. Gathered, the storage is rank-major
        ``(world_size, local_numel)``; ``unsharded_*`` tensors are group-major.
    """

    unit_name: str
    dtype: torch.dtype
    world_size: int
    buffers: tuple[FlatBufferLayout, ...]

    def __post_init__(self) -> None:
        if any(buffer.world_size != self.world_size for buffer in self.buffers):
            raise ValueError("Expects every buffer of a storage to share its world size")
        kinds = [buffer.group_index == FROZEN_GROUP for buffer in self.buffers]
        if kinds != sorted(kinds):
            raise ValueError("Expects trainable buffers before the frozen buffer")

    @cached_property
    def trainable_buffers(self) -> tuple[FlatBufferLayout, ...]:
        return tuple(b for b in self.buffers if b.group_index != FROZEN_GROUP)

    @cached_property
    def frozen_buffers(self) -> tuple[FlatBufferLayout, ...]:
        return tuple(b for b in self.buffers if b.group_index == FROZEN_GROUP)

    @cached_property
    def shard_offsets(self) -> tuple[int, ...]:
        """Start of each buffer's shard inside the local tensor."""
        offsets, total = [], 0
        for buffer in self.buffers:
            offsets.append(total)
            total += buffer.shard_numel
        return tuple(offsets)

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(slot.fqn for buffer in self.buffers for slot in buffer.params)

    @property
    def local_numel(self) -> int:
        return sum(buffer.shard_numel for buffer in self.buffers)

    @property
    def trainable_shard_numel(self) -> int:
        return sum(buffer.shard_numel for buffer in self.trainable_buffers)

    @property
    def trainable_unsharded_numel(self) -> int:
        return sum(buffer.padded_numel for buffer in self.trainable_buffers)

    @property
    def frozen_unsharded_numel(self) -> int:
        return sum(buffer.padded_numel for buffer in self.frozen_buffers)

    def local_range(self, buffer_index: int) -> tuple[int, int]:
        """``[start, end)`` of buffer ``buffer_index``'s shard in the local tensor."""
        start = self.shard_offsets[buffer_index]
        return start, start + self.buffers[buffer_index].shard_numel


def build_storage(
    unit_name: str,
    dtype: torch.dtype,
    world_size: int,
    groups: Sequence[tuple[int, Sequence[tuple[str, tuple[int, ...]]]]],
) -> StorageLayout:
    """Build a storage from ``(group_index, [(fqn, shape), ...])``, skipping empty groups."""
    ordered = sorted((g for g in groups if g[1]), key=lambda g: (g[0] == FROZEN_GROUP, g[0]))
    buffers = tuple(build_flat_buffer(index, shapes, world_size) for index, shapes in ordered)
    return StorageLayout(unit_name, dtype, world_size, buffers)


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A rectangular block of a tensor: ``(offsets, sizes)``, one entry per dimension."""


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The rectangular blocks that the row-major elements ``[start, stop)`` of a tensor of
    ``shape`` make up, in order: for a matrix a partial first row, whole rows, a partial
    last row (at most 2 x (dims - 1) + 1 blocks in general). A shard's contiguous piece of
    a parameter is saved as these blocks, so a checkpoint holds the parameter in its own
    shape, as torch's distributed checkpoint writes a DTensor's shards."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= stop <= _numel(shape):
        raise ValueError(f"elements [{start}, {stop}) are outside a tensor of shape {list(shape)}")
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    inner = _numel(shape[1:])
    first, lead = divmod(start, inner)
    last, tail = divmod(stop, inner)
    if first == last:  # inside one slice of the leading dimension
        return [((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lead, tail)]
    boxes: list[Box] = []
    if lead:  # the partial first slice
        boxes += [((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lead, inner)]
        first += 1
    if last > first:  # whole slices
        boxes.append(((first, *(0,) * (len(shape) - 1)), (last - first, *shape[1:])))
    if tail:  # the partial last slice
        boxes += [((last, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, tail)]
    return boxes


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
