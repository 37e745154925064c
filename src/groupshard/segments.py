"""The segment map of a shard: which original parameters a rank's flat slice holds, where.

Attached to every shard the optimizer sees (``attach_segments``), so norms, layer-wise
optimizers, Muon, the ZeRO optimizer and checkpoints reduce or slice per original
parameter (or per row) over a flat shard. No communication here; ``ranks`` is carried
for the callers that reduce over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from groupshard.comm import Ranks
from groupshard.layout import FlatBufferLayout, Segment

SEGMENTS_ATTR = "groupshard_segments"


@dataclass(frozen=True)
class ShardSegments:
    """How one shard parameter maps onto the original parameters.

    ``needs_reduce`` is False when this rank holds the whole buffer.
    """

    buffer: FlatBufferLayout
    shard_rank: int
    ranks: Ranks
    replicated: bool
    device: torch.device

    @property
    def needs_reduce(self) -> bool:
        return not self.replicated and self.ranks.size > 1

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(slot.fqn for slot in self.buffer.params)

    @property
    def num_rows(self) -> int:
        return sum(self.buffer.row_counts())

    @cached_property
    def pieces(self) -> tuple[Segment, ...]:
        """The segment map of this shard: consecutive parameter pieces, then padding."""
        return self.buffer.segments(self.shard_rank)

    @property
    def padding_numel(self) -> int:
        return self.buffer.shard_numel - sum(piece.numel for piece in self.pieces)

    @cached_property
    def first_rows(self) -> tuple[int, ...]:
        """Index of each parameter's first row among all rows of the buffer."""
        counts = self.buffer.row_counts()
        return tuple(sum(counts[:index]) for index in range(len(counts)))

    @cached_property
    def segment_ids(self) -> torch.Tensor:
        return self.buffer.segment_ids(self.shard_rank).to(self.device)

    @cached_property
    def row_ids(self) -> torch.Tensor:
        return self.buffer.row_ids(self.shard_rank).to(self.device)


def attach_segments(shard: torch.Tensor, segments: ShardSegments) -> None:
    """Make ``segments`` the segment map of ``shard`` (see ``segments_of``)."""
    setattr(shard, SEGMENTS_ATTR, segments)


def segments_of(tensor: torch.Tensor) -> ShardSegments | None:
    """The segment map of a groupshard shard, or None for a plain tensor."""
    return getattr(tensor, SEGMENTS_ATTR, None)
