"""Convert between per-parameter tensors and a rank's slice of a flat buffer.

Used for parameters and for optimizer state alike, by the ZeRO optimizer, the state-dict
functions and checkpoints: per-element state (``exp_avg``, momentum buffers...) is laid out
like its parameter, so it shards with the same layout; scalar state (``step``) is one value
shared by every parameter of a slice. ``plain_optimizer_state`` assembles per-parameter
state into torch.optim's state-dict format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from groupshard import comm
from groupshard.layout import FlatBufferLayout
from groupshard.tensor_parallel import TensorParallelism

SCALAR_STATE = ("step", "mu_product")
"""State keys of torch optimizers holding one value per parameter, not one per element."""


def flatten(tensors: list[torch.Tensor], buffer: FlatBufferLayout) -> torch.Tensor:
    """The unsharded flat buffer: ``tensors`` end to end, zero-padded."""
    padding = tensors[0].new_zeros(buffer.padding_numel)
    return torch.cat([t.reshape(-1) for t in tensors] + [padding])


def split(flat: torch.Tensor, buffer: FlatBufferLayout) -> list[torch.Tensor]:
    """Views of an unsharded flat buffer, one per parameter, in their shapes."""
    pieces = flat.split(buffer.split_sizes)[:-1]
    return [piece.view(slot.shape) for piece, slot in zip(pieces, buffer.params, strict=True)]


def shard_of(
    tensors: list[torch.Tensor], buffer: FlatBufferLayout, shard_rank: int, like: torch.Tensor
) -> torch.Tensor:
    """``shard_rank``'s slice of the flat buffer of ``tensors``, on the device/dtype of ``like``."""
    start, end = buffer.shard_range(shard_rank)
    flat = flatten([t.to(like.device, like.dtype) for t in tensors], buffer)
    return flat[start:end].clone()


def unshard(
    shard: torch.Tensor, buffer: FlatBufferLayout, ranks: comm.Ranks, replicated: bool
) -> torch.Tensor:
    """The whole padded flat buffer from every rank's slice (one all-gather)."""
    if replicated:
        return shard.detach().clone()
    flat = shard.new_empty(buffer.padded_numel)
    comm.all_gather(flat, shard.detach().contiguous(), ranks)
    return flat


def is_per_element(value: Any, shard: torch.Tensor) -> bool:
    """Whether a shard's state value is laid out like the shard (vs a scalar such as step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape


def is_per_parameter(key: str, values: list[Any], shapes: list[torch.Size]) -> bool:
    """Whether saved per-parameter state values are shaped like their parameters.

    For 0-d parameters shapes cannot tell, so the known scalar keys decide.
    """
    if not all(
        isinstance(v, torch.Tensor) and v.shape == s for v, s in zip(values, shapes, strict=True)
    ):
        return False
    return any(len(s) > 0 for s in shapes) or key not in SCALAR_STATE


def gather_shard_state(
    state: dict[str, Any],
    shard: torch.Tensor,
    buffer: FlatBufferLayout,
    ranks: comm.Ranks,
    replicated: bool,
    tensor_parallel: TensorParallelism | None = None,
) -> list[dict[str, Any]]:
    """One shard's optimizer state as per-parameter dicts (original shapes); collective.
    Under tensor parallelism the buffer holds local pieces: their state is made whole over
    tp too."""
    per_param: list[dict[str, Any]] = [{} for _ in buffer.params]
    for key, value in sorted(state.items()):
        if is_per_element(value, shard):
            full = unshard(value, buffer, ranks, replicated)
            for entry, piece in zip(per_param, split(full, buffer), strict=True):
                entry[key] = piece.clone()
        else:
            for entry in per_param:
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
    if tensor_parallel is not None:
        per_param = [
            tensor_parallel.whole_state(slot.fqn, slot.shape, entry)
            for slot, entry in zip(buffer.params, per_param, strict=True)
        ]
    return per_param


def _comparable(value: Any) -> float | None:
    """A scalar state value as a number to compare, or None where it is not one."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


def check_one_scalar(key: str, values: list[Any], buffer: FlatBufferLayout) -> None:
    """Fail, naming the parameters, if they hold different values of a scalar state key
    (e.g. Adam's ``step``): their flat buffer keeps one, so loading would change it."""
    numbers = [_comparable(value) for value in values]
    if any(number is None for number in numbers) or len({repr(n) for n in numbers}) < 2:
        return
    names_by_value: dict[str, list[str]] = {}
    for slot, number in zip(buffer.params, numbers, strict=True):
        names_by_value.setdefault(repr(number), []).append(slot.fqn)
    listed = "; ".join(
        f"{value} for {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if names[3:] else "")
        for value, names in names_by_value.items()
    )
    raise ValueError(
        f"Optimizer state {key!r} differs between parameters that share one flat buffer "
        f"({listed}); a flat buffer and its slices keep one {key!r} for all their parameters, "
        "so loading would silently change it. Load this state dict into a plain torch.optim "
        "optimizer, or put these parameters in separate param groups (or, for "
        "gs.ZeroRedundancyOptimizer, separate buckets with a smaller max_slice_numel)."
    )


def shard_state_from(
    entries: list[dict[str, Any]],
    shard: torch.Tensor,
    buffer: FlatBufferLayout,
    shard_rank: int,
    tensor_parallel: TensorParallelism | None = None,
) -> dict[str, Any]:
    """A shard's optimizer state from per-parameter dicts (of whole parameters: under
    tensor parallelism each rank takes its pieces).

    A scalar state value (``step``) must be the same for every parameter of the buffer:
    a ValueError names the parameters otherwise (the same on every rank).
    """
    if tensor_parallel is not None:
        entries = [
            tensor_parallel.local_state(slot.fqn, entry)
            for slot, entry in zip(buffer.params, entries, strict=True)
        ]
    shapes = [torch.Size(slot.shape) for slot in buffer.params]
    state: dict[str, Any] = {}
    for key, first in entries[0].items():
        values = [entry[key] for entry in entries]
        if is_per_parameter(key, values, shapes):
            state[key] = shard_of(values, buffer, shard_rank, shard)
        else:
            check_one_scalar(key, values, buffer)
            state[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return state


def plain_optimizer_state(
    groups: list[tuple[Sequence[str], dict[str, Any]]],
    per_fqn: Mapping[str, dict[str, Any]],
    by_name: bool = False,
) -> dict[str, Any]:
    """torch.optim's state-dict format from ``(listed FQNs, hyperparameters)`` per group and
    each parameter's state: parameters are numbered across groups in the listed order, as
    a torch optimizer built with those groups numbers them (``by_name``: keyed by their
    names instead, as torch's ``get_optimizer_state_dict`` keys them); ones without state
    are left out. Either form loads into a torch optimizer built with those groups
    (``Optimizer.load_state_dict`` pairs the listed keys with its parameters in order).
    """
    result: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    for listed, hyperparameters in groups:
        keys: list[Any] = list(listed) if by_name else list(range(index, index + len(listed)))
        for key, fqn in zip(keys, listed, strict=True):
            if per_fqn.get(fqn):
                result["state"][key] = per_fqn[fqn]
        result["param_groups"].append({**hyperparameters, "params": keys})
        index += len(keys)
    return result
