"""Gradients of one storage, and parameters without a gradient.

A storage's trainable parameters are views of one unsharded leaf, so autograd delivers a
unit's whole gradient as one flat tensor, with zeros for the parameters a backward did not
reach. torch.optim leaves a parameter whose ``.grad`` is None alone; to do the same for a
piece of a flat shard:

- each forward hooks the parameter views, so the backward notes which ones it reached
  (``StorageGradients.used_in_backward``);
- the end of a synced backward combines the ranks' flags (a parameter used on any rank has
  a gradient, as in DDP) into ``had_grad`` and marks each shard with the pieces its next
  optimizer step must leave alone (``SkippedSegments``);
- a global optimizer-step hook keeps those pieces' values and per-element state
  (``preserve_segments``) for any torch optimizer, and refuses a step while gradients of
  backwards without sync wait to be reduced.

Gradient accumulation: while gradient sync is off, a backward adds the storage's unsharded
gradient to a local sum (``reduce_dtype``); the next synced backward reduces it once.

A shard's gradient is a ``ShardGrad``: a norm of it is the norm of the whole flat buffer
over ranks (as a DTensor's), so torch's ``clip_grad_norm_`` and ``get_total_norm`` over
``model.parameters()`` give the unsharded model's norm on every rank. During an optimizer
step it is a plain tensor (no dispatch cost).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from groupshard import comm
from groupshard.flatten import is_per_element
from groupshard.layout import StorageLayout
from groupshard.segments import attach_segments, segments_of
from groupshard.writes import note_parameters_written

SKIP_ATTR = "groupshard_skip"
ORIGINAL_ATTR = "groupshard_original"  # on the user's parameters of a sharded model: the FQN
STEPPED_ATTR = "groupshard_stepped"  # on a shard's gradient that an optimizer step consumed


@dataclass(frozen=True)
class SkippedSegments:
    """The parameters of a shard that had no gradient, for its next optimizer step.

    ``whole``: no parameter of the flat buffer (on any rank) had a gradient, so the shard
    is stepped as if its gradient were None. ``ranges``: otherwise, this rank's
    ``(start, end)`` pieces of the shard to keep. Valid while the shard's gradient is the
    tensor ``grad`` refers to (a new gradient comes with a new record).
    """

    grad: weakref.ref[torch.Tensor]
    whole: bool
    ranges: tuple[tuple[int, int], ...]
    params: tuple[int, ...] = ()  # the buffer's parameters without a gradient (indices)

    def applies_to(self, shard: torch.Tensor) -> bool:
        return shard.grad is not None and self.grad() is shard.grad


def skipped_segments_of(tensor: torch.Tensor) -> SkippedSegments | None:
    """What the next optimizer step must leave alone in a shard, or None."""
    record = getattr(tensor, SKIP_ATTR, None)
    return record if record is not None and record.applies_to(tensor) else None


_NORMS = {torch.linalg.vector_norm, torch.linalg.norm, torch.norm, torch.Tensor.norm}


class ShardGrad(torch.Tensor):
    """The gradient of a flat shard: a plain tensor whose norms are the whole flat
    buffer's (every rank's slice; the padding is zero), one all-reduce each. So the sum
    over ``model.parameters()`` that torch's norm utilities take is the unsharded model's.
    Every rank must take the same norms, as with DTensors."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func in _NORMS and isinstance(args[0], ShardGrad):
                return _buffer_norm(func, args[0], args[1:], kwargs)
            if func is torch._foreach_norm:  # clip_grad_norm_(..., foreach=True)
                ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
                return [
                    _buffer_norm(torch.linalg.vector_norm, t, (ord,), {})
                    if isinstance(t, ShardGrad)
                    else torch.linalg.vector_norm(t, ord)
                    for t in args[0]
                ]
            return func(*args, **kwargs)


def _buffer_norm(func: Any, grad: ShardGrad, args: Sequence[Any], kwargs: Any) -> torch.Tensor:
    """``func(grad, *args, **kwargs)`` (a vector norm) over the whole flat buffer."""
    first = "ord" if func in (torch.linalg.vector_norm, torch.linalg.norm) else "p"
    names = (first, "dim", "keepdim")
    options = {**dict(zip(names, args, strict=False)), **kwargs}
    if options.get("dim") is not None:
        raise ValueError(
            f"{getattr(func, '__name__', func)}(dim={options['dim']!r}) of a groupshard shard's "
            "gradient: a shard is a 1-D slice of a flat buffer of several parameters, so a "
            "norm over a dimension has no meaning for the unsharded model; take gs.grad_norms("
            "model) for per-parameter norms, or a norm over all elements."
        )
    ord = options.get(first, 2)
    ord = 2 if ord in (None, "fro") else ord
    if isinstance(ord, bool) or not isinstance(ord, (int, float)) or ord < 0:
        raise ValueError(
            f"The norm of a groupshard shard's gradient supports ord >= 0 and inf, got {ord!r} "
            "(the shard's padding would count as zeros)."
        )
    local = grad.as_subclass(torch.Tensor)
    if options.get("dtype") is not None:
        local = local.to(options["dtype"])
    segments = segments_of(grad)
    reduce_over = segments.reduce_over if segments is not None else ()
    if segments is not None and segments.uncounted_pieces:  # a tp peer counts these
        local = local.clone()
        for piece in segments.uncounted_pieces:
            local[piece.shard_offset : piece.shard_offset + piece.numel] = 0
    if ord == math.inf:
        value = local.abs().max()  # a shard is never empty
        for ranks in reduce_over:
            comm.all_reduce_max(value, ranks)
        return value
    value = (local != 0).sum().to(local.dtype) if ord == 0 else local.abs().pow(ord).sum()
    for ranks in reduce_over:
        comm.all_reduce_sum(value, ranks)
    return value if ord == 0 else value.pow(1.0 / ord)


def as_shard_grad(grad: torch.Tensor, shard: torch.Tensor) -> ShardGrad:
    """``grad`` (a view of the same memory) as ``shard``'s ``ShardGrad``."""
    wrapped = grad.as_subclass(ShardGrad)
    segments = segments_of(shard)
    if segments is not None:
        attach_segments(wrapped, segments)
    return wrapped


class StorageGradients:
    """The gradient bookkeeping of one storage (its trainable flat buffers)."""

    def __init__(
        self,
        layout: StorageLayout,
        unsharded: torch.Tensor,
        shards: Sequence[nn.Parameter],
        originals: Sequence[torch.Tensor],
        output_positions: Sequence[int],
        reduce_dtype: torch.dtype,
    ) -> None:
        self.layout = layout
        self.unsharded = unsharded  # the leaf autograd accumulates into (1D, group-major)
        self.shards = list(shards)  # the trainable shards, in layout order
        self.originals = list(originals)  # the user's parameters; requires_grad says frozen
        self.output_positions = list(output_positions)  # each parameter's piece among the views
        self.reduce_dtype = reduce_dtype
        self.used_in_backward = [False] * len(self.originals)  # this rank, since synced
        self.accumulated: torch.Tensor | None = None  # sum of backwards without sync (1D)
        # reduced within the shard group, not yet across replicas (1D, trainable shards)
        self.partial: torch.Tensor | None = None
        # per trainable shard, per parameter: had a gradient on some rank since .grad was None
        self.had_grad = [[False] * len(b.params) for b in layout.trainable_buffers]

    def note_used(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Backward hook of the views' split: autograd passes None for every output that
        got no gradient, before filling in zeros."""
        used = self.used_in_backward
        for index, output in enumerate(self.output_positions):
            if grads[output] is not None:
                used[index] = True

    def frozen_flags(self) -> list[bool]:
        """Per trainable parameter: frozen since sharding (``requires_grad_(False)`` on the
        original parameter, or on its shard, e.g. by ``module.requires_grad_(False)``)."""
        flags = []
        for shard, buffer in zip(self.shards, self.layout.trainable_buffers, strict=True):
            flags.extend(not shard.requires_grad for _ in buffer.params)
        return [
            shard_frozen or not original.requires_grad
            for shard_frozen, original in zip(flags, self.originals, strict=True)
        ]

    def take_used(self) -> list[bool]:
        """This backward's used flags on this rank (frozen parameters count as unused)."""
        used = [
            u and not f for u, f in zip(self.used_in_backward, self.frozen_flags(), strict=True)
        ]
        self.used_in_backward = [False] * len(used)
        return used

    def take_unsharded(self) -> torch.Tensor | None:
        """The gradient autograd accumulated into the unsharded buffer (1D, group-major),
        zero where a parameter is frozen."""
        grad = self.unsharded.grad
        self.unsharded.grad = None
        frozen = self.frozen_flags()
        if grad is not None and any(frozen):
            buffers = self.layout.trainable_buffers
            pieces = [
                piece
                for buffer, data in zip(
                    buffers, grad.split([b.padded_numel for b in buffers]), strict=True
                )
                for piece in data.split(buffer.split_sizes)[:-1]
            ]
            torch._foreach_zero_([p for p, f in zip(pieces, frozen, strict=True) if f])
        return grad

    def to_reduce(self, grad: torch.Tensor, sync: bool) -> torch.Tensor | None:
        """The unsharded gradient to reduce now, in ``reduce_dtype``, with what backwards
        without sync accumulated; None (no collective) while ``sync`` is off."""
        grad = grad.to(self.reduce_dtype)
        if self.accumulated is not None:
            grad = self.accumulated.add_(grad)
        if sync:
            self.take_accumulated()
            return grad
        self.accumulated = grad
        _accumulating.add(self)
        return None

    @property
    def holds_unreduced(self) -> bool:
        """Whether backwards left gradients here that no synced reduction took along: sums
        without sync, or shards not yet all-reduced across replicas."""
        return self.accumulated is not None or self.partial is not None

    def take_accumulated(self) -> torch.Tensor | None:
        """What backwards without sync accumulated and no synced backward reduced yet."""
        grad, self.accumulated = self.accumulated, None
        if self.partial is None:
            _accumulating.discard(self)
        return grad

    def hold_partial(self, sharded_grad: torch.Tensor) -> None:
        """Add a gradient reduced within the shard group only (hybrid sharding with
        ``set_requires_all_reduce(False)``) to what waits for the all-reduce across replicas."""
        if self.partial is None:
            self.partial = sharded_grad
        else:
            self.partial.add_(sharded_grad)
        _accumulating.add(self)

    def take_partial(self) -> torch.Tensor | None:
        """What ``hold_partial`` gathered, now to be all-reduced across replicas."""
        held, self.partial = self.partial, None
        if self.accumulated is None:
            _accumulating.discard(self)
        return held

    def assign(self, sharded_grad: torch.Tensor) -> None:
        """Give each trainable shard its slice of ``sharded_grad`` (added if it has one),
        in the shards' dtype."""
        sizes = [buffer.shard_numel for buffer in self.layout.trainable_buffers]
        pieces = sharded_grad.to(self.layout.dtype).split(sizes)
        for index, (shard, piece) in enumerate(zip(self.shards, pieces, strict=True)):
            if shard.grad is None:
                shard.grad = as_shard_grad(piece, shard)
                self.had_grad[index] = [False] * len(self.had_grad[index])  # start afresh
            else:
                shard.grad.add_(piece)
                setattr(shard.grad, STEPPED_ATTR, False)  # pending again: not yet stepped

    def add_used(self, used: Sequence[bool]) -> None:
        """Add a backward's used flags (combined over ranks) and mark, on each shard, the
        parameters its next optimizer step must leave alone (``SkippedSegments``)."""
        flags = iter(used)
        for shard, had in zip(self.shards, self.had_grad, strict=True):
            for index in range(len(had)):
                had[index] = had[index] or next(flags)
            record = None
            if shard.grad is not None and not all(had):
                pieces = segments_of(shard).pieces  # type: ignore[union-attr]
                ranges = tuple(
                    (piece.shard_offset, piece.shard_offset + piece.numel)
                    for piece in pieces
                    if not had[piece.param_index]
                )
                if ranges or not any(had):
                    without = tuple(i for i, h in enumerate(had) if not h)
                    record = SkippedSegments(weakref.ref(shard.grad), not any(had), ranges, without)
            setattr(shard, SKIP_ATTR, record)


def preserve_segments(
    shard: torch.Tensor, state: Mapping[str, Any], ranges: Sequence[tuple[int, int]]
) -> Callable[[], None]:
    """Keep ``shard[start:end]`` for each (start, end) in ``ranges``, and the same elements of
    every per-element state tensor of ``state`` (laid out like ``shard``), as copies; the
    returned function writes them back (after an optimizer step, so parameters without a
    gradient neither move nor change their state). Scalar state (``step``) is shared by the
    whole shard and cannot be kept per parameter.

    Per-element state that appears in ``state`` during the step (pass the optimizer's own
    dict, ``optimizer.state[shard]``, which torch optimizers fill lazily) is zeroed over
    ``ranges``: torch creates state only at a parameter's first gradient, zero-initialised.
    """
    if not ranges:
        return lambda: None
    existing = {key for key, value in state.items() if is_per_element(value, shard)}
    tensors = [shard.detach()] + [state[key].detach() for key in sorted(existing)]
    targets = [tensor[start:end] for tensor in tensors for start, end in ranges]
    kept = [torch.empty_like(target) for target in targets]
    torch._foreach_copy_(kept, targets)

    def restore() -> None:
        with torch.no_grad():
            torch._foreach_copy_(targets, kept)
            created = [
                value.detach()[start:end]
                for key, value in state.items()
                if key not in existing and is_per_element(value, shard)
                for start, end in ranges
            ]
            if created:
                torch._foreach_zero_(created)

    return restore


# Storages holding gradient sums of backwards without sync.
_accumulating: weakref.WeakSet[StorageGradients] = weakref.WeakSet()


def _refuse_unreduced_gradients(optimizer: torch.optim.Optimizer) -> None:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    waiting = [
        book
        for book in list(_accumulating)
        if book.holds_unreduced and any(id(s) in stepped for s in book.shards)
    ]
    if waiting:
        units = list(dict.fromkeys(book.layout.unit_name or "<root>" for book in waiting))
        raise RuntimeError(
            f"optimizer.step() while units {units} hold gradients of backwards run without "
            "gradient sync (inside model.no_sync() or after "
            "model.set_requires_gradient_sync(False)), or reduced without the all-reduce "
            "across replicas (model.set_requires_all_reduce(False)), that no synced "
            "backward has reduced: the step would miss them. Run the last micro-batch's "
            "backward with sync on (outside no_sync / set_requires_gradient_sync(True) and "
            "set_requires_all_reduce(True)), then step."
        )


# During an optimizer step over shards, their gradients are plain tensors, and the pieces of
# parameters without a gradient are left alone (kept and written back after the step).
# Keyed by id(shard): (id of the optimizer whose step holds it, function that restores it).
# A wrapper (gs.optim.LARC) steps its inner optimizer inside its own step: the outer
# step holds the shard, the inner one leaves it to the outer.
_held: dict[int, tuple[int, Callable[[bool], None]]] = {}
_skipped_in_step: dict[int, SkippedSegments] = {}  # id(shard) -> its record, while held
_optimizer_hooks: list[Any] = []


SHAPE_DEPENDENT = frozenset(
    {"Adafactor", "AdaFactor", "Muon", "AdaMuon", "Shampoo", "ScalableShampoo", "SOAP",
     "DistributedShampoo", "Lamb", "LAMB", "LARS", "Lars"}
)  # fmt: skip
"""Names of optimizer classes (torch's, pytorch-optimizer's, ...) whose update of a parameter
depends on its shape or whole-tensor statistics: wrong on a 1-D flat shard."""
SHARDS_ACCEPTED_ATTR = "groupshard_accepts_shards"
"""Set on an optimizer instance handed shards on purpose (``"whole": False`` groups)."""


def _refuse_shape_dependent(optimizer: torch.optim.Optimizer) -> None:
    """A shape-dependent optimizer (``SHAPE_DEPENDENT``, not groupshard's own) must not step
    flat shards: a TypeError naming gs.optim.WholeParamOptimizer, on every rank alike."""
    cls = type(optimizer)
    if (
        cls.__name__ not in SHAPE_DEPENDENT
        or cls.__module__.startswith("groupshard.")
        or getattr(optimizer, SHARDS_ACCEPTED_ATTR, False)
    ):
        return
    for group in optimizer.param_groups:
        for shard in group["params"]:
            segments = segments_of(shard)
            if segments is not None:
                raise TypeError(
                    f"{cls.__module__}.{cls.__qualname__} computes a parameter's update from "
                    "its shape or whole-tensor statistics, but it was given groupshard's flat "
                    f"1-D shards (one holds {list(segments.fqns[:3])}), on which it would "
                    "silently do something else. Step whole parameters instead: "
                    f"gs.optim.WholeParamOptimizer(model.optimizer_groups(), {cls.__name__}, "
                    "**its arguments) gives each parameter to one owner rank and equals "
                    f"{cls.__name__} on one process."
                )


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
    """Before an optimizer's step: its shards' gradients as plain tensors. With a closure
    (``step(closure)``: Lightning, LBFGS) that runs a backward inside the step, that
    happens after each closure call, before the optimizer's own math."""
    _refuse_shape_dependent(optimizer)
    # torch passes the optimizer itself as args[0], then step's own arguments
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        _prepare_step(optimizer, args, kwargs)
        return None

    def closure_then_prepare() -> Any:
        _after_step(optimizer, args, kwargs)  # an earlier call's holds (LBFGS calls again)
        loss = closure()
        _prepare_step(optimizer, args, kwargs)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_prepare}
    return (args[0], closure_then_prepare, *args[2:]), kwargs


def _prepare_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _accumulating:
        _refuse_unreduced_gradients(optimizer)
    # A step of this optimizer that raised left its holds behind: settle them first.
    _after_step(optimizer, args, kwargs)
    for group in optimizer.param_groups:
        for shard in group["params"]:
            _refuse_original(shard)
            grad = shard.grad
            if not isinstance(grad, ShardGrad) or id(shard) in _held:
                continue
            record = skipped_segments_of(shard)
            keep = None
            if record is not None and record.whole:  # as torch.optim skips a .grad of None
                shard.grad = None
            else:
                shard.grad = grad.as_subclass(torch.Tensor)  # plain: no dispatch in the step
                if record is not None:
                    keep = preserve_segments(shard, optimizer.state[shard], record.ranges)
            _held[id(shard)] = (id(optimizer), _restorer(shard, grad, shard.grad, keep))
            if record is not None:
                _skipped_in_step[id(shard)] = record


def _refuse_original(param: torch.Tensor) -> None:
    """torch's idiom (``requires_grad_(True)``, ``optimizer.add_param_group``) with the
    user's parameter of a sharded model would step a tensor the model never reads."""
    fqn = getattr(param, ORIGINAL_ATTR, None)
    if fqn is not None:
        raise ValueError(
            f"The optimizer holds parameter {fqn!r} of a model sharded by gs.shard (e.g. "
            "through optimizer.add_param_group), which the sharded model never reads: its "
            "values live in flat shards. Change param groups with gs.regroup(model, "
            "optimizer, groups) instead (docs/regroup.md)."
        )


def _restorer(
    shard: torch.Tensor,
    grad: torch.Tensor,
    during_step: torch.Tensor | None,
    keep: Callable[[], None] | None,
) -> Callable[[bool], None]:
    """Write the kept pieces back and give the shard its gradient again, unless the shard
    has another gradient by now (a step that raised, then a new backward); ``stepped``:
    the step finished, so the gradient is marked consumed (``was_stepped``)."""

    def restore(stepped: bool) -> None:
        if keep is not None:
            keep()
        if shard.grad is during_step:
            shard.grad = grad
            setattr(grad, STEPPED_ATTR, stepped)

    return restore


def _after_step(
    optimizer: torch.optim.Optimizer, args: Any, kwargs: Any, stepped: bool = False
) -> None:
    """Settle this optimizer's holds: after its step (``stepped``), or a step that raised."""
    note_parameters_written()
    if not _held:
        return
    mine = [key for key, (owner, _) in _held.items() if owner == id(optimizer)]
    for key in mine:
        _skipped_in_step.pop(key, None)
        _held.pop(key)[1](stepped)


def _after_finished_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _after_step(optimizer, args, kwargs, stepped=True)


def was_stepped(grad: torch.Tensor) -> bool:
    """Whether an optimizer step has consumed this shard gradient since its last change
    (what ``zero_grad`` would drop, and ``gs.regroup`` drops)."""
    return bool(getattr(grad, STEPPED_ATTR, False))


def without_grad_in_step(shard: torch.Tensor) -> tuple[int, ...]:
    """During an optimizer step over ``shard``: the indices (in its flat buffer) of the
    parameters that had no gradient in the backwards since the last step (all of them when
    ``shard.grad`` is None), so an optimizer of whole parameters leaves them alone."""
    if shard.grad is None:
        segments = segments_of(shard)
        return tuple(range(len(segments.buffer.params))) if segments is not None else ()
    record = _skipped_in_step.get(id(shard))
    return record.params if record is not None else ()


def register_optimizer_hooks() -> None:
    """Install the global optimizer-step hooks once per process."""
    if not _optimizer_hooks:
        _optimizer_hooks.append(register_optimizer_step_pre_hook(_before_step))
        _optimizer_hooks.append(register_optimizer_step_post_hook(_after_finished_step))
