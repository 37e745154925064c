"""The tensors of one storage: local shards, and unsharded buffers while gathered.

Note: FSDP-style tensor vocabulary
    ``local``: this rank's shards of every flat buffer of the storage, end to end,
    trainable first (1D, ``layout.local_numel``). ``shards``: one ``nn.Parameter``
    per flat buffer, a view into ``local``; the optimizer sees these.
    ``unsharded_trainable``: a leaf tensor holding every trainable buffer unsharded
    and group-major (1D); the model's parameters are views of it (one ``split``),
    so autograd delivers a unit's whole gradient as one flat tensor.
    ``unsharded_frozen``: the same for frozen parameters, without gradient.
    When the storage is replicated (``layout.world_size == 1``) the unsharded
    tensors alias ``local`` and gathering is a no-op.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from groupshard import comm, flatstate
from groupshard.layout import FlatBufferLayout, Segment, StorageLayout

SEGMENTS_ATTR = "groupshard_segments"


@dataclass(frozen=True)
class ShardSegments:
    """How one shard parameter maps onto the original parameters.

    Attached to every shard as ``shard.groupshard_segments``, so norm code and
    layer-wise optimizers can reduce per original parameter (or per row) over the
    flat shard. ``needs_reduce`` is False when this rank holds the whole buffer.
    """

    buffer: FlatBufferLayout
    shard_rank: int
    ranks: comm.Ranks
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


def segments_of(tensor: torch.Tensor) -> ShardSegments | None:
    """The segment map of a groupshard shard, or None for a plain tensor."""
    return getattr(tensor, SEGMENTS_ATTR, None)


def _flatten_buffer(buffer: FlatBufferLayout, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The unsharded, padded flat buffer built from the original parameters."""
    first = params[buffer.params[0].fqn]
    pieces = [params[slot.fqn].detach().reshape(-1) for slot in buffer.params]
    pieces.append(first.new_zeros(buffer.padding_numel))
    return torch.cat(pieces)


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _allocate(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    wanted = tensor.numel() * tensor.element_size()
    if storage.size() != wanted:
        storage.resize_(wanted)


class FlatStorage:
    """Owns the local shards of one (unit, dtype) and gathers / reduces them."""

    def __init__(
        self,
        layout: StorageLayout,
        ranks: comm.Ranks,
        params: Mapping[str, torch.Tensor],
        sync_from_rank0: bool,
    ) -> None:
        self.layout = layout
        self.ranks = ranks
        self.replicated = layout.world_size == 1
        self.shard_rank = 0 if self.replicated else ranks.rank
        device = params[layout.buffers[0].params[0].fqn].device
        self.local = torch.empty(layout.local_numel, dtype=layout.dtype, device=device)  # 1D
        self._fill_local(params, sync_from_rank0)
        self.shards = [
            nn.Parameter(
                self.local[slice(*layout.local_range(i))], requires_grad=b.group_index >= 0
            )
            for i, b in enumerate(layout.buffers)
        ]
        for shard, buffer in zip(self.shards, layout.buffers, strict=True):
            segments = ShardSegments(buffer, self.shard_rank, ranks, self.replicated, device)
            setattr(shard, SEGMENTS_ATTR, segments)
        trainable, frozen = layout.trainable_unsharded_numel, layout.frozen_unsharded_numel
        if self.replicated:
            self.unsharded_trainable = self.local[:trainable].detach()
            self.unsharded_frozen = self.local[trainable:]
        else:
            self.unsharded_trainable = self.local.new_empty(trainable)
            self.unsharded_frozen = self.local.new_empty(frozen)
        # .data gives an alias with its own version counter: gathering into it does not
        # invalidate views that autograd saved for backward.
        self.trainable_data = self.unsharded_trainable.data
        self.unsharded_trainable.requires_grad_(trainable > 0)
        self.is_unsharded = self.replicated
        if not self.replicated:
            self.reshard()

    def _fill_local(self, params: Mapping[str, torch.Tensor], sync_from_rank0: bool) -> None:
        unsharded = torch.cat([_flatten_buffer(b, params) for b in self.layout.buffers])
        if sync_from_rank0:
            comm.broadcast(unsharded, self.ranks)
        offset = 0
        for index, buffer in enumerate(self.layout.buffers):
            start, end = buffer.shard_range(self.shard_rank)
            local_start, local_end = self.layout.local_range(index)
            self.local[local_start:local_end].copy_(unsharded[offset + start : offset + end])
            offset += buffer.padded_numel

    @cached_property
    def trainable_shards(self) -> list[nn.Parameter]:
        return [
            s for s, b in zip(self.shards, self.layout.buffers, strict=True) if b.group_index >= 0
        ]

    def unsharded_buffers(self) -> list[torch.Tensor]:
        """Each buffer's unsharded (padded) data, in layout order, without autograd."""
        views = []
        for data, buffers in (
            (self.trainable_data, self.layout.trainable_buffers),
            (self.unsharded_frozen, self.layout.frozen_buffers),
        ):
            views.extend(data.split([b.padded_numel for b in buffers]))
        return views

    def unshard(self) -> None:
        """All-gather every buffer of the storage with one collective."""
        if self.replicated:
            return
        self.allocate_unsharded()
        targets = self.unsharded_buffers()
        if len(targets) == 1:  # rank-major is group-major: gather in place
            comm.all_gather(targets[0], self.local, self.ranks)
        else:
            gathered = self.local.new_empty(self.ranks.size * self.layout.local_numel)
            comm.all_gather(gathered, self.local, self.ranks)
            self.copy_out(gathered.view(self.ranks.size, -1))
        self.is_unsharded = True

    def allocate_unsharded(self) -> None:
        _allocate(self.trainable_data)
        _allocate(self.unsharded_frozen)

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Rank-major gathered shards ``(ranks, local_numel)`` into the group-major buffers."""
        torch.split_with_sizes_copy(
            gathered,
            [b.shard_numel for b in self.layout.buffers],
            dim=1,
            out=[t.view(self.ranks.size, -1) for t in self.unsharded_buffers()],
        )
        self.is_unsharded = True

    def reshard(self) -> None:
        """Free the unsharded buffers (their views keep pointing at the same storage)."""
        if self.replicated:
            return
        _free(self.trainable_data)
        _free(self.unsharded_frozen)
        self.is_unsharded = False

    def param_views(self) -> dict[str, torch.Tensor]:
        """The original parameters as views of the unsharded buffers, by FQN."""
        views: dict[str, torch.Tensor] = {}
        for source, buffers in (
            (self.unsharded_trainable, self.layout.trainable_buffers),
            (self.unsharded_frozen, self.layout.frozen_buffers),
        ):
            if not buffers:
                continue
            sizes = [size for b in buffers for size in b.split_sizes]
            chunks = iter(torch.split(source, sizes))
            for buffer in buffers:
                for slot in buffer.params:
                    views[slot.fqn] = next(chunks).view(slot.shape)
                next(chunks)  # padding
        return views

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The gradient autograd accumulated into the unsharded buffer (1D, group-major)."""
        grad = self.unsharded_trainable.grad
        self.unsharded_trainable.grad = None
        return grad

    def assign_shard_grads(self, sharded_grad: torch.Tensor) -> None:
        """Give each trainable shard its slice of ``sharded_grad`` (added if it has one)."""
        sizes = [buffer.shard_numel for buffer in self.layout.trainable_buffers]
        for shard, piece in zip(self.trainable_shards, sharded_grad.split(sizes), strict=True):
            if shard.grad is None:
                shard.grad = piece
            else:
                shard.grad.add_(piece)

    def gather_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the storage, unsharded, as new tensors (one all-gather per
        flat buffer; the runtime's unsharded buffers are not touched)."""
        params: dict[str, torch.Tensor] = {}
        for shard, buffer in zip(self.shards, self.layout.buffers, strict=True):
            full = flatstate.unshard(shard, buffer, self.ranks, self.replicated)
            params.update(
                zip(
                    (slot.fqn for slot in buffer.params), flatstate.split(full, buffer), strict=True
                )
            )
        return params

    def write_back(self) -> None:
        """Copy this rank's part of the unsharded buffers back into ``local``."""
        if self.replicated:
            return
        for index, (buffer, data) in enumerate(
            zip(self.layout.buffers, self.unsharded_buffers(), strict=True)
        ):
            start, end = buffer.shard_range(self.shard_rank)
            self.local[slice(*self.layout.local_range(index))].copy_(data[start:end])


def reduce_gradients(storages: list[FlatStorage], grads: list[torch.Tensor]) -> None:
    """Average unsharded gradients over ranks into the storages' shard gradients.

    One reduce-scatter (an all-reduce when replicated) for all groups of all the given
    storages, which must share dtype, ranks and replication: the rank-major scatter
    input ``(ranks, sum of trainable shard sizes)`` is one ``_chunk_cat`` of every
    flat buffer's gradient.
    """
    ranks = storages[0].ranks
    if storages[0].replicated:
        flat = grads[0] if len(grads) == 1 else torch.cat(grads)
        comm.all_reduce_mean(flat, ranks)
        pieces = flat.split([grad.numel() for grad in grads])
    else:
        per_buffer = [
            piece
            for storage, grad in zip(storages, grads, strict=True)
            for piece in grad.split([b.padded_numel for b in storage.layout.trainable_buffers])
        ]
        if len(per_buffer) == 1:  # rank-major already
            scatter_input = per_buffer[0]
        else:
            scatter_input = torch._chunk_cat(per_buffer, dim=0, num_chunks=ranks.size)
        sizes = [storage.layout.trainable_shard_numel for storage in storages]
        flat = grads[0].new_empty(sum(sizes))
        comm.reduce_scatter_mean(flat, scatter_input, ranks)
        pieces = flat.split(sizes)
    for storage, piece in zip(storages, pieces, strict=True):
        storage.assign_shard_grads(piece)


def unshard_storages(storages: list[FlatStorage]) -> None:
    """All-gather several sharded storages (one dtype, one process group) in one collective."""
    ranks = storages[0].ranks
    sizes = [storage.layout.local_numel for storage in storages]
    local = torch.cat([storage.local for storage in storages])
    gathered = local.new_empty(ranks.size * local.numel())
    comm.all_gather(gathered, local, ranks)
    for storage, columns in zip(
        storages, gathered.view(ranks.size, -1).split(sizes, dim=1), strict=True
    ):
        storage.allocate_unsharded()
        storage.copy_out(columns)
