"""Module hooks: gather a unit before it runs, free it after, reduce its gradients.

Strategies:
    ``full`` (ZeRO-3): gather before forward, free after forward, gather again
    before backward, reduce-scatter gradients and free as soon as they are ready;
    the root unit stays gathered from its forward into backward, which starts with it.
    ``grad_op`` (ZeRO-2): stay gathered from forward to the end of backward.
    ``no_shard``: every rank holds everything; gradients are all-reduced.

Parameters without a gradient: torch.optim leaves a parameter whose ``.grad`` is None
alone, but autograd fills zeros into a flat gradient for the parameters a backward did
not reach. So each forward hooks the parameter views, the end of backward combines the
ranks' "used" flags (one small all-reduce; a parameter used on any rank has a gradient,
as in DDP), and a global optimizer-step hook keeps the other parameters' values and
per-element state (``SkippedSegments``), for any torch optimizer.

Gradient accumulation: while gradient sync is off (``no_sync``), a backward adds each
storage's unsharded gradient to a local sum (``reduce_dtype``) and communicates nothing,
not even the used flags; the next synced backward reduces the sum once. An optimizer
step while sums wait raises instead of stepping without them.

Overlap (``overlap=True``): collectives are started asynchronously and waited for as
late as possible. ``full`` and ``grad_op`` gather units in windows (a unit and the units
that run next, up to ``prefetch_bytes``); the next window's all-gather starts before the
last unit of the current one computes, in forward order (and for ``full`` in backward
order; ``grad_op`` keeps its units gathered for backward). A full gradient bucket's
reduce-scatter starts at once and is waited for when more than
``REDUCES_IN_FLIGHT`` are running, or at the end of backward. The collectives are the
same ones, in the same order on every rank, as without overlap, so results are equal.

Gathered parameters are current until a shard is written: any optimizer step (a global
hook) or a groupshard load counts as a write (``flat.note_parameters_written``).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_flatten

from groupshard import comm, flatstate
from groupshard.flat import (
    FlatStorage,
    note_parameters_written,
    reduce_gradients,
    skipped_segments_of,
    unshard_storages,
)
from groupshard.precision import MixedPrecision

STRATEGIES = ("full", "grad_op", "no_shard")
FIRST_BUCKET_BYTES = 2**20
"""The default limit of a backward's first gradient bucket: DDP's
(``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)."""
REDUCES_IN_FLIGHT = 2
"""Gradient buckets reducing at once: unsharded gradient bytes in flight stay below
``REDUCES_IN_FLIGHT`` x (``reduce_bucket_bytes`` + the largest unit's gradient)."""


class UnitRuntime:
    """One unit: its module, its storages, and where its parameters are registered."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        storages: Sequence[FlatStorage],
        places: dict[str, list[tuple[nn.Module, str]]],
        originals: dict[str, nn.Parameter],
        policy: MixedPrecision | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.storages = list(storages)
        self.places = places  # FQN -> [(module, attribute)], every registration
        self.originals = originals  # FQN -> the user's parameter object
        self.policy = policy

    def storages_to_gather(self) -> list[FlatStorage]:
        """Storages not gathered, or gathered before a shard was written."""
        return [s for s in self.storages if not s.is_current]

    @property
    def needs_gather(self) -> bool:
        return bool(self.storages_to_gather())

    @cached_property
    def unsharded_bytes(self) -> int:
        return sum(
            (s.layout.trainable_unsharded_numel + s.layout.frozen_unsharded_numel)
            * s.unsharded_trainable.element_size()
            for s in self.storages
            if not s.aliases_local
        )

    def reshard(self) -> None:
        """Free the gathered buffers; the parameters' names show this rank's pieces."""
        for storage in self.storages:
            storage.reshard()
        self.install_local_pieces()

    def install_local_pieces(self) -> None:
        """Point every registration of the unit's parameters at the user's parameter
        object holding this rank's piece (``FlatStorage.local_pieces``), as FSDP1's
        ``use_orig_params``: outside forward, ``module.weight`` is never stale."""
        for storage in self.storages:
            for fqn, piece in storage.local_pieces.items():
                original = self.originals[fqn]
                original.data = piece
                for module, attr in self.places[fqn]:
                    module.__dict__[attr] = original

    def install_views(self, track_use: bool) -> None:
        """Point every registration of the unit's parameters at the unsharded views;
        with ``track_use``, note which of them the coming backward reaches."""
        for storage in self.storages:
            # Views made with grad enabled are never leaves, so requires_grad_(False) on
            # one (which cannot freeze a view) raises instead of silently doing nothing.
            with torch.enable_grad() if not torch.is_inference_mode_enabled() else nullcontext():
                views = storage.param_views(track_use)
            for fqn, view in views.items():
                for module, attr in self.places[fqn]:
                    module.__dict__[attr] = view


class ShardedRuntime:
    """The hook logic of a sharded model, shared by all its units."""

    def __init__(
        self,
        units: Sequence[UnitRuntime],
        strategy: str,
        reduce_bucket_bytes: int = 0,
        prefetch_bytes: int = 0,
        overlap: bool = True,
        first_bucket_bytes: int | None = None,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"Expects strategy in {STRATEGIES} but got {strategy=}")
        self.units = list(units)  # pre-order; units[0] is the root
        self.strategy = strategy
        self.reduce_bucket_bytes = reduce_bucket_bytes
        if first_bucket_bytes is None:
            first_bucket_bytes = reduce_bucket_bytes
        self.first_bucket_bytes = min(first_bucket_bytes, reduce_bucket_bytes)
        self.prefetch_bytes = prefetch_bytes
        self.overlap = overlap
        self._gathering: dict[UnitRuntime, list[comm.Pending]] = {}  # started, not waited
        self._reducing: list[tuple[comm.Pending, int]] = []  # (reduce, its input bytes)
        self.peak_reducing_bytes = 0  # most unsharded gradient bytes in reductions at once
        self._forward_order: list[UnitRuntime] = []  # as the last forward ran them
        self._backward_order: list[UnitRuntime] = []  # as the last backward reached them
        self._recording: list[UnitRuntime] = []
        self._backward_recording: list[UnitRuntime] = []
        self.summoned = False
        self._final_callback_queued = False
        self._handles: list[Any] = []
        # gradients waiting for one collective, per dtype: [(storage, unsharded grad)]
        self._pending: dict[torch.dtype, list[tuple[FlatStorage, torch.Tensor]]] = {}
        self._flushed: set[torch.dtype] = set()  # dtypes whose first bucket of this backward left
        self._arrivals: list[tuple[FlatStorage, torch.dtype, int]] = []  # (storage, dtype, bytes)
        # bytes of the gradient of the same dtype that came after a storage's, last backward
        self._next_bytes: dict[FlatStorage, int] = {}
        self.peak_gathered_bytes = 0  # most unsharded parameter bytes held at once
        self.requires_gradient_sync = True
        self.in_no_sync = False
        self.reshard_after_backward = True

    def gathered_bytes(self) -> int:
        """Bytes of unsharded parameters allocated right now."""
        return sum(u.unsharded_bytes for u in self.units if any(s.is_unsharded for s in u.storages))

    @property
    def storages(self) -> list[FlatStorage]:
        return [storage for unit in self.units for storage in unit.storages]

    def register_hooks(self) -> None:
        register_optimizer_hooks()
        for unit in self.units:
            module = unit.module
            self._handles.append(
                module.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(self._post_forward_hook(unit)))
            for storage in unit.storages:
                if storage.layout.trainable_buffers:
                    self._handles.append(
                        storage.unsharded_trainable.register_post_accumulate_grad_hook(
                            self._gradient_ready_hook(storage)
                        )
                    )

    def _pre_forward_hook(self, unit: UnitRuntime) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if self.summoned:
                return None
            for storage in unit.storages:
                storage.check_shards()
            if unit is self.units[0]:
                self._start_forward()
            if unit not in self._recording:
                self._recording.append(unit)
            self._gather_for_use(unit, self._forward_order)
            unit.install_views(track_use=torch.is_grad_enabled())
            return None if unit.policy is None else unit.policy.cast_inputs(args, kwargs)

        return hook

    def _gather_for_use(self, unit: UnitRuntime, order: Sequence[UnitRuntime]) -> None:
        """Make ``unit`` gathered (waiting for its prefetch, or gathering its window now),
        then start gathering the next window if ``unit`` ends the current one."""
        self._wait_for_gather(unit)
        if unit.needs_gather:
            self.unshard_together(self._with_followers(unit, order))
        if not (self.overlap and self.strategy != "no_shard" and unit in order):
            return
        position = order.index(unit) + 1
        if position == len(order):
            return
        following = order[position]
        if (
            following not in self._gathering
            and following.needs_gather
            and following.unsharded_bytes <= self.prefetch_bytes
        ):
            window = self._with_followers(following, order)
            pendings = self.unshard_together(window, async_op=True)
            for member in window:
                self._gathering[member] = pendings

    def _wait_for_gather(self, unit: UnitRuntime) -> None:
        for pending in self._gathering.pop(unit, ()):
            pending.wait()

    def wait_for_gathers(self) -> None:
        """Wait for every gather started ahead (e.g. prefetched but not used)."""
        for unit in list(self._gathering):
            self._wait_for_gather(unit)

    def _start_forward(self) -> None:
        if self._recording:
            self._forward_order = self._recording
        self._recording = []
        self.wait_for_gathers()

    def _with_followers(self, unit: UnitRuntime, order: Sequence[UnitRuntime]) -> list[UnitRuntime]:
        """``unit`` and the units after it in ``order`` that fit in ``prefetch_bytes``.

        Gathering them together saves a collective's latency per unit (one for all).
        """
        chosen = [unit]
        if self.strategy == "no_shard" or unit not in order:
            return chosen
        budget = self.prefetch_bytes - unit.unsharded_bytes
        for follower in order[order.index(unit) + 1 :]:
            if follower.unsharded_bytes > budget:
                break
            if follower.needs_gather and follower not in self._gathering:
                chosen.append(follower)
                budget -= follower.unsharded_bytes
        return chosen

    def unshard_together(
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
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())
        return pendings

    def _post_forward_hook(self, unit: UnitRuntime) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.summoned:
                return None
            if unit.policy is not None:
                output = unit.policy.cast_output(output)
            # grad_op keeps every unit for backward; full keeps only the root, whose
            # backward begins right after its forward (FSDP2's root does the same)
            keep = self.strategy != "full" or unit is self.units[0]
            if not (keep and torch.is_grad_enabled()):
                unit.reshard()
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
                tensors = [t for t in tensors if t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, self._pre_backward_hook(unit), mode="any"
                    )
            return output

        return hook

    def _pre_backward_hook(self, unit: UnitRuntime) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self._final_callback_queued:
                self._final_callback_queued = True
                Variable._execution_engine.queue_callback(self._end_of_backward)
            if unit not in self._backward_recording:
                self._backward_recording.append(unit)
            self._gather_for_use(unit, self._backward_order or self._forward_order[::-1])

        return hook

    def _gradient_ready_hook(self, storage: FlatStorage) -> Callable[[torch.Tensor], None]:
        def hook(unsharded: torch.Tensor) -> None:
            grad = storage.take_unsharded_grad()
            if grad is None:
                return
            # The parameters are no longer needed once their gradient is complete (unless
            # a frozen op later in backward reads this storage: then wait for the end).
            if (
                self.strategy == "full"
                and self.reshard_after_backward
                and not storage.layout.frozen_buffers
            ):
                storage.reshard()
            grad = storage.gradient_to_reduce(grad, self.requires_gradient_sync)
            if grad is None:
                _accumulating.add(self)
                return
            self._add_pending(storage, grad)

        return hook

    def _add_pending(self, storage: FlatStorage, grad: torch.Tensor) -> None:
        """Add a gradient to its bucket; flush the bucket when it is full, or when the
        gradient that came next in the last backward would overfill it (so the gradients
        that arrive last, whose reduction nothing hides, go in a bucket of their own).
        The first bucket of a backward is at most ``first_bucket_bytes`` (DDP's first
        bucket): its reduction starts while most of the backward is still to run."""
        size = grad.numel() * grad.element_size()
        self._arrivals.append((storage, grad.dtype, size))
        pending = self._pending.setdefault(grad.dtype, [])
        pending.append((storage, grad))
        waiting = sum(g.numel() * g.element_size() for _, g in pending)
        limit = self.reduce_bucket_bytes if grad.dtype in self._flushed else self.first_bucket_bytes
        following = self._next_bytes.get(storage)
        if waiting >= limit or (following is not None and waiting + following > limit):
            self._flush(grad.dtype)

    def _record_arrivals(self) -> None:
        """Remember, per storage, the size of the next gradient of its dtype."""
        self._next_bytes = {}
        last: dict[torch.dtype, FlatStorage] = {}
        for storage, dtype, size in self._arrivals:
            if dtype in last:
                self._next_bytes[last[dtype]] = size
            last[dtype] = storage
        self._arrivals = []
        self._flushed = set()

    def _flush(self, dtype: torch.dtype) -> None:
        """One collective for every gradient waiting in the bucket of ``dtype`` (started,
        with overlap; waited for when too many run)."""
        pending = self._pending.pop(dtype, [])
        if not pending:
            return
        self._flushed.add(dtype)
        grads = [grad for _, grad in pending]
        started = reduce_gradients([storage for storage, _ in pending], grads, self.overlap)
        self._reducing.append((started, sum(g.numel() * g.element_size() for g in grads)))
        self.peak_reducing_bytes = max(
            self.peak_reducing_bytes, sum(size for _, size in self._reducing)
        )
        while len(self._reducing) > (REDUCES_IN_FLIGHT if self.overlap else 0):
            self._reducing.pop(0)[0].wait()

    def _wait_for_reduces(self) -> None:
        while self._reducing:
            self._reducing.pop(0)[0].wait()

    def _end_of_backward(self) -> None:
        self._backward_order, self._backward_recording = self._backward_recording, []
        self._final_callback_queued = False
        self.wait_for_gathers()
        for unit in self.units:
            if self.reshard_after_backward:
                unit.reshard()
            else:
                unit.install_local_pieces()
        if not self.requires_gradient_sync:
            return
        # sums from backwards without sync whose storage this backward did not reach
        for storage in self.storages:
            accumulated = storage.take_accumulated_grad()
            if accumulated is not None:
                self._add_pending(storage, accumulated)
        for dtype in list(self._pending):
            self._flush(dtype)
        orders = self._orders_that_match_collectives()
        self._record_arrivals()
        combining = self._combine_used(orders)
        self._wait_for_reduces()
        _accumulating.discard(self)
        if combining is not None:
            combining.wait()

    def waiting_gradients(self) -> list[str]:
        """Units holding local gradient sums that no synced backward has reduced yet."""
        return [
            unit.name or "<root>"
            for unit in self.units
            if any(s.accumulated_grad is not None for s in unit.storages)
        ]

    @cached_property
    def shard_ids(self) -> frozenset[int]:
        return frozenset(id(shard) for storage in self.storages for shard in storage.shards)

    @cached_property
    def _storage_names(self) -> dict[FlatStorage, str]:
        """Each storage as its unit's name and its place among the unit's storages."""
        return {
            storage: f"{unit.name or '<root>'}#{index}"
            for unit in self.units
            for index, storage in enumerate(unit.storages)
        }

    def _orders_that_match_collectives(self) -> dict[str, list[str]]:
        """The orders this step's collectives followed on this rank, by what they are: the
        units' forward order (gathers, ``full`` and ``grad_op``), backward order (gathers,
        ``full``) and the order gradients arrived in (buckets, every strategy)."""
        names = self._storage_names
        orders = {"order gradients arrived in": [names[s] for s, _, _ in self._arrivals]}
        if self.strategy != "no_shard":
            orders["forward order of units"] = [u.name or "<root>" for u in self._recording]
        if self.strategy == "full":
            orders["backward order of units"] = [u.name or "<root>" for u in self._backward_order]
        return orders

    def _combine_used(self, orders: dict[str, list[str]]) -> comm.Pending | None:
        """Which parameters had a gradient in this backward on any rank: one all-reduce,
        started behind the last gradient reductions (with overlap) and applied at its wait.
        The same all-reduce checks that every rank's collectives followed the same
        ``orders``: a rank whose units ran in another order would have gathered or reduced
        other parameters' data in matching collectives, silently."""
        storages = [s for s in self.storages if s.layout.trainable_buffers]
        if not storages:
            return None
        flags = [storage.take_used() for storage in storages]
        agreement = [_agreement_bytes(order) for order in orders.values()]
        combined = torch.tensor(
            [f for per_storage in flags for f in per_storage]
            + [b for per_order in agreement for b in per_order],
            dtype=torch.uint8,
            device=storages[0].local.device,
        )

        def apply() -> None:
            values = combined.cpu()
            offset = 0
            for storage, per_storage in zip(storages, flags, strict=True):
                storage.add_used(values[offset : offset + len(per_storage)].bool().tolist())
                offset += len(per_storage)
            for (kind, order), per_order in zip(orders.items(), agreement, strict=True):
                reduced = values[offset : offset + len(per_order)].tolist()
                offset += len(per_order)
                if not _agreed(reduced):
                    raise RuntimeError(
                        f"The {kind} differs between ranks (this rank: {_shortened(order)}): "
                        "groupshard's collectives follow it, so the ranks exchanged other "
                        "parameters' data. Run the same units in the same order on every "
                        "rank (keep rank-dependent branches inside a unit)."
                    )

        return comm.all_reduce_max(combined, storages[0].ranks, self.overlap, apply)


def _agreement_bytes(order: Sequence[str]) -> list[int]:
    """8 bytes of a hash of ``order`` and their complements (255 - byte): after an
    all-reduce of maxima, every byte plus its complement is 255 exactly when every rank
    had the same hash (max(b) + max(255 - b) = 255 + max(b) - min(b))."""
    digest = hashlib.blake2b("\0".join(order).encode(), digest_size=8).digest()
    return [*digest, *(255 - b for b in digest)]


def _agreed(reduced: Sequence[int]) -> bool:
    half = len(reduced) // 2
    return all(a + b == 255 for a, b in zip(reduced[:half], reduced[half:], strict=True))


def _shortened(order: Sequence[str], shown: int = 6) -> str:
    names = ", ".join(order[:shown])
    return f"[{names}{', ...' if len(order) > shown else ''}]"


# Runtimes whose storages hold gradient sums of backwards without sync.
_accumulating: weakref.WeakSet[ShardedRuntime] = weakref.WeakSet()


def _refuse_unreduced_gradients(optimizer: torch.optim.Optimizer) -> None:
    for runtime in list(_accumulating):
        units = runtime.waiting_gradients()
        if not units:
            continue
        if any(id(p) in runtime.shard_ids for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError(
                f"optimizer.step() while units {units} hold gradients of backwards run without "
                "gradient sync (inside model.no_sync() or after "
                "model.set_requires_gradient_sync(False)) that no synced backward has reduced: "
                "the step would miss them. Run the last micro-batch's backward with sync on "
                "(outside no_sync / set_requires_gradient_sync(True)), then step."
            )


# Optimizer steps over shards leave the pieces of parameters without a gradient alone.
# Keyed by id(shard): (id of the optimizer whose step holds it, function that restores it).
# A wrapper (gs.optim.LARC) steps its inner optimizer inside its own step: the outer
# step holds the shard, the inner one leaves it to the outer.
_held: dict[int, tuple[int, Callable[[], None]]] = {}
_optimizer_hooks: list[Any] = []


def _keep_skipped_segments(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _accumulating:
        _refuse_unreduced_gradients(optimizer)
    # A step of this optimizer that raised left its holds behind: settle them first.
    _restore_skipped_segments(optimizer, args, kwargs)
    for group in optimizer.param_groups:
        for shard in group["params"]:
            record = skipped_segments_of(shard)
            if record is None or id(shard) in _held:
                continue
            if record.whole:  # as torch.optim skips a parameter whose .grad is None
                grad, shard.grad = shard.grad, None
                restore = _grad_restorer(shard, grad)
            else:
                state = optimizer.state[shard]
                restore = flatstate.preserve_segments(shard, state, record.ranges)
            _held[id(shard)] = (id(optimizer), restore)


def _grad_restorer(shard: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def restore() -> None:
        shard.grad = grad

    return restore


def _restore_skipped_segments(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    note_parameters_written()
    if not _held:
        return
    mine = [key for key, (owner, _) in _held.items() if owner == id(optimizer)]
    for key in mine:
        _held.pop(key)[1]()


def register_optimizer_hooks() -> None:
    """Install the global optimizer-step hooks once per process."""
    if not _optimizer_hooks:
        _optimizer_hooks.append(register_optimizer_step_pre_hook(_keep_skipped_segments))
        _optimizer_hooks.append(register_optimizer_step_post_hook(_restore_skipped_segments))
