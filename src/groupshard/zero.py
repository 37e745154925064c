"""The ZeRO-1 optimizer front-end: a drop-in for torch's ZeroRedundancyOptimizer that
takes param groups in its constructor and partitions by element, not by parameter.

Each param group is split into flat buckets of consecutive whole parameters; every
rank owns an equal slice of each (``layout``), so optimizer state per rank is within
a few elements of 1/N whatever the parameter sizes, and layer-wise optimizers
(``gs.optim.LAMB``...) see the segment map of their slice and stay exact. A bucket's
slice is kept near cache size: optimizers make several passes over each tensor, and
on CPU AdamW over one 15M-element tensor took twice as long as over 1M-element
pieces. After the local step one all-gather per bucket refreshes the parameters.

Each step starts from the parameters' current values (whatever changed them since the
last step: ``load_state_dict``, a re-initialisation, DDP's broadcast), and a parameter
whose ``.grad`` is None keeps its values and per-element state, as in torch.optim.

For ZeRO-2 (gradients reduce-scattered, each rank keeping only its slice) use
``gs.shard(model, groups, strategy="grad_op")`` with any torch optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from groupshard import comm, flatten
from groupshard.flatten import plain_optimizer_state
from groupshard.gradients import preserve_segments
from groupshard.layout import Segment, build_flat_buffer
from groupshard.materialize import same_on_every_rank
from groupshard.optim.common import evaluate_closure
from groupshard.segments import ShardSegments, attach_segments


def _param_name(group_index: int, position: int) -> str:
    return f"param_groups[{group_index}]['params'][{position}]"


def _check_params(params: Any) -> list[Any]:
    """The validation of torch's ZeroRedundancyOptimizer, naming what is wrong."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}"
        )
    try:
        entries = list(params)
    except TypeError as error:
        raise TypeError(
            "`params` argument should be an iterable of Tensors or dicts, "
            f"but got {torch.typename(params)}"
        ) from error
    if not entries:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(e, dict) for e in entries):
        groups = [dict(group) for group in entries]
    elif all(isinstance(e, torch.Tensor) for e in entries):
        groups = [{"params": entries}]
    else:
        bad = next(e for e in entries if not isinstance(e, (torch.Tensor, dict)))
        raise TypeError(
            "`params` argument should be an iterable of Tensors or dicts, but it contains "
            f"a {type(bad).__name__}"
        )
    for index, group in enumerate(groups):
        if "params" not in group:
            raise ValueError(f"Param group {index} has no 'params' key")
        tensors = group["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for position, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"{_param_name(index, position)} is a {type(tensor).__name__}, not a Tensor"
                )
            if tensor.is_sparse:
                raise ValueError(
                    f"{_param_name(index, position)} is sparse; ZeroRedundancyOptimizer only "
                    "supports dense parameters"
                )
            if torch.typename(tensor) != torch.typename(tensors[0]):
                raise ValueError(
                    f"Param group {index} mixes dense types: {_param_name(index, 0)} is "
                    f"{torch.typename(tensors[0])} but {_param_name(index, position)} is "
                    f"{torch.typename(tensor)}; put them in separate groups"
                )
        group["params"] = tensors
    return groups


def _bucket_positions(
    params: list[torch.Tensor], world_size: int, max_slice_numel: int | None
) -> list[list[int]]:
    """Runs of consecutive parameter positions whose slice per rank stays within
    ``max_slice_numel`` elements (a larger parameter is a run of its own), as few as
    that allows and about equal in size, so no run is a small remainder."""
    if max_slice_numel is None:
        return [list(range(len(params)))]
    limit = max_slice_numel * world_size
    total = sum(param.numel() for param in params)
    target = total / max(1, -(-total // limit))
    runs: list[list[int]] = [[]]
    numel = 0
    for position, param in enumerate(params):
        if runs[-1] and (numel >= target or numel + param.numel() > limit):
            runs.append([])
            numel = 0
        runs[-1].append(position)
        numel += param.numel()
    return [run for run in runs if run]  # an empty param group has no bucket


def _close(a: float, b: float) -> bool:
    """Equal fingerprints, up to the rounding of a reduction (NaN equals NaN)."""
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))


def _first_difference(ours: dict[str, Any], theirs: dict[str, Any], rank: int) -> str:
    """The first entry of two group signatures that differs, as a sentence."""
    on = f"on rank 0 but {{}} on rank {rank}"
    for key, value in ours.items():
        other = theirs.get(key)
        if value == other:
            continue
        if not key.startswith("param_groups[") or other is None:
            return f"{key} is {value!r} " + on.format(repr(other))
        for j, (mine, its) in enumerate(zip(value["params"], other["params"], strict=False)):
            if mine != its:
                return f"{key}['params'][{j}] is {mine} " + on.format(its)
        if len(value["params"]) != len(other["params"]):
            counts = len(value["params"]), len(other["params"])
            return f"{key} has {counts[0]} parameters " + on.format(counts[1])
        mine, its = value["hyperparameters"], other["hyperparameters"]
        name = next(k for k in sorted(set(mine) | set(its)) if mine.get(k) != its.get(k))
        return f"{key}[{name!r}] is {mine.get(name, 'missing')} " + on.format(
            its.get(name, "missing")
        )
    return "their param groups differ"


def _flat_piece(param: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """Elements ``[offset, offset + numel)`` of ``param`` flattened (a view when contiguous)."""
    return param.detach().reshape(-1)[offset : offset + numel]


def _check_carried_state(
    index: int, positions: list[int], states: list[tuple[torch.Tensor | None, dict[str, Any]]]
) -> None:
    """A new bucket keeps one scalar state (``step``) for all its parameters: refuse,
    naming them, parameters with state beside ones without, or different ``step``s
    (``states``: each parameter's old slice and that slice's state)."""
    if not states:
        return
    names = [_param_name(index, i) for i in positions]
    without = [name for name, (_, state) in zip(names, states, strict=True) if not state]
    if without and len(without) < len(names):
        raise ValueError(
            f"{without} have no optimizer state (newly trainable) but would share a bucket "
            "with parameters that have state; a bucket keeps one 'step' for all its "
            "parameters. Put them in a param group of their own."
        )
    for key in states[0][1] if not without else ():
        values = {
            repr(state[key].tolist() if isinstance(state[key], torch.Tensor) else state[key])
            for shard, state in states
            if not flatten.is_per_element(state[key], shard)
        }
        if len(values) > 1:
            raise ValueError(
                f"The parameters {names} would share a bucket but hold different optimizer "
                f"state {key!r} ({sorted(values)}); put them in separate param groups."
            )


class _Bucket:
    """Consecutive parameters of one group as a flat buffer, and this rank's slice of it."""

    def __init__(
        self,
        group_index: int,
        positions: list[int],
        params: list[torch.Tensor],
        ranks: comm.Ranks,
        as_view: bool,
    ) -> None:
        self.positions = positions  # of the parameters in their group
        self.params = params
        self.ranks = ranks
        self.layout = build_flat_buffer(
            group_index,
            [(_param_name(group_index, i), tuple(p.shape))
             for i, p in zip(positions, params, strict=True)],
            ranks.size,
        )  # fmt: skip
        flat = flatten.flatten([p.detach() for p in params], self.layout)
        start, end = self.layout.shard_range(ranks.rank)
        self.flat = flat if as_view else None  # 1D, padded; the parameters view it
        self.views: list[torch.Tensor] = []
        if as_view:
            self.views = flatten.split(flat, self.layout)
            with torch.no_grad():
                for param, view in zip(params, self.views, strict=True):
                    param.data = view
            self.shard = nn.Parameter(flat[start:end])
        else:
            self.shard = nn.Parameter(flat[start:end].clone())
        self.grad_buffer: torch.Tensor | None = None
        self.segments = ShardSegments(self.layout, ranks.rank, ranks, False, flat.device)
        attach_segments(self.shard, self.segments)

    def _shard_piece(self, segment: Segment) -> torch.Tensor:
        return self.shard.detach()[segment.shard_offset : segment.shard_offset + segment.numel]

    def pull_parameters(self) -> None:
        """Start from the parameters' current values, whatever changed them since the last
        step. Bucket views see in-place changes; a parameter whose ``.data`` was replaced
        is copied into its view and made a view again. Otherwise this rank's slice is
        copied from the parameters (1/N of them)."""
        if self.flat is not None:
            for param, view in zip(self.params, self.views, strict=True):
                if param.data_ptr() != view.data_ptr() or param.stride() != view.stride():
                    view.copy_(param.detach())
                    param.data = view
            return
        pieces = self.segments.pieces
        if not pieces:  # this rank's slice is padding only (e.g. one scalar at world 2)
            return
        torch._foreach_copy_(
            [self._shard_piece(s) for s in pieces],
            [_flat_piece(self.params[s.param_index], s.param_offset, s.numel) for s in pieces],
        )

    def push_own_slice(self) -> None:
        """Write this rank's slice into its part of the parameters (bucket views need not)."""
        if self.flat is not None:
            return
        for segment in self.segments.pieces:
            param = self.params[segment.param_index]
            piece = self._shard_piece(segment)
            if param.is_contiguous():
                _flat_piece(param, segment.param_offset, segment.numel).copy_(piece)
            else:
                values = param.detach().reshape(-1).clone()
                values[segment.param_offset : segment.param_offset + segment.numel] = piece
                param.detach().copy_(values.view(param.shape))

    def ranges_without_gradient(self) -> list[tuple[int, int]]:
        """Where in this rank's slice lie parameters whose ``.grad`` is None."""
        return [
            (segment.shard_offset, segment.shard_offset + segment.numel)
            for segment in self.segments.pieces
            if self.params[segment.param_index].grad is None
        ]

    def load_shard_gradient(self) -> None:
        """This rank's slice of the parameters' gradients (missing ones as zero, their
        segments are then kept unchanged across the step), copied into one buffer kept
        between steps (1/N of the gradient bytes; allocating it afresh every step is
        slower)."""
        if all(p.grad is None for p in self.params):
            self.shard.grad = None
            return
        if self.grad_buffer is None:
            self.grad_buffer = torch.zeros_like(self.shard)
        targets, sources = [], []
        for segment in self.segments.pieces:
            target = self.grad_buffer[segment.shard_offset : segment.shard_offset + segment.numel]
            grad = self.params[segment.param_index].grad
            if grad is None:
                target.zero_()
            else:
                start = segment.param_offset
                targets.append(target)
                sources.append(grad.detach().reshape(-1)[start : start + segment.numel])
        # the padding: an optimizer may have written to it
        self.grad_buffer[self.layout.shard_numel - self.segments.padding_numel :].zero_()
        if targets:
            torch._foreach_copy_(targets, sources)
        self.shard.grad = self.grad_buffer

    def gather(self) -> None:
        """All-gather every rank's updated slice into the parameters (one collective)."""
        self.shard.grad = None
        if self.flat is not None:
            comm.all_gather(self.flat, self.shard.detach(), self.ranks)  # in place
            return
        flat = self.shard.new_empty(self.layout.padded_numel)
        comm.all_gather(flat, self.shard.detach(), self.ranks)
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], flatten.split(flat, self.layout))


class _ZeroJoinHook(JoinHook):
    """What a rank that ran out of inputs does while others step: the same ``step()``, so
    its all-gathers match theirs (its own gradients, usually None, step its slice)."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


class ZeroRedundancyOptimizer(torch.optim.Optimizer, Joinable):
    """Shard any torch optimizer's state across ranks, param groups included.

    Used as torch's ``ZeroRedundancyOptimizer``: gradients already averaged (by DDP
    or the caller), then ``step()``; a joinable of ``torch.distributed.algorithms.Join``
    for uneven inputs (``Join([ddp_model, optimizer])``).

    Args:
        params: tensors, a generator of them, or param-group dicts with "params" and
            per-group hyperparameters (the list you would give ``torch.optim``).
        optimizer_class: the local optimizer, e.g. ``torch.optim.AdamW``.
        process_group: defaults to the default group (a single process if none).
        parameters_as_bucket_view: make the parameters views into the flat buckets,
            so the all-gather writes them in place (no copy).
        overlap_with_ddp: only ``False`` is implemented; to overlap gradient
            communication with the backward pass use
            ``gs.shard(model, groups, strategy="grad_op")`` (ZeRO-2).
        max_slice_numel: most elements of a bucket's slice per rank (whole parameters
            decide; one larger parameter makes a bucket alone); ``None``: one bucket
            per group. Each bucket costs one all-gather per step.
        **defaults: the optimizer's keyword arguments.

    Every rank must pass the same param groups (shapes, dtypes, hyperparameters) and
    hold, at the first ``step()``, the same parameter values in the same order; else
    every rank raises a ValueError naming the first difference.

    Note:
        ``step()`` has torch.optim's semantics but for one thing. It starts from the
        parameters' current values, passes ``closure`` to the local optimizer, and a
        parameter whose ``.grad`` is None keeps its values and its per-element state
        (moments, momentum buffers). Scalar state (Adam's ``step``) is one per bucket:
        it advances whenever any parameter of the bucket has a gradient (a bucket where
        none has one is skipped), so the bias correction of a parameter that missed
        steps uses its bucket's count, and state dicts report that count for every
        parameter of the bucket. Per-element state created in a step where a parameter
        had no gradient is zero for it, as torch creates it at its first gradient (SGD's
        first momentum buffer then includes ``1 - dampening``). A state dict whose
        parameters of one bucket have different ``step`` counts is refused with a
        ValueError naming them.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        max_slice_numel: int | None = 2**21,
        **defaults: Any,
    ) -> None:
        Joinable.__init__(self)
        self.ranks = comm.resolve_ranks(process_group)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.optimizer_class = optimizer_class
        self.max_slice_numel = max_slice_numel
        self._buckets: list[list[_Bucket]] = []  # per group, in group order
        self._consolidated: dict[str, Any] | None = None
        self._replicas_checked = False  # at the first step, then after add_param_group
        error: BaseException | None = None
        try:
            if overlap_with_ddp:
                raise NotImplementedError(
                    "groupshard's ZeroRedundancyOptimizer does not implement "
                    "overlap_with_ddp=True; to overlap gradient communication with the "
                    'backward pass use gs.shard(model, groups, strategy="grad_op") with any '
                    "torch optimizer (ZeRO-2), or pass overlap_with_ddp=False and call step() "
                    "after backward"
                )
            super().__init__(_check_params(params), defaults)
            self.optim = optimizer_class(
                [self._local_group(group) for group in self.param_groups], **defaults
            )
            self._sync(self.optim.param_groups, self.param_groups)
        except Exception as caught:  # every rank must hear of any failure
            error = caught
        comm.raise_if_any_failed(error, self.ranks)
        self._check_same_groups_on_every_rank()

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.size

    @property
    def gradient_slices(self) -> list[torch.Tensor]:
        """The buffers this rank copies its gradient slices into, kept between steps (one
        per bucket that has had a gradient): memory held beside the full gradients."""
        return [b.grad_buffer for b in self._all_buckets if b.grad_buffer is not None]

    def local_slices(self) -> list[tuple[int, list[torch.Tensor], nn.Parameter]]:
        """Per bucket, in group order: its group's index, its parameters, and this rank's
        slice of them, the local optimizer's parameter (``optim.state`` is keyed by it;
        ``flat.segments_of`` gives its segment map). What ``gs.checkpoint`` saves and loads."""
        return [
            (index, bucket.params, bucket.shard)
            for index, buckets in enumerate(self._buckets)
            for bucket in buckets
        ]

    @property
    def _all_buckets(self) -> list[_Bucket]:
        return [bucket for buckets in self._buckets for bucket in buckets]

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """The local optimizer's group: this rank's slices of the group's buckets."""
        params, index = group["params"], len(self._buckets)
        buckets = [
            _Bucket(index, positions, [params[i] for i in positions], self.ranks,
                    self.parameters_as_bucket_view)
            for positions in _bucket_positions(params, self.ranks.size, self.max_slice_numel)
        ]  # fmt: skip
        self._buckets.append(buckets)
        return {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [bucket.shard for bucket in buckets],
        }

    @staticmethod
    def _sync(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
        """Copy every hyperparameter from ``source`` groups to ``target`` groups."""
        for source_group, target_group in zip(source, target, strict=True):
            for key, value in source_group.items():
                if key != "params":
                    target_group[key] = value

    def _groups_signature(self) -> dict[str, Any]:
        """What every rank must agree on: it decides the buckets and the training."""
        signature: dict[str, Any] = {
            "optimizer_class": self.optimizer_class.__qualname__,
            "max_slice_numel": self.max_slice_numel,
            "number of param groups": len(self.param_groups),
        }
        for index, group in enumerate(self.param_groups):
            signature[f"param_groups[{index}]"] = {
                "params": [(tuple(p.shape), str(p.dtype)) for p in group["params"]],
                "hyperparameters": {str(k): repr(v) for k, v in group.items() if k != "params"},
            }
        return signature

    def _check_same_groups_on_every_rank(self) -> None:
        """Fail on every rank, naming the first difference, if ranks passed different
        param groups (collective; at construction and in ``add_param_group`` only)."""
        signatures = comm.gather_if_different(self._groups_signature(), self.ranks)
        if signatures is None:
            return
        ours = signatures[0]
        for rank, theirs in enumerate(signatures):
            if theirs != ours:
                raise ValueError(
                    "Ranks passed different param groups to ZeroRedundancyOptimizer: "
                    f"{_first_difference(ours, theirs, rank)}. Every rank must pass the same "
                    "parameters (shapes, dtypes, order) and hyperparameters."
                )

    def _check_replicas(self) -> None:
        """Every rank must hold the same parameter values in the same order (gradients are
        averaged, so replicas must match): fail on every rank naming the first parameter
        that differs. One collective, at the first step (and after add_param_group)."""
        params = [p for group in self.param_groups for p in group["params"]]
        if same_on_every_rank([p.detach() for p in params], self.ranks):  # bit for bit
            self._replicas_checked = True
            return
        fingerprints = torch.stack(
            [torch.stack([p.detach().double().sum(), p.detach().double().norm()]) for p in params]
        ).tolist()
        gathered = comm.gather_objects(fingerprints, self.ranks)
        self._replicas_checked = True
        names = [
            _param_name(i, j) for i, group in enumerate(self.param_groups)
            for j in range(len(group["params"]))
        ]  # fmt: skip
        for rank, theirs in enumerate(gathered):
            for name, ours, other in zip(names, gathered[0], theirs, strict=True):
                if not all(_close(a, b) for a, b in zip(ours, other, strict=True)):
                    raise ValueError(
                        f"{name} has different values on rank 0 and rank {rank} at the first "
                        "step(): every rank must hold the same parameters in the same order "
                        "(wrap the model in DDP, or broadcast it from one rank, before stepping)"
                    )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: it gets its own buckets; existing partitions and state stay as they
        are. Collective after construction: every rank must add the same group."""
        if not hasattr(self, "optim"):  # during construction
            super().add_param_group(param_group)
            return
        groups_before = len(self.param_groups)
        error: BaseException | None = None
        try:
            super().add_param_group(param_group)
            self.optim.add_param_group(self._local_group(self.param_groups[-1]))
            self._sync(self.optim.param_groups[-1:], self.param_groups[-1:])
        except Exception as caught:  # every rank must hear of any failure
            error = caught
        try:
            comm.raise_if_any_failed(error, self.ranks)
            self._check_same_groups_on_every_rank()
        except Exception:
            for groups in (self.param_groups, self.optim.param_groups, self._buckets):
                del groups[groups_before:]
            raise
        self._replicas_checked = False

    def regroup(self, param_groups: list[dict[str, Any]]) -> None:
        """``gs.regroup`` for this optimizer: new groups and buckets, each parameter that
        stays keeping its state (by identity), new ones starting without, the others'
        dropped. Collective: every rank passes the same groups. The whole optimizer state
        is gathered once (as ``consolidate_state_dict`` does, on every rank)."""
        error: BaseException | None = None
        try:
            groups = _check_params(param_groups)
            old_state = {
                id(param): (bucket.shard, self.optim.state.get(bucket.shard, {}))
                for bucket in self._all_buckets
                for param in bucket.params
            }
            for index, group in enumerate(groups):
                if not group["params"]:
                    raise ValueError(
                        f"Param group {index} is empty; every group of a "
                        "ZeroRedundancyOptimizer needs parameters (leave it out)."
                    )
                for positions in _bucket_positions(
                    group["params"], self.ranks.size, self.max_slice_numel
                ):
                    states = [old_state.get(id(group["params"][i]), (None, {})) for i in positions]
                    _check_carried_state(index, positions, states)
        except Exception as caught:  # every rank must hear of any failure
            error = caught
        comm.raise_if_any_failed(error, self.ranks)
        per_param: dict[int, dict[str, Any]] = {}
        for bucket in self._all_buckets:
            local = self.optim.state.get(bucket.shard, {})
            if local:
                entries = flatten.gather_shard_state(
                    local, bucket.shard, bucket.layout, self.ranks, replicated=False
                )
                per_param.update(zip(map(id, bucket.params), entries, strict=True))
        staying = {id(p) for group in groups for p in group["params"]}
        for bucket in self._all_buckets:  # a parameter leaving a bucket view gets its own data
            for param in bucket.params:
                if bucket.flat is not None and id(param) not in staying:
                    param.data = param.data.clone()
        self.param_groups.clear()
        self._buckets = []
        for group in groups:
            super().add_param_group(group)
        self.optim = self.optimizer_class(
            [self._local_group(group) for group in self.param_groups], **self.defaults
        )
        self._sync(self.optim.param_groups, self.param_groups)
        for bucket in self._all_buckets:
            entries = [per_param.get(id(param)) for param in bucket.params]
            if entries and all(entries):
                self.optim.state[bucket.shard] = flatten.shard_state_from(
                    entries,
                    bucket.shard,
                    bucket.layout,
                    self.rank,  # type: ignore[arg-type]
                )
        self._consolidated = None
        self._replicas_checked = False
        self._check_same_groups_on_every_rank()

    def _keep_parameters_without_gradient(self) -> list[Callable[[], None]]:
        """Per bucket being stepped: restore, after the step, the values and per-element
        state of the parameters whose ``.grad`` is None (torch.optim skips them)."""
        restores = []
        for bucket in self._all_buckets:
            ranges = bucket.ranges_without_gradient() if bucket.shard.grad is not None else []
            if ranges:
                state = self.optim.state[bucket.shard]  # the dict the optimizer fills
                restores.append(preserve_segments(bucket.shard, state, ranges))
        return restores

    def _local_closure(
        self, closure: Callable[[], Any], restores: list[Callable[[], None]]
    ) -> Callable[[], Any]:
        """``closure`` for the local optimizer: every evaluation but the first sees this
        rank's slices as the optimizer has changed them so far (as torch's ZeRO, whose
        local optimizer holds the parameters themselves), and is followed by loading the
        gradient slices; the first also decides anew which parameters have no gradient
        (``restores`` holds what was decided from the gradients before the step)."""
        buckets = self._all_buckets
        evaluations = 0

        def local_closure() -> Any:
            nonlocal evaluations
            if evaluations:
                with torch.no_grad():
                    for bucket in buckets:
                        bucket.push_own_slice()
            loss = evaluate_closure(closure)
            with torch.no_grad():
                for bucket in buckets:
                    bucket.load_shard_gradient()
                if not evaluations:
                    restores[:] = self._keep_parameters_without_gradient()
            evaluations += 1
            return loss

        return local_closure

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step the local optimizer on this rank's slices, then all-gather the parameters.

        ``closure`` goes to the local optimizer: each evaluation (with gradients enabled)
        is followed by loading this rank's gradient slices, and it sees this rank's part
        of the parameters as the local optimizer has changed it so far. The gradients
        present before the step are loaded first, as torch's local optimizer holds them
        too: a local optimizer that ignores the closure steps from them.
        """
        Join.notify_join_context(self)
        if not self._replicas_checked:
            self._check_replicas()
        buckets = self._all_buckets
        for bucket in buckets:
            bucket.pull_parameters()
        self._sync(self.param_groups, self.optim.param_groups)
        for bucket in buckets:
            bucket.load_shard_gradient()
        restores = self._keep_parameters_without_gradient()
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            loss = self.optim.step(closure=self._local_closure(closure, restores), **kwargs)
        for restore in restores:
            restore()
        self._sync(self.optim.param_groups, self.param_groups)
        for bucket in buckets:
            bucket.gather()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.optim.zero_grad(set_to_none)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook with which a rank that ran out of inputs shadows ``step()``'s
        collectives under ``torch.distributed.algorithms.Join`` (takes no kwargs)."""
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._all_buckets[0].shard.device

    @property
    def join_process_group(self) -> Any:
        return self.ranks.group

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on group rank ``to`` (collective: call on all ranks)."""
        per_param: dict[str, dict[str, Any]] = {}
        groups = []
        for buckets, group in zip(self._buckets, self.param_groups, strict=True):
            names = []
            for bucket in buckets:
                local = self.optim.state.get(bucket.shard, {})
                entries = flatten.gather_shard_state(
                    local, bucket.shard, bucket.layout, self.ranks, replicated=False
                )
                bucket_names = [slot.fqn for slot in bucket.layout.params]
                per_param.update(zip(bucket_names, entries, strict=True))
                names += bucket_names
            groups.append((names, {k: v for k, v in group.items() if k != "params"}))
        self._consolidated = plain_optimizer_state(groups, per_param) if self.rank == to else None

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state in plain torch.optim format (after consolidate_state_dict)."""
        if self._consolidated is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant "
                "to save the global state."
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain torch.optim state dict (from an unsharded optimizer, or this one saved
        at any world size): each rank keeps its slice."""
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        saved = [len(g["params"]) for g in groups]
        if sizes != saved:
            raise ValueError(
                f"The state dict has param groups of sizes {saved} but this optimizer has {sizes}"
            )
        self._sync(groups, self.param_groups)
        self._sync(self.param_groups, self.optim.param_groups)
        for buckets, group in zip(self._buckets, groups, strict=True):
            for bucket in buckets:
                entries = [state_dict["state"].get(group["params"][i]) for i in bucket.positions]
                self.optim.state.pop(bucket.shard, None)
                if all(entry is None for entry in entries):
                    continue
                if any(entry is None for entry in entries):
                    missing = [
                        _param_name(bucket.layout.group_index, i)
                        for i, entry in zip(bucket.positions, entries, strict=True)
                        if entry is None
                    ]
                    raise ValueError(
                        f"The state dict has no state for {', '.join(missing)} but has state for "
                        "other parameters stepped with them; expects all or none"
                    )
                local = flatten.shard_state_from(entries, bucket.shard, bucket.layout, self.rank)
                self.optim.state[bucket.shard] = local
