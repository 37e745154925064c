"""``gs.optim.WholeParamOptimizer``: any optimizer class over whole parameters, in their
original shapes, exact on flat shards.

An optimizer whose update of a parameter depends on its shape (Adafactor's factored
moments, Shampoo's and SOAP's preconditioners, Muon's Newton-Schulz) cannot step a 1-D
flat shard. Here every original parameter of the sharded groups has one owner rank
(``optim.owners``: cost-balanced, the same on every rank). Per step and process group:

1. one all-to-all sends each rank's pieces of the gradients to their owners (and of the
   values, when a shard was written since the last step: a load, an edit), while the
   groups with ``"whole": False`` step on their shards;
2. each owner assembles whole gradients and values, in the original shapes, and steps
   them with an unmodified ``optimizer_class`` instance (one for all its parameters, so
   per-group counters and foreach kernels behave as on one process);
3. one all-to-all sends the updated values back into the shards.

State lives on the owner only, keyed by its whole tensors; ``state_dict`` and
``gs.optim_state_dict`` give torch's plain format, ``gs.checkpoint`` writes each state
from its owner. docs/whole-param-optimizers.md has the design and its costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from groupshard import comm, flatten
from groupshard.gradients import SHARDS_ACCEPTED_ATTR, without_grad_in_step
from groupshard.optim import muon
from groupshard.optim.common import evaluate_closure
from groupshard.optim.owners import (
    OwnerExchange,
    Ownership,
    by_process_group,
    raise_if_options_differ,
)
from groupshard.segments import segments_of

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


class WholeParamOptimizer(torch.optim.Optimizer):
    """An unmodified ``optimizer_class`` over whole parameters, on flat shards.

    Args:
        params: ``model.optimizer_groups()`` of a ``gs.shard`` model (or groups of its
            shards); plain tensors are stepped whole on every rank, as torch would.
        optimizer_class: any ``torch.optim.Optimizer`` subclass, e.g.
            ``torch.optim.Adafactor``, ``torch.optim.Muon``, pytorch-optimizer's ``SOAP``.
        cost: ``cost(shape) -> float``, the owner's work for one parameter, to balance the
            owners (default by family: ``rows * cols * min`` for Muon, ``sum(d ** 3)`` for
            Shampoo and SOAP, ``numel`` otherwise).
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
        cost: Callable[[tuple[int, ...]], float] | None = None,
        **defaults: Any,
    ) -> None:
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"{WHO} expects optimizer_class to be a torch.optim.Optimizer subclass but got "
                f"{optimizer_class!r}"
            )
        self.optimizer_class = optimizer_class
        self.class_defaults = dict(defaults)
        self._cost = cost if cost is not None else default_cost(optimizer_class)
        probe = optimizer_class([{"params": []}], **defaults)  # its defaults, checked
        self._building = True
        self._owners: dict[str, int] = {}  # FQN -> owner rank, kept once assigned
        self._wholes: dict[str, torch.Tensor] = {}  # FQN -> the whole tensor stepped here
        self._exchanges: list[OwnerExchange] = []
        # the whole tensors that are views of a shard here: (whole, shard, fqn, offset)
        self._local: list[tuple[torch.Tensor, torch.Tensor, str, int]] = []
        self._whole_optimizer: torch.optim.Optimizer | None = None
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
            by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
            for index, param in found:
                by_dtype.setdefault(param.dtype, []).append((index, param))
            for part in by_dtype.values():
                exchange = OwnerExchange(ranks, part, self._group_cost, self._owners, near=True)
                self._owners.update((t.fqn, t.owner) for t in exchange.tensors)
                exchanges.append(exchange)
        self._exchanges = exchanges
        self._synced = {}  # new exchanges: their owners' values come with the next step
        per_group = self._whole_tensors()
        self._build_inner(per_group)

    def _group_cost(self, group: int, shape: tuple[int, ...]) -> float:
        return self._cost(shape)

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
                    wholes.append(self._wholes[slot.fqn])
        return per_group

    def _build_inner(self, per_group: list[list[torch.Tensor]]) -> None:
        """One ``optimizer_class`` over the whole tensors (all groups, in order, some
        empty) and one over the shards of ``"whole": False`` groups; the latter shares
        this optimizer's ``state`` (the step hooks keep the state of parameters without a
        gradient there)."""
        whole_groups = [
            {**self._hyperparameters(g), "params": wholes}
            for g, wholes in zip(self.param_groups, per_group, strict=True)
        ]
        shard_groups = [
            {**self._hyperparameters(g), "params": [] if g["whole"] else list(g["params"])}
            for g in self.param_groups
        ]
        if self._whole_optimizer is None:
            self._whole_optimizer = self.optimizer_class(whole_groups, **self.class_defaults)
            self._shard_optimizer = self.optimizer_class(shard_groups, **self.class_defaults)
            self._shard_optimizer.state = self.state
            setattr(self._shard_optimizer, SHARDS_ACCEPTED_ATTR, True)  # "whole": False
            return
        assert self._shard_optimizer is not None
        for inner, groups in (
            (self._whole_optimizer, whole_groups),
            (self._shard_optimizer, shard_groups),
        ):
            for index, group in enumerate(groups):
                if index < len(inner.param_groups):
                    inner.param_groups[index]["params"] = group["params"]
                else:
                    inner.add_param_group(group)

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
                    raise_if_options_differ(
                        WHO, comm.gather_objects(self._signature(), segments.ranks)
                    )
        self._checked = True

    def _keep_group_state(self) -> None:
        """Group entries the inner optimizer changed in its step (pytorch-optimizer keeps a
        ``step`` count in each group) into ours, so state dicts and checkpoints have them."""
        assert self._whole_optimizer is not None and self._shard_optimizer is not None
        for group, whole, shard in zip(
            self.param_groups, self._whole_optimizer.param_groups,
            self._shard_optimizer.param_groups, strict=True,
        ):  # fmt: skip
            inner = whole if group["whole"] else shard
            group.update({k: v for k, v in inner.items() if k != "params"})

    def _sync_hyperparameters(self) -> None:
        """The groups' current hyperparameters (an LR scheduler edits ours) into the
        inner optimizers."""
        assert self._whole_optimizer is not None and self._shard_optimizer is not None
        for group, whole, shard in zip(
            self.param_groups, self._whole_optimizer.param_groups,
            self._shard_optimizer.param_groups, strict=True,
        ):  # fmt: skip
            hyperparameters = self._hyperparameters(group)
            whole.update(hyperparameters)
            shard.update(hyperparameters)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of every group; collective over the ranks that share sharded
        parameters (two all-to-alls per process group)."""
        loss = evaluate_closure(closure)
        if not self._checked:
            self._check_ranks_agree()
        self._sync_hyperparameters()
        assert self._whole_optimizer is not None and self._shard_optimizer is not None
        started = []
        for exchange in self._exchanges:
            payloads = [[param.grad for param in exchange.params]]
            if self._values_changed(exchange):
                payloads.append([param.detach() for param in exchange.params])
            send = exchange.pack(payloads, exchange.params[0].dtype)
            received, pending = exchange.to_owners(send, len(payloads))
            started.append((received, pending, len(payloads)))
        if any(not g["whole"] and g["params"] for g in self.param_groups):
            self._shard_optimizer.step()  # while the pieces travel to their owners
        without_grad = self._without_grad()
        for whole, shard, fqn, begin in self._local:
            grad = shard.grad
            if grad is None or fqn in without_grad:
                whole.grad = None
            else:
                whole.grad = grad.view(-1)[begin : begin + whole.numel()].view(whole.shape)
        for exchange, (received, pending, payloads) in zip(self._exchanges, started, strict=True):
            pending.wait()
            self._assemble(exchange, received, without_grad, payloads)
        self._whole_optimizer.step()
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

    def _values_changed(self, exchange: OwnerExchange) -> bool:
        """Whether the owners' whole values may differ from the shards, on any rank (one
        all-reduce of a flag): before the first step, and after anything wrote a shard in
        place since the last one (a load, another optimizer over the same storage, an edit;
        the tensors' version counters tell, which writes through ``.data`` bypass)."""
        synced = self._synced.get(id(exchange))
        changed = synced != [param._version for param in exchange.params]
        flag = torch.tensor([float(changed)], device=exchange.params[0].device)
        comm.all_reduce_max(flag, exchange.ranks)
        return bool(flag.item())

    def _assemble(
        self,
        exchange: OwnerExchange,
        received: torch.Tensor,
        without_grad: set[str],
        payloads: int,
    ) -> None:
        """The whole gradients of the parameters this rank owns from the pieces, and their
        values where they came too (``payloads`` 2); else the owner's values are current."""
        for position, index in enumerate(exchange.owned):
            if index in exchange.solo:
                continue
            t = exchange.tensors[index]
            whole = self._wholes[t.fqn]
            if payloads == 2:
                values = exchange.received_pieces(received, position, 1, 2)
                torch.cat(values, out=whole.view(-1))
            if t.fqn in without_grad:
                whole.grad = None
                continue
            grads = exchange.received_pieces(received, position, 0, payloads)
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
        assert self._whole_optimizer is not None
        found = {}
        for group, inner in zip(self.param_groups, self._whole_optimizer.param_groups, strict=True):
            if not group["whole"]:
                continue
            by_id = {id(w): w for w in inner["params"]}
            for fqn, whole in self._wholes.items():
                if id(whole) in by_id:
                    found[fqn] = (whole, self._whole_optimizer.state.get(whole, {}), group)
        return found

    def fqn_state(self) -> dict[str, dict[str, Any]]:
        """Every parameter's state, in original shapes, on every rank. Collective: one
        gather of the owners' states per process group, and one all-gather per state
        tensor of a ``"whole": False`` shard."""
        per_fqn: dict[str, dict[str, Any]] = {}
        mine = {fqn: dict(state) for fqn, (_, state, _) in self.owned_states().items() if state}
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
                        segments.replicated,
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
                        entries, param, segments.buffer, segments.shard_rank
                    )

    def state_dict(self) -> dict[str, Any]:
        """torch's format with parameter names for keys (as
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives):
        ``{"state": {fqn: state}, "param_groups": [{..., "params": [fqn, ...]}]}``, every
        parameter's state in its original shape. Collective; the same on every rank.
        ``gs.optim_state_dict(model, optimizer)`` numbers them as torch does instead."""
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


