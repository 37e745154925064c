"""Muon for 2-D hidden weights and AdamW for the rest, in one optimizer, exact on flat shards.

``torch.optim.Muon``'s math operation for operation (and ``torch.optim.AdamW``'s functional
for groups with ``use_muon=False``), bit for bit equal to torch's. Newton-Schulz needs a
whole matrix: every matrix held in sharded parameters gets one owner rank, balanced by its
Newton-Schulz cost; per step one ``all_to_all`` sends the pieces to their owners (while the
AdamW groups step) and one sends the orthogonalized results back. State is torch's
(``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``), per element and laid out like
each shard, so state dicts and checkpoints handle it like any torch optimizer's.
docs/muon-design.md has the design: ownership, volume and memory per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache
from typing import Any

import torch
from torch.optim.adamw import adamw as adamw_functional

from groupshard import comm
from groupshard.optim.common import evaluate_closure
from groupshard.optim.owners import (
    OwnerExchange,
    Ownership,
    assign_owners,
    by_process_group,
)
from groupshard.segments import ShardSegments, segments_of
from groupshard.tensor_parallel import TensorParallelism, apply_to_wholes, whole_dims

__all__ = ["Muon", "Ownership", "assign_owners", "newton_schulz_cost", "zeropower_via_newtonschulz"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic coefficients, as torch.optim.Muon's defaults."""
NS_STEPS = 5
NS_EPS = 1e-7
NS_DTYPE = torch.bfloat16
"""The dtype Newton-Schulz runs in (torch.optim.Muon's) and the exchanges carry."""
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
MUON_ONLY_KEYS = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn")
"""Group keys a group with ``use_muon=False`` does not get from the defaults."""


def zeropower_via_newtonschulz(
    matrix: torch.Tensor,
    ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """The orthogonalized ``matrix`` (bfloat16, same shape), torch.optim.Muon's iteration.

    Unlike torch's, the input is always copied: torch's divides a bfloat16 input in place
    (with ``nesterov=False`` and bfloat16 parameters, its momentum buffer).
    """
    if matrix.ndim != 2:
        raise ValueError(f"Expects a 2-D matrix but got shape {tuple(matrix.shape)}")
    return _newton_schulz(matrix.to(NS_DTYPE, copy=True), ns_coefficients, ns_steps, eps)


def _newton_schulz(
    ortho: torch.Tensor, ns_coefficients: Sequence[float], ns_steps: int, eps: float
) -> torch.Tensor:
    """``zeropower_via_newtonschulz`` of a bfloat16 matrix that it may scale in place."""
    a, b, c = ns_coefficients
    tall = ortho.size(0) > ortho.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning rate for a ``rows x cols`` matrix."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def newton_schulz_cost(rows: int, cols: int) -> int:
    """Work of one Newton-Schulz iteration, up to a constant: ``rows * cols * min``."""
    return rows * cols * min(rows, cols)


def matrix_shape(shape: Sequence[int], flatten_conv: bool, name: str) -> tuple[int, int]:
    """The matrix Muon orthogonalizes for a parameter of ``shape``; a ValueError naming
    the parameter when there is none."""
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    if len(shape) > 2 and flatten_conv:
        return int(shape[0]), math.prod(shape[1:])
    hint = (
        ", or pass flatten_conv=True (to gs.optim.Muon or in the group) to orthogonalize it "
        f"as a ({shape[0]}, {math.prod(shape[1:])}) matrix"
        if len(shape) > 2
        else ""
    )
    raise ValueError(
        f"Muon only supports 2D parameters, but {name} of shape {tuple(shape)} is in a Muon "
        "param group; put it in a group with use_muon=False (AdamW; gs.muon_groups does so "
        f"for biases, norms, embeddings and the head){hint}"
    )


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


@cache
def _adamw_defaults() -> dict[str, Any]:
    """torch.optim.AdamW's group keys and defaults, from the installed torch."""
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return dict(probe.defaults)


def _scalar_dtype(fused: bool | None) -> torch.dtype:
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _write_orthogonalized(
    ortho: torch.Tensor, matrix: torch.Tensor, pieces: Sequence[torch.Tensor]
) -> None:
    """Newton-Schulz's result ``ortho`` of ``matrix`` (the received ``pieces`` end to end)
    into those pieces, which travel back to their ranks."""
    if not ortho.is_contiguous():  # a tall matrix's: transposed into the input's place
        ortho = matrix.copy_(ortho)
    if ortho.data_ptr() != matrix.data_ptr() or len(pieces) > 1:
        sizes = [piece.numel() for piece in pieces]
        torch._foreach_copy_(list(pieces), list(ortho.reshape(-1).split(sizes)))


def _split_over_tp(tensor_parallel: TensorParallelism | None, fqn: str) -> bool:
    """Whether tensor parallelism splits the matrix ``fqn`` (by rows or columns)."""
    return tensor_parallel is not None and tensor_parallel.split_dim(fqn) is not None


def _subtract_update(
    target: torch.Tensor,
    ortho: torch.Tensor,
    group: dict[str, Any],
    rows: int,
    cols: int,
    whole: Sequence[int] | None = None,
) -> None:
    """Subtract the group's learning rate, adjusted by the matrix's shape (``whole``: the
    whole matrix's, of which ``rows`` x ``cols`` is this rank's piece under tensor
    parallelism), times ``ortho`` from ``target`` (a matrix's elements, row-major)."""
    lr = adjusted_lr(_scalar(group["lr"]), group["adjust_lr_fn"], *(whole or (rows, cols)))
    target.view(rows, cols).add_(ortho, alpha=-lr)


def _add_orthogonalized(
    target: torch.Tensor, update: torch.Tensor, group: dict[str, Any], rows: int, cols: int
) -> None:
    """Subtract the group's adjusted learning rate times the orthogonalized ``update`` (a
    matrix's elements, row-major) from ``target`` (the same elements of the parameter)."""
    ortho = zeropower_via_newtonschulz(
        update.view(rows, cols), group["ns_coefficients"], group["ns_steps"], group["eps"]
    )
    _subtract_update(target, ortho, group, rows, cols)


def _orthogonalized_over_tp(
    tensor_parallel: TensorParallelism, items: Sequence[tuple[str, torch.Tensor, dict[str, Any]]]
) -> list[torch.Tensor]:
    """This rank's pieces of the orthogonalized whole matrices of ``(fqn, bfloat16 piece,
    group)`` items split over tp, the Newton-Schulz shared out over tp (``apply_to_wholes``,
    balanced by its cost); Newton-Schulz may scale the pieces in place."""

    def newton_schulz(item: int, matrix: torch.Tensor) -> torch.Tensor:
        group = items[item][2]
        return _newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

    return apply_to_wholes(
        tensor_parallel, [(fqn, matrix) for fqn, matrix, _ in items], newton_schulz,
        lambda shape: newton_schulz_cost(*shape),
    )  # fmt: skip


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's math, exact on groupshard shards and on plain parameters alike,
    with param groups that use AdamW instead (``{"params": ..., "use_muon": False}``).

    Args:
        params: parameters or param groups: ``model.optimizer_groups()`` of ``gs.shard``,
            the local slices of ``gs.ZeroRedundancyOptimizer(groups, gs.optim.Muon, ...)``,
            or plain tensors (``gs.muon_groups(model)`` builds the usual two groups).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as ``torch.optim.Muon`` (the defaults of every Muon group).
        flatten_conv: orthogonalize a parameter with more than 2 dimensions (a conv
            weight ``(out, in, k, k)``) as the matrix ``(out, in * k * k)``, its learning
            rate adjusted for that shape; without it such a parameter is refused.

    A group with ``use_muon=False`` is stepped exactly as ``torch.optim.AdamW`` would step
    it, with AdamW's keys (``betas``, ``eps``, ``amsgrad``, ``maximize``, ``foreach``,
    ``fused``...) and AdamW's defaults for the keys it does not set, except ``lr`` and
    ``weight_decay``, which default to this optimizer's (as any torch optimizer's
    defaults reach every group); ``eps`` means AdamW's epsilon there (default 1e-8).

    Every rank must step (the exchange is collective); see the module docstring for the
    ownership, the collectives and the memory.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        flatten_conv: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, flatten_conv=flatten_conv, use_muon=True,
        )  # fmt: skip
        _check_muon_options(defaults, "gs.optim.Muon")
        self._exchanges: tuple[Any, list[OwnerExchange]] | None = None
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """As torch's (``load_state_dict`` ends here); groups loaded from a plain
        torch.optim.Muon's state dict become Muon groups."""
        super().__setstate__(state)
        for group in self.param_groups:
            if group.setdefault("use_muon", True):
                group.setdefault("flatten_conv", self.defaults.get("flatten_conv", False))
        self._exchanges = None

    # --- groups ---------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, plus: a group with ``use_muon=False`` gets AdamW's keys and defaults
        (not Muon's); a Muon group's parameters must be matrices (ValueError naming one
        that is not, by FQN for shards)."""
        use_muon = param_group.get("use_muon", self.defaults["use_muon"])
        if not isinstance(use_muon, bool):
            raise TypeError(f"Expects use_muon to be True or False but got {use_muon!r}")
        given = set(param_group)
        if not use_muon:
            for key, value in _adamw_defaults().items():
                if key not in ("lr", "weight_decay"):
                    param_group.setdefault(key, value)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        try:
            if use_muon:
                _check_muon_options(group, f"Param group {index}")
                for position, param in enumerate(group["params"]):
                    _check_matrices(param, group["flatten_conv"], index, position)
            else:
                for key in (*MUON_ONLY_KEYS, "flatten_conv"):
                    if key not in given:
                        group.pop(key, None)
                _check_adamw_options(group, index)
        except Exception:
            self.param_groups.pop()
            raise
        self._exchanges = None

    def ownership(self) -> list[Ownership]:
        """Per process group over which Muon matrices are sharded: each matrix's owner, the
        Newton-Schulz cost per rank, and the elements this rank moves per step. Pure: no
        communication; the same owners on every rank."""
        return [exchange.ownership(NS_DTYPE.itemsize) for exchange in self._plans()]

    def _plans(self) -> list[OwnerExchange]:
        """The exchanges (one per process group), rebuilt when the groups change."""
        key = tuple(
            (index, group["use_muon"], group.get("flatten_conv"), tuple(map(id, group["params"])))
            for index, group in enumerate(self.param_groups)
        )
        if self._exchanges is not None and self._exchanges[0] == key:
            return self._exchanges[1]
        entries = [
            (index, param)
            for index, group in enumerate(self.param_groups)
            if group["use_muon"]
            for param in group["params"]
        ]
        exchanges = [
            OwnerExchange(ranks, found, self._matrix_cost)
            for ranks, found in by_process_group(entries)
        ]
        self._exchanges = (key, exchanges)
        return exchanges

    def _matrix_cost(self, group: int, shape: tuple[int, ...]) -> float:
        flatten_conv = self.param_groups[group]["flatten_conv"]
        return newton_schulz_cost(*matrix_shape(shape, flatten_conv, "a Muon parameter"))

    def _dims(self, exchange: OwnerExchange, index: int) -> tuple[int, int]:
        """The matrix (rows, cols) Muon orthogonalizes for the exchange's tensor ``index``."""
        t = exchange.tensors[index]
        return matrix_shape(t.shape, self.param_groups[t.group]["flatten_conv"], repr(t.fqn))

    @staticmethod
    def _tensor_parallel(exchange: OwnerExchange, index: int) -> TensorParallelism | None:
        """The tensor parallelism of the exchange's tensor ``index`` (None: none)."""
        segments = segments_of(exchange.params[exchange.tensors[index].param])
        return None if segments is None else segments.tensor_parallel

    # --- step -----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon / AdamW step for every group; collective over the ranks that share
        sharded Muon parameters (two all-to-alls per process group)."""
        loss = evaluate_closure(closure)
        exchanges = self._plans()
        updates: dict[int, torch.Tensor] = {}  # id(sharded param) -> momentum-updated grad
        adamw_groups = []
        over_tp: list[tuple[Any, ...]] = []  # held whole here, split over tp (_local_step)
        tensor_parallel = None
        for group in self.param_groups:
            if not group["use_muon"]:
                adamw_groups.append(group)
                continue
            for param in group["params"]:
                if param.grad is None:
                    continue
                update = self._momentum_update(param, group)
                segments = segments_of(param)
                if segments is not None and segments.needs_reduce:
                    updates[id(param)] = update
                else:
                    self._local_step(param, update, group, segments, over_tp)
                    if segments is not None and segments.tensor_parallel is not None:
                        tensor_parallel = segments.tensor_parallel
        if over_tp:
            assert tensor_parallel is not None
            self._add_orthogonalized_over_tp(tensor_parallel, over_tp)
        started = []
        for exchange in exchanges:
            if not exchange.checked:
                exchange.check_same_on_every_rank("gs.optim.Muon", "Muon matrices")
            started.append(self._exchange_start(exchange, updates))
        for group in adamw_groups:  # while the pieces travel to their owners
            self._adamw_step(group)
        for exchange, transfer in zip(exchanges, started, strict=True):
            self._exchange_finish(exchange, *transfer)
        return loss

    def _momentum_update(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        grad = param.grad
        if torch.is_complex(param):
            raise RuntimeError("Muon does not support complex parameters")
        if grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buffer = state["momentum_buffer"]
        momentum = group["momentum"]
        buffer.lerp_(grad, 1 - momentum)
        return grad.lerp(buffer, momentum) if group["nesterov"] else buffer

    def _local_step(
        self,
        param: torch.Tensor,
        update: torch.Tensor,
        group: dict[str, Any],
        segments: ShardSegments | None,
        over_tp: list[tuple[Any, ...]],
    ) -> None:
        """A parameter this rank holds whole (a plain tensor, or a shard of a buffer held
        whole): orthogonalize here, as torch.optim.Muon does; matrices split over tp go to
        ``over_tp`` (``_add_orthogonalized_over_tp``)."""
        lr = _scalar(group["lr"])
        ns = group["ns_coefficients"], group["ns_steps"], group["eps"]
        if segments is None:
            rows, cols = matrix_shape(param.shape, group["flatten_conv"], "a parameter")
            ortho = zeropower_via_newtonschulz(update.view(rows, cols), *ns)
            param.mul_(1 - lr * group["weight_decay"])
            ortho = ortho if param.ndim == 2 else ortho.reshape(param.shape)
            param.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], rows, cols))
            return
        start = segments.buffer.shard_range(segments.shard_rank)[0]
        flat, values = update.view(-1), param.view(-1)
        param.mul_(1 - lr * group["weight_decay"])
        for slot in segments.buffer.params:
            rows, cols = matrix_shape(slot.shape, group["flatten_conv"], repr(slot.fqn))
            if not slot.numel:
                continue
            begin = slot.offset - start
            span = slice(begin, begin + slot.numel)
            tensor_parallel = segments.tensor_parallel
            if _split_over_tp(tensor_parallel, slot.fqn):  # with the others, after the loop
                over_tp.append((values[span], flat[span], group, rows, cols, slot.fqn))
                continue
            _add_orthogonalized(values[span], flat[span], group, rows, cols)

    @staticmethod
    def _add_orthogonalized_over_tp(
        tensor_parallel: TensorParallelism, over_tp: list[tuple[Any, ...]]
    ) -> None:
        """``_add_orthogonalized`` of the matrices split over tp that this dp rank holds
        whole, their Newton-Schulz shared out over tp (two collectives)."""
        items = [
            (fqn, update.view(rows, cols).to(NS_DTYPE, copy=True), group)
            for _, update, group, rows, cols, fqn in over_tp
        ]
        results = _orthogonalized_over_tp(tensor_parallel, items)
        for (target, _, group, rows, cols, fqn), ortho in zip(over_tp, results, strict=True):
            whole = tensor_parallel.params[fqn].shape
            _subtract_update(target, ortho, group, rows, cols, whole)

    def _exchange_start(
        self, exchange: OwnerExchange, updates: dict[int, torch.Tensor]
    ) -> tuple[list[torch.Tensor | None], torch.Tensor, torch.Tensor, comm.Pending]:
        """Pack this rank's pieces of the matrices owned elsewhere (and of its own that
        others hold pieces of), in bfloat16 as NS's first op would cast them, and start the
        all-to-all to their owners (no gradient here: zeros, nothing applied)."""
        flats = [updates.get(id(param)) for param in exchange.params]
        send = exchange.pack(flats, NS_DTYPE)
        received, pending = exchange.to_owners(send)
        return flats, send, received, pending

    def _exchange_finish(
        self,
        exchange: OwnerExchange,
        flats: list[torch.Tensor | None],
        send: torch.Tensor,
        received: torch.Tensor,
        pending: comm.Pending,
    ) -> None:
        """Newton-Schulz on whole matrices, slices back to their ranks, update."""
        pending.wait()
        # owned matrices tensor parallelism splits: (fqn, matrix, group), and their pieces
        # to send back (None: held whole here, applied below)
        split_over_tp: list[tuple[str, torch.Tensor, dict[str, Any]]] = []
        pieces_of: list[list[torch.Tensor] | None] = []
        tensor_parallel = None
        for position, index in enumerate(exchange.owned):
            if index in exchange.solo:
                continue
            group = self.param_groups[exchange.tensors[index].group]
            rows, cols = self._dims(exchange, index)
            pieces = exchange.received_pieces(received, position)
            # the pieces in rank order are the flattened matrix; Newton-Schulz may scale
            # its input in place (received or the concatenation), overwritten below
            whole = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            fqn = exchange.tensors[index].fqn
            tp = self._tensor_parallel(exchange, index)
            if _split_over_tp(tp, fqn):
                tensor_parallel = tp
                split_over_tp.append((fqn, whole.view(rows, cols), group))
                pieces_of.append(pieces)
                continue
            ortho = _newton_schulz(
                whole.view(rows, cols), group["ns_coefficients"], group["ns_steps"], group["eps"]
            )
            _write_orthogonalized(ortho, whole.view(rows, cols), pieces)
        solo_over_tp: dict[int, int] = {}  # held whole here and split by tp: its item
        for index in sorted(exchange.solo):
            t = exchange.tensors[index]
            tp = self._tensor_parallel(exchange, index)
            if flats[t.param] is None or not _split_over_tp(tp, t.fqn):
                continue
            rows, cols = self._dims(exchange, index)
            matrix = exchange.local_piece(flats[t.param], index).view(rows, cols)
            solo_over_tp[index] = len(split_over_tp)
            tensor_parallel = tp
            group = self.param_groups[t.group]
            split_over_tp.append((t.fqn, matrix.to(NS_DTYPE, copy=True), group))
            pieces_of.append(None)
        over_tp: list[torch.Tensor] = []
        if split_over_tp:  # the whole matrices over tp, their Newton-Schulz shared by tp
            assert tensor_parallel is not None
            over_tp = _orthogonalized_over_tp(tensor_parallel, split_over_tp)
            for item, (_, matrix, _) in enumerate(split_over_tp):
                pieces = pieces_of[item]
                if pieces is not None:
                    _write_orthogonalized(over_tp[item], matrix, pieces)
        back = exchange.back(received, send)
        for param, flat, index in zip(exchange.params, flats, exchange.groups, strict=True):
            if flat is not None:
                group = self.param_groups[index]
                param.mul_(1 - _scalar(group["lr"]) * group["weight_decay"])
        for index in sorted(exchange.solo):  # held whole here: orthogonalized while slices travel
            t = exchange.tensors[index]
            flat = flats[t.param]
            if flat is None:
                continue
            rows, cols = self._dims(exchange, index)
            target = exchange.local_piece(exchange.params[t.param], index)
            group = self.param_groups[t.group]
            if index in solo_over_tp:  # orthogonalized over tp above
                whole = whole_dims(self._tensor_parallel(exchange, index), t.fqn, (rows, cols))
                _subtract_update(target, over_tp[solo_over_tp[index]], group, rows, cols, whole)
                continue
            _add_orthogonalized(target, exchange.local_piece(flat, index), group, rows, cols)
        back.wait()
        by_alpha: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for index, result in exchange.returned_pieces(send):
            t = exchange.tensors[index]
            if flats[t.param] is None or index in exchange.solo:
                continue
            group = self.param_groups[t.group]
            rows, cols = whole_dims(
                self._tensor_parallel(exchange, index), t.fqn, self._dims(exchange, index)
            )
            lr = adjusted_lr(_scalar(group["lr"]), group["adjust_lr_fn"], rows, cols)
            targets, results = by_alpha.setdefault(-lr, ([], []))
            targets.append(exchange.local_piece(exchange.params[t.param], index))
            results.append(result)
        for alpha, (targets, results) in by_alpha.items():
            torch._foreach_add_(targets, results, alpha=alpha)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's step for one group (its lazy state, then its functional)."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = False
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError(
                    "Adam does not support sparse gradients, please consider SparseAdam instead"
                )
            has_complex |= torch.is_complex(param)
            params.append(param)
            grads.append(param.grad)
            state = self.state[param]
            if not state:
                fused = group["fused"]
                state["step"] = (
                    torch.zeros((), dtype=_scalar_dtype(fused), device=param.device)
                    if group["capturable"] or fused
                    else torch.tensor(0.0, dtype=_scalar_dtype(None))
                )
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw_functional(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            foreach=group["foreach"], capturable=group["capturable"],
            differentiable=group["differentiable"], fused=group["fused"],
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None), has_complex=has_complex,
            amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        )  # fmt: skip


def _check_muon_options(options: Mapping[str, Any], where: str) -> None:
    lr, momentum, decay = _scalar(options["lr"]), options["momentum"], options["weight_decay"]
    if not (lr >= 0 and momentum >= 0 and decay >= 0):
        raise ValueError(
            f"{where}: expects lr, momentum, weight_decay >= 0 but got {lr=}, {momentum=}, "
            f"weight_decay={decay}"
        )
    if options["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"{where}: adjust_lr_fn {options['adjust_lr_fn']!r} is not supported; expects one "
            f"of {ADJUST_LR_FNS}"
        )
    if not 0 <= options["ns_steps"] < 100:
        raise ValueError(f"{where}: expects 0 <= ns_steps < 100 but got {options['ns_steps']}")
    if len(options["ns_coefficients"]) != 3:
        raise ValueError(f"{where}: expects 3 ns_coefficients but got {options['ns_coefficients']}")


def _check_adamw_options(group: Mapping[str, Any], index: int) -> None:
    lr, eps, decay = _scalar(group["lr"]), group["eps"], group["weight_decay"]
    betas = tuple(_scalar(beta) for beta in group["betas"])
    if not (lr >= 0 and eps >= 0 and decay >= 0 and all(0 <= b < 1 for b in betas)):
        raise ValueError(
            f"Param group {index} (use_muon=False, AdamW): expects lr, eps, weight_decay >= 0 "
            f"and betas in [0, 1) but got {lr=}, {eps=}, weight_decay={decay}, {betas=}"
        )


def _check_matrices(param: torch.Tensor, flatten_conv: bool, index: int, position: int) -> None:
    segments = segments_of(param)
    if segments is None:
        matrix_shape(param.shape, flatten_conv, f"param_groups[{index}]['params'][{position}]")
        return
    for slot in segments.buffer.params:
        matrix_shape(slot.shape, flatten_conv, repr(slot.fqn))
        tensor_parallel = segments.tensor_parallel
        split = tensor_parallel is not None and slot.fqn in tensor_parallel.params
        if split and len(slot.shape) != 2:
            raise ValueError(
                f"Parameter {slot.fqn!r} (shape {tuple(slot.shape)}) is split by tensor "
                "parallelism and is not a matrix: Muon orthogonalizes whole matrices gathered "
                "over tp by rows or columns; put it in an AdamW group (use_muon=False)."
            )


def split_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Muon state dict (``gs.optim_state_dict`` or ``Muon.state_dict()``) as the state
    dicts of a plain ``torch.optim.Muon`` over its Muon groups and a plain
    ``torch.optim.AdamW`` over its AdamW groups, in order, parameters renumbered as those
    optimizers number them."""
    muon: dict[str, Any] = {"state": {}, "param_groups": []}
    adamw: dict[str, Any] = {"state": {}, "param_groups": []}
    for group in state_dict["param_groups"]:
        target = muon if group.get("use_muon", True) else adamw
        first = sum(len(g["params"]) for g in target["param_groups"])
        renumbered = list(range(first, first + len(group["params"])))
        for old, new in zip(group["params"], renumbered, strict=True):
            if old in state_dict["state"]:
                target["state"][new] = state_dict["state"][old]
        target["param_groups"].append({**group, "params": renumbered})
    return muon, adamw


def merge_state_dicts(
    muon: Mapping[str, Any], adamw: Mapping[str, Any], use_muon: Sequence[bool]
) -> dict[str, Any]:
    """The inverse of ``split_state_dict``: one state dict for a ``gs.optim.Muon`` whose
    groups are Muon or AdamW as ``use_muon`` says (e.g. ``[g["use_muon"] for g in
    optimizer.param_groups]``), from a plain Muon's and a plain AdamW's state dicts."""
    sources = {
        True: (muon, iter(muon["param_groups"])),
        False: (adamw, iter(adamw["param_groups"])),
    }
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    counts = {True: len(muon["param_groups"]), False: len(adamw["param_groups"])}
    wanted = {flag: sum(1 for f in use_muon if bool(f) == flag) for flag in (True, False)}
    if counts != wanted:
        raise ValueError(
            f"Expects {wanted[True]} Muon and {wanted[False]} AdamW param groups (use_muon="
            f"{list(use_muon)}) but got {counts[True]} and {counts[False]}"
        )
    index = 0
    for flag in map(bool, use_muon):
        source, groups = sources[flag]
        group = next(groups)
        renumbered = list(range(index, index + len(group["params"])))
        for old, new in zip(group["params"], renumbered, strict=True):
            if old in source["state"]:
                merged["state"][new] = source["state"][old]
        merged["param_groups"].append({**group, "use_muon": flag, "params": renumbered})
        index += len(renumbered)
    return merged
