"""Full (unsharded) state dicts of a sharded model and its optimizer, in plain torch format.

``full_state_dict`` loads into the unsharded model with ``load_state_dict``;
``optim_state_dict`` loads into a plain torch optimizer built with the same param
groups on the unsharded model. The ``load_*`` functions take those plain formats
(e.g. saved by single-process training) into a sharded model and optimizer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from groupshard import comm, flatten
from groupshard.flatten import plain_optimizer_state
from groupshard.safetensors_io import load_safetensors
from groupshard.segments import segments_of
from groupshard.sharding import ShardingState, originals_installed, sharding_state
from groupshard.tensor_parallel import TensorParallelism, whole_dims, whole_tensor
from groupshard.writes import note_parameters_written


@comm.named_call("gs.full_state_dict()")
def full_state_dict(
    model: nn.Module, rank0_only: bool = False, cpu_offload: bool = False
) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict: original names and shapes, buffers included.

    Collective (one all-gather per flat buffer). Args:
        rank0_only: only group rank 0 keeps the result; the others return ``{}``.
        cpu_offload: move every tensor to the CPU as it is gathered.
    """
    state = sharding_state(model, "full_state_dict")
    tensor_parallel = state.tensor_parallel
    keep = not rank0_only or (
        state.ranks.rank == 0 and (tensor_parallel is None or tensor_parallel.ranks.rank == 0)
    )
    gathered: dict[str, torch.Tensor] = {}
    for storage in state.storages:
        for fqn, local in storage.gather_params().items():
            tensor = whole_tensor(tensor_parallel, fqn, local)  # gathered over dp: over tp too
            if keep:
                gathered[fqn] = _own_storage(tensor.cpu() if cpu_offload else tensor)
    if not keep:
        return {}
    with originals_installed(model, gathered):
        result = model.state_dict()
    parameters = {n for n, (fqn, _) in _expected_entries(model).items() if fqn is not None}
    for name, tensor in result.items():
        if name in parameters:  # freshly gathered already
            result[name] = tensor.detach()
        else:  # a buffer of the live model
            result[name] = (tensor.detach().cpu() if cpu_offload else tensor.detach()).clone()
    return dict(result)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A view of a gathered flat buffer copied into a storage of its own, as each entry of
    torch's ``state_dict()`` has one (safetensors refuses tensors that share a storage
    without covering it), and so the flat buffer is freed once its unit is copied."""
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


def _expected_entries(model: nn.Module) -> dict[str, tuple[str | None, torch.Size]]:
    """Every key of the unsharded state dict -> (canonical FQN or None for buffers, shape)."""
    state = model.groupshard
    entries: dict[str, tuple[str | None, torch.Size]] = {}
    slots = {
        slot.fqn: torch.Size(whole_dims(state.tensor_parallel, slot.fqn, slot.shape))
        for storage in state.storages
        for buffer in storage.layout.buffers
        for slot in buffer.params
    }
    for fqn, places in state.plan.registrations.items():
        for module_name, attr in places:
            entries[f"{module_name}.{attr}" if module_name else attr] = (fqn, slots[fqn])
    for name, tensor in nn.Module.state_dict(model, keep_vars=True).items():
        if not isinstance(tensor, nn.Parameter):  # the shards are the only parameters left
            entries[name] = (None, tensor.shape)
    return entries


def _describe(kind: str, names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:8]) + (" ..." if len(names) > 8 else "")
    return f"{len(names)} {kind}: {shown}"


def _check_model_state_dict(
    expected: dict[str, tuple[str | None, torch.Size]], state_dict: dict[str, Any]
) -> None:
    """Raise a ValueError listing missing, unexpected and mis-shaped entries, if any."""
    missing = [n for n in expected if n not in state_dict]
    unexpected = [n for n in state_dict if n not in expected]
    mismatched = [
        f"{n} (expects {tuple(expected[n][1])}, got {tuple(state_dict[n].shape)})"
        for n in expected
        if n in state_dict and torch.Size(state_dict[n].shape) != expected[n][1]
    ]
    problems = [
        _describe(kind, names)
        for kind, names in (
            ("missing entries", missing),
            ("unexpected entries", unexpected),
            ("entries with another shape", mismatched),
        )
        if names
    ]
    if problems:
        raise ValueError("The state dict does not match the model: " + "; ".join(problems))


@torch.no_grad()
@comm.named_call("gs.load_full_state_dict()")
def load_full_state_dict(
    model: nn.Module,
    source: Mapping[str, torch.Tensor] | str | os.PathLike,
    broadcast_from_rank0: bool = False,
) -> int | None:
    """Load unsharded weights into the shards, from one of:

    - a state dict (as ``full_state_dict`` returns, or a plain model's): every rank
      passes the whole dict and keeps its own slices, no collectives; with
      ``broadcast_from_rank0=True`` only rank 0's dict is read (the others may pass
      ``{}``) and each flat buffer is broadcast, one at a time;
    - a path to a safetensors file or a folder of them (Hugging Face's format): each
      rank reads only the rows its shards hold (``groupshard.safetensors_io``) and the
      bytes it read are returned.
    """
    state = sharding_state(model, "load_full_state_dict")
    tensor_parallel = state.tensor_parallel
    if isinstance(source, (str, os.PathLike)):
        return load_safetensors(model, source)
    if not isinstance(source, Mapping):
        raise TypeError(
            "load_full_state_dict expects a state dict (name -> tensor) or a path to a "
            f".safetensors file or folder, got {type(source).__name__}"
        )
    if broadcast_from_rank0:
        _load_from_rank0(model, source)
        return None
    state_dict = dict(source)
    expected = _expected_entries(model)
    _check_model_state_dict(expected, state_dict)
    by_fqn = {fqn: state_dict[name] for name, (fqn, _) in expected.items() if fqn}
    for storage in state.storages:
        for shard, buffer in zip(storage.shards, storage.layout.buffers, strict=True):
            values = [_local(tensor_parallel, slot.fqn, by_fqn[slot.fqn]) for slot in buffer.params]
            shard.copy_(flatten.shard_of(values, buffer, storage.shard_rank, shard))
    note_parameters_written()
    buffers = dict(model.named_buffers())
    for name, (fqn, _) in expected.items():
        if fqn is None and name in buffers:
            buffers[name].copy_(state_dict[name])
    return None


def _local(
    tensor_parallel: TensorParallelism | None, fqn: str, whole: torch.Tensor
) -> torch.Tensor:
    """What this rank's flat buffers hold of parameter ``fqn``: all of it, or under tensor
    parallelism its tp piece."""
    return whole if tensor_parallel is None else tensor_parallel.piece(fqn, whole)


def _load_from_rank0(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Rank 0 checks and flattens each buffer of ``state_dict``; one broadcast per flat
    buffer and model buffer gives every rank its slices. Under tensor parallelism rank 0
    of the whole mesh broadcasts each parameter whole and every rank keeps its tp piece."""
    state = model.groupshard
    tensor_parallel = state.tensor_parallel
    ranks = state.model_ranks
    expected = _expected_entries(model)
    error: BaseException | None = None
    if ranks.rank == 0:
        try:
            _check_model_state_dict(expected, dict(state_dict))
        except ValueError as caught:
            error = caught
    comm.raise_if_any_failed(error, ranks)
    by_fqn = (
        {fqn: state_dict[name] for name, (fqn, _) in expected.items() if fqn}
        if ranks.rank == 0
        else {}
    )
    for storage in state.storages:
        for shard, buffer in zip(storage.shards, storage.layout.buffers, strict=True):
            if tensor_parallel is not None:
                values = []
                for slot in buffer.params:
                    shape = whole_dims(tensor_parallel, slot.fqn, slot.shape)
                    whole = (
                        by_fqn[slot.fqn].to(shard.device, shard.dtype).contiguous()
                        if ranks.rank == 0
                        else shard.new_empty(shape)
                    )
                    comm.broadcast(whole, ranks)
                    values.append(tensor_parallel.piece(slot.fqn, whole))
                shard.copy_(flatten.shard_of(values, buffer, storage.shard_rank, shard))
                continue
            if ranks.rank == 0:
                values = [by_fqn[slot.fqn].to(shard.device, shard.dtype) for slot in buffer.params]
                flat = flatten.flatten(values, buffer)
            else:
                flat = shard.new_empty(buffer.padded_numel)
            comm.broadcast(flat, ranks)
            start, end = buffer.shard_range(storage.shard_rank)
            shard.copy_(flat[start:end])
    note_parameters_written()
    buffers = dict(model.named_buffers())
    for name, (fqn, _) in expected.items():
        if fqn is None and name in buffers:
            if ranks.rank == 0:
                buffers[name].copy_(state_dict[name])
            comm.broadcast(buffers[name].data, ranks)


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> ShardingState:
    state = sharding_state(model, "optimizer state dicts")
    groups = state.groups.groups
    if len(optimizer.param_groups) != len(groups):
        raise ValueError(
            f"The optimizer has {len(optimizer.param_groups)} param groups but the model was "
            f"sharded with {len(groups)}; build it from model.optimizer_groups()"
        )
    for group, resolved in zip(optimizer.param_groups, groups, strict=True):
        expected = state.shards_of_group(resolved.index)
        if [id(p) for p in group["params"]] != [id(p) for p in expected]:
            raise ValueError(
                f"Param group {resolved.index} of the optimizer does not hold the model's shards "
                "of that group; build the optimizer from model.optimizer_groups()"
            )
    return state


def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state in plain torch.optim format on the unsharded model, as torch's
    ``get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
    full_state_dict=True))`` gives it for the unsharded model: state keyed by parameter
    name, in original shapes; each param group lists its parameters' names and carries
    its current hyperparameters. Loads with ``set_optimizer_state_dict``, with
    ``gs.load_optim_state_dict`` and into a plain torch optimizer built with the same
    groups (``Optimizer.load_state_dict``). Collective; on every rank.
    """
    state = check_optimizer(model, optimizer)
    per_fqn: dict[str, dict[str, Any]] = {}
    whole_state = getattr(optimizer, "fqn_state", None)  # gs.optim.WholeParamOptimizer
    if whole_state is not None:  # state in original shapes, on owner ranks
        per_fqn = whole_state()
    for group in optimizer.param_groups if whole_state is None else ():
        for shard in group["params"]:
            segments = segments_of(shard)
            assert segments is not None
            entries = flatten.gather_shard_state(
                optimizer.state.get(shard, {}), shard, segments.buffer, segments.ranks,
                segments.replicated, segments.tensor_parallel,
            )  # fmt: skip
            per_fqn.update(zip(segments.fqns, entries, strict=True))
    groups = [
        (resolved.listed, {k: v for k, v in group.items() if k != "params"})
        for group, resolved in zip(optimizer.param_groups, state.groups.groups, strict=True)
    ]
    return plain_optimizer_state(groups, per_fqn, by_name=True)


def _keys_of(listed: list[str], saved: list[Any], index: int) -> dict[str, Any]:
    """Each parameter's key in a saved group: its name, or its number in the same order."""
    if saved and all(isinstance(key, str) for key in saved):
        if sorted(saved) != sorted(listed):
            missing = [n for n in listed if n not in saved]
            unexpected = [n for n in saved if n not in listed]
            raise ValueError(
                f"Param group {index} of the optimizer state dict differs from the model's: "
                f"missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
        return {name: name for name in listed}
    return dict(zip(listed, saved, strict=True))


def load_optim_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Load a plain torch.optim state dict (per original parameter) into the sharded optimizer:
    keyed by parameter name (``gs.optim_state_dict``, torch's full
    ``get_optimizer_state_dict``) or numbered (``Optimizer.state_dict()`` of a torch
    optimizer built with the same groups on the unsharded model)."""
    state = check_optimizer(model, optimizer)
    saved = state_dict["param_groups"]
    ours = [len(g.listed) for g in state.groups.groups]
    theirs = [len(g["params"]) for g in saved]
    if ours != theirs:
        raise ValueError(
            f"The optimizer state dict has {len(theirs)} param groups of sizes {theirs} but the "
            f"model's groups have sizes {ours}"
        )
    load_whole = getattr(optimizer, "load_fqn_state", None)  # gs.optim.WholeParamOptimizer
    whole_entries: dict[str, Any] = {}
    for group, saved_group, resolved in zip(
        optimizer.param_groups, saved, state.groups.groups, strict=True
    ):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
        index_of = _keys_of(resolved.listed, saved_group["params"], resolved.index)
        if load_whole is not None:
            whole_entries.update((f, state_dict["state"].get(i)) for f, i in index_of.items())
            continue
        for shard in group["params"]:
            segments = segments_of(shard)
            assert segments is not None
            entries = [state_dict["state"].get(index_of[fqn]) for fqn in segments.fqns]
            optimizer.state.pop(shard, None)
            if all(entry is None for entry in entries):
                continue
            if any(entry is None for entry in entries):
                absent = [f for f, e in zip(segments.fqns, entries, strict=True) if e is None]
                raise ValueError(
                    f"The optimizer state dict has no state for {absent} but has state for "
                    f"other parameters of param group {resolved.index}; expects all or none"
                )
            optimizer.state[shard] = flatten.shard_state_from(
                entries, shard, segments.buffer, segments.shard_rank, segments.tensor_parallel
            )
    if load_whole is not None:
        load_whole(whole_entries)
