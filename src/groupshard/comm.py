"""Every collective groupshard issues, as free functions over an explicit process group.

The only module that calls ``torch.distributed``. Tests patch these functions to
count collectives. A ``Ranks`` with ``group=None`` is a single process without an
initialised process group, and a group of one process (a mesh dimension of size 1) needs
no communication either: every collective is then a local copy.

The gather and the reduce can run asynchronously (``async_op=True``): they return a
``Pending`` whose ``wait()`` blocks until the data is there. On gloo the collective runs
on gloo's own threads while Python goes on; on NCCL it runs on NCCL's stream, ordered
after the work already queued on the current stream, and ``wait()`` makes the current
stream wait for it (the host does not block); c10d records the tensors' use on that
stream, so the caching allocator does not hand their memory out early, and ``Pending``
keeps them referenced until the wait. Every collective is started asynchronously; a
synchronous call waits for it at once. On gloo that wait is cut at ``WAIT_NOTICE_S``: a
rank left alone in a collective (a call made under ``if rank == 0:``) says on stderr
which call it is in (``collective_call``), then waits on.
"""

from __future__ import annotations

import atexit
import contextvars
import datetime
import functools
import hashlib
import os
import pickle
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from groupshard.early_imports import import_early

import_early()  # before a process group is resolved: groupshard/early_imports.py says why

# torch 2.13 renamed the single-tensor collectives; older releases have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

GLOO_EMULATION = {"enabled": True}
"""On gloo, gather with broadcasts and reduce with an all-reduce (faster on CPU than gloo's
all_gather_into_tensor and reduce_scatter_tensor: benchmarks/README.md); tests turn it off
to run the native collectives NCCL uses."""


WAIT_NOTICE_S = float(os.environ.get("GROUPSHARD_WAIT_NOTICE_S", "30"))
"""A rank that has waited this long for the other ranks in one of our collectives (gloo,
where the host waits) says on stderr which call it is in and that every rank must make it,
then waits on until the process group's timeout: a collective called on some ranks only
(``model.state_dict()`` or ``generate`` under ``if rank == 0``) would otherwise hang
silently for the whole timeout (30 minutes by default)."""

_call: contextvars.ContextVar[str | None] = contextvars.ContextVar("groupshard_call", default=None)


@contextmanager
def collective_call(name: str) -> Iterator[None]:
    """Name the public call (``"model.state_dict()"``) whose collectives run inside, for
    the notice of a rank left waiting in them; the outermost name is kept."""
    token = _call.set(_call.get() or name)
    try:
        yield
    finally:
        _call.reset(token)


def named_call(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: the function's collectives run inside ``collective_call(name)``."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def named(*args: Any, **kwargs: Any) -> Any:
            with collective_call(name):
                return function(*args, **kwargs)

        return named

    return decorate


def _wait_noticed(work: Any, ranks: Ranks) -> None:
    """``work.wait()``; after ``WAIT_NOTICE_S`` seconds the notice, once, then on."""
    started = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=WAIT_NOTICE_S))
        return
    except RuntimeError as error:
        # the collective itself failed (a peer gone, the group's own timeout): not our wait
        if "timed out" not in str(error).lower() or time.monotonic() - started < WAIT_NOTICE_S:
            raise
    call = _call.get() or (
        "a collective of the sharded model (its forward: model(...) or generate(); its "
        "backward; the optimizer's step)"
    )
    print(
        f"groupshard: rank {ranks.rank} of {ranks.size} has waited {WAIT_NOTICE_S:g} s for "
        f"the other ranks in {call}. Every rank must make this call: under `if rank == 0:` "
        "alone it hangs. Waiting on until the process group's timeout.",
        file=sys.stderr,
        flush=True,
    )
    work.wait()


@dataclass(eq=False)  # compared by identity: _in_flight holds them
class Pending:
    """A started collective: ``wait()`` blocks until it is done, then runs ``finish``
    (copy out, scale). Waiting twice is harmless. ``ranks``: where the host itself waits
    (gloo), the group, for the notice of a long wait (``WAIT_NOTICE_S``)."""

    works: list[Any] = field(default_factory=list)
    finish: Callable[[], None] | None = None
    keep: Sequence[torch.Tensor] = ()  # tensors the collective reads or writes
    done: bool = False
    ranks: Ranks | None = None

    def wait(self) -> None:
        if self.done:
            return
        for work in self.works:
            if self.ranks is not None:
                _wait_noticed(work, self.ranks)
            else:
                work.wait()
        self.done = True
        _in_flight.discard(self)
        if self.finish is not None:
            self.finish()
        self.works, self.keep, self.finish = [], (), None


def _started(
    works: list[Any],
    finish: Callable[[], None] | None,
    keep: Sequence[torch.Tensor],
    async_op: bool,
    ranks: Ranks | None = None,
) -> Pending:
    """``works`` (every collective is started asynchronously) as a ``Pending``, waited for
    here unless ``async_op``."""
    noticed = ranks if ranks is not None and ranks.is_gloo else None  # NCCL: the host goes on
    pending = Pending([w for w in works if w is not None], finish, keep, ranks=noticed)
    if async_op:
        _in_flight.add(pending)
    else:
        pending.wait()
    return pending


_in_flight: weakref.WeakSet[Pending] = weakref.WeakSet()
"""The asynchronous collectives started and not yet waited for."""


def _destroy_process_groups_at_exit() -> None:
    """Destroy torch's process groups when a script ends without doing so, as the Hugging
    Face Trainer, accelerate and Lightning's gloo strategies leave them.

    A gloo group's worker threads otherwise live into interpreter shutdown; one still
    releasing a finished collective's tensors then needs the GIL of a finalizing
    interpreter, the thread exits inside a noexcept destructor and the process aborts
    ("terminate called without an active exception", SIGABRT) after a complete training:
    8 of 50 plain DDP jobs aborted so, run two at a time on 2 cores, and 0 of 50 of ours
    (benchmarks/stress_exit.py). At
    ``atexit`` Python still runs, and destroying the groups joins those threads (the
    sharded models and optimizers hold them weakly; Lightning does the same for NCCL).
    Skipped when an exception ends the program, or a collective of ours is still in flight:
    joining a thread that waits for a peer which never comes would turn a failure into a
    hang until the collective's timeout.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if hasattr(sys, "last_value") or len(_in_flight):
        return
    dist.destroy_process_group()


@functools.cache
def _register_teardown() -> None:
    """Register the exit handler once, when a model or optimizer first takes a group: it
    then runs after the handlers registered later (a user's) and before earlier ones."""
    atexit.register(_destroy_process_groups_at_exit)


def _emulated(ranks: Ranks) -> bool:
    return ranks.is_gloo and GLOO_EMULATION["enabled"]


@dataclass(frozen=True)
class Ranks:
    """The process group a model is sharded over, with this process's place in it.

    The group is held weakly. ``dist.destroy_process_group()`` drops torch's references;
    if a model kept the group alive past that, its C++ object (and gloo's worker threads)
    would live until interpreter shutdown, and a worker still releasing a finished
    collective's tensors then needs the GIL of a finalizing interpreter: the thread exits
    inside a noexcept destructor and the process aborts ("terminate called without an
    active exception", issue 27). Dropped with the last reference, the group joins its
    threads at once, while Python still runs.
    """

    group_ref: Callable[[], Any] | None  # weakref to a dist.ProcessGroup; None: one process
    rank: int
    size: int
    backend: str = "none"

    @property
    def group(self) -> Any:
        """The process group, or None for a single process.

        Raises:
            RuntimeError: the group was destroyed (``dist.destroy_process_group()``).
        """
        if self.group_ref is None:
            return None
        group = self.group_ref()
        if group is None:
            raise RuntimeError(
                "the process group this model or optimizer was sharded over has been "
                "destroyed (torch.distributed.destroy_process_group()); it cannot "
                "communicate any more: save what you need before destroying the group"
            )
        return group

    @property
    def is_gloo(self) -> bool:
        return self.backend == "gloo"

    @property
    def is_local(self) -> bool:
        """One process: every collective over it is a local copy (no call into c10d)."""
        return self.group_ref is None or self.size == 1


def resolve_ranks(process_group: Any = None) -> Ranks:
    """The given process group, else the default one, else a single local process.

    Raises:
        ValueError: the environment says this is one of several processes (``WORLD_SIZE`` > 1,
            as torchrun sets it) but there is no default process group: each process would
            otherwise train alone, silently.
    """
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            world_size = os.environ.get("WORLD_SIZE", "1")
            if world_size.strip().isdigit() and int(world_size) > 1:
                raise ValueError(
                    f"WORLD_SIZE is {world_size} (torchrun sets it) but no default process "
                    "group is initialised, so each process would train alone: call "
                    'torch.distributed.init_process_group() (e.g. "gloo" on CPU, "nccl" on '
                    "GPUs) before gs.shard or gs.ZeroRedundancyOptimizer, or pass process_group"
                )
            return Ranks(None, 0, 1)
        process_group = dist.group.WORLD
    _register_teardown()
    return Ranks(
        weakref.ref(process_group),
        dist.get_rank(process_group),
        dist.get_world_size(process_group),
        str(dist.get_backend(process_group)),
    )


# writer groups by the ranks and timeout of the training group they write for
_writer_groups: dict[tuple[tuple[int, ...], datetime.timedelta | None], Ranks] = {}


def writer_group(ranks: Ranks) -> Ranks:
    """A gloo group of the same processes as ``ranks``, for a background thread's
    collectives (an asynchronous checkpoint's write), which must not interleave with the
    training's on ``ranks``. Its collectives wait as long as ``ranks``' do, so that a write
    whose peer died fails within the training's timeout. Made when first asked for (only
    these processes take part), then reused while it lives; held weakly, as every group."""
    if ranks.is_local:
        return ranks
    members = tuple(dist.get_process_group_ranks(ranks.group))
    timeout = group_timeout(ranks.group)
    found = _writer_groups.get((members, timeout))
    if found is not None and found.group_ref() is not None:
        return found
    group = dist.new_group(
        list(members), backend="gloo", timeout=timeout, use_local_synchronization=True
    )
    _writer_groups[members, timeout] = resolve_ranks(group)
    return _writer_groups[members, timeout]


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """How long ``group``'s collectives wait (the ``timeout`` it was made with), or None
    where its backend does not say (torch's default then applies)."""
    for device in group._device_types:
        timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    ranks: Ranks,
    async_op: bool = False,
    finish: Callable[[], None] | None = None,
) -> Pending:
    """Fill ``output`` (``size`` x ``shard``, rank-major) with every rank's ``shard``, then
    run ``finish`` (at the wait when ``async_op``).

    ``shard`` may be this rank's chunk of ``output`` itself (an in-place all-gather).

    Note:
        On gloo, one broadcast from each rank into its chunk of ``output``, faster there
        than gloo's all-gather (``GLOO_EMULATION``).
    """
    if ranks.is_local:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return _started([], finish, (), async_op=False)
    if _emulated(ranks):
        chunks = output.view(ranks.size, -1)
        if chunks[ranks.rank].data_ptr() != shard.data_ptr():
            chunks[ranks.rank].copy_(shard.reshape(-1))
        works = [
            dist.broadcast(
                chunk,
                src=dist.get_global_rank(ranks.group, rank),
                group=ranks.group,
                async_op=True,
            )
            for rank, chunk in enumerate(chunks)
        ]
        return _started(works, finish, (output, shard), async_op, ranks)
    work = _all_gather_single(output, shard, group=ranks.group, async_op=True)
    return _started([work], finish, (output, shard), async_op, ranks)


def reduce_scatter_mean(
    output: torch.Tensor,
    unsharded: torch.Tensor,
    ranks: Ranks,
    async_op: bool = False,
    finish: Callable[[], None] | None = None,
) -> Pending:
    """``output`` = this rank's chunk of the mean of ``unsharded`` over ranks, then run
    ``finish`` (at the wait when ``async_op``).

    ``unsharded`` (rank-major) may be overwritten.

    Note:
        gloo carries out a reduce-scatter as an all-reduce anyway, and its own
        all-reduce is faster than its reduce-scatter, so on gloo we all-reduce in place.
    """
    flat = unsharded.reshape(-1)

    def average() -> None:
        if _emulated(ranks):
            output.copy_(flat.view(ranks.size, -1)[ranks.rank])
        output.div_(ranks.size)
        if finish is not None:
            finish()

    if ranks.is_local:
        output.copy_(flat)
        return _started([], finish, (), async_op=False)
    if _emulated(ranks):
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ranks.group, async_op=True)
    else:
        work = _reduce_scatter_single(
            output, flat, op=dist.ReduceOp.SUM, group=ranks.group, async_op=True
        )
    return _started([work], average, (output, flat), async_op, ranks)


def all_reduce_mean(
    tensor: torch.Tensor,
    ranks: Ranks,
    async_op: bool = False,
    finish: Callable[[], None] | None = None,
) -> Pending:
    """Average ``tensor`` over ranks in place, then run ``finish`` (at the wait when
    ``async_op``)."""

    def average() -> None:
        tensor.div_(ranks.size)
        if finish is not None:
            finish()

    if ranks.is_local:
        return _started([], finish, (), async_op=False)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=ranks.group, async_op=True)
    return _started([work], average, (tensor,), async_op, ranks)


def all_reduce_sum(tensor: torch.Tensor, ranks: Ranks) -> None:
    """Sum ``tensor`` over ranks in place."""
    if ranks.is_local:
        return
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=ranks.group, async_op=True)
    _started([work], None, (tensor,), False, ranks)


def all_reduce_max(
    tensor: torch.Tensor,
    ranks: Ranks,
    async_op: bool = False,
    finish: Callable[[], None] | None = None,
) -> Pending:
    """Element-wise maximum of ``tensor`` over ranks, in place, then run ``finish`` (at the
    wait when ``async_op``)."""
    if ranks.is_local:
        return _started([], finish, (), async_op=False)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=ranks.group, async_op=True)
    return _started([work], finish, (tensor,), async_op, ranks)


def broadcast(tensor: torch.Tensor, ranks: Ranks, src_rank: int = 0) -> None:
    """Overwrite ``tensor`` with group rank ``src_rank``'s copy."""
    if ranks.is_local:
        return
    source = dist.get_global_rank(ranks.group, src_rank)
    work = dist.broadcast(tensor, src=source, group=ranks.group, async_op=True)
    _started([work], None, (tensor,), False, ranks)


def broadcast_object(value: Any, ranks: Ranks, src_rank: int = 0) -> Any:
    """Group rank ``src_rank``'s ``value`` (picklable), on every rank."""
    if ranks.is_local:
        return value
    shared = [value]
    dist.broadcast_object_list(
        shared, src=dist.get_global_rank(ranks.group, src_rank), group=ranks.group
    )
    return shared[0]


def object_device(ranks: Ranks) -> torch.device:
    """Where a small tensor of agreement goes: the current GPU for NCCL, else the CPU."""
    if ranks.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def digest(value: Any) -> int:
    """A 62-bit digest of plain data (numbers, strings, dtypes, classes, and lists,
    tuples, dicts and sets of them): equal values give equal digests in every process
    (sets are ordered first: string hashing differs between processes)."""
    encoded = pickle.dumps(_canonical(value), protocol=4)
    return int.from_bytes(hashlib.blake2b(encoded, digest_size=8).digest(), "little") >> 2


def _canonical(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return ("set", sorted((_canonical(v) for v in value), key=repr))
    if isinstance(value, dict):
        return ("dict", [(_canonical(k), _canonical(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_canonical(v) for v in value])
    return value


def same_everywhere(value: Any, ranks: Ranks) -> bool:
    """Whether every rank passed a value equal to this rank's: one all-reduce of two
    64-bit numbers (the largest digest and the largest of their complements), whatever the
    world size; the same answer on every rank."""
    if ranks.is_local:
        return True
    mine = digest(value)
    extremes = torch.tensor([mine, ~mine], dtype=torch.int64, device=object_device(ranks))
    all_reduce_max(extremes, ranks)
    return int(extremes[0]) == ~int(extremes[1])


def gather_if_different(value: Any, ranks: Ranks) -> list[Any] | None:
    """None when every rank's ``value`` is equal (``same_everywhere``: O(1) bytes per
    rank); else every rank's value, in rank order, gathered only then so that an error can
    name the rank and the difference."""
    if same_everywhere(value, ranks):
        return None
    return gather_objects(value, ranks)


def gather_objects(value: Any, ranks: Ranks) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank: O(world) bytes and
    unpickling per rank, so only where every value is needed (a full state dict) or after
    ``same_everywhere`` found a difference."""
    if ranks.is_local:
        return [value]
    gathered: list[Any] = [None] * ranks.size
    dist.all_gather_object(gathered, value, group=ranks.group)
    return gathered


def raise_if_any_failed(
    error: BaseException | None, ranks: Ranks, others_raise: type[Exception] | None = None
) -> None:
    """Make a failure on any rank fail every rank, so no rank waits in a collective.

    A rank re-raises its own error; the others raise the first failing rank's
    message as ``others_raise`` if given, else with the same type (ValueError or
    TypeError, else RuntimeError).
    """
    # the first failing rank (the largest negated rank; -size when none failed), then
    # its message from it: O(1) bytes per rank whatever the world size
    first = torch.tensor(
        [-ranks.rank if error is not None else -ranks.size],
        dtype=torch.int64, device=object_device(ranks),
    )  # fmt: skip
    all_reduce_max(first, ranks)
    failed_rank = -int(first)
    if failed_rank < ranks.size:  # every rank takes part, the failed ones too
        mine = (type(error).__name__, str(error)) if ranks.rank == failed_rank else None
        type_name, message = broadcast_object(mine, ranks, src_rank=failed_rank)
    if error is not None:
        raise error
    if failed_rank < ranks.size:
        error_type = others_raise or {"ValueError": ValueError, "TypeError": TypeError}.get(
            type_name, RuntimeError
        )
        raise error_type(f"rank {failed_rank} failed: {message}")


def all_to_all(
    output: torch.Tensor,
    source: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    ranks: Ranks,
    async_op: bool = False,
    finish: Callable[[], None] | None = None,
) -> Pending:
    """Send chunk ``r`` of ``source`` (``input_splits[r]`` elements, in rank order) to rank
    ``r`` and receive rank ``r``'s chunk for us into chunk ``r`` of ``output``
    (``output_splits[r]`` elements), then run ``finish`` (at the wait when ``async_op``).

    Both tensors are 1-D and contiguous, of one dtype; ``output`` must not overlap
    ``source``. Chunks may be empty. Used by ``gs.optim.Muon`` to move pieces of matrices
    to their owner rank and the results back.

    Note:
        gloo implements ``all_to_all_single`` with uneven splits natively (checked on
        torch 2.13, CPU: 3 ranks, bf16, empty chunks); on 2 ranks and 8 MB it took about as
        long as an all-reduce of the same tensor, so it is not emulated.
    """
    if ranks.is_local:
        if output.data_ptr() != source.data_ptr():
            output.copy_(source)
        return _started([], finish, (), async_op=False)
    work = dist.all_to_all_single(
        output,
        source,
        output_split_sizes=list(output_splits),
        input_split_sizes=list(input_splits),
        group=ranks.group,
        async_op=True,
    )
    return _started([work], finish, (output, source), async_op, ranks)
