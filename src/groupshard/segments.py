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
from groupshard.tensor_parallel import TensorParallelism

SEGMENTS_ATTR = "groupshard_segments"


@dataclass(frozen=True)
class ShardSegments:
    """How one shard parameter maps onto the original parameters.

    ``needs_reduce`` is False when this rank holds the whole buffer. Under tensor
    parallelism (``tensor_parallel``) the buffer holds the rank's local TP pieces: a sum
    over the whole model also runs over the tp ranks (``reduce_over``), and counts each
    parameter's pieces as ``counted`` says.
    """

    buffer: FlatBufferLayout
    shard_rank: int
    ranks: Ranks
    replicated: bool
    device: torch.device
    tensor_parallel: TensorParallelism | None = None

    @property
    def needs_reduce(self) -> bool:
        return not self.replicated and self.ranks.size > 1

    @property
    def reduce_over(self) -> tuple[Ranks, ...]:
        """The groups a sum over the whole parameters runs over, in order: the shard group,
        then the tp group (none: this rank holds the whole buffer)."""
        data_parallel = (self.ranks,) if self.needs_reduce else ()
        if self.tensor_parallel is None or self.tensor_parallel.ranks.size < 2:
            return data_parallel
        return (*data_parallel, self.tensor_parallel.ranks)

    @cached_property
    def counted(self) -> torch.Tensor | None:
        """Per parameter, 1 where this rank's partial counts in a sum over the whole
        model and 0 where a tp peer counts the same values (``TensorParallelism.counted``);
        None without tensor parallelism."""
        if self.tensor_parallel is None:
            return None
        weights = [float(self.tensor_parallel.counted(fqn)) for fqn in self.fqns]
        return torch.tensor(weights, dtype=torch.float64, device=self.device)

    @cached_property
    def tp_summed_rows(self) -> torch.Tensor | None:
        """Per row of the buffer (see ``FlatBufferLayout.row_numels``), whether the row is
        split over the tp ranks, so its sums add over tp: every row of a Shard(1) matrix,
        and a Shard(0) vector (one row). A Shard(0) matrix's rows are whole on their tp
        rank, and a Replicate parameter's are the same on every tp rank. None without
        tensor parallelism."""
        if self.tensor_parallel is None:
            return None
        flags = []
        for slot, rows in zip(self.buffer.params, self.buffer.row_counts(), strict=True):
            dim = self.tensor_parallel.split_dim(slot.fqn)
            flags += [dim == 1 or (dim == 0 and len(slot.shape) < 2)] * rows
        return torch.tensor(flags, dtype=torch.bool, device=self.device)

    @cached_property
    def uncounted_pieces(self) -> tuple[Segment, ...]:
        """The pieces of this shard whose values a tp peer counts (see ``counted``)."""
        if self.tensor_parallel is None:
            return ()
        return tuple(p for p in self.pieces if not self.tensor_parallel.counted(p.fqn))

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
