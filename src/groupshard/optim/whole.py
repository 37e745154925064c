"""``gs.optim.WholeParamOptimizer``: any optimizer class over whole parameters, in their
original shapes, exact on flat shards.

An optimizer whose update of a parameter depends on its shape (Adafactor's factored
moments, Shampoo's and SOAP's preconditioners, Muon's Newton-Schulz) cannot step a 1-D
flat shard. Here every original parameter of the sharded groups has one owner rank
(``optim.owners``: cost-balanced, the same on every rank). Per step and process group:

1. one all-to-all sends each rank's pieces of the gradients to their owners, headed by a
   flag saying whether its shards were written since the last step (a load, an edit:
   then the values travel too, in a second one), while the groups with ``"whole": False``
   step on their shards and each rank steps the whole parameters its shards hold;
2. each owner assembles the other whole gradients (and values), in the original shapes,
   and steps them with an unmodified ``optimizer_class`` instance (a second one over the
   same groups, sharing the first's state);
3. one all-to-all sends the updated values back into the shards.

State lives on the owner only, keyed by its whole tensors; ``state_dict`` and
``gs.optim_state_dict`` give torch's plain format, ``gs.checkpoint`` writes each state
from its owner. docs/whole-param-optimizers.md has the design and its costs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from groupshard import comm, flatten
from groupshard.gradients import SHARDS_ACCEPTED_ATTR, without_grad_in_step
from groupshard.optim import measure, muon
from groupshard.optim.common import evaluate_closure
from groupshard.optim.owners import (
    OwnerExchange,
    Ownership,
    by_process_group,
    raise_if_options_differ,
)
from groupshard.segments import segments_of
from groupshard.tensor_parallel import TensorParallelism

WHO = "gs.optim.WholeParamOptimizer"
OWN_KEYS = ("params", "whole")
"""Group keys that are this optimizer's, not ``optimizer_class``'s."""


def newton_schulz_cost(shape: tuple[int, ...]) -> float:
    """Muon's work for a parameter: ``rows * cols * min(rows, cols)`` (conv weights flattened)."""
    if len(shape) < 2:
        return float(math.prod(shape))
    return float(muon.newton_schulz_cost(shape[0], math.prod(shape[1:])))


def preconditioner_cost(shape: tuple[int, ...]) -> float:
    """Shampoo's and SOAP's work: an eigendecomposition (or inverse root) per dimension,
    ``sum(d ** 3)``; element-wise for vectors."""
    if len(shape) < 2:
        return float(math.prod(shape))
    return float(sum(d**3 for d in shape))


def element_cost(shape: tuple[int, ...]) -> float:
    """Work proportional to the elements (Adafactor, Adam-like updates): ``numel``."""
    return float(math.prod(shape))


def default_cost(optimizer_class: type) -> Callable[[tuple[int, ...]], float]:
    """The cost of a parameter's update by its shape, for ``optimizer_class``'s family."""
    name = optimizer_class.__name__.lower()
    if "muon" in name:
        return newton_schulz_cost
    if "shampoo" in name or "soap" in name:
        return preconditioner_cost
    return element_cost


def _placed(value: Any, like: torch.Tensor, key: str) -> Any:
    """A loaded state value placed as torch's ``Optimizer.load_state_dict`` places it:
    tensors on the parameter's device, floating ones in its dtype, ``step`` kept."""
    if isinstance(value, torch.Tensor):
        if key == "step":
            return value.clone()
        if value.is_floating_point() and like.is_floating_point():
            return value.to(device=like.device, dtype=like.dtype, copy=True)
        return value.to(device=like.device, copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_placed(v, like, key) for v in value)
    if isinstance(value, dict):
        return {k: _placed(v, like, k) for k, v in value.items()}
    return value


def _changed_entries(inner: Mapping[str, Any], ours: Mapping[str, Any]) -> bool:
    """Whether an inner optimizer's group has an entry (besides its parameters) that is not
    ours: one it added or replaced in its step."""
    return any(k != "params" and (k not in ours or ours[k] is not v) for k, v in inner.items())


class WholeParamOptimizer(torch.optim.Optimizer):
    """An unmodified ``optimizer_class`` over whole parameters, on flat shards.

    Args:
        params: ``model.optimizer_groups()`` of a ``gs.shard`` model (or groups of its
            shards); plain tensors are stepped whole on every rank, as torch would.
        optimizer_class: any ``torch.optim.Optimizer`` subclass, e.g.
            ``torch.optim.Adafactor``, ``torch.optim.Muon``, pytorch-optimizer's ``SOAP``.
        cost: ``cost(shape) -> float``, the owner's work for one parameter, to balance the
            owners (default by family: ``rows * cols * min`` for Muon, ``sum(d ** 3)`` for
            Shampoo and SOAP, ``numel`` otherwise); or ``"measured"``: each distinct shape's
            step timed here, on every rank, at construction and ``add_param_group``, which
            are then collective (``optim.measure``).
        **defaults: ``optimizer_class``'s arguments (the defaults of every group).

    A group with ``"whole": False`` is stepped on its shards directly (one rank's slice
    each, no exchange): only right for element-wise updates. Every rank must step (the
    exchanges are collective) and build the optimizer alike: the first step checks that
    the ranks agree on the class, its arguments and the parameters.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        cost: Callable[[tuple[int, ...]], float] | Literal["measured"] | None = None,
        **defaults: Any,
    ) -> None:
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"{WHO} expects optimizer_class to be a torch.optim.Optimizer subclass but got "
                f"{optimizer_class!r}"
            )
        if not (cost is None or cost == "measured" or callable(cost)):
            raise TypeError(
                f"{WHO} expects cost to be a function of a shape, 'measured' or None but got "
                f"{cost!r}"
            )
        self.optimizer_class = optimizer_class
        self.class_defaults = dict(defaults)
        self._measure = cost == "measured"
        self._cost = cost if callable(cost) else default_cost(optimizer_class)
        # cost="measured": (process group id, group index, shape, dtype) -> seconds
        self._measured: dict[tuple[int, int, tuple[int, ...], torch.dtype], float] = {}
        probe = optimizer_class([{"params": []}], **defaults)  # its defaults, checked
        self._building = True
        self._owners: dict[str, int] = {}  # FQN -> owner rank, kept once assigned
        self._wholes: dict[str, torch.Tensor] = {}  # FQN -> the whole tensor stepped here
        # tensor parallelism: FQN -> the whole parameter over tp (what the inner optimizer
        # steps; ``_wholes`` then holds this tp rank's piece of it), and its tp split
        self._across_tp: dict[str, tuple[torch.Tensor, TensorParallelism]] = {}
        self._tp_local: list[str] = []  # such FQNs among the tensors held here, in order
        self._tp_assembled: list[str] = []  # and among those assembled from pieces
        self._exchanges: list[OwnerExchange] = []
        # the whole tensors that are views of a shard here: (whole, shard, fqn, offset)
        self._local: list[tuple[torch.Tensor, torch.Tensor, str, int]] = []
        # ``optimizer_class`` instances: over the whole tensors held here (views of shards,
        # plain tensors), over those assembled from pieces (sharing the former's state),
        # and over the shards of ``"whole": False`` groups
        self._whole_optimizer: torch.optim.Optimizer | None = None
        self._assembled_optimizer: torch.optim.Optimizer | None = None
        self._shard_optimizer: torch.optim.Optimizer | None = None
        self._checked = False
        # per exchange, its shards' version counters when the owners' values last matched
        self._synced: dict[int, list[int]] = {}
        super().__init__(params, {**probe.defaults, "whole": True})
        self._building = False
        self._rebuild()

    # --- groups -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, plus: ``"whole"`` (default True) must be a bool; the owners of the
        parameters already here stay, the new ones are balanced around them."""
        whole = param_group.get("whole", True)
        if not isinstance(whole, bool):
            raise TypeError(f"{WHO}: expects 'whole' to be True or False but got {whole!r}")
        super().add_param_group(param_group)
        if not self._building:
            try:
                self._rebuild()
            except Exception:
                self.param_groups.pop()
                index = len(self.param_groups)  # its timings, taken with its hyperparameters
                self._measured = {k: v for k, v in self._measured.items() if k[1] != index}
                raise

    def _hyperparameters(self, group: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k not in OWN_KEYS}

    def _rebuild(self) -> None:
        """Owners, exchanges and the whole tensors, then the inner optimizers' groups."""
        entries = [
            (index, param)
            for index, group in enumerate(self.param_groups)
            if group["whole"]
            for param in group["params"]
        ]
        exchanges = []
        for ranks, found in by_process_group(entries):
            if self._measure:
                self._time_costs(ranks, found)
            by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
            for index, param in found:
                by_dtype.setdefault(param.dtype, []).append((index, param))
            for dtype, part in by_dtype.items():
                cost = (
                    functools.partial(self._measured_cost, id(ranks.group), dtype)
                    if self._measure
                    else self._group_cost
                )
                exchange = OwnerExchange(ranks, part, cost, self._owners, near=True)
                self._owners.update((t.fqn, t.owner) for t in exchange.tensors)
                exchanges.append(exchange)
        self._exchanges = exchanges
        self._synced = {}  # new exchanges: their owners' values come with the next step
        per_group = self._whole_tensors()
        self._build_inner(per_group)

    def _group_cost(self, group: int, shape: tuple[int, ...]) -> float:
        return self._cost(shape)

    def _time_costs(self, ranks: comm.Ranks, found: list[tuple[int, torch.Tensor]]) -> None:
        """``cost="measured"``: the seconds of a step of each (group, shape, dtype) among
        one process group's sharded parameters not timed before, agreed over its ranks (one
        call, collective, whatever the dtypes: ranks holding other parameters fail alike)."""
        process_group = id(ranks.group)
        keys: list[measure.Key] = []
        for group, param in found:
            segments = segments_of(param)
            assert segments is not None
            for slot in segments.buffer.params:
                key = (group, tuple(int(n) for n in slot.shape), param.dtype)
                known = (process_group, *key) in self._measured
                if slot.numel and not known and key not in keys:
                    keys.append(key)
        device = found[0][1].device

        def timer(key: measure.Key) -> float:
            group, shape, dtype = key
            hyperparameters = self._hyperparameters(self.param_groups[group])
            return measure.time_step(
                self.optimizer_class, self.class_defaults, hyperparameters, shape, dtype, device
            )

        for key, seconds in measure.measured_costs(keys, timer, ranks, WHO).items():
            self._measured[(process_group, *key)] = seconds

    def _measured_cost(
        self, process_group: int, dtype: torch.dtype, group: int, shape: tuple[int, ...]
    ) -> float:
        """A parameter's timed cost (``_time_costs``); 0 for an empty one (not timed)."""
        return self._measured.get((process_group, group, shape, dtype), 0.0)

    def _whole_tensors(self) -> list[list[torch.Tensor]]:
        """Per group, the whole tensors this rank steps: views of shards it holds whole
        (a view: the step writes the shard), new tensors for parameters it owns and others
        hold pieces of (filled by the exchange, kept between steps), plain tensors
        themselves."""
        owned = {
            t.fqn: (exchange, index)
            for exchange in self._exchanges
            for index in exchange.owned
            for t in [exchange.tensors[index]]
        }
        self._local = []
        self._tp_local, self._tp_assembled = [], []
        per_group: list[list[torch.Tensor]] = []
        for group in self.param_groups:
            wholes: list[torch.Tensor] = []
            per_group.append(wholes)
            if not group["whole"]:
                continue
            for param in group["params"]:
                segments = segments_of(param)
                if segments is None:
                    wholes.append(param)
                    continue
                start = segments.buffer.shard_range(segments.shard_rank)[0]
                for slot in segments.buffer.params:
                    local = not segments.needs_reduce
                    if not (local or slot.fqn in owned):
                        continue
                    exchange, index = owned.get(slot.fqn, (None, -1))
                    view = local or (exchange is not None and index in exchange.solo)
                    if slot.fqn not in self._wholes:
                        if view:
                            begin = slot.offset - start
                            tensor = param.detach().view(-1)[begin : begin + slot.numel]
                            self._wholes[slot.fqn] = tensor.view(slot.shape)
                        else:
                            self._wholes[slot.fqn] = param.new_zeros(slot.shape).detach()
                    if view:
                        begin = slot.offset - start
                        self._local.append((self._wholes[slot.fqn], param, slot.fqn, begin))
                    wholes.append(self._across_tp_of(slot.fqn, segments.tensor_parallel, view))
        return per_group

    def _across_tp_of(
        self, fqn: str, tensor_parallel: TensorParallelism | None, local: bool
    ) -> torch.Tensor:
        """What the inner optimizer steps for ``fqn``: its whole tensor here, or, for a
        parameter tensor parallelism splits, the whole over tp (kept between steps, so its
        state lives on; ``_gather_over_tp`` fills it)."""
        if tensor_parallel is None or tensor_parallel.split_dim(fqn) is None:
            return self._wholes[fqn]
        (self._tp_local if local else self._tp_assembled).append(fqn)
        if fqn not in self._across_tp:
            whole = self._wholes[fqn].new_zeros(tensor_parallel.params[fqn].shape)
            self._across_tp[fqn] = (whole, tensor_parallel)
        return self._across_tp[fqn][0]

    def _stepped(self, fqn: str) -> torch.Tensor:
        """The tensor the inner optimizer steps for ``fqn`` (see ``_across_tp_of``)."""
        return self._across_tp[fqn][0] if fqn in self._across_tp else self._wholes[fqn]

    def _gather_over_tp(self, fqns: list[str]) -> None:
        """The whole values and gradients over tp of ``fqns`` from the tp ranks' pieces
        (collective over tp, in the same order on every tp rank)."""
        for fqn in fqns:
            whole, tensor_parallel = self._across_tp[fqn]
            piece = self._wholes[fqn]
            whole.copy_(tensor_parallel.whole(fqn, piece.detach()))
            grad = piece.grad
            whole.grad = None if grad is None else tensor_parallel.whole(fqn, grad)

    def _keep_own_piece(self, fqns: list[str]) -> None:
        """Each tp rank's piece of the stepped whole back into its tensor (and shard)."""
        for fqn in fqns:
            whole, tensor_parallel = self._across_tp[fqn]
            self._wholes[fqn].detach().copy_(tensor_parallel.piece(fqn, whole))
            whole.grad = None

    def _build_inner(self, per_group: list[list[torch.Tensor]]) -> None:
        """The inner ``optimizer_class`` instances, each over every group (in order, some
        empty): one over the whole tensors held here, one over those assembled from pieces
        (two, so that the first steps while the pieces travel; they share one state), one
        over the shards of ``"whole": False`` groups, which shares this optimizer's
        ``state`` (the step hooks keep the state of parameters without a gradient there)."""
        assembled = {
            id(self._stepped(exchange.tensors[index].fqn))
            for exchange in self._exchanges
            for index in exchange.owned
            if index not in exchange.solo
        }
        parts = {
            "local": [[w for w in wholes if id(w) not in assembled] for wholes in per_group],
            "assembled": [[w for w in wholes if id(w) in assembled] for wholes in per_group],
            "shard": [[] if g["whole"] else list(g["params"]) for g in self.param_groups],
        }
        groups = {
            name: [
                {**self._hyperparameters(g), "params": params}
                for g, params in zip(self.param_groups, lists, strict=True)
            ]
            for name, lists in parts.items()
        }
        if self._whole_optimizer is None:
            build = self.optimizer_class
            self._whole_optimizer = build(groups["local"], **self.class_defaults)
            self._assembled_optimizer = build(groups["assembled"], **self.class_defaults)
            self._assembled_optimizer.state = self._whole_optimizer.state
            self._shard_optimizer = build(groups["shard"], **self.class_defaults)
            self._shard_optimizer.state = self.state
            setattr(self._shard_optimizer, SHARDS_ACCEPTED_ATTR, True)  # "whole": False
            return
        for inner, name in zip(self._inners(), groups, strict=True):
            for index, group in enumerate(groups[name]):
                if index < len(inner.param_groups):
                    inner.param_groups[index]["params"] = group["params"]
                else:
                    inner.add_param_group(group)

    def _inners(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer, torch.optim.Optimizer]:
        """The local, assembled and shard instances (see ``_build_inner``)."""
        assert self._whole_optimizer is not None
        assert self._assembled_optimizer is not None and self._shard_optimizer is not None
        return self._whole_optimizer, self._assembled_optimizer, self._shard_optimizer

    def ownership(self) -> list[Ownership]:
        """Per process group and dtype: each parameter's owner, the cost per rank and the
        elements this rank moves per step (gradients there, values back; the values there
        too on a step after a shard was written, counted out here)."""
        return [
            exchange.ownership(exchange.params[0].element_size()) for exchange in self._exchanges
        ]

    # --- step -------------------------------------------------------------------------

    def _signature(self) -> tuple[str, str, list[str]]:
        cls = self.optimizer_class
        groups = [repr(sorted(self._hyperparameters(g).items())) for g in self.param_groups]
        return (
            f"{cls.__module__}.{cls.__qualname__}",
            repr(sorted(self.class_defaults.items())),
            groups,
        )

    def _check_ranks_agree(self) -> None:
        """Once: every rank has the same class, arguments, groups and parameters."""
        checked = set()
        for exchange in self._exchanges:
            exchange.check_same_on_every_rank(WHO, extra=self._signature())
            checked.add(id(exchange.ranks.group))
        for group in self.param_groups:
            for param in group["params"]:
                segments = segments_of(param)
                if segments is None or segments.ranks.size < 2:
                    continue
                if id(segments.ranks.group) not in checked:
                    checked.add(id(segments.ranks.group))
                    signatures = comm.gather_if_different(self._signature(), segments.ranks)
                    if signatures is not None:
                        raise_if_options_differ(WHO, signatures)
        self._checked = True

    def _keep_group_state(self) -> None:
        """Group entries the inner optimizer changed in its step (pytorch-optimizer keeps a
        ``step`` count in each group) into ours, so state dicts and checkpoints have them:
        from an instance holding the group's parameters here that changed them (the
        instances start each step from ours, ``_sync_hyperparameters``, so an unchanged
        entry is still our very object)."""
        local, assembled, shard = self._inners()
        for group, *inner in zip(
            self.param_groups, local.param_groups, assembled.param_groups, shard.param_groups,
            strict=True,
        ):  # fmt: skip
            held = [g for g in inner if g["params"]] or [inner[0 if group["whole"] else 2]]
            changed = (g for g in held if _changed_entries(g, group))
            source = next(changed, held[0])
            group.update({k: v for k, v in source.items() if k != "params"})

    def _sync_hyperparameters(self) -> None:
        """The groups' current hyperparameters (an LR scheduler edits ours) into the
        inner optimizers."""
        for inner in self._inners():
            for group, theirs in zip(self.param_groups, inner.param_groups, strict=True):
                theirs.update(self._hyperparameters(group))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of every group; collective over the ranks that share sharded
        parameters (two all-to-alls per process group and dtype; three on a step after a
        shard was written)."""
        loss = evaluate_closure(closure)
        if not self._checked:
            self._check_ranks_agree()
        self._sync_hyperparameters()
        local, assembled, shard = self._inners()
        started = []
        for exchange in self._exchanges:
            grads = [param.grad for param in exchange.params]
            send = exchange.pack(grads, exchange.params[0].dtype, self._written_flag(exchange))
            started.append(exchange.to_owners(send, flagged=True))
        # while the pieces travel to their owners: the shards of "whole": False groups, and
        # the whole tensors held here
        if any(not g["whole"] and g["params"] for g in self.param_groups):
            shard.step()
        without_grad = self._without_grad()
        for whole, sharded, fqn, begin in self._local:
            grad = sharded.grad
            if grad is None or fqn in without_grad:
                whole.grad = None
            else:
                whole.grad = grad.view(-1)[begin : begin + whole.numel()].view(whole.shape)
        self._gather_over_tp(self._tp_local)
        local.step()
        self._keep_own_piece(self._tp_local)
        for exchange, (received, pending) in zip(self._exchanges, started, strict=True):
            pending.wait()
            values = None
            if exchange.received_flags(received).any():  # every rank has every flag
                current = [param.detach() for param in exchange.params]
                values, pending = exchange.to_owners(exchange.pack(current, current[0].dtype))
                pending.wait()
            self._assemble(exchange, received, values, without_grad)
        self._gather_over_tp(self._tp_assembled)
        assembled.step()
        self._keep_own_piece(self._tp_assembled)
        returns = [self._send_back(exchange) for exchange in self._exchanges]
        for exchange, (into, pending) in zip(self._exchanges, returns, strict=True):
            pending.wait()
            targets, results = [], []
            for index, piece in exchange.returned_pieces(into):
                if index not in exchange.solo:
                    t = exchange.tensors[index]
                    targets.append(exchange.local_piece(exchange.params[t.param].detach(), index))
                    results.append(piece)
            if targets:
                torch._foreach_copy_(targets, results)
            self._synced[id(exchange)] = [param._version for param in exchange.params]
        for whole, *_ in self._local:
            whole.grad = None
        for exchange in self._exchanges:
            for index in exchange.owned:
                if index not in exchange.solo:
                    self._wholes[exchange.tensors[index].fqn].grad = None
        self._keep_group_state()
        return loss

    def _without_grad(self) -> set[str]:
        """Parameters that had no gradient (on any rank) since the last step."""
        found: set[str] = set()
        for group in self.param_groups:
            if not group["whole"]:
                continue
            for param in group["params"]:
                segments = segments_of(param)
                if segments is not None:
                    found.update(segments.fqns[i] for i in without_grad_in_step(param))
        return found

    def _written_flag(self, exchange: OwnerExchange) -> float:
        """1.0 where this rank's shards may differ from the owners' whole values: before
        the first step, and after anything wrote a shard in place since the last one (a
        load, another optimizer over the same storage, an edit; the tensors' version
        counters tell, which writes through ``.data`` bypass). It travels at the head of
        the gradients' all-to-all, so every rank learns every rank's without a collective
        of its own; then the values travel too."""
        synced = self._synced.get(id(exchange))
        return float(synced != [param._version for param in exchange.params])

    def _assemble(
        self,
        exchange: OwnerExchange,
        received: torch.Tensor,
        values: torch.Tensor | None,
        without_grad: set[str],
    ) -> None:
        """The whole gradients of the parameters this rank owns from the pieces (flagged
        ``received``), and their values where they came too (``values``); else the
        owner's values are current."""
        for position, index in enumerate(exchange.owned):
            if index in exchange.solo:
                continue
            t = exchange.tensors[index]
            whole = self._wholes[t.fqn]
            if values is not None:
                torch.cat(exchange.received_pieces(values, position), out=whole.view(-1))
            if t.fqn in without_grad:
                whole.grad = None
                continue
            grads = exchange.received_pieces(received, position, flagged=True)
            grad = grads[0] if len(grads) == 1 else torch.cat(grads)
            whole.grad = grad.view(whole.shape)

    def _send_back(self, exchange: OwnerExchange) -> tuple[torch.Tensor, comm.Pending]:
        """Start the all-to-all of the updated values back to the shards' ranks."""
        dtype, device = exchange.params[0].dtype, exchange.params[0].device
        values = torch.empty(sum(exchange.recv_splits), dtype=dtype, device=device)
        targets, sources = [], []
        for position, index in enumerate(exchange.owned):
            if index in exchange.solo:
                continue
            pieces = exchange.received_pieces(values, position)
            whole = self._wholes[exchange.tensors[index].fqn].view(-1)
            targets.extend(pieces)
            sources.extend(whole.split([piece.numel() for piece in pieces]))
        if targets:
            torch._foreach_copy_(targets, sources)
        into = torch.empty(sum(exchange.send_splits), dtype=dtype, device=device)
        return into, exchange.back(values, into)

    # --- state ----------------------------------------------------------------------------

    def named_groups(self) -> list[list[str]]:
        """Per group, the names of its parameters: the FQNs a shard holds, in layout order;
        ``"param_groups[i][j]"`` for a plain tensor."""
        named = []
        for index, group in enumerate(self.param_groups):
            names = []
            for position, param in enumerate(group["params"]):
                segments = segments_of(param)
                if segments is None:
                    names.append(f"param_groups[{index}][{position}]")
                else:
                    names.extend(segments.fqns)
            named.append(names)
        return named

    def owned_states(self) -> dict[str, tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]:
        """The whole parameters this rank steps, with their state: FQN -> (whole tensor,
        state, group); the ones every rank holds alike (replicated) on every rank."""
        local, assembled, _ = self._inners()
        found = {}
        for group, *inner in zip(
            self.param_groups, local.param_groups, assembled.param_groups, strict=True
        ):
            if not group["whole"]:
                continue
            held = {id(w) for g in inner for w in g["params"]}
            for fqn in self._wholes:
                whole = self._stepped(fqn)  # under tensor parallelism, the whole over tp
                if id(whole) in held:
                    found[fqn] = (whole, local.state.get(whole, {}), group)
        return found

    def fqn_state(self) -> dict[str, dict[str, Any]]:
        """Every parameter's state, in original shapes, on every rank. Collective: one
        gather of the owners' states per process group, and one all-gather per state
        tensor of a ``"whole": False`` shard."""
        per_fqn: dict[str, dict[str, Any]] = {}
        mine = {  # copies, as the flat shards' gathered state is: not the live tensors
            fqn: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            for fqn, (_, state, _) in self.owned_states().items()
            if state
        }
        per_fqn.update(mine)
        groups = {}
        for group in self.param_groups:
            for param in group["params"]:
                segments = segments_of(param)
                if segments is not None and segments.needs_reduce:
                    groups.setdefault(id(segments.ranks.group), segments.ranks)
                if segments is not None and not group["whole"]:
                    entries = flatten.gather_shard_state(
                        self.state.get(param, {}), param, segments.buffer, segments.ranks,
                        segments.replicated, segments.tensor_parallel,
                    )  # fmt: skip
                    per_fqn.update(zip(segments.fqns, entries, strict=True))
        for ranks in groups.values():
            for gathered in comm.gather_objects(mine, ranks):
                for fqn, state in gathered.items():
                    per_fqn.setdefault(fqn, state)
        return {fqn: state for fqn, state in per_fqn.items() if state}

    def load_owned_state(self, per_fqn: Mapping[str, Mapping[str, Any] | None]) -> None:
        """The state of the whole parameters this rank steps, from ``per_fqn`` (placed as
        torch's ``load_state_dict`` places state); none where it has none."""
        assert self._whole_optimizer is not None
        for fqn, (whole, _, _) in self.owned_states().items():
            self._whole_optimizer.state.pop(whole, None)
            entry = per_fqn.get(fqn)
            if entry:
                self._whole_optimizer.state[whole] = {
                    key: _placed(value, whole, key) for key, value in entry.items()
                }

    def load_fqn_state(self, per_fqn: Mapping[str, Mapping[str, Any] | None]) -> None:
        """Each rank takes the state of the whole parameters it steps and its slices of
        the ``"whole": False`` shards' state, from every parameter's state (no collective)."""
        self.load_owned_state(per_fqn)
        for group in self.param_groups:
            if group["whole"]:
                continue
            for param in group["params"]:
                segments = segments_of(param)
                if segments is None:
                    continue
                entries = [dict(per_fqn.get(fqn) or {}) for fqn in segments.fqns]
                self.state.pop(param, None)
                if any(entries):
                    self.state[param] = flatten.shard_state_from(
                        entries, param, segments.buffer, segments.shard_rank,
                        segments.tensor_parallel,
                    )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """torch's format with parameter names for keys (as
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives):
        ``{"state": {fqn: state}, "param_groups": [{..., "params": [fqn, ...]}]}``, every
        parameter's state in its original shape. Collective; the same on every rank, and
        the same as ``gs.optim_state_dict(model, optimizer)``."""
        state = self.fqn_state()
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": names}
            for group, names in zip(self.param_groups, self.named_groups(), strict=True)
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict()``'s format (at any world size: each rank keeps what it
        steps). No collective."""
        saved = state_dict["param_groups"]
        ours = self.named_groups()
        theirs = [list(g["params"]) for g in saved]
        if [sorted(n) for n in ours] != [sorted(n) for n in theirs]:
            raise ValueError(
                f"{WHO}.load_state_dict expects param groups of parameter names {ours} but got "
                f"{theirs}; for torch's numbered format use gs.load_optim_state_dict(model, "
                "optimizer, state_dict)"
            )
        for group, saved_group in zip(self.param_groups, saved, strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self.load_fqn_state(state_dict["state"])
