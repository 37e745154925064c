"""The model front-end: ``shard``, the methods it adds, and ``shard_optimizer``."""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from groupshard import comm
from groupshard.full_state import full_state_dict, load_full_state_dict
from groupshard.groups import ParamGroups, ResolvedGroups, resolve_groups
from groupshard.guards import wrapped_error
from groupshard.layout import FROZEN_GROUP, StorageLayout, build_storage
from groupshard.materialize import (
    ParamInitFn,
    agreed_seed,
    check_initializable,
    materialize_unit,
    meta_parameters,
    release_free_memory,
    same_on_every_rank,
)
from groupshard.mesh import (
    MeshRanks,
    check_mesh,
    mesh_ranks,
    mesh_signature,
)
from groupshard.options import BUCKET_BYTES, FIRST_BUCKET_BYTES, ShardOptions
from groupshard.precision import MixedPrecision, PrecisionSpec, unit_policy
from groupshard.runtime import ShardedRuntime, TrainingState
from groupshard.sharding import (
    ShardingState,
    register_shards,
    sharding_state,
    swap_in_originals,
    swap_out_originals,
)
from groupshard.storage import FlatStorage
from groupshard.tensor_parallel import (
    TensorParallelism,
    data_parallel_ranks,
    find_tensor_parallelism,
    local_parameters,
    tensor_parallel_signature,
)
from groupshard.unit_runtime import UnitRuntime
from groupshard.units import UnitPlan, UnitSpec, plan_units


class ShardedModule(nn.Module):
    """Methods added to a module by ``gs.shard`` (its class becomes a subclass of this)."""

    groupshard: ShardingState

    def optimizer_groups(self) -> list[dict[str, Any]]:
        """Param groups over the shards, one per user group, in the user's order.

        Each dict carries the user's hyperparameters, so ``optimizer.param_groups[i]``
        is the user's group ``i`` and LR schedulers work unchanged.
        """
        state = self.groupshard
        return [
            {"params": state.shards_of_group(group.index), **group.options}
            for group in state.groups.groups
        ]

    def num_unsharded_parameters(self, trainable_only: bool = False) -> int:
        """The unsharded model's parameter count (tied parameters once): what
        ``sum(p.numel() for p in model.parameters())`` gave before ``gs.shard``. After it,
        ``parameters()`` are this rank's flat shards, padding included, so that sum counts
        those (a flat layout cannot make it the model's count); no communication."""
        return sum(
            numel
            for numel, trainable in self._unsharded_numels().values()
            if trainable or not trainable_only
        )

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Hugging Face's ``PreTrainedModel.num_parameters`` of the unsharded model (the
        Trainer's FLOPs count uses it); no communication."""
        embeddings = {
            f"{name}.weight"
            for name, module in self.named_modules()
            if isinstance(module, nn.Embedding)
        }
        return sum(
            numel
            for fqn, (numel, trainable) in self._unsharded_numels().items()
            if (trainable or not only_trainable) and not (exclude_embeddings and fqn in embeddings)
        )

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """peft's ``(trainable, all)`` parameter counts (``print_trainable_parameters``) of
        the unsharded model; no communication."""
        numels = self._unsharded_numels().values()
        return sum(n for n, trainable in numels if trainable), sum(n for n, _ in numels)

    def _unsharded_numels(self) -> dict[str, tuple[int, bool]]:
        """Each parameter's unsharded element count and whether it trains, by name."""
        tensor_parallel = self.groupshard.tensor_parallel
        return {
            slot.fqn: (
                slot.numel
                if tensor_parallel is None
                else tensor_parallel.numel(slot.fqn, slot.numel),
                buffer.group_index >= 0,
            )
            for storage in self.groupshard.storages
            for buffer in storage.layout.buffers
            for slot in buffer.params
        }

    @comm.named_call(
        "model.state_dict() (also called by save_pretrained, torch.save(model.state_dict()) "
        "and accelerate's get_state_dict)"
    )
    def state_dict(  # type: ignore[override]
        self, *, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The unsharded model's state dict, under its original names (FSDP1's default
        ``FULL_STATE_DICT``): a collective, every rank must call it, and every rank gets
        the whole model (use ``gs.full_state_dict(model, rank0_only=True)`` to keep it
        on rank 0 only). Inside ``summon_full_params``: the summoned parameters."""
        if self.groupshard.originals_registered:
            return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        full = full_state_dict(self)
        if destination is None:
            destination = OrderedDict()
        for name, value in full.items():
            destination[prefix + name] = value
        return destination

    @comm.named_call("model.load_state_dict()")
    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load an unsharded state dict (original names, full shapes; e.g. saved by
        single-process training) into the shards. Every rank passes the whole dict.

        ``strict=False`` keeps the current values of missing entries (gathered: then a
        collective) and returns them with the unexpected ones, as torch does.
        """
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) would replace the parameters of a sharded "
                "model; load with assign=False (values are copied into the shards)."
            )
        # torch's set_model_state_dict passes the model's own parameters (our shards)
        # through beside the entries it loads: skip exactly those.
        shards = dict(self.named_parameters())
        state_dict = {
            name: value
            for name, value in state_dict.items()
            if not (name in shards and value is shards[name])
        }
        missing: list[str] = []
        unexpected: list[str] = []
        if not strict:
            current = full_state_dict(self)
            missing = [name for name in current if name not in state_dict]
            unexpected = [name for name in state_dict if name not in current]
            state_dict = {name: state_dict.get(name, value) for name, value in current.items()}
        load_full_state_dict(self, state_dict)
        return _IncompatibleKeys(missing, unexpected)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """Refuse ``to(dtype)``, ``half()``, ``double()``, ``type(...)``... (all go through
        ``_apply``) before anything changes when they would convert the shards: the flat
        storages, their gathered buffers and the optimizer's parameters would part ways.

        A call that leaves them where they are is a no-op, whatever its spelling:
        ``.to("cpu:0")`` of shards on ``"cpu"`` (torch copies then: another spelling of
        the device), ``.cuda()`` on their own GPU, ``.to_empty()`` on their device.
        """
        for storage in self.groupshard.storages:
            probe = fn(storage.local.new_empty(0))
            if probe.dtype != storage.local.dtype or probe.device != storage.local.device:
                raise ValueError(
                    f"This call would convert the sharded parameters of unit "
                    f"{storage.layout.unit_name or '<root>'!r} from {storage.local.dtype} on "
                    f"{storage.local.device} to {probe.dtype} on {probe.device}, which a model "
                    "sharded by gs.shard does not support: convert or move the model before "
                    "gs.shard; to compute in another dtype, shard with "
                    "mixed_precision=gs.MixedPrecision(param_dtype=...)."
                )

        def unless_unchanged(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() in (4, 5):  # to(memory_format=...) may change these: torch's
                return fn(tensor)
            empty = tensor.new_empty(0)
            probe = fn(empty)
            if probe is not empty and (probe.dtype, probe.device) == (empty.dtype, empty.device):
                # the same dtype and device, another spelling (torch would copy): keep the
                # tensor itself, which a flat storage may hold (shards, their gradients)
                return tensor
            return fn(tensor)

        return super()._apply(unless_unchanged, recurse)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        # DistributedDataParallel's constructor reads this attribute first (with hasattr,
        # which lets any error but AttributeError through), before it broadcasts rank 0's
        # parameters over every rank's: the one point where DDP can be refused before it
        # overwrites the shards.
        raise wrapped_error("DistributedDataParallel")

    @contextmanager
    def summon_full_params(self, writeback: bool = False) -> Iterator[None]:
        """Give the model its original parameters back, gathered, under their own names.

        Inside the block ``named_parameters()`` and ``state_dict()`` look like the
        unsharded model and forward runs unsharded (no gradients reach the shards). The
        parameters are the masters, in the shards' dtype, whatever the mixed precision.

        Args:
            writeback: copy the parameters' values back into the shards on exit.
        """
        state = sharding_state(self, "summon_full_params", "part 3, issue 54")
        runtime = state.runtime
        if runtime.state is TrainingState.SUMMONED:
            raise RuntimeError(
                "summon_full_params is already active on this model; do not nest it."
            )
        # A replicated storage is its own unsharded buffer: keep a copy to discard edits.
        snapshots = [
            s.local.clone() if s.replicated and not writeback else None for s in state.storages
        ]
        with torch.no_grad(), comm.collective_call("model.summon_full_params()"):
            masters = [storage.gather_masters() for storage in state.storages]
            views = {
                fqn: view
                for storage, unsharded in zip(state.storages, masters, strict=True)
                for fqn, view in storage.param_views(unsharded=unsharded).items()
            }
            swap_in_originals(state, views)
        runtime.state = TrainingState.SUMMONED
        try:
            yield
        finally:
            runtime.state = TrainingState.IDLE
            with torch.no_grad():
                if writeback:
                    _write_back(state, masters)
                for storage, snapshot in zip(state.storages, snapshots, strict=True):
                    if snapshot is not None:
                        storage.local.copy_(snapshot)
                swap_out_originals(state)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backwards inside keep this rank's gradient sum locally, with no collective (as
        DDP's and FSDP1's ``no_sync``); the first backward after the block reduces it.

        Costs one unsharded gradient (in ``reduce_dtype``) per unit with parameters
        while the block lasts, as FSDP2's ``set_requires_gradient_sync(False)``.
        """
        return _without_gradient_sync(self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch for gradient accumulation: ``False`` until the last micro-batch's
        backward, which then reduces every micro-batch's gradients once."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                f"Expects requires_gradient_sync to be a bool but got {requires_gradient_sync!r}"
            )
        runtime = self.groupshard.runtime
        if runtime.in_no_sync:
            raise RuntimeError(
                "set_requires_gradient_sync inside model.no_sync(): use one or the other."
            )
        runtime.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """Hybrid sharding's accumulation (FSDP2's name): ``False`` reduce-scatters each
        backward's gradients within the shard group but keeps them on this rank; the first
        backward after ``True`` all-reduces their sum across the replicas once. Costs one
        sharded gradient per storage; no effect without replicas."""
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(
                f"Expects requires_all_reduce to be a bool but got {requires_all_reduce!r}"
            )
        self.groupshard.runtime.buckets.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None:
        """``False`` keeps units gathered after backward (FSDP2's name), so the next
        micro-batch's forward does not gather them again; costs their unsharded bytes.

        Gathered copies stay valid until an optimizer step or a groupshard load (then
        they are gathered again); call ``reshard()`` to free them.
        """
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(
                f"Expects reshard_after_backward to be a bool but got {reshard_after_backward!r}"
            )
        self.groupshard.runtime.reshard_after_backward = reshard_after_backward

    def reshard(self) -> None:
        """Free every gathered unit now (FSDP2's ``reshard``)."""
        self.groupshard.runtime.reshard()


@contextmanager
def _without_gradient_sync(model: ShardedModule) -> Iterator[None]:
    runtime = model.groupshard.runtime
    if runtime.in_no_sync:
        raise RuntimeError(
            "model.no_sync() is already active: do not nest it (the inner block's exit would "
            "turn gradient sync back on early)."
        )
    if not runtime.requires_gradient_sync:
        raise RuntimeError(
            "model.no_sync() after model.set_requires_gradient_sync(False): use one or the other."
        )
    runtime.in_no_sync = True
    runtime.requires_gradient_sync = False
    try:
        yield
    finally:
        runtime.in_no_sync = False
        runtime.requires_gradient_sync = True


def _write_back(state: ShardingState, masters: list[torch.Tensor]) -> None:
    unsharded_of = dict(zip(map(id, state.storages), masters, strict=True))
    for unit in state.runtime.units:
        for storage in unit.storages:
            views = storage.param_views(unsharded=unsharded_of[id(storage)])
            for fqn, view in views.items():
                module, attr = unit.places[fqn][0]
                current = module._parameters[attr]
                if current is None or current.shape != view.shape:
                    raise ValueError(
                        f"Parameter {fqn!r} was replaced inside summon_full_params by "
                        f"{None if current is None else tuple(current.shape)}; expects shape "
                        f"{tuple(view.shape)} to write it back."
                    )
                if current.data_ptr() != view.data_ptr():
                    view.copy_(current.detach())
            storage.write_back(unsharded_of[id(storage)])


def plan_storages(
    groups: ResolvedGroups, plan: UnitPlan, params: Mapping[str, nn.Parameter], world_size: int
) -> dict[str, list[StorageLayout]]:
    """Storage layouts per unit: one per dtype, a flat buffer per (group, dtype)."""
    storages: dict[str, list[StorageLayout]] = {}
    members = [(g.index, g.fqns) for g in groups.groups] + [(FROZEN_GROUP, groups.frozen)]
    for unit_name in plan.names:
        by_dtype: dict[torch.dtype, list[tuple[int, list[tuple[str, tuple[int, ...]]]]]] = {}
        for group_index, fqns in members:
            for fqn in fqns:
                if plan.owner[fqn] != unit_name:
                    continue
                param = params[fqn]
                entries = by_dtype.setdefault(param.dtype, [])
                if not entries or entries[-1][0] != group_index:
                    entries.append((group_index, []))
                entries[-1][1].append((fqn, tuple(param.shape)))
        storages[unit_name] = [
            build_storage(unit_name, dtype, world_size, entries)
            for dtype, entries in by_dtype.items()
        ]
        for layout in storages[unit_name]:
            devices = {params[s.fqn].device for b in layout.buffers for s in b.params}
            if len(devices) > 1:
                raise ValueError(
                    f"Unit {unit_name or '<root>'!r} has {layout.dtype} parameters on several "
                    f"devices {sorted(map(str, devices))}; move the model to one device first."
                )
    return storages


def check_same_structure(
    signature: Any,
    ranks: comm.Ranks,
    doing: str = "shard the model",
    remedy: str = "the same param groups, unit, strategy and options of gs.shard",
) -> None:
    """Fail on every rank, naming the first difference, if ranks sharded differently (one
    all-reduce of a digest; the signatures are gathered only when they differ)."""
    signatures = comm.gather_if_different(signature, ranks)
    if signatures is None:
        return
    for rank, other in enumerate(signatures):
        if other == signatures[0]:
            continue
        ours, theirs = signatures[0], other
        for key in [*ours, *(k for k in theirs if k not in ours)]:
            if ours.get(key) != theirs.get(key):
                raise ValueError(
                    f"Ranks disagree on how to {doing}: {key} on rank 0 is "
                    f"{ours[key]!r} but on rank {rank} is {theirs[key]!r}. Every rank must "
                    f"pass {remedy}."
                )


def structure_signature(
    groups: ResolvedGroups,
    storages: dict[str, list[StorageLayout]],
    model: nn.Module,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """Everything that decides which collectives run, to compare between ranks."""
    signature: dict[str, Any] = dict(options)
    if options["sync_module_states"]:  # one broadcast per buffer
        signature["module buffers"] = [
            (name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers()
        ]
    signature["number of param groups"] = len(groups.groups)
    for group in groups.groups:
        signature[f"param group {group.index}"] = {
            "params": group.fqns,
            "hyperparameters": sorted((str(k), repr(v)) for k, v in group.options.items()),
        }
    signature["frozen parameters"] = groups.frozen
    signature["units"] = [
        (
            name,
            [
                (str(layout.dtype), [[(s.fqn, s.shape) for s in b.params] for b in layout.buffers])
                for layout in layouts
            ],
        )
        for name, layouts in storages.items()
    ]
    return signature


def shard(
    model: nn.Module,
    param_groups: ParamGroups | None = None,
    *,
    unit: UnitSpec = None,
    strategy: str = "full",
    process_group: Any = None,
    mesh: Any = None,
    default_group: Mapping[str, Any] | None = None,
    sync_module_states: bool = True,
    reduce_bucket_bytes: int = BUCKET_BYTES,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
    prefetch_bytes: int = BUCKET_BYTES,
    mixed_precision: PrecisionSpec = None,
    overlap: bool = True,
    param_init_fn: ParamInitFn | None = None,
    device: torch.device | str | None = None,
) -> ShardedModule:
    """Shard ``model`` in place with one flat buffer per (unit, param group, dtype).

    Args:
        model: the unsharded module (its parameters are freed; shards replace them).
        param_groups: what ``torch.optim`` accepts (tensors, or dicts with "params" and
            hyperparameters, ``optimizer.param_groups`` included); ``None``: one group.
        unit: what is gathered as one piece: a module class, a tuple of classes or a
            predicate ``f(module) -> bool``; the root takes the remaining parameters.
        strategy: "full" (ZeRO-3), "grad_op" (ZeRO-2) or "no_shard" (DDP-like).
        process_group: defaults to the default group (a single process if none).
        mesh: a ``DeviceMesh`` instead of ``process_group``: 1-D shards over it; 2-D with
            ``mesh_dim_names=("replicate", "shard")`` shards within each shard group and
            replicates across (hybrid sharding, docs/hybrid-sharding.md).
        default_group: hyperparameters for trainable parameters no group names;
            ``None`` makes leaving one out an error.
        sync_module_states: broadcast rank 0's parameters and buffers first, as DDP does;
            a meta-built model is initialized from rank 0's seed on every rank and only
            a unit whose checksums differ between ranks is broadcast.
        reduce_bucket_bytes: gradients wait in a bucket until this many bytes are ready,
            then go in one reduce-scatter (DDP's buckets); 0 reduces each unit at once.
        first_bucket_bytes: the limit of each backward's first bucket (DDP's 1 MiB).
        prefetch_bytes: units that run next are gathered together while they fit in
            this many bytes ("full", "grad_op"); 0 gathers each unit on its own. The
            next unit is prefetched whatever its size (with ``overlap``).
        mixed_precision: a ``gs.MixedPrecision``, or ``(unit_name, module) ->
            gs.MixedPrecision | None`` for one per unit; the shards stay the masters.
        overlap: start collectives asynchronously and wait as late as possible;
            ``False`` runs each where it is needed. Same results either way.
        param_init_fn: for a model built on the meta device: ``f(module)`` initializes
            each module after its ``reset_parameters()``; units are materialized and
            sharded one at a time (``groupshard.materialize``).
        device: where a meta-built model's shards go (default: the current CUDA device
            with NCCL, else the CPU).

    Returns:
        The same module object, now also a ``ShardedModule``. docs/usage.md has the
        details: buckets, windows and overlap in docs/overlap.md.
    """
    ranks = comm.resolve_ranks(process_group)  # the world; with a mesh, the default group
    error: BaseException | None = None
    try:
        if mesh is not None and process_group is not None:
            raise ValueError("Pass either process_group or mesh to gs.shard, not both.")
        tensor_parallel = find_tensor_parallelism(
            dict(model.named_parameters()), mesh, ranks, strategy
        )
        if tensor_parallel is not None:  # every strategy runs over the data-parallel ranks
            sharding = data_parallel_ranks(mesh, strategy)
        elif mesh is not None:
            check_mesh(mesh, ranks)
            sharding = mesh_ranks(mesh, ranks, strategy)
        else:
            sharding = MeshRanks.flat(ranks)
        options = ShardOptions(
            strategy=strategy,
            reduce_bucket_bytes=reduce_bucket_bytes,
            first_bucket_bytes=first_bucket_bytes,
            prefetch_bytes=prefetch_bytes,
            overlap=overlap,
            sync_module_states=sync_module_states,
        )
        if isinstance(model, ShardedModule):
            raise ValueError("This model is already sharded by groupshard.")
        groups = resolve_groups(model, param_groups, default_group)
        plan = plan_units(model, unit)
        params = local_parameters(dict(model.named_parameters()), tensor_parallel)
        meta = bool(meta_parameters(params))
        world_size = 1 if strategy == "no_shard" else sharding.shard.size
        layouts = plan_storages(groups, plan, params, world_size)
        modules = dict(model.named_modules())
        policies = {name: unit_policy(mixed_precision, name, modules[name]) for name in plan.names}
        if not meta and (param_init_fn is not None or device is not None):
            raise ValueError(
                "param_init_fn and device are for a model built on the meta device; this "
                "model's parameters are real: initialize and move it before gs.shard."
            )
        if meta:
            check_initializable(model, param_init_fn)
        target = _target_device(device, ranks) if meta else None
    except Exception as caught:  # every rank must hear of any failure
        error = caught
    comm.raise_if_any_failed(error, ranks)
    signature = {
        **options.signature(),
        "mixed_precision": {name: repr(policy) for name, policy in policies.items() if policy},
        "built on the meta device": target is not None,
        # with tensor parallelism each rank's data-parallel sub-mesh holds other ranks
        "mesh": mesh_signature(mesh) if tensor_parallel is None else mesh.mesh_dim_names,
        "tensor parallel": tensor_parallel_signature(tensor_parallel),
    }
    check_same_structure(structure_signature(groups, layouts, model, signature), ranks)
    materialize = (
        functools.partial(
            materialize_unit,
            model,
            plan,
            params,
            layouts,
            device=target,
            param_init_fn=param_init_fn,
            base_seed=agreed_seed(torch.initial_seed(), ranks, target)
            if options.sync_module_states
            else torch.initial_seed(),
            tensor_parallel=tensor_parallel,
        )
        if target is not None
        else None
    )
    units = _shard_units(
        model, plan, layouts, params, sharding, options, policies, materialize, tensor_parallel
    )
    runtime = ShardedRuntime(units, options)
    runtime.register_hooks()
    state = ShardingState(groups, plan, runtime, params, sharding, tensor_parallel)
    model.groupshard = state  # type: ignore[assignment]
    cls = model.__class__
    # the class keeps the user's name: Hugging Face writes it into config.json's
    # "architectures", which tools read to pick the class that loads the model
    refused = {name: _refusal(name) for name in RESTRUCTURING_METHODS if hasattr(model, name)}
    model.__class__ = type(
        cls.__name__, (ShardedModule, cls), {"__qualname__": cls.__qualname__, **refused}
    )
    return model  # type: ignore[return-value]


RESTRUCTURING_METHODS = ("merge_and_unload", "unload", "merge_adapter", "unmerge_adapter")
"""peft's methods that replace or rewrite the modules whose parameters are sharded: on a
sharded model they are refused (``_refusal``), naming what works instead."""


def _refusal(name: str) -> Callable[..., Any]:
    def refused(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{name}() rewrites the modules of a model whose parameters gs.shard has "
            f"sharded, which it cannot do on the shards. Load gs.full_state_dict(model) (on "
            f"every rank) into an unsharded copy of the model (model.load_state_dict) and "
            f"call {name}() there."
        )

    refused.__name__ = name
    return refused


def _shard_units(
    model: nn.Module,
    plan: UnitPlan,
    layouts: dict[str, list[StorageLayout]],
    params: dict[str, nn.Parameter],
    sharding: MeshRanks,
    options: ShardOptions,
    policies: Mapping[str, MixedPrecision | None],
    materialize: Callable[[str], tuple[list[torch.Tensor], dict[torch.dtype, torch.Tensor]]]
    | None = None,
    tensor_parallel: TensorParallelism | None = None,
) -> list[UnitRuntime]:
    """Shard unit by unit; ``materialize(unit_name)`` first gives a meta-built unit real,
    initialized parameters and buffers (then freed as soon as the unit is sharded)."""
    modules = dict(model.named_modules())
    if options.sync_module_states and materialize is None:
        for buffer in model.buffers():
            comm.broadcast(buffer.data, sharding.world)
    units = []
    differing: list[str] = []  # meta-built units the ranks initialized differently
    for name in plan.names:
        flats: dict[torch.dtype, torch.Tensor] = {}
        sync = options.sync_module_states
        if materialize is not None:
            buffers, flats = materialize(name)
            # initialized from rank 0's seed: broadcast only if the ranks' checksums differ
            sync = sync and not same_on_every_rank([*flats.values(), *buffers], sharding.world)
            for buffer in buffers if sync else ():
                comm.broadcast(buffer.data, sharding.world)
            differing += [name or "<root>"] if sync else []
        policy = policies[name] or MixedPrecision()
        storages = [
            FlatStorage(
                layout,
                sharding,
                params,
                sync,
                compute_dtype=policy.compute_dtype(layout.dtype),
                reduce_dtype=policy.gradient_dtype(layout.dtype),
                unsharded=flats.get(layout.dtype),
                tensor_parallel=tensor_parallel,
            )
            for layout in layouts[name]
        ]
        owned = [fqn for fqn, owner in plan.owner.items() if owner == name]
        places = {fqn: [(modules[m], attr) for m, attr in plan.registrations[fqn]] for fqn in owned}
        originals = {fqn: params[fqn] for fqn in owned}
        unit = UnitRuntime(name, modules[name], storages, places, originals, policies[name])
        for registrations in unit.places.values():
            for module, attr in registrations:
                del module._parameters[attr]
        for storage in unit.storages:
            register_shards(unit.module, storage)
        unit.install_local_pieces()  # frees the unit's full parameters
        units.append(unit)
        if materialize is not None:
            del flats
            release_free_memory()
    if differing:
        warnings.warn(
            f"Units {differing} were initialized differently on different ranks (an init "
            "drawing from a random source other than torch's seeded generators, or reading "
            "the rank): rank 0's values were broadcast to every rank (sync_module_states).",
            stacklevel=3,
        )
    return units


def _target_device(device: torch.device | str | None, ranks: comm.Ranks) -> torch.device:
    if device is not None:
        return torch.device(device)
    if ranks.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _constructor_defaults(optimizer_class: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts as keywords."""
    accepted = inspect.signature(optimizer_class.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(defaults)
    return {key: value for key, value in defaults.items() if key in accepted}


def shard_optimizer(
    optimizer: torch.optim.Optimizer, model: ShardedModule
) -> torch.optim.Optimizer:
    """Rebuild ``optimizer`` (built on the unsharded model) over ``model``'s shards.

    The model must have been sharded with ``optimizer.param_groups``; the new
    optimizer has the same class, defaults and per-group hyperparameters (current
    values, e.g. an LR already changed by a scheduler).
    """
    if not isinstance(model, ShardedModule):
        raise TypeError("shard_optimizer expects a model returned by gs.shard.")
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already has state for {len(optimizer.state)} parameters, "
            "which rebuilding would drop; call shard_optimizer before the first step."
        )
    state = model.groupshard
    names = {id(p): fqn for fqn, p in state.original_params.items()}
    sharded = state.groups.groups
    if len(optimizer.param_groups) != len(sharded):
        raise ValueError(
            f"The optimizer has {len(optimizer.param_groups)} param groups but the model was "
            f"sharded with {len(sharded)}; shard the model with optimizer.param_groups."
        )
    groups = []
    for index, (group, resolved) in enumerate(zip(optimizer.param_groups, sharded, strict=True)):
        fqns = tuple(names.get(id(p), "<not in model>") for p in group["params"] if p.requires_grad)
        if fqns != resolved.fqns:
            raise ValueError(
                f"Param group {index} of the optimizer holds {list(fqns)} but the model's group "
                f"{index} holds {list(resolved.fqns)}; shard the model with optimizer.param_groups."
            )
        options = {key: value for key, value in group.items() if key != "params"}
        groups.append({"params": state.shards_of_group(index), **options})
    optimizer_class = type(optimizer)
    return optimizer_class(groups, **_constructor_defaults(optimizer_class, optimizer.defaults))
