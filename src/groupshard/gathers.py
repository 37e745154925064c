"""Gather windows: when each unit's parameters are all-gathered.

A unit is gathered before it runs, together with the units that run after it (in the
last forward's order, and for ``full`` in the last backward's) while they fit in
``prefetch_bytes``: one all-gather for the window. With overlap, the window of the unit
that runs next is always prefetched, whatever its size (FSDP2's default: one unit ahead):
its all-gather starts before the last unit of the current window computes, and is waited
for when its first unit runs. So ``full`` holds at most the root, the unit computing and
the next window (one unit, or several together up to ``prefetch_bytes``). The windows
follow each rank's recorded order, so every rank must run its units in the same order
(``end_of_backward`` checks it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from groupshard import comm
from groupshard.options import ShardOptions
from groupshard.storage import FlatStorage
from groupshard.unit_runtime import UnitRuntime


class GatherSchedule:
    """The gathers of one sharded model's units, and the orders they follow."""

    def __init__(self, units: Sequence[UnitRuntime], options: ShardOptions) -> None:
        self.units = list(units)  # pre-order; units[0] is the root
        self.windows = options.gathers_in_windows
        self.prefetch_bytes = options.prefetch_bytes
        self.overlap = options.overlap
        self._in_flight: dict[UnitRuntime, list[comm.Pending]] = {}  # started, not waited
        self.forward_order: list[UnitRuntime] = []  # as the last whole forward ran them
        self.forward_running: list[UnitRuntime] = []  # as this forward runs them
        self.backward_order: list[UnitRuntime] = []  # as the last backward reached them
        self._backward_running: list[UnitRuntime] = []  # as this backward reaches them
        self.peak_gathered_bytes = 0  # most unsharded parameter bytes held at once

    def start_forward(self) -> None:
        """The root's forward begins: the forward that ran before is the order to follow."""
        if self.forward_running:
            self.forward_order = self.forward_running
        self.forward_running = []
        self.wait_all()

    def before_forward(self, unit: UnitRuntime) -> None:
        if unit not in self.forward_running:
            self.forward_running.append(unit)
        self._gather_for_use(unit, self.forward_order)

    def before_backward(self, unit: UnitRuntime) -> None:
        if unit not in self._backward_running:
            self._backward_running.append(unit)
        self._gather_for_use(unit, self.backward_order or self.forward_order[::-1])

    def gather_now(self, unit: UnitRuntime) -> None:
        """Make ``unit`` gathered now, outside the recorded orders (a recomputation)."""
        self._wait_for(unit)
        if unit.needs_gather:
            self.gather_together([unit])

    def end_backward(self) -> None:
        """Backward is over: its order is the one the next backward follows."""
        self.backward_order, self._backward_running = self._backward_running, []
        self.wait_all()

    def wait_all(self) -> None:
        """Wait for every gather started ahead (e.g. prefetched but not used)."""
        for unit in list(self._in_flight):
            self._wait_for(unit)

    def gathered_bytes(self) -> int:
        """Bytes of unsharded parameters allocated right now: gathered or being gathered."""
        return sum(
            unit.unsharded_bytes
            for unit in self.units
            if unit.is_gathered or unit in self._in_flight
        )

    def _gather_for_use(self, unit: UnitRuntime, order: Sequence[UnitRuntime]) -> None:
        """Make ``unit`` gathered (waiting for its prefetch, or gathering its window now),
        then start gathering the next window if ``unit`` ends the current one."""
        self._wait_for(unit)
        if unit.needs_gather:
            self.gather_together(self._with_followers(unit, order))
        if self.overlap and self.windows and unit in order:
            self._prefetch_after(unit, order)

    def _prefetch_after(self, unit: UnitRuntime, order: Sequence[UnitRuntime]) -> None:
        """Start gathering the window of the unit after ``unit`` in ``order`` (a unit larger
        than ``prefetch_bytes`` alone), unless it is gathered or on its way already."""
        position = order.index(unit) + 1
        if position == len(order):
            return
        following = order[position]
        if following in self._in_flight or not following.needs_gather:
            return
        window = self._with_followers(following, order)
        pendings = self.gather_together(window, async_op=True)
        for member in window:
            self._in_flight[member] = pendings
        self._note_peak()

    def _wait_for(self, unit: UnitRuntime) -> None:
        for pending in self._in_flight.pop(unit, ()):
            pending.wait()

    def _with_followers(self, unit: UnitRuntime, order: Sequence[UnitRuntime]) -> list[UnitRuntime]:
        """``unit`` and the units after it in ``order`` that fit in ``prefetch_bytes``.

        Gathering them together saves a collective's latency per unit (one for all).
        """
        chosen = [unit]
        if not self.windows or unit not in order:
            return chosen
        budget = self.prefetch_bytes - unit.unsharded_bytes
        for follower in order[order.index(unit) + 1 :]:
            if follower.unsharded_bytes > budget:
                break
            if follower.needs_gather and follower not in self._in_flight:
                chosen.append(follower)
                budget -= follower.unsharded_bytes
        return chosen

    def gather_together(
        self, units: Sequence[UnitRuntime], async_op: bool = False
    ) -> list[comm.Pending]:
        """Gather the storages of ``units`` that need it (not gathered, or stale): one
        collective per compute dtype (a replicated storage only casts)."""
        by_dtype: dict[torch.dtype, list[FlatStorage]] = {}
        pendings = []
        for unit in units:
            for storage in unit.storages_to_gather():
                if storage.replicated:
                    storage.unshard()
                else:
                    by_dtype.setdefault(storage.compute_dtype, []).append(storage)
        for storages in by_dtype.values():
            if len(storages) == 1:
                pendings.append(storages[0].unshard(async_op))
            else:
                pendings.append(unshard_storages(storages, async_op))
        self._note_peak()
        return pendings

    def _note_peak(self) -> None:
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())


def unshard_storages(storages: list[FlatStorage], async_op: bool = False) -> comm.Pending:
    """All-gather several sharded storages (one compute dtype, one process group) in one
    collective; with ``async_op``, their buffers are complete after ``wait()``."""
    ranks = storages[0].ranks
    sizes = [storage.layout.local_numel for storage in storages]
    local = torch.cat([storage.gather_source() for storage in storages])
    gathered = local.new_empty(ranks.size * local.numel())
    for storage in storages:
        storage.allocate_unsharded()

    def copy_out() -> None:
        for storage, columns in zip(
            storages, gathered.view(ranks.size, -1).split(sizes, dim=1), strict=True
        ):
            storage.copy_out(columns)

    pending = comm.all_gather(gathered, local, ranks, async_op, copy_out)
    for storage in storages:
        storage.gathering = pending
    return pending
