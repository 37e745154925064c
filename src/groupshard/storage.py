"""The storage of one (unit, dtype): its local shards, and its unsharded buffers while gathered.

Note: FSDP-style tensor vocabulary
    ``local``: this rank's shards of every flat buffer of the storage, end to end,
    trainable first (1D, ``layout.local_numel``). ``shards``: one ``nn.Parameter``
    per flat buffer, a view into ``local``; the optimizer sees these.
    ``unsharded_trainable``: a leaf tensor holding every trainable buffer unsharded
    and group-major (1D); the model's parameters are views of it (one ``split``),
    so autograd delivers a unit's whole gradient as one flat tensor.
    ``unsharded_frozen``: the same for frozen parameters, without gradient.
    Under tensor parallelism every tensor here holds the rank's *local* TP pieces
    (``groupshard.tensor_parallel``); ``param_views`` wraps them as DTensors again.
    When the storage is replicated (``layout.world_size == 1``) and computes in its own
    dtype, the unsharded tensors alias ``local`` and gathering is a no-op.

Note: mixed precision
    ``local`` (the optimizer's shards) is the master, in the parameters' own dtype. The
    unsharded tensors are in ``compute_dtype``: a gather casts the local shard first (so
    the all-gather moves ``compute_dtype`` bytes), and a replicated storage that computes
    in another dtype gathers by a cast copy. Gradients arrive in ``compute_dtype`` and
    are reduced in ``reduce_dtype``; they land in the shards' dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

import torch
from torch import nn

from groupshard import comm, flatten
from groupshard.gradients import StorageGradients
from groupshard.layout import StorageLayout
from groupshard.mesh import MeshRanks
from groupshard.segments import ShardSegments, attach_segments
from groupshard.tensor_parallel import TensorParallelism
from groupshard.writes import note_parameters_written, parameter_writes


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
        mesh: MeshRanks,
        params: Mapping[str, torch.Tensor],
        sync_from_rank0: bool,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        unsharded: torch.Tensor | None = None,
        tensor_parallel: TensorParallelism | None = None,
    ) -> None:
        self.layout = layout
        # the DTensor parameters among ours, stored as their local pieces
        self._tp_params = {
            slot.fqn: tensor_parallel.params[slot.fqn]
            for b in layout.buffers
            for slot in b.params
            if tensor_parallel is not None and slot.fqn in tensor_parallel.params
        }
        self.ranks = ranks = mesh.shard  # the shard group
        self.replicas = mesh.replicate  # hold the same shards; gradients all-reduced across
        self.world = mesh.world  # every rank of the model
        self.replicated = layout.world_size == 1
        self.shard_rank = 0 if self.replicated else ranks.rank
        self.compute_dtype = compute_dtype or layout.dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        # the unsharded tensors are ``local`` itself: nothing to gather, nothing to free
        self.aliases_local = self.replicated and self.compute_dtype == layout.dtype
        device = params[layout.buffers[0].params[0].fqn].device
        self.local = torch.empty(layout.local_numel, dtype=layout.dtype, device=device)  # 1D
        self._fill_local(params, sync_from_rank0, unsharded)
        self.shards = [
            nn.Parameter(
                self.local[slice(*layout.local_range(i))], requires_grad=b.group_index >= 0
            )
            for i, b in enumerate(layout.buffers)
        ]
        for shard, buffer in zip(self.shards, layout.buffers, strict=True):
            segments = ShardSegments(
                buffer, self.shard_rank, ranks, self.replicated, device, tensor_parallel
            )
            attach_segments(shard, segments)
        trainable, frozen = layout.trainable_unsharded_numel, layout.frozen_unsharded_numel
        if self.aliases_local:
            self.unsharded_trainable = self.local[:trainable].detach()
            self.unsharded_frozen = self.local[trainable:]
        else:
            self.unsharded_trainable = self.local.new_empty(trainable, dtype=self.compute_dtype)
            self.unsharded_frozen = self.local.new_empty(frozen, dtype=self.compute_dtype)
        # .data gives an alias with its own version counter: gathering into it does not
        # invalidate views that autograd saved for backward.
        self.trainable_data = self.unsharded_trainable.data
        self.frozen_data = self.unsharded_frozen.data
        self.unsharded_trainable.requires_grad_(trainable > 0)
        self.is_unsharded = self.aliases_local
        self.gathered_at = -1  # parameter_writes() when last gathered
        self.gathering: comm.Pending | None = None  # an asynchronous gather into the buffers
        self.reshard()
        # The user's original parameters (emptied), whose requires_grad still says frozen.
        self.frozen_originals = {
            slot.fqn: params[slot.fqn] for b in layout.frozen_buffers for slot in b.params
        }
        self.gradients = StorageGradients(
            layout,
            self.unsharded_trainable,
            self.trainable_shards,
            [params[slot.fqn] for b in layout.trainable_buffers for slot in b.params],
            self._param_outputs,
            self.reduce_dtype,
        )

    @torch.no_grad()
    def _fill_local(
        self,
        params: Mapping[str, torch.Tensor],
        sync_from_rank0: bool,
        unsharded: torch.Tensor | None,
    ) -> None:
        """Copy this rank's slices of the parameters into ``local``; with
        ``sync_from_rank0``, rank 0's values, through one broadcast of the flat storage
        (the only full-size temporary). ``unsharded``: the parameters already laid out as
        the storage's flat buffers, end to end (``materialize``), used in place."""
        if unsharded is None and sync_from_rank0 and self.world.group is not None:
            unsharded = self.local.new_zeros(sum(b.padded_numel for b in self.layout.buffers))
            offset = 0
            for buffer in self.layout.buffers:
                for slot in buffer.params:
                    start = offset + slot.offset
                    unsharded[start : start + slot.numel].copy_(params[slot.fqn].reshape(-1))
                offset += buffer.padded_numel
        if unsharded is not None:
            if sync_from_rank0:
                comm.broadcast(unsharded, self.world)
            sources = {
                slot.fqn: piece
                for buffer, data in zip(
                    self.layout.buffers,
                    unsharded.split([b.padded_numel for b in self.layout.buffers]),
                    strict=True,
                )
                for slot, piece in zip(buffer.params, data.split(buffer.split_sizes), strict=False)
            }
        else:
            sources = {
                slot.fqn: params[slot.fqn].detach().reshape(-1)
                for buffer in self.layout.buffers
                for slot in buffer.params
            }
        self.local.zero_()  # padding
        for index, buffer in enumerate(self.layout.buffers):
            start, end = buffer.shard_range(self.shard_rank)
            local_start, _ = self.layout.local_range(index)
            for slot in buffer.params:
                first = max(slot.offset, start)
                last = min(slot.offset + slot.numel, end)
                if last > first:
                    self.local[local_start + first - start : local_start + last - start].copy_(
                        sources[slot.fqn][first - slot.offset : last - slot.offset]
                    )

    def check_shards(self) -> None:
        """Fail if a shard stopped being a view of ``local`` (e.g. ``module.half()`` on a
        submodule converted it): the optimizer would step a tensor the model never reads."""
        for shard in self.shards:
            if (
                shard.dtype != self.local.dtype
                or shard.device != self.local.device
                or shard.untyped_storage().data_ptr() != self.local.untyped_storage().data_ptr()
            ):
                raise ValueError(
                    f"The shards of unit {self.layout.unit_name or '<root>'!r} were replaced "
                    f"(now {shard.dtype} on {shard.device}, sharded as {self.local.dtype} on "
                    f"{self.local.device}), e.g. by .to(), .half() or .to_empty() on a "
                    "submodule; a model sharded by gs.shard cannot be converted: convert or "
                    "move the model before gs.shard; to compute in another dtype, shard with "
                    "mixed_precision=gs.MixedPrecision(param_dtype=...)."
                )
        unfrozen = [fqn for fqn, p in self.frozen_originals.items() if p.requires_grad]
        if unfrozen:
            raise ValueError(
                f"Parameters {unfrozen} were frozen when the model was sharded (or by "
                "gs.regroup) and were given requires_grad=True since; a sharded model keeps "
                "them in a flat buffer without gradient or param group: unfreeze them with "
                "gs.regroup(model, optimizer, groups) (docs/regroup.md), or freeze them again."
            )

    @cached_property
    def local_pieces(self) -> dict[str, torch.Tensor]:
        """Each parameter's part of this rank's shards, by FQN, as a view of ``local``:
        1-D and possibly empty when sharded, the whole parameter in its shape when
        replicated. Never stale: the optimizer updates ``local`` in place."""
        pieces: dict[str, torch.Tensor] = {}
        for index, buffer in enumerate(self.layout.buffers):
            local_start, _ = self.layout.local_range(index)
            start, end = buffer.shard_range(self.shard_rank)
            for slot in buffer.params:
                first = max(slot.offset, start)
                last = max(first, min(slot.offset + slot.numel, end))
                piece = self.local[local_start + first - start : local_start + last - start]
                pieces[slot.fqn] = piece.view(slot.shape) if self.replicated else piece
        return pieces

    @cached_property
    def whole_shapes(self) -> dict[str, torch.Size]:
        """Each parameter's whole shape, by FQN: a DTensor parameter's global one."""
        return {
            slot.fqn: self._tp_params[slot.fqn].shape if slot.fqn in self._tp_params else slot.shape
            for buffer in self.layout.buffers
            for slot in buffer.params
        }

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
            (self.frozen_data, self.layout.frozen_buffers),
        ):
            views.extend(data.split([b.padded_numel for b in buffers]))
        return views

    @property
    def is_current(self) -> bool:
        """Gathered, and no parameter was written since (an optimizer step, a load)."""
        return self.is_unsharded and (self.aliases_local or self.gathered_at == parameter_writes())

    def gather_source(self) -> torch.Tensor:
        """This rank's shards in ``compute_dtype``: what the all-gather sends."""
        return self.local.to(self.compute_dtype)

    def unshard(self, async_op: bool = False) -> comm.Pending:
        """All-gather every buffer of the storage with one collective (a cast copy when
        replicated); with ``async_op``, the buffers are complete after ``wait()``."""
        if self.aliases_local:
            return comm.Pending(done=True)
        self.allocate_unsharded()
        targets = self.unsharded_buffers()
        if self.replicated:
            torch._foreach_copy_(targets, list(self.local.split([t.numel() for t in targets])))
            self.mark_gathered()
            return comm.Pending(done=True)
        source = self.gather_source()
        if len(targets) == 1:  # rank-major is group-major: gather in place
            pending = comm.all_gather(targets[0], source, self.ranks, async_op, self.mark_gathered)
        else:
            gathered = source.new_empty(self.ranks.size * self.layout.local_numel)
            pending = comm.all_gather(
                gathered,
                source,
                self.ranks,
                async_op,
                lambda: self.copy_out(gathered.view(self.ranks.size, -1)),
            )
        self.gathering = pending
        return pending

    def mark_gathered(self) -> None:
        self.is_unsharded = True
        self.gathered_at = parameter_writes()

    def allocate_unsharded(self) -> None:
        _allocate(self.trainable_data)
        _allocate(self.frozen_data)

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Rank-major gathered shards ``(ranks, local_numel)`` into the group-major buffers."""
        torch.split_with_sizes_copy(
            gathered,
            [b.shard_numel for b in self.layout.buffers],
            dim=1,
            out=[t.view(self.ranks.size, -1) for t in self.unsharded_buffers()],
        )
        self.mark_gathered()

    def reshard(self) -> None:
        """Free the unsharded buffers (their views keep pointing at the same storage).

        A gather into them that is still in flight is waited for first: the collective
        writes through the buffers' address (and its copy-out into them), which freeing the
        storage would leave pointing at memory the allocator may have handed out again."""
        if self.aliases_local:
            return
        if self.gathering is not None:
            self.gathering.wait()  # at once when done: waiting twice is harmless
            self.gathering = None
        _free(self.trainable_data)
        _free(self.frozen_data)
        self.is_unsharded = False

    def param_views(
        self, track_use: bool = False, unsharded: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The original parameters as views of the unsharded buffers, by FQN.

        With ``track_use``, the backward that reaches any trainable view records which
        ones it reached (``StorageGradients.note_used``).
        ``unsharded``: views of this tensor (``gather_masters()``) instead.
        """
        views: dict[str, torch.Tensor] = {}
        if unsharded is None:
            trainable, frozen = self.unsharded_trainable, self.unsharded_frozen
        else:
            trainable, frozen = unsharded.split(
                [self.layout.trainable_unsharded_numel, self.layout.frozen_unsharded_numel]
            )
        for source, (sizes, slots) in zip((trainable, frozen), self._view_plans, strict=True):
            if not sizes:
                continue
            chunks = source.split_with_sizes(sizes)
            for position, fqn, shape in slots:
                chunk = chunks[position]
                # a view op costs as much as the split: make one only where the shape differs
                views[fqn] = chunk if len(shape) == 1 else chunk.view(shape)
                if fqn in self._tp_params:  # the DTensor around the local piece
                    views[fqn] = self._tp_params[fqn].wrap(views[fqn])
            if track_use and source is self.unsharded_trainable and chunks[0].grad_fn is not None:
                # one hook per storage and forward, one call per backward
                chunks[0].grad_fn.register_prehook(self.gradients.note_used)
        return views

    @cached_property
    def _view_plans(self) -> tuple[tuple[list[int], list[tuple[int, str, torch.Size]]], ...]:
        """Per source (trainable, frozen): the sizes that split it into parameters and
        paddings, and each parameter's (index among the pieces, FQN, shape)."""
        plans = []
        for buffers in (self.layout.trainable_buffers, self.layout.frozen_buffers):
            sizes = [size for b in buffers for size in b.split_sizes]
            slots, position = [], 0
            for buffer in buffers:
                for slot in buffer.params:
                    slots.append((position, slot.fqn, torch.Size(slot.shape)))
                    position += 1
                position += 1  # padding
            plans.append((sizes, slots))
        return tuple(plans)

    @cached_property
    def _param_outputs(self) -> list[int]:
        """Index of each trainable parameter's piece among the split's outputs."""
        _, trainable_slots = self._view_plans[0]
        return [position for position, _, _ in trainable_slots]

    def gather_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the storage, unsharded, as new tensors (one all-gather per
        flat buffer; the runtime's unsharded buffers are not touched)."""
        params: dict[str, torch.Tensor] = {}
        for shard, buffer in zip(self.shards, self.layout.buffers, strict=True):
            full = flatten.unshard(shard, buffer, self.ranks, self.replicated)
            params.update(
                zip((slot.fqn for slot in buffer.params), flatten.split(full, buffer), strict=True)
            )
        return params

    def gather_masters(self) -> torch.Tensor:
        """Every buffer unsharded in the shards' own dtype, group-major, as one new tensor
        (``local`` itself when replicated): one all-gather."""
        if self.replicated:
            return self.local
        gathered = self.local.new_empty(self.ranks.size * self.layout.local_numel)
        comm.all_gather(gathered, self.local, self.ranks)
        unsharded = self.local.new_empty(self.ranks.size * self.layout.local_numel)
        sizes = [b.padded_numel for b in self.layout.buffers]
        torch.split_with_sizes_copy(
            gathered.view(self.ranks.size, -1),
            [b.shard_numel for b in self.layout.buffers],
            dim=1,
            out=[t.view(self.ranks.size, -1) for t in unsharded.split(sizes)],
        )
        return unsharded

    def write_back(self, unsharded: torch.Tensor) -> None:
        """Copy this rank's part of ``unsharded`` (from ``gather_masters``) into ``local``."""
        note_parameters_written()
        if unsharded is self.local:
            return
        sizes = [b.padded_numel for b in self.layout.buffers]
        for index, (buffer, data) in enumerate(
            zip(self.layout.buffers, unsharded.split(sizes), strict=True)
        ):
            start, end = buffer.shard_range(self.shard_rank)
            self.local[slice(*self.layout.local_range(index))].copy_(data[start:end])
