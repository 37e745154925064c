"""Exact per-parameter norms from flat shards: segment sums, then one all-reduce.

A shard holds pieces of several original parameters. Each rank reduces its shard
per segment (``index_add_`` over ``segment_ids``: sum of ``|x|^p``, or a max for
the inf norm), every partial vector of a call goes into **one** all-reduce, and the
root is taken afterwards, so the result equals ``torch.linalg.vector_norm`` of the
unsharded tensor on every rank. Plain (unsharded) tensors work too: each is one
segment and needs no communication.

Note:
    Partials are accumulated in float64 (``dtype=`` of torch's norm kernels) and
    cast back at the end: a float32 norm of a million elements is off by up to 1e-4
    relative, more than the differences the exactness tests look for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from groupshard import comm
from groupshard.segments import ShardSegments, segments_of
from groupshard.sharding import is_sharded

ACCUMULATE = torch.float64


def check_norm_type(norm_type: float | str) -> float:
    """``norm_type`` as a float (``"inf"`` accepted); p must be positive."""
    value = float(norm_type)
    if not value > 0:
        raise ValueError(f"Expects norm_type > 0 (or inf) but got {norm_type=}")
    return value


def _to_partial(norms: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Norms -> what adds (or maxes) across ranks: ``norm^p``, or the norm itself for inf."""
    if norm_type in (1.0, math.inf):
        return norms
    if norm_type == 2.0:
        return norms * norms
    return norms.pow(norm_type)


def _segment_partials(
    flat: torch.Tensor, segments: ShardSegments, norm_type: float
) -> torch.Tensor:
    """Per original parameter, this shard's partial (zero for parameters not in it).

    Segments are contiguous runs of the shard, so each is a view; torch's own norm
    kernels reduce them (accurate and fast, unlike a sequential ``index_add_``).
    """
    pieces = segments.pieces
    out = flat.new_zeros(len(segments.buffer.params), dtype=ACCUMULATE)
    if not pieces:
        return out
    views = flat.split([piece.numel for piece in pieces] + [segments.padding_numel])[:-1]
    norms = torch.stack(torch._foreach_norm(list(views), norm_type, dtype=ACCUMULATE))
    first = pieces[0].param_index
    out[first : first + len(pieces)] = _to_partial(norms, norm_type)
    return out


def _row_partials(flat: torch.Tensor, segments: ShardSegments, norm_type: float) -> torch.Tensor:
    """Per row of every parameter of the buffer, this shard's partial."""
    out = flat.new_zeros(segments.num_rows, dtype=ACCUMULATE)
    row_numels = segments.buffer.row_numels()
    first_rows = segments.first_rows
    for piece in segments.pieces:
        row_numel = row_numels[piece.param_index]
        values = flat[piece.shard_offset : piece.shard_offset + piece.numel]
        first_row = first_rows[piece.param_index] + piece.param_offset // row_numel
        head = min(-piece.param_offset % row_numel, piece.numel)
        full_rows = (piece.numel - head) // row_numel
        parts = [values[:head].reshape(1, -1)] if head else []
        if full_rows:
            parts.append(values[head : head + full_rows * row_numel].view(full_rows, row_numel))
        tail = values[head + full_rows * row_numel :]
        if tail.numel():
            parts.append(tail.reshape(1, -1))
        norms = torch.cat(
            [torch.linalg.vector_norm(p, norm_type, dim=1, dtype=ACCUMULATE) for p in parts]
        )
        out[first_row : first_row + norms.numel()] = _to_partial(norms, norm_type)
    return out


class SegmentReduction:
    """Collects per-segment partial reductions and finishes them with one all-reduce.

    ``add`` returns a handle; ``reduce`` returns, per handle, the total over ranks
    of ``sum |x|^p`` (or ``max |x|`` for the inf norm), per parameter or per row.
    """

    def __init__(self, norm_type: float | str = 2.0) -> None:
        self.norm_type = check_norm_type(norm_type)
        self._partials: list[torch.Tensor] = []
        self._ranks: list[tuple[comm.Ranks, ...]] = []  # reduced over each, in order
        # row-wise partials under tensor parallelism: which rows the tp step (last) sums
        self._rows_over_tp: list[torch.Tensor | None] = []

    def add(
        self, values: torch.Tensor, like: torch.Tensor | None = None, by_rows: bool = False
    ) -> int:
        """Queue ``values``, laid out like tensor ``like`` (default: itself).

        ``like`` is the parameter when ``values`` is its gradient or update: a shard
        gives the segment map, a plain tensor is one segment (or one per row).
        """
        like = values if like is None else like
        segments = segments_of(like)
        partial = self._partial(values.detach(), segments, by_rows, like.shape)
        rows_over_tp = None
        if segments is not None and segments.counted is not None:
            if by_rows:  # rows split over tp add up there; the others are whole already
                rows_over_tp = segments.tp_summed_rows
            else:  # a Replicate parameter counted once (where, not a product: 0 * inf is nan)
                partial = torch.where(segments.counted > 0, partial, 0.0)
        self._partials.append(partial)
        self._ranks.append(segments.reduce_over if segments is not None else ())
        self._rows_over_tp.append(rows_over_tp)
        return len(self._partials) - 1

    def _partial(
        self,
        values: torch.Tensor,
        segments: ShardSegments | None,
        by_rows: bool,
        shape: torch.Size,
    ) -> torch.Tensor:
        flat = values.reshape(-1)
        if segments is not None:
            if by_rows:
                return _row_partials(flat, segments, self.norm_type)
            return _segment_partials(flat, segments, self.norm_type)
        rows = shape[0] if by_rows and len(shape) >= 2 else 1
        norms = torch.linalg.vector_norm(
            flat.view(rows, -1), self.norm_type, dim=1, dtype=ACCUMULATE
        )
        return _to_partial(norms, self.norm_type)

    def reduce(self) -> list[torch.Tensor]:
        """Finish every queued partial: one collective per process group (normally one;
        under tensor parallelism one over the shard group, then one over tp)."""
        results = list(self._partials)
        for step in range(max((len(ranks) for ranks in self._ranks), default=0)):
            by_group: dict[int, list[int]] = {}
            for index, ranks in enumerate(self._ranks):
                if len(ranks) > step:
                    by_group.setdefault(id(ranks[step].group), []).append(index)
            for indices in by_group.values():
                ranks = self._ranks[indices[0]][step]
                sent = [self._masked(results[i], i, step) for i in indices]
                flat = torch.cat(sent)
                if self.norm_type == math.inf:
                    comm.all_reduce_max(flat, ranks)
                else:
                    comm.all_reduce_sum(flat, ranks)
                pieces = flat.split([t.numel() for t in sent])
                for index, piece in zip(indices, pieces, strict=True):
                    rows = self._rows_over(index, step)
                    kept = results[index]
                    results[index] = piece if rows is None else torch.where(rows, piece, kept)
        return results

    def _rows_over(self, index: int, step: int) -> torch.Tensor | None:
        """At the tp step (the last) of a row-wise partial: the rows tp sums, else None."""
        if step != len(self._ranks[index]) - 1:
            return None
        return self._rows_over_tp[index]

    def _masked(self, partial: torch.Tensor, index: int, step: int) -> torch.Tensor:
        """What ``partial`` sends at ``step``: zeros for rows whole on this rank already."""
        rows = self._rows_over(index, step)
        return partial if rows is None else torch.where(rows, partial, 0.0)

    def root(self, total: torch.Tensor) -> torch.Tensor:
        """Turn a reduced ``sum |x|^p`` into the p-norm (the inf norm is already one)."""
        if self.norm_type == math.inf or self.norm_type == 1.0:
            return total
        if self.norm_type == 2.0:
            return total.sqrt()
        return total.pow(1.0 / self.norm_type)


def expand(
    per_segment: torch.Tensor, like: torch.Tensor, by_rows: bool = False, fill: float = 0.0
) -> torch.Tensor:
    """Spread one value per parameter (or per row) over the elements of ``like``.

    For a shard, the padding gets ``fill``. For a plain tensor the result broadcasts
    against it: a 0-d tensor, or ``(rows, 1, ...)`` when ``by_rows``.
    """
    segments = segments_of(like)
    if segments is None:
        if by_rows and like.ndim >= 2:
            return per_segment.view(like.shape[0], *([1] * (like.ndim - 1)))
        return per_segment.reshape(())
    padded = torch.cat([per_segment, per_segment.new_full((1,), fill)])
    return padded[segments.row_ids if by_rows else segments.segment_ids]


def scale_by_parameter_(
    values: torch.Tensor, per_parameter: torch.Tensor, like: torch.Tensor | None = None
) -> torch.Tensor:
    """Multiply ``values`` in place by one factor per parameter (``like``'s layout).

    A shard's segments are contiguous views, so this is one ``_foreach_mul_`` over them
    (the padding keeps its values) instead of spreading the factors over every element
    as ``expand`` does; a plain tensor is one parameter.
    """
    segments = segments_of(values if like is None else like)
    if segments is None:
        return values.mul_(per_parameter.reshape(()))
    pieces = segments.pieces
    if pieces:
        views = values.view(-1).split([piece.numel for piece in pieces] + [segments.padding_numel])
        first = pieces[0].param_index
        factors = per_parameter[first : first + len(pieces)].unbind()
        torch._foreach_mul_(list(views[:-1]), list(factors))
    return values


def _model_shards(model: nn.Module) -> list[nn.Parameter]:
    if not is_sharded(model):
        raise TypeError(f"Expects a model returned by gs.shard but got {type(model).__name__}")
    return [shard for storage in model.groupshard.storages for shard in storage.shards]


def _named_norms(
    tensors: list[tuple[torch.Tensor, torch.Tensor]], reduction: SegmentReduction
) -> dict[str, torch.Tensor]:
    """``(shard, values)`` pairs -> ``{fqn: norm}`` after one reduction."""
    handles = [(shard, reduction.add(values, shard)) for shard, values in tensors]
    totals = reduction.reduce()
    norms: dict[str, torch.Tensor] = {}
    for shard, handle in handles:
        segments = segments_of(shard)
        assert segments is not None
        per_param = reduction.root(totals[handle]).to(shard.dtype)
        for fqn, total in zip(segments.fqns, per_param, strict=True):
            norms[fqn] = total
    return norms


def param_norms(model: nn.Module, norm_type: float | str = 2.0) -> dict[str, torch.Tensor]:
    """``{original name: norm}`` of every parameter (frozen too), identical on all ranks."""
    shards = _model_shards(model)
    return _named_norms([(s, s) for s in shards], SegmentReduction(norm_type))


def grad_norms(model: nn.Module, norm_type: float | str = 2.0) -> dict[str, torch.Tensor]:
    """``{original name: norm of its gradient}`` for parameters that have one."""
    shards = _model_shards(model)
    pairs = [(s, s.grad) for s in shards if s.requires_grad and s.grad is not None]
    return _named_norms(pairs, SegmentReduction(norm_type))


def norm_report(model: nn.Module, by: str = "parameter") -> list[dict[str, Any]]:
    """Weight and gradient 2-norms per original parameter or per layer, for logging.

    One all-reduce for everything. Rows: ``{"name", "numel", "param_norm",
    "grad_norm"}`` (floats; ``grad_norm`` is None without a gradient). ``by="layer"``
    combines the parameters of each module (the name without its last part).
    """
    if by not in ("parameter", "layer"):
        raise ValueError(f"Expects by in ('parameter', 'layer') but got {by=}")
    shards = _model_shards(model)
    reduction = SegmentReduction(2.0)
    pairs = [(s, s) for s in shards] + [
        (s, s.grad) for s in shards if s.requires_grad and s.grad is not None
    ]
    handles = [(shard, reduction.add(values, shard)) for shard, values in pairs]
    totals = reduction.reduce()
    squares: dict[str, dict[str, float]] = {}
    numels: dict[str, int] = {}
    for position, (shard, handle) in enumerate(handles):
        kind = "param_norm" if position < len(shards) else "grad_norm"
        segments = segments_of(shard)
        assert segments is not None
        for slot, total in zip(segments.buffer.params, totals[handle].tolist(), strict=True):
            name = slot.fqn if by == "parameter" else slot.fqn.rpartition(".")[0] or slot.fqn
            entry = squares.setdefault(name, {})
            entry[kind] = entry.get(kind, 0.0) + total
            if kind == "param_norm":
                numel = slot.numel if segments.tensor_parallel is None else (
                    segments.tensor_parallel.numel(slot.fqn, slot.numel)
                )  # fmt: skip
                numels[name] = numels.get(name, 0) + numel
    return [
        {
            "name": name,
            "numel": numels[name],
            "param_norm": math.sqrt(entry["param_norm"]),
            "grad_norm": math.sqrt(entry["grad_norm"]) if "grad_norm" in entry else None,
        }
        for name, entry in squares.items()
    ]


def _grad_pairs(parameters: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter, gradient)`` for the parameters that have a gradient."""
    return [(p, p.grad) for p in parameters if p.grad is not None]


def _combined_norm(reduction: SegmentReduction, per_segment: list[torch.Tensor]) -> torch.Tensor:
    """The norm of many tensors from their reduced per-segment partials."""
    joined = torch.cat(per_segment) if per_segment else torch.zeros(0, dtype=ACCUMULATE)
    if reduction.norm_type == math.inf:
        return joined.max() if joined.numel() else joined.new_zeros(())
    return reduction.root(joined.sum())


def _clip(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    clip_coef = max_norm / (total + 1e-6)
    clamped = torch.clamp(clip_coef, max=1.0)
    for grad in grads:
        grad.mul_(clamped.to(grad.device, grad.dtype))


def _check_finite(total: torch.Tensor, norm_type: float | str, what: str) -> None:
    if not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for {what} is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )


def clip_grad_norm_(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the exact global norm over shards.

    Args:
        parameters: a sharded model, or tensors (shards and/or plain parameters).
        max_norm: the largest allowed total norm.
        norm_type: p of the p-norm, or ``inf``.
        error_if_nonfinite: raise if the total norm is nan or inf (on every rank).

    Returns:
        The total norm before clipping, the same on every rank.
    """
    if isinstance(parameters, nn.Module):
        params: list[torch.Tensor] = [s for s in _model_shards(parameters) if s.requires_grad]
    elif isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        params = list(parameters)
    pairs = _grad_pairs(params)
    reduction = SegmentReduction(norm_type)
    handles = [reduction.add(grad, param) for param, grad in pairs]
    totals = reduction.reduce()
    total = _combined_norm(reduction, [totals[h] for h in handles])
    if error_if_nonfinite:
        _check_finite(total, norm_type, "gradients")
    grads = [grad for _, grad in pairs]
    _clip(grads, float(max_norm), total)
    return total.to(grads[0].dtype) if grads else total


def clip_grad_norm_per_group_(
    optimizer: torch.optim.Optimizer,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
) -> dict[int, torch.Tensor]:
    """Clip each param group to its own ``max_grad_norm`` (groups without it are left alone).

    Every group's norm comes from one shared all-reduce. Returns ``{group index:
    total norm before clipping}`` for the clipped groups.
    """
    reduction = SegmentReduction(norm_type)
    plans = []
    for index, group in enumerate(optimizer.param_groups):
        if group.get("max_grad_norm") is None:
            continue
        pairs = _grad_pairs(group["params"])
        handles = [reduction.add(grad, param) for param, grad in pairs]
        plans.append((index, group["max_grad_norm"], [grad for _, grad in pairs], handles))
    totals = reduction.reduce()
    norms = {}
    for index, max_norm, grads, handles in plans:
        total = _combined_norm(reduction, [totals[h] for h in handles])
        if error_if_nonfinite:
            _check_finite(total, norm_type, f"the gradients of param group {index}")
        _clip(grads, float(max_norm), total)
        norms[index] = total.to(grads[0].dtype) if grads else total
    return norms
