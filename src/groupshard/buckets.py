"""Gradient buckets: when unit gradients are reduced, and the collective that does it.

Gradients wait in a bucket per dtype until ``reduce_bucket_bytes`` are ready (a
backward's first bucket: ``first_bucket_bytes``, DDP's), then one reduce-scatter (an
all-reduce when replicated) averages them all into the shards' gradients. A bucket also
leaves early when the gradient that came next in the last backward would overfill it, so
the last gradients of backward, whose reduction nothing hides, go alone. With overlap a
reduction runs while backward goes on, at most ``REDUCES_IN_FLIGHT`` at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from groupshard import comm
from groupshard.options import ShardOptions
from groupshard.storage import FlatStorage

REDUCES_IN_FLIGHT = 2
"""Gradient buckets reducing at once: unsharded gradient bytes in flight stay below
``REDUCES_IN_FLIGHT`` x (``reduce_bucket_bytes`` + the largest unit's gradient)."""


class GradientBuckets:
    """The gradient buckets of one sharded model, and the reductions in flight."""

    def __init__(self, options: ShardOptions) -> None:
        self.bucket_bytes = options.reduce_bucket_bytes
        self.first_bucket_bytes = options.first_bucket_limit
        self.overlap = options.overlap
        # False: hybrid sharding keeps reduce-scattered gradients for a later all-reduce
        self.requires_all_reduce = True
        # gradients waiting for one collective, per dtype: [(storage, unsharded grad)]
        self._waiting: dict[torch.dtype, list[tuple[FlatStorage, torch.Tensor]]] = {}
        self._sent: set[torch.dtype] = set()  # dtypes whose first bucket of this backward left
        self.arrivals: list[tuple[FlatStorage, torch.dtype, int]] = []  # this backward's
        # bytes of the gradient of the same dtype that came after a storage's, last backward
        self._next_bytes: dict[FlatStorage, int] = {}
        self._reducing: list[tuple[comm.Pending, int]] = []  # (reduction, its input bytes)
        self.peak_reducing_bytes = 0  # most unsharded gradient bytes in reductions at once

    def add(self, storage: FlatStorage, grad: torch.Tensor) -> None:
        """Add a gradient to its bucket; send the bucket when it is full, or when the
        gradient that came next in the last backward would overfill it."""
        size = grad.numel() * grad.element_size()
        self.arrivals.append((storage, grad.dtype, size))
        waiting = self._waiting.setdefault(grad.dtype, [])
        waiting.append((storage, grad))
        total = sum(g.numel() * g.element_size() for _, g in waiting)
        limit = self.bucket_bytes if grad.dtype in self._sent else self.first_bucket_bytes
        following = self._next_bytes.get(storage)
        if total >= limit or (following is not None and total + following > limit):
            self._send(grad.dtype)

    def send_all(self) -> None:
        """Send every bucket that still waits (the end of a synced backward)."""
        for dtype in list(self._waiting):
            self._send(dtype)

    def end_backward(self) -> None:
        """Remember, per storage, the size of the next gradient of its dtype."""
        self._next_bytes = {}
        last: dict[torch.dtype, FlatStorage] = {}
        for storage, dtype, size in self.arrivals:
            if dtype in last:
                self._next_bytes[last[dtype]] = size
            last[dtype] = storage
        self.arrivals = []
        self._sent = set()

    def wait_all(self) -> None:
        while self._reducing:
            self._reducing.pop(0)[0].wait()

    def _then_across(self, started: comm.Pending, flat: torch.Tensor) -> None:
        """A reduced bucket's all-reduce across replicas, started when its reduce-scatter
        was waited for: it runs on while backward goes on, waited for as the others."""
        self._reducing.append((started, flat.numel() * flat.element_size()))

    def _send(self, dtype: torch.dtype) -> None:
        """One collective for every gradient waiting in the bucket of ``dtype`` (started,
        with overlap; waited for when too many run)."""
        waiting = self._waiting.pop(dtype, [])
        if not waiting:
            return
        self._sent.add(dtype)
        grads = [grad for _, grad in waiting]
        started = reduce_gradients(
            [storage for storage, _ in waiting], grads, self.overlap, self.requires_all_reduce,
            self._then_across,
        )  # fmt: skip
        self._reducing.append((started, sum(g.numel() * g.element_size() for g in grads)))
        self.peak_reducing_bytes = max(
            self.peak_reducing_bytes, sum(size for _, size in self._reducing)
        )
        while len(self._reducing) > (REDUCES_IN_FLIGHT if self.overlap else 0):
            self._reducing.pop(0)[0].wait()


def reduce_gradients(
    storages: list[FlatStorage],
    grads: list[torch.Tensor],
    async_op: bool = False,
    all_reduce: bool = True,
    then_across: Callable[[comm.Pending, torch.Tensor], None] | None = None,
) -> comm.Pending:
    """Average unsharded gradients over ranks into the storages' shard gradients.

    One reduce-scatter (an all-reduce when replicated) over the shard group for all groups
    of all the given storages, which must share ranks and replication, and whose gradients
    must share a dtype (the reduce dtype): the rank-major scatter input ``(ranks, sum of
    trainable shard sizes)`` is one ``_chunk_cat`` of every flat buffer's gradient. Under
    hybrid sharding, then one all-reduce of the reduced shards across the replicas
    (``across_replicas``); ``all_reduce=False`` keeps them on this rank for a later one
    instead. With ``async_op``, the shards have their gradients after ``wait()``, or, under
    hybrid sharding, after the wait of the all-reduce that ``wait()`` starts and hands to
    ``then_across`` (without ``then_across``, ``wait()`` waits for it too).
    """
    ranks = storages[0].ranks
    if storages[0].replicated:
        flat = grads[0] if len(grads) == 1 else torch.cat(grads)
        sizes = [grad.numel() for grad in grads]
        finish = across_replicas(storages, flat, sizes, all_reduce, async_op, then_across)
        return comm.all_reduce_mean(flat, ranks, async_op, finish)
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
    finish = across_replicas(storages, flat, sizes, all_reduce, async_op, then_across)
    return comm.reduce_scatter_mean(flat, scatter_input, ranks, async_op, finish)


def across_replicas(
    storages: list[FlatStorage],
    flat: torch.Tensor,
    sizes: list[int],
    all_reduce: bool,
    async_op: bool = False,
    then_across: Callable[[comm.Pending, torch.Tensor], None] | None = None,
) -> Callable[[], None]:
    """What follows the reduction within the shard group: assign each storage its part of
    ``flat``; under hybrid sharding first average it across the replicas (one all-reduce,
    with what earlier backwards without it held), or with ``all_reduce=False`` hold it.

    Note:
        The all-reduce starts when the reduce-scatter is waited for (on NCCL that wait only
        orders the streams, the host goes on); with ``async_op`` and ``then_across`` it then
        runs while backward goes on, and assigns the gradients at its own wait.
    """
    replicas = storages[0].replicas

    def assign() -> None:
        for storage, piece in zip(storages, flat.split(sizes), strict=True):
            storage.gradients.assign(piece)

    def finish() -> None:
        if replicas.size == 1:
            assign()
            return
        pieces = flat.split(sizes)
        for storage, piece in zip(storages, pieces, strict=True):
            if not all_reduce:
                storage.gradients.hold_partial(piece)
                continue
            held = storage.gradients.take_partial()
            if held is not None:
                piece.add_(held)
        if not all_reduce:
            return
        background = async_op and then_across is not None
        started = comm.all_reduce_mean(flat, replicas, background, assign)
        if background:
            then_across(started, flat)  # type: ignore[misc]

    return finish


def reduce_held_partials(storages: list[FlatStorage]) -> None:
    """Average across replicas the shard gradients that backwards without the all-reduce
    left on this rank and that no later reduction took along (one all-reduce each)."""
    for storage in storages:
        held = storage.gradients.take_partial()
        if held is not None:
            comm.all_reduce_mean(held, storage.replicas)
            storage.gradients.assign(held)
