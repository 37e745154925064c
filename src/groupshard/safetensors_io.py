"""Pretrained weights in safetensors files (Hugging Face's format), straight into shards.

``load_safetensors`` reads, on each rank, only the rows of each tensor that overlap the
rank's shards (``safe_open(...).get_slice``): never a whole file, and per parameter at
most one row beyond its piece at each end. ``save_safetensors`` writes the unsharded
model unit by unit: every rank takes part in each unit's all-gather, rank 0 appends the
unit's tensors to the file, so no rank ever holds more than one unit's full parameters.
Nothing is unpickled: safetensors is a JSON header and raw bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from groupshard import comm
from groupshard.layout import Box
from groupshard.sharding import sharding_state
from groupshard.tensor_parallel import local_region, whole_dims, whole_tensor
from groupshard.writes import note_parameters_written

INDEX_FILE = "model.safetensors.index.json"
DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as error:  # a dependency of groupshard; a broken install otherwise
        raise ImportError("Reading safetensors files needs `pip install safetensors`") from error
    return safe_open


def tensor_files(path: Path) -> dict[str, Path]:
    """Which file holds each tensor: one ``.safetensors`` file, or a folder with
    ``model.safetensors.index.json`` (a sharded checkpoint) or ``.safetensors`` files."""
    if path.is_file():
        files = [path]
    elif (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    elif path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path} holds no .safetensors file")
    else:
        raise ValueError(f"{path} is not a .safetensors file or a folder holding them")
    safe_open = _safe_open()
    sources: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                sources[name] = file
    return sources


class _Reader:
    """Open files on demand; count the bytes read."""

    def __init__(self, sources: dict[str, Path], stack: ExitStack) -> None:
        self.sources = sources
        self.stack = stack
        self.handles: dict[Path, Any] = {}
        self.bytes_read = 0

    def handle(self, name: str) -> Any:
        file = self.sources[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(_safe_open()(str(file), framework="pt"))
        return self.handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handle(name).get_slice(name).get_shape())

    def flat_range(
        self, name: str, first: int, last: int, region: Box | None = None
    ) -> torch.Tensor:
        """Elements ``first:last`` of the flattened tensor ``name``, reading whole rows; or,
        given a ``region`` (a tensor-parallel rank's block of it), of the flattened block,
        reading its rows only."""
        shape = self.shape(name)
        if len(shape) == 0:
            values = self.handle(name).get_tensor(name).reshape(-1)
            self.bytes_read += values.numel() * values.element_size()
            return values[first:last]
        origin, sizes = region or ((0,) * len(shape), shape)
        row = math.prod(sizes[1:])
        first_row, end_row = first // row, -(-last // row)
        index = (
            slice(origin[0] + first_row, origin[0] + end_row),
            *(slice(at, at + size) for at, size in zip(origin[1:], sizes[1:], strict=True)),
        )
        rows = self.handle(name).get_slice(name)[index]
        self.bytes_read += rows.numel() * rows.element_size()
        start = first - first_row * row
        return rows.reshape(-1)[start : start + last - first]


def _names(model: nn.Module) -> tuple[dict[str, list[str]], dict[str, torch.Tensor]]:
    """Per parameter FQN its names (tied ones have several); the persistent buffers."""
    state = model.groupshard
    names = {
        fqn: [f"{module}.{attr}" if module else attr for module, attr in places]
        for fqn, places in state.plan.registrations.items()
    }
    buffers = {
        name: tensor
        for name, tensor in nn.Module.state_dict(model, keep_vars=True).items()
        if not isinstance(tensor, nn.Parameter)
    }
    return names, buffers


def _plan_reads(model: nn.Module, reader: _Reader) -> tuple[dict[str, str], list[str]]:
    """The file's name for each parameter FQN, and what does not match (names, shapes)."""
    names, buffers = _names(model)
    shapes = {
        slot.fqn: whole_dims(model.groupshard.tensor_parallel, slot.fqn, slot.shape)
        for storage in model.groupshard.storages
        for buffer in storage.layout.buffers
        for slot in buffer.params
    }
    chosen: dict[str, str] = {}
    problems: list[str] = []
    missing = []
    for fqn, candidates in names.items():
        present = [name for name in candidates if name in reader.sources]
        if not present:
            missing.append(candidates[0])
            continue
        chosen[fqn] = present[0]
        found = reader.shape(present[0])
        if found != shapes[fqn]:
            problems.append(f"{present[0]} has shape {list(found)}, expects {list(shapes[fqn])}")
    for name, tensor in buffers.items():
        if name in reader.sources and reader.shape(name) != tuple(tensor.shape):
            problems.append(
                f"{name} has shape {list(reader.shape(name))}, expects {list(tensor.shape)}"
            )
    known = {name for candidates in names.values() for name in candidates} | set(buffers)
    unexpected = sorted(name for name in reader.sources if name not in known)
    if missing:
        problems.insert(0, f"{len(missing)} missing parameters: {missing[:8]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected entries: {unexpected[:8]}")
    return chosen, problems


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | os.PathLike) -> int:
    """Read each rank's slices of a safetensors checkpoint into its shards (and the
    persistent buffers the file holds into the model); returns the bytes this rank read.

    Every parameter must be in the file (under any of its names, for tied ones) with its
    shape; an entry the model does not have is an error, on every rank.
    """
    state = sharding_state(model, "load_safetensors")
    tensor_parallel = state.tensor_parallel
    error: BaseException | None = None
    bytes_read = 0
    try:
        with ExitStack() as stack:
            reader = _Reader(tensor_files(Path(path)), stack)
            chosen, problems = _plan_reads(model, reader)
            if problems:
                raise ValueError(f"{path} does not match the model: " + "; ".join(problems))
            for storage in state.storages:
                for index, buffer in enumerate(storage.layout.buffers):
                    local_start, _ = storage.layout.local_range(index)
                    start, end = buffer.shard_range(storage.shard_rank)
                    for slot in buffer.params:
                        first = max(slot.offset, start)
                        last = min(slot.offset + slot.numel, end)
                        if last <= first:
                            continue
                        # under tensor parallelism: the local piece's block
                        region = local_region(tensor_parallel, slot.fqn, slot.shape)
                        values = reader.flat_range(
                            chosen[slot.fqn], first - slot.offset, last - slot.offset, region
                        )
                        target = storage.local[
                            local_start + first - start : local_start + last - start
                        ]
                        target.copy_(values)
            for name, tensor in _names(model)[1].items():
                if name in reader.sources:
                    tensor.copy_(reader.handle(name).get_tensor(name))
            bytes_read = reader.bytes_read
    except Exception as caught:  # every rank must hear of any failure
        error = caught
    comm.raise_if_any_failed(error, state.model_ranks)
    note_parameters_written()
    return bytes_read



def _entries(model: nn.Module) -> Iterator[tuple[str, torch.Size, torch.dtype]]:
    """What the file holds, in file order: each parameter once (under its FQN), in unit
    and layout order, then the persistent buffers."""
    tensor_parallel = model.groupshard.tensor_parallel
    for storage in model.groupshard.storages:
        for buffer in storage.layout.buffers:
            for slot in buffer.params:
                shape = whole_dims(tensor_parallel, slot.fqn, slot.shape)
                yield slot.fqn, torch.Size(shape), storage.layout.dtype
    for name, tensor in _names(model)[1].items():
        yield name, tensor.shape, tensor.dtype


def _header(model: nn.Module) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in _entries(model):
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {
            "dtype": DTYPE_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(encoded)) + encoded


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()


class _Writer:
    """Rank 0's file; the first error stops the writing (the ranks still gather every
    unit, so none waits in a collective) and is raised on every rank at the end."""

    def __init__(self, temporary: Path, model: nn.Module) -> None:
        self.temporary = temporary
        self.error: BaseException | None = None
        self.file: Any = None
        self.write(lambda: setattr(self, "file", open(temporary, "wb")))  # noqa: SIM115
        self.write(lambda: self.file.write(_header(model)))

    def write(self, action: Any) -> None:
        if self.error is not None:
            return
        try:
            action()
        except Exception as caught:
            self.error = caught

    def close(self, path: str | os.PathLike) -> BaseException | None:
        def finish() -> None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.temporary, path)

        self.write(finish)
        if self.error is not None:
            if self.file is not None:
                self.file.close()
            self.temporary.unlink(missing_ok=True)
        return self.error


@torch.no_grad()
def save_safetensors(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the unsharded model to one safetensors file (parameters under their FQNs,
    tied ones once, and the persistent buffers), unit by unit. A collective: every rank
    calls it; rank 0 writes ``path`` (atomically: a temporary file renamed at the end)."""
    state = sharding_state(model, "save_safetensors")
    tensor_parallel, ranks = state.tensor_parallel, state.model_ranks
    writer = _Writer(Path(f"{path}.tmp{os.getpid()}"), model) if ranks.rank == 0 else None
    for storage in state.storages:
        params = storage.gather_params()  # one unit's parameters at a time
        for buffer in storage.layout.buffers:
            for slot in buffer.params:
                tensor = whole_tensor(tensor_parallel, slot.fqn, params[slot.fqn])
                if writer is not None:
                    writer.write(lambda tensor=tensor: writer.file.write(_raw(tensor)))
        del params
    error = None
    if writer is not None:
        for tensor in _names(model)[1].values():
            writer.write(lambda tensor=tensor: writer.file.write(_raw(tensor)))
        error = writer.close(path)
    comm.raise_if_any_failed(error, ranks)
