"""Whole parameters of flat shards, each owned by one rank, and the all-to-all that moves
their pieces between the shards and the owner.

Shared by ``gs.optim.Muon`` (its momentum updates travel, in bfloat16) and
``gs.optim.WholeParamOptimizer`` (gradients and values travel). Each original parameter
held in sharded parameters gets one owner rank, chosen by a cost-balanced greedy
assignment (largest first to the least loaded rank), computed alike on every rank from
the segment maps: nothing is communicated to agree on it, nothing saved.

Buffers of one exchange, per rank ``me``:

- *to owners*: destination-major; per destination the pieces ``me`` holds of the
  parameters that rank owns, in parameter order; *flagged*, each destination's chunk
  starts with one element, the same to every rank (a fact every rank must learn: whether
  its shards were written since the last step), so that it travels with the pieces
  instead of in a collective of its own;
- *received*: source-major; per source (after its flag, when flagged) its pieces of the
  parameters ``me`` owns, in order: concatenating a parameter's pieces in rank order gives
  it flattened;
- the trip *back* uses the same two layouts unflagged, the roles swapped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from groupshard import comm
from groupshard.segments import segments_of

Cost = Callable[[int, tuple[int, ...]], float]
"""``cost(group_index, shape)``: the owner's work for one parameter of that group."""


def assign_owners(
    costs: Sequence[float], world_size: int, loads: Sequence[float] | None = None
) -> list[int]:
    """An owner rank per item: largest cost first, each to the least loaded rank (ties:
    the earlier item first, the lower rank), starting from ``loads`` (default zeros), then
    ``_rebalance``d. Deterministic: the same on every rank."""
    owners = [0] * len(costs)
    heap = [(loads[rank] if loads else 0, rank) for rank in range(world_size)]
    heapq.heapify(heap)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + costs[index], rank))
    return _rebalance(costs, owners, loads or [0.0] * world_size)


def _rebalance(costs: Sequence[float], owners: list[int], start: Sequence[float]) -> list[int]:
    """Improve an assignment by moves and swaps off the most loaded rank: the best one that
    lowers the larger of the two ranks' loads, until none does (at most twice as many
    rounds as items). Largest-first alone leaves lumpy costs unbalanced: SOAP's 12 matrices
    of the 4.2M GPT at 4 ranks, 1.107 x the mean load where 1.053 is possible."""
    loads = list(start)
    for index, rank in enumerate(owners):
        loads[rank] += costs[index]
    for _ in range(2 * len(costs)):
        top = max(range(len(loads)), key=lambda r: (loads[r], -r))
        best: tuple[float, int, int, int] | None = None  # (new larger load, rank, item, other)
        for index in (i for i, owner in enumerate(owners) if owner == top):
            for rank in range(len(loads)):
                if rank == top:
                    continue
                others = [-1, *(j for j, owner in enumerate(owners) if owner == rank)]
                for other in others:
                    delta = costs[index] - (costs[other] if other >= 0 else 0.0)
                    larger = max(loads[top] - delta, loads[rank] + delta)
                    if (
                        delta > 0
                        and larger < loads[top]
                        and (best is None or (larger, rank, index, other) < best)
                    ):
                        best = (larger, rank, index, other)
        if best is None:
            break
        _, rank, index, other = best
        delta = costs[index] - (costs[other] if other >= 0 else 0.0)
        owners[index] = rank
        if other >= 0:
            owners[other] = top
        loads[top] -= delta
        loads[rank] += delta
    return owners


def _balance(loads: Sequence[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def _near(
    costs: Sequence[float],
    numels: Sequence[Sequence[int]],
    loads: list[float],
    slack: float,
) -> tuple[list[int], list[float]]:
    """Largest first, to the rank holding most of the item while it stays within
    ``slack`` times the mean load, else to the least loaded rank."""
    size = len(loads)
    target = slack * (sum(loads) + sum(costs)) / size
    owners = [0] * len(costs)
    heap = [(load, rank) for rank, load in enumerate(loads)]  # (load, rank), stale allowed
    heapq.heapify(heap)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        held = _held_by(numels[index], size)
        holder = max(held, key=lambda r: (numels[index][r], -loads[r], -r))
        while heap[0][0] != loads[heap[0][1]]:  # an entry of a load since changed
            heapq.heappop(heap)
        least = heap[0][1]
        rank = holder if loads[holder] + costs[index] <= target else least
        owners[index] = rank
        loads[rank] += costs[index]
        heapq.heappush(heap, (loads[rank], rank))
    return owners, loads


def _held_by(numels: Sequence[int] | Spread, size: int) -> list[int]:
    """The ranks holding some of an item (all ranks if none does)."""
    if isinstance(numels, Spread):
        held = [rank for rank, _ in numels.items()]
    else:
        held = [rank for rank in range(size) if numels[rank]]
    return held or list(range(size))


def assign_owners_near(
    costs: Sequence[float],
    numels: Sequence[Sequence[int]],
    world_size: int,
    loads: Sequence[float] | None = None,
) -> list[int]:
    """As ``assign_owners``, but each item goes to the rank holding most of it (``numels[i]``:
    its elements per rank) where the balance allows: a parameter owned where it lies needs
    no exchange. The loosest slack over the mean load (1.05 down to 1.0) whose balance
    (max / mean) is within 1.05 or ``assign_owners``'s, else ``assign_owners``'s."""
    start = list(loads) if loads else [0.0] * world_size
    plain = assign_owners(costs, world_size, start)
    plain_loads = list(start)
    for index, rank in enumerate(plain):
        plain_loads[rank] += costs[index]
    limit = max(1.05, _balance(plain_loads))
    for slack in (1.05, 1.03, 1.01, 1.0):
        owners, ended = _near(costs, numels, list(start), slack)
        if _balance(ended) <= limit:
            return owners
    return plain


@dataclass(frozen=True)
class Spread:
    """Elements of one parameter per rank: ranks ``first`` .. ``first + len(counts) - 1``
    hold ``counts`` (a parameter is contiguous in its flat buffer, so the ranks holding it
    are too); every other rank none. Its size is the ranks it touches, not the world."""

    first: int
    counts: tuple[int, ...]

    def __getitem__(self, rank: int) -> int:
        index = rank - self.first
        return self.counts[index] if 0 <= index < len(self.counts) else 0

    def items(self) -> list[tuple[int, int]]:
        """``(rank, elements)`` of the ranks holding some, in rank order."""
        return [(self.first + i, n) for i, n in enumerate(self.counts) if n]

    @classmethod
    def of_slot(cls, offset: int, numel: int, shard_numel: int) -> Spread:
        """The spread of ``numel`` elements at ``offset`` of a buffer cut in shards of
        ``shard_numel``."""
        first, last = offset // shard_numel, (offset + numel - 1) // shard_numel
        end = offset + numel
        counts = tuple(
            min(end, (rank + 1) * shard_numel) - max(offset, rank * shard_numel)
            for rank in range(first, last + 1)
        )
        return cls(first, counts)


@dataclass(frozen=True)
class OwnedParam:
    """One original parameter held in sharded parameters, and where its pieces lie."""

    fqn: str
    group: int  # param-group index
    param: int  # position of its sharded parameter in the exchange
    shape: tuple[int, ...]
    cost: float
    owner: int
    numels: Spread  # elements held by each rank
    local_start: int  # where this rank's piece starts in its shard

    @property
    def numel(self) -> int:
        return sum(self.numels.counts)


@dataclass(frozen=True)
class Ownership:
    """Who owns which parameter, for one process group (``optimizer.ownership()``)."""

    world_size: int
    rank: int
    owners: dict[str, int]  # parameter name (FQN) -> owner rank
    cost_per_rank: list[float]  # the owners' cost (see the optimizer's cost) per rank
    elements_sent: int  # of this rank's shards to other owners (and back)
    elements_received: int  # of this rank's owned parameters from other ranks (and back)
    bytes_per_step: int  # this rank sends per step, both trips (it receives as many)

    @property
    def balance(self) -> float:
        """Largest cost per rank over the mean (1.0 is perfect)."""
        mean = sum(self.cost_per_rank) / len(self.cost_per_rank)
        return max(self.cost_per_rank) / mean if mean else 1.0


class OwnerExchange:
    """The owners and the all-to-all layout of one process group's sharded parameters.

    Pure arithmetic on the segment maps: every rank builds the same parameters in the
    same order (param groups, then sharded parameters, then their slots) and owners.
    ``owners`` fixes the owner of parameters (by FQN) assigned before, e.g. whose state
    lives on their owner; the others are assigned around them, with ``near`` to the rank
    holding most of each where the balance allows (``assign_owners_near``).
    """

    def __init__(
        self,
        ranks: comm.Ranks,
        params: list[tuple[int, torch.Tensor]],
        cost: Cost,
        owners: Mapping[str, int] | None = None,
        near: bool = False,
    ) -> None:
        self.ranks = ranks
        self.params = [param for _, param in params]
        self.groups = [group for group, _ in params]
        size, me = ranks.size, ranks.rank
        found = []
        for position, (group, param) in enumerate(params):
            segments = segments_of(param)
            assert segments is not None
            buffer = segments.buffer
            if buffer.world_size != size or segments.shard_rank != me:
                raise ValueError(
                    f"A sharded parameter holding {segments.fqns[:3]} is laid out for "
                    f"{buffer.world_size} ranks (this is shard {segments.shard_rank}) but its "
                    f"process group has {size} ranks (this is rank {me})"
                )
            my_start = buffer.shard_range(me)[0]
            for slot in buffer.params:
                shape = tuple(int(n) for n in slot.shape)
                work = cost(group, shape)  # also where a subclass refuses a shape
                if not slot.numel:
                    continue
                numels = Spread.of_slot(slot.offset, slot.numel, buffer.shard_numel)
                start = max(slot.offset, my_start) - my_start
                found.append((slot.fqn, group, position, shape, work, numels, start))
        fixed = dict(owners or {})
        loads = [0.0] * size
        for f in found:
            if f[0] in fixed:
                loads[fixed[f[0]]] += f[4]
        free = [f for f in found if f[0] not in fixed]
        if near:
            chosen = assign_owners_near([f[4] for f in free], [f[5] for f in free], size, loads)
        else:
            chosen = assign_owners([f[4] for f in free], size, loads)
        fixed.update(zip([f[0] for f in free], chosen, strict=True))
        self.tensors = [OwnedParam(*f[:5], fixed[f[0]], *f[5:]) for f in found]
        self._send_starts: list[int] | None = None
        self._send_flags: torch.Tensor | None = None
        self._plan_buffers()
        self._flag_index: torch.Tensor | None = None
        self.checked = False

    def _plan_buffers(self) -> None:
        """The buffers' layout. A tensor its owner holds whole ("solo" there) travels not
        at all: only the others' pieces are in the buffers. Work in the pieces, not in
        the world size, but for the split sizes all_to_all takes (one per rank)."""
        size, me = self.ranks.size, self.ranks.rank
        moved = [t.numels[t.owner] != t.numel for t in self.tensors]
        # per destination, the tensors whose piece this rank sends it (sparse: by owner)
        self.sends_to: dict[int, list[int]] = {}
        self.send_splits = [0] * size
        for index, t in enumerate(self.tensors):
            if t.numels[me] and moved[index]:
                self.sends_to.setdefault(t.owner, []).append(index)
                self.send_splits[t.owner] += t.numels[me]
        self.send_order = [i for rank in sorted(self.sends_to) for i in self.sends_to[rank]]
        self.owned = [index for index, t in enumerate(self.tensors) if t.owner == me]
        self.solo = {index for index in self.owned if not moved[index]}
        # per owned tensor, its pieces: (source rank, offset in that source's chunk, numel)
        self.recv_splits = [0] * size
        self.recv_places: list[list[tuple[int, int, int]]] = []
        for index in self.owned:
            places = []
            if moved[index]:
                for rank, numel in self.tensors[index].numels.items():
                    places.append((rank, self.recv_splits[rank], numel))
                    self.recv_splits[rank] += numel
            self.recv_places.append(places)
        # where each source's chunk starts in the received buffer, unflagged and flagged
        # (one element ahead of each chunk)
        self.received_starts: dict[bool, list[int]] = {False: [], True: []}
        offset = 0
        for rank, split in enumerate(self.recv_splits):
            self.received_starts[False].append(offset)
            self.received_starts[True].append(offset + rank + 1)
            offset += split

    # --- the layout --------------------------------------------------------------------

    def local_piece(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's piece of tensor ``index`` in ``flat``, a tensor laid out like its shard."""
        t = self.tensors[index]
        numel = t.numels[self.ranks.rank]
        return flat.view(-1)[t.local_start : t.local_start + numel]

    def pack(
        self,
        flats: Sequence[torch.Tensor | None],
        dtype: torch.dtype,
        flag: float | None = None,
    ) -> torch.Tensor:
        """The buffer to the owners: per destination (after ``flag``, when given), this
        rank's pieces.

        ``flats[k]`` is laid out like the exchange's sharded parameter ``k``, or None to
        send zeros (it has no gradient here).
        """
        device = self.params[0].device
        me = self.ranks.rank
        flagged = flag is not None
        send = torch.empty(
            sum(self.send_splits) + int(flagged) * self.ranks.size, dtype=dtype, device=device
        )
        if flagged:  # one element ahead of each destination's chunk, every rank's too
            send[self._send_flag_index(device)] = flag
        offset = 0
        for rank, indices in sorted(self.sends_to.items()):
            offset = self._send_start(rank, flagged)
            for index in indices:
                numel = self.tensors[index].numels[me]
                flat = flats[self.tensors[index].param]
                if flat is None:
                    send[offset : offset + numel].zero_()
                else:
                    send[offset : offset + numel].copy_(self.local_piece(flat, index))
                offset += numel
        return send

    def _send_start(self, rank: int, flagged: bool) -> int:
        """Where destination ``rank``'s pieces start in the buffer to the owners."""
        if self._send_starts is None:
            starts, offset = [], 0
            for split in self.send_splits:
                starts.append(offset)
                offset += split
            self._send_starts = starts
        return self._send_starts[rank] + (rank + 1 if flagged else 0)

    def _send_flag_index(self, device: torch.device) -> torch.Tensor:
        if self._send_flags is None or self._send_flags.device != device:
            places = [self._send_start(rank, True) - 1 for rank in range(self.ranks.size)]
            self._send_flags = torch.tensor(places, device=device)  # once, not per step
        return self._send_flags

    def to_owners(
        self, send: torch.Tensor, flagged: bool = False
    ) -> tuple[torch.Tensor, comm.Pending]:
        """Start the all-to-all of ``send`` (``pack``'s) to the owners; the receive buffer."""
        extra = int(flagged)
        received = send.new_empty(sum(self.recv_splits) + extra * self.ranks.size)
        pending = comm.all_to_all(
            received, send, [n + extra for n in self.recv_splits],
            [n + extra for n in self.send_splits], self.ranks, async_op=True,
        )  # fmt: skip
        return received, pending

    def received_pieces(
        self, received: torch.Tensor, position: int, flagged: bool = False
    ) -> list[torch.Tensor]:
        """Views of ``received`` holding the pieces, in rank order, of ``self.owned[position]``."""
        starts = self.received_starts[flagged]
        return [
            received[starts[rank] + offset : starts[rank] + offset + numel]
            for rank, offset, numel in self.recv_places[position]
        ]

    def received_flags(self, received: torch.Tensor) -> torch.Tensor:
        """Every rank's flag, in rank order, from a flagged received buffer."""
        if self._flag_index is None or self._flag_index.device != received.device:
            places = [start - 1 for start in self.received_starts[True]]
            self._flag_index = torch.tensor(places, device=received.device)  # once, not per step
        return received[self._flag_index]

    def back(self, values: torch.Tensor, into: torch.Tensor) -> comm.Pending:
        """Start the all-to-all from the owners: ``values`` in the (unflagged) received
        layout go back into ``into``, in the (unflagged) layout sent to the owners."""
        return comm.all_to_all(
            into, values, self.send_splits, self.recv_splits, self.ranks, async_op=True
        )

    def returned_pieces(self, returned: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``(tensor index, view)`` of each piece in the (unflagged) layout sent to owners."""
        me, offset, found = self.ranks.rank, 0, []
        for index in self.send_order:
            numel = self.tensors[index].numels[me]
            found.append((index, returned[offset : offset + numel]))
            offset += numel
        return found

    # --- reports and checks ------------------------------------------------------------

    def costs(self) -> list[float]:
        loads = [0.0] * self.ranks.size
        for t in self.tensors:
            loads[t.owner] += t.cost
        return loads

    def ownership(self, element_size: int) -> Ownership:
        """The report, for one payload to the owners and one back, of ``element_size``
        bytes an element."""
        me = self.ranks.rank
        sent = sum(s for rank, s in enumerate(self.send_splits) if rank != me)
        received = sum(r for rank, r in enumerate(self.recv_splits) if rank != me)
        return Ownership(
            world_size=self.ranks.size, rank=me,
            owners={t.fqn: t.owner for t in self.tensors}, cost_per_rank=self.costs(),
            elements_sent=sent, elements_received=received,
            bytes_per_step=(sent + received) * element_size,
        )  # fmt: skip

    def signature(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
        return [(t.fqn, t.shape, t.numels, t.owner) for t in self.tensors]

    def check_same_on_every_rank(
        self, who: str, what: str = "parameters", extra: Any = None
    ) -> None:
        """One collective: every rank must exchange the same parameters (else the
        all-to-all would mismatch) and agree on ``extra``; fails on every rank, naming
        the first difference."""
        signatures = comm.gather_if_different((extra, self.signature()), self.ranks)
        self.checked = True
        if signatures is None:
            return
        raise_if_options_differ(who, [other_extra for other_extra, _ in signatures])
        ours = signatures[0][1]
        for rank, (_, other) in enumerate(signatures):
            if other != ours:
                first = next(
                    (i for i, (a, b) in enumerate(zip(ours, other, strict=False)) if a != b),
                    min(len(ours), len(other)),
                )
                mine = ours[first] if first < len(ours) else "nothing"
                its = other[first] if first < len(other) else "nothing"
                raise ValueError(
                    f"{who}: ranks hold different {what}: number {first} (name, shape, "
                    f"elements per rank, owner) is {mine} on rank 0 but {its} on rank {rank}; "
                    "build the optimizer from the same param groups on every rank "
                    "(model.optimizer_groups())."
                )


def raise_if_options_differ(who: str, gathered: Sequence[Any]) -> None:
    """Fail (on every rank: each has ``gathered``, every rank's optimizer options) where a
    rank's differ from rank 0's."""
    for rank, other in enumerate(gathered):
        if other != gathered[0]:
            raise ValueError(
                f"{who}: ranks were given different optimizers: {gathered[0]} on rank 0 "
                f"but {other} on rank {rank}; build it alike on every rank."
            )


def by_process_group(
    entries: Sequence[tuple[int, torch.Tensor]],
) -> list[tuple[comm.Ranks, list[tuple[int, torch.Tensor]]]]:
    """The sharded parameters among ``entries`` (group index, parameter) that need an
    exchange (split over several ranks), by process group, in first-seen order."""
    found: dict[int, tuple[comm.Ranks, list[tuple[int, torch.Tensor]]]] = {}
    for group, param in entries:
        segments = segments_of(param)
        if segments is not None and segments.needs_reduce:
            key = id(segments.ranks.group)
            found.setdefault(key, (segments.ranks, []))[1].append((group, param))
    return list(found.values())
