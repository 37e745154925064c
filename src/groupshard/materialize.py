"""Give a model built on the meta device real parameters, one unit at a time.

``gs.shard`` calls ``materialize_unit`` for each unit of a meta-built model just before
sharding it: the unit's parameters (and its modules' buffers) are allocated on the
target device, initialized, sharded, and freed, so a rank never holds more than its
shards plus one unit's full parameters.

Initialization of each module that directly holds parameters or buffers: its
``reset_parameters()`` if it has one, then ``param_init_fn(module)`` if given (a module
with neither is an error: its memory would be uninitialized). The random stream is
seeded per module, from ``torch.initial_seed()`` (what ``torch.manual_seed`` set) and
the module's name: the model does not depend on the world size, the units chosen, or
the order modules are initialized in.

With ``sync_module_states`` (the default) every rank starts from rank 0's initial seed
(``agreed_seed``), so a deterministic initialization gives every rank the same unit
already: instead of broadcasting it from rank 0, the ranks compare a checksum of its
bits (``same_on_every_rank``: one all-reduce of four numbers per unit), and only a unit
whose checksums differ (an initialization drawing from another random source, or
reading the rank) is broadcast from rank 0, as ``sync_module_states`` promises: every
rank ends with rank 0's values.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from groupshard import comm
from groupshard.layout import StorageLayout
from groupshard.tensor_parallel import TensorParallelism
from groupshard.units import UnitPlan, enclosing_unit

ParamInitFn = Callable[[nn.Module], None]


def meta_parameters(params: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the parameters on the meta device; all of them or none, else an error."""
    meta = [name for name, p in params.items() if p.is_meta]
    if meta and len(meta) != len(params):
        real = [name for name, p in params.items() if not p.is_meta]
        raise ValueError(
            f"Parameters {meta[:4]} are on the meta device but {real[:4]} are not; build the "
            "whole model under torch.device('meta') (gs.shard then initializes it unit by "
            "unit) or none of it."
        )
    return meta


def _load_libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _load_libc() if sys.platform.startswith("linux") else None


def release_free_memory() -> None:
    """Give the freed memory of a built unit back to the operating system.

    glibc serves allocations of a few MB from its heap once such blocks have been freed
    (its mmap threshold rises up to 32 MB), and the holes the unit temporaries leave
    between the shards stay resident: without this, a rank's RSS grows by about one
    unit per unit built, as if it kept the whole model.
    """
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def check_initializable(model: nn.Module, param_init_fn: ParamInitFn | None) -> None:
    """Fail before anything is built if a module holding parameters or buffers would stay
    uninitialized (no ``reset_parameters()`` and no ``param_init_fn``)."""
    if param_init_fn is not None:
        return
    for name, module in model.named_modules():
        holds = any(
            t is not None for t in (*module._parameters.values(), *module._buffers.values())
        )
        if holds and getattr(module, "reset_parameters", None) is None:
            raise ValueError(
                f"Module {name or '<root>'!r} ({type(module).__name__}) was built on the meta "
                "device and has no reset_parameters(): pass gs.shard(..., param_init_fn=f) "
                "with f(module) initializing its parameters and buffers."
            )


def module_seed(base_seed: int, module_name: str) -> int:
    """The seed of one module's initialization: the same on every rank and world size."""
    return (base_seed + zlib.crc32(module_name.encode())) % 2**63


def agreed_seed(seed: int, ranks: comm.Ranks, device: torch.device) -> int:
    """Rank 0's ``seed`` on every rank (one broadcast), reduced modulo 2**63 as
    ``module_seed`` does, so the per-module seeds are rank 0's."""
    value = torch.tensor([seed % 2**63], dtype=torch.int64, device=device)
    comm.broadcast(value, ranks)
    return int(value.item())


CHECKSUM_CHUNKS = 64


def checksum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Two int64 numbers summing up the tensors' bits: their bytes read as 64-bit words and
    added (wrapping), plain and weighted by the word's place among 64 equal chunks.

    Integer sums are exact whatever the reduction order, and one pass over the memory
    costs far less than initializing it (a float sum would round differently with the
    thread count). Any single changed word changes the plain sum, and two tensors that
    trade places (with different sums) change the weighted one; it is a checksum to
    catch ranks that initialized differently, not a cryptographic hash.
    """
    device = tensors[0].device if tensors else None
    total = torch.zeros(2, dtype=torch.int64, device=device)
    weights = torch.arange(1, CHECKSUM_CHUNKS + 1, dtype=torch.int64, device=device)
    for position, tensor in enumerate(tensors):
        raw = tensor.detach().reshape(-1).view(torch.uint8)
        if raw.storage_offset() % 8:
            raw = raw.clone()  # 64-bit words need 8-byte alignment
        whole = raw.numel() // 8 * 8
        words = raw[:whole].view(torch.int64)
        chunked = words.numel() // CHECKSUM_CHUNKS * CHECKSUM_CHUNKS
        chunks = words[:chunked].view(CHECKSUM_CHUNKS, chunked // CHECKSUM_CHUNKS).sum(1)
        rest = words[chunked:].sum() + raw[whole:].to(torch.int64).sum()
        plain = chunks.sum() + rest
        total[0] += plain
        # the tensor's place in the list counts too: swapped tensors are a difference
        total[1] += (chunks * weights).sum() + rest * (CHECKSUM_CHUNKS + 1) + plain * position
    return total


def same_on_every_rank(tensors: Sequence[torch.Tensor], ranks: comm.Ranks) -> bool:
    """Whether every rank's ``tensors`` have the same ``checksum`` (one all-reduce; the
    same answer on every rank). Nothing to compare (a unit owning no parameters and no
    buffers, the same on every rank) needs no collective."""
    if ranks.size == 1 or not tensors:
        return True
    mine = checksum(tensors)
    # the largest checksum, and the largest of their bitwise complements (~x = -x - 1,
    # which reverses the order without overflow): the smallest
    extremes = torch.cat([mine, torch.bitwise_not(mine)])
    comm.all_reduce_max(extremes, ranks)
    return torch.equal(extremes[:2], torch.bitwise_not(extremes[2:]))


def _modules_of_unit(
    model: nn.Module, plan: UnitPlan, unit_name: str
) -> list[tuple[str, nn.Module]]:
    units = set(plan.names)
    return [
        (name, module)
        for name, module in model.named_modules()
        if enclosing_unit(name, units) == unit_name
    ]


def materialize_unit(
    model: nn.Module,
    plan: UnitPlan,
    params: dict[str, nn.Parameter],
    layouts: dict[str, list[StorageLayout]],
    unit_name: str,
    device: torch.device,
    param_init_fn: ParamInitFn | None,
    base_seed: int,
    tensor_parallel: TensorParallelism | None = None,
) -> tuple[list[torch.Tensor], dict[torch.dtype, torch.Tensor]]:
    """Allocate and initialize the parameters the unit owns and its modules' buffers.

    Returns the buffers (to broadcast when ranks sync module states) and, per dtype, the
    storage's flat buffers end to end, of which the new parameters are views: so the
    unit's full parameters take one allocation per dtype and no copy before sharding.
    A meta tensor cannot take real data, so each parameter is replaced by a new
    ``nn.Parameter`` in every module that registers it and in ``params`` (by FQN).
    Under tensor parallelism the flat buffers hold local pieces. The modules get each
    tensor-parallel parameter whole, as the plain model holds it, for the initialization
    (per-module seeds, as for any unit), and each rank keeps its piece: the values do not
    depend on the tp size, as they do not on the world size, at the cost of one unit's
    whole parameters while it is built. (Initializing DTensors in place would draw each
    piece from the same seeded stream on CPU, where torch has no DTensor RNG: tp peers
    would start with equal pieces.)
    """
    modules = dict(model.named_modules())
    owned = [fqn for fqn, owner in plan.owner.items() if owner == unit_name]
    flats: dict[torch.dtype, torch.Tensor] = {}
    registered: dict[str, nn.Parameter] = {}  # what the modules hold, by FQN
    pieces: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # TP: (FQN, piece, whole)
    for layout in layouts[unit_name]:
        flat = torch.zeros(
            sum(b.padded_numel for b in layout.buffers), dtype=layout.dtype, device=device
        )
        flats[layout.dtype] = flat
        offset = 0
        for buffer in layout.buffers:
            for slot in buffer.params:
                old = params[slot.fqn]
                start = offset + slot.offset
                new = nn.Parameter(
                    flat[start : start + slot.numel].view(slot.shape),
                    requires_grad=old.requires_grad,
                )
                params[slot.fqn] = new
                if tensor_parallel is not None and slot.fqn in tensor_parallel.params:
                    shape = tensor_parallel.params[slot.fqn].shape
                    whole = torch.empty(shape, dtype=layout.dtype, device=device)
                    new = nn.Parameter(whole, requires_grad=old.requires_grad)
                    pieces.append((slot.fqn, params[slot.fqn].detach(), whole))
                registered[slot.fqn] = new
                for module_name, attr in plan.registrations[slot.fqn]:
                    modules[module_name]._parameters[attr] = new
            offset += buffer.padded_numel
    fresh = {id(registered[fqn]) for fqn in owned}
    buffers: list[torch.Tensor] = []
    for module_name, module in _modules_of_unit(model, plan, unit_name):
        materialized = False  # a tied parameter is initialized by its first module
        for param in module._parameters.values():
            if param is not None and id(param) in fresh:
                fresh.discard(id(param))
                materialized = True
        for attr, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[attr] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
                materialized = True
        if not materialized:
            continue
        buffers.extend(b for b in module._buffers.values() if b is not None)
        reset = getattr(module, "reset_parameters", None)
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(module_seed(base_seed, module_name))
            if reset is not None:
                reset()
            if param_init_fn is not None:
                param_init_fn(module)
    assert tensor_parallel is not None or not pieces
    for fqn, piece, whole in pieces:
        piece.copy_(tensor_parallel.piece(fqn, whole))
    return buffers, flats
