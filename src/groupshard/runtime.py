"""Module hooks of a sharded model: the training state, and what each hook sets off.

Strategies:
    ``full`` (ZeRO-3): gather before forward, free after forward, gather again
    before backward, reduce-scatter gradients and free as soon as they are ready;
    the root unit stays gathered from its forward into backward, which starts with it.
    ``grad_op`` (ZeRO-2): stay gathered from forward to the end of backward.
    ``no_shard``: every rank holds everything; gradients are all-reduced.

The hooks hand the work to their rooms: ``gathers`` (when units are gathered),
``gradients`` (a storage's gradient and parameters without one), ``buckets`` (when
gradients are reduced) and ``end_of_backward`` (the ranks' agreement after a synced
backward). Gathered parameters are current until a shard is written (``writes``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from enum import Enum, auto
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from groupshard.buckets import GradientBuckets, reduce_held_partials
from groupshard.end_of_backward import agree_on_gradients_and_order
from groupshard.gathers import GatherSchedule
from groupshard.gradients import register_optimizer_hooks
from groupshard.guards import (
    check_not_parallelized_since,
    check_not_wrapped,
    parallelized_modules,
)
from groupshard.options import ShardOptions
from groupshard.storage import FlatStorage
from groupshard.unit_runtime import UnitRuntime


class TrainingState(Enum):
    """Where a sharded model is in its step (FSDP2's ``TrainingState``)."""

    IDLE = auto()  # between forward and backward, or between steps
    FORWARD = auto()  # from the root's pre-forward hook to its post-forward hook
    BACKWARD = auto()  # from the first pre-backward hook to the end-of-backward callback
    SUMMONED = auto()  # inside summon_full_params: the hooks do nothing


class ShardedRuntime:
    """The hook logic of a sharded model, shared by all its units."""

    def __init__(self, units: Sequence[UnitRuntime], options: ShardOptions) -> None:
        self.units = list(units)  # pre-order; units[0] is the root
        # modules that tensor parallelism had distributed before gs.shard
        self.parallelized = parallelized_modules(self.units[0].module)
        self.options = options
        self.gathers = GatherSchedule(self.units, options)
        self.buckets = GradientBuckets(options)
        self.state = TrainingState.IDLE
        self.requires_gradient_sync = True  # False: backwards keep local gradient sums
        self.in_no_sync = False  # inside model.no_sync()
        self.reshard_after_backward = True  # False: units stay gathered after backward
        self._backward_task = -1  # autograd's id of the backward the hooks serve
        self._handles: list[Any] = []
        self._gradient_hooks: dict[FlatStorage, Any] = {}  # each storage's, to remove it

    @property
    def strategy(self) -> str:
        return self.options.strategy

    @property
    def storages(self) -> list[FlatStorage]:
        return [storage for unit in self.units for storage in unit.storages]

    def register_hooks(self) -> None:
        register_optimizer_hooks()
        for unit in self.units:
            module = unit.module
            pre_forward, post_forward = self._pre_forward_hook(unit), self._post_forward_hook(unit)
            self._handles.append(
                module.register_forward_pre_hook(_eager(pre_forward), with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(_eager(post_forward)))
            for storage in unit.storages:
                self._hook_gradient(storage)

    def _hook_gradient(self, storage: FlatStorage) -> None:
        if storage.layout.trainable_buffers:
            self._gradient_hooks[storage] = (
                storage.unsharded_trainable.register_post_accumulate_grad_hook(
                    self._gradient_ready_hook(storage)
                )
            )

    def replace_storage(self, unit: UnitRuntime, index: int, storage: FlatStorage) -> None:
        """Make ``storage`` the unit's storage ``index`` (``gs.regroup``, between steps): its
        gradient hook (the old one's removed: it holds the old storage in a reference
        cycle), and bucket sizes learnt afresh from the next backward."""
        old = self._gradient_hooks.pop(unit.storages[index], None)
        if old is not None:
            old.remove()
        unit.replace_storage(index, storage)
        self.__dict__.pop("_storage_names", None)
        self.buckets = GradientBuckets(self.options)
        self._hook_gradient(storage)

    def reshard(self) -> None:
        """Free every gathered unit now (FSDP2's ``reshard``)."""
        self.gathers.wait_all()
        for unit in self.units:
            unit.reshard()

    def _pre_forward_hook(self, unit: UnitRuntime) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if self.state is TrainingState.SUMMONED:
                return None
            if _in_backward():  # activation checkpointing recomputes the unit
                self.gathers.gather_now(unit)
                unit.install_views(track_use=torch.is_grad_enabled())
                return None if unit.policy is None else unit.policy.cast_inputs(args, kwargs)
            if unit is self.units[0]:
                check_not_parallelized_since(unit.module, self.parallelized)
            for storage in unit.storages:
                storage.check_shards()
            check_not_wrapped(
                unit.module,
                [shard for storage in unit.storages for shard in storage.shards],
                self.units[0].module if unit is self.units[0] else None,
            )
            if unit is self.units[0]:
                if self.state is not TrainingState.BACKWARD:
                    self.state = TrainingState.FORWARD
                self.gathers.start_forward()
            self.gathers.before_forward(unit)
            unit.install_views(track_use=torch.is_grad_enabled())
            return None if unit.policy is None else unit.policy.cast_inputs(args, kwargs)

        return hook

    def _post_forward_hook(self, unit: UnitRuntime) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.state is TrainingState.SUMMONED:
                return None
            if unit.policy is not None:
                output = unit.policy.cast_output(output)
            if _in_backward():  # a recomputation: the unit's backward follows at once
                return output
            if unit is self.units[0] and self.state is TrainingState.FORWARD:
                self.state = TrainingState.IDLE
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
            if self.state is not TrainingState.BACKWARD:
                self.state = TrainingState.BACKWARD
                self._backward_task = torch._C._current_graph_task_id()
                Variable._execution_engine.queue_callback(self._end_of_backward)
            self.gathers.before_backward(unit)
            if self.strategy == "full" and unit is not self.units[0]:
                # the parameters' names show the gathered views again, for a forward that
                # activation checkpointing recomputes from them
                unit.install_views(track_use=True)

        return hook

    def _gradient_ready_hook(self, storage: FlatStorage) -> Callable[[torch.Tensor], None]:
        # The hook lives on a tensor, whose hooks torch keeps on the C++ side, where Python's
        # garbage collector cannot see them: a hook holding the runtime or the storage
        # strongly would keep them, the model and its shards alive after the model is
        # dropped. Weak references let them go.
        runtime_ref, storage_ref = weakref.ref(self), weakref.ref(storage)

        def hook(unsharded: torch.Tensor) -> None:
            runtime, storage = runtime_ref(), storage_ref()
            if runtime is None or storage is None:
                return
            runtime.gradient_ready(storage)

        return hook

    def gradient_ready(self, storage: FlatStorage) -> None:
        """A storage's unsharded gradient is complete: reshard, and queue its reduction."""
        grad = storage.gradients.take_unsharded()
        if grad is None:
            return
        # The parameters are no longer needed once their gradient is complete, unless a
        # frozen op later in backward reads this storage, or this is the inner backward
        # of a reentrant checkpoint (the outer one may still read the unit): then the
        # end of backward frees them.
        if (
            self.strategy == "full"
            and self.reshard_after_backward
            and not storage.layout.frozen_buffers
            and torch._C._current_graph_task_id() == self._backward_task
        ):
            storage.reshard()
        grad = storage.gradients.to_reduce(grad, self.requires_gradient_sync)
        if grad is not None:
            self.buckets.add(storage, grad)

    def _end_of_backward(self) -> None:
        self.state = TrainingState.IDLE
        self.gathers.end_backward()
        for unit in self.units:
            if self.reshard_after_backward:
                unit.reshard()
            else:
                unit.install_local_pieces()
        if not self.requires_gradient_sync:
            return
        # sums from backwards without sync whose storage this backward did not reach
        for storage in self.storages:
            accumulated = storage.gradients.take_accumulated()
            if accumulated is not None:
                self.buckets.add(storage, accumulated)
        self.buckets.send_all()
        orders = self._orders_followed()
        self.buckets.end_backward()
        # gradients held for a later all-reduce across replicas: the used flags wait for it
        holding = not self.buckets.requires_all_reduce and self._has_replicas
        agreeing = (
            None
            if holding
            else agree_on_gradients_and_order(self.storages, orders, self.options.overlap)
        )
        self.buckets.wait_all()
        if self.buckets.requires_all_reduce:
            reduce_held_partials(self.storages)
        if agreeing is not None:
            agreeing.wait()

    @cached_property
    def _has_replicas(self) -> bool:
        return any(storage.replicas.size > 1 for storage in self.storages)

    @cached_property
    def _storage_names(self) -> dict[FlatStorage, str]:
        """Each storage as its unit's name and its place among the unit's storages."""
        return {
            storage: f"{unit.label}#{index}"
            for unit in self.units
            for index, storage in enumerate(unit.storages)
        }

    def _orders_followed(self) -> dict[str, list[str]]:
        """The orders this step's collectives followed on this rank, by what they are: the
        units' forward order (gathers, ``full`` and ``grad_op``), backward order (gathers,
        ``full``) and the order gradients arrived in (buckets, every strategy)."""
        names = self._storage_names
        orders = {"order gradients arrived in": [names[s] for s, _, _ in self.buckets.arrivals]}
        if self.strategy != "no_shard":
            orders["forward order of units"] = [u.label for u in self.gathers.forward_running]
        if self.strategy == "full":
            orders["backward order of units"] = [u.label for u in self.gathers.backward_order]
        return orders


def _in_backward() -> bool:
    """Whether autograd is running a backward (a forward now is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run as plain Python under ``torch.compile``: dynamo skips it and whatever it
    calls (a graph break on each side of it) instead of tracing the gathers and guarding on
    the hooks' state, which recompiled every step (FSDP2 skips its hooks the same way)."""
    return torch.compiler.disable(hook, recursive=True)
