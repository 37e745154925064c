"""Reading DCP checkpoint files without running anything they hold.

torch's ``FileSystemReader`` unpickles the ``.metadata`` file with plain ``pickle``, so a
crafted file runs code on every rank that loads it. Here the metadata goes through an
unpickler that builds only DCP's metadata classes (listed in ``_ALLOWED``), is checked
for the structure groupshard writes (tensors only, data files inside the checkpoint's
folder, pieces that cover each tensor exactly once), and tensor data is decoded only by
``torch.load(..., weights_only=True)``, whatever torch's own reader does in this
version. Every failure is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import importlib
import io
import math
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Any, NoReturn

import torch
from torch.distributed.checkpoint import FileSystemReader

# Private, and no public way around it: torch's FileSystemWriter pickles each data file's
# byte range as a _StorageInfo into .metadata, so the unpickler must build exactly that
# class (and _MEM_FORMAT_ENCODING, torch.serialization._get_layout below, which the
# pickle of TensorProperties refers to). Nothing here calls them; they are checked types.
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from groupshard.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from groupshard.checkpoint.planner import SafeLoadPlanner

METADATA_FILE = ".metadata"  # the name torch's FileSystemWriter gives it

# Everything a DCP metadata pickle of a tensor-only checkpoint refers to (torch 2.7 to 2.15),
# besides torch's dtypes, named as the pickle names them (private names included: see the
# import of _StorageInfo). All are plain records or value lookups: building them runs nothing.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size",),
}
# StorageMeta.checkpoint_id is the path the checkpoint was saved to: rebuilt as a pure path.
_PATHS = {"PosixPath": PurePosixPath, "PurePosixPath": PurePosixPath}
_PATHS |= {"WindowsPath": PureWindowsPath, "PureWindowsPath": PureWindowsPath}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes of ``_ALLOWED``, torch dtypes and pure paths."""

    def __init__(self, stream: IO[bytes], file: Path) -> None:
        super().__init__(stream)
        self._file = file

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        if module in ("pathlib", "pathlib._local") and name in _PATHS:
            return _PATHS[name]
        raise UnsafeCheckpointError(
            f"The checkpoint file {self._file} refers to {module}.{name}, which DCP metadata "
            "never holds: it was crafted or damaged, and is refused (nothing in it was run)"
        )


def short(error: BaseException) -> str:
    """An error in one line: its type and first line (DCP's and torch's run to kilobytes)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def read_metadata(directory: Path) -> Metadata:
    """The DCP metadata of the checkpoint in ``directory``, decoded safely and checked."""
    file = directory / METADATA_FILE
    try:
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream, file).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"The checkpoint file {file} is missing") from None
    except Exception as error:  # a damaged pickle fails in many ways; all mean the same
        raise CheckpointError(f"The checkpoint file {file} is damaged ({short(error)})") from None
    _check_metadata(metadata, file)
    return metadata


def _check_metadata(metadata: Any, file: Path) -> None:
    def fail(what: str) -> NoReturn:
        raise CheckpointError(f"The checkpoint file {file} is not what groupshard writes: {what}")

    if not isinstance(metadata, Metadata):
        fail(f"it holds a {type(metadata).__name__}, not DCP metadata")
    storage = metadata.storage_data
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(storage, dict):
        fail("its entries or their storage are not dicts")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            fail("its storage table holds other objects than DCP's")
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            fail(f"data file {name!r} is not a file of the checkpoint's folder")
        if not (_is_count(info.offset) and _is_count(info.length)):
            fail(f"entry {index.fqn!r} has an invalid byte range")
        if getattr(info, "transform_descriptors", None):
            fail(f"entry {index.fqn!r} is stored through stream transforms")
    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):  # a plain value, decoded weights-only
            if MetadataIndex(name) not in storage:
                fail(f"entry {name!r} has no data")
            continue
        if not isinstance(entry, TensorStorageMetadata):
            fail(f"entry {name!r} is a {type(entry).__name__}, not a tensor or a value")
        problem = _chunk_problem(name, entry, storage)
        if problem:
            fail(f"entry {name!r} {problem}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _chunk_problem(name: str, entry: TensorStorageMetadata, storage: dict) -> str | None:
    """Why the saved pieces of a tensor do not tile it exactly once (None if they do)."""
    size = entry.size
    properties = entry.properties
    if not isinstance(size, torch.Size) or not isinstance(properties, TensorProperties):
        return "has no valid size"
    if not isinstance(properties.dtype, torch.dtype):
        return "has no valid dtype"
    chunks = entry.chunks
    if not isinstance(chunks, list) or not chunks:
        return "has no pieces"
    for position, chunk in enumerate(chunks):
        if not (
            isinstance(chunk, ChunkStorageMetadata)
            and isinstance(chunk.offsets, torch.Size)
            and isinstance(chunk.sizes, torch.Size)
            and len(chunk.offsets) == len(chunk.sizes) == len(size)
        ):
            return "has a malformed piece"
        if any(
            o < 0 or n < 0 or o + n > s
            for o, n, s in zip(chunk.offsets, chunk.sizes, size, strict=True)
        ):
            return f"has a piece outside its size {list(size)}"
        if MetadataIndex(name, chunk.offsets, position) not in storage:
            return "has a piece with no data"
    return _tiling_problem(chunks, size)


def _tiling_problem(chunks: list[ChunkStorageMetadata], size: torch.Size) -> str | None:
    """Why blocks do not tile a tensor of ``size`` exactly once (None if they do): their
    volumes add up to its and no two overlap (a sweep along the first dimension)."""
    total = math.prod(size)
    if sum(math.prod(chunk.sizes) for chunk in chunks) != total:
        return "is saved in pieces that do not cover it once"
    if not size:
        return None if len(chunks) == 1 else "is saved in pieces that do not cover it once"
    ordered = sorted(chunks, key=lambda c: tuple(c.offsets))
    for position, chunk in enumerate(ordered):
        end = chunk.offsets[0] + chunk.sizes[0]
        for other in ordered[position + 1 :]:
            if other.offsets[0] >= end:
                break
            if (
                math.prod(chunk.sizes)
                and math.prod(other.sizes)
                and all(
                    o1 < o2 + n2 and o2 < o1 + n1
                    for o1, n1, o2, n2 in zip(
                        chunk.offsets, chunk.sizes, other.offsets, other.sizes, strict=True
                    )
                )
            ):
                return "has pieces that overlap"
    return None


def check_files(directory: Path, metadata: Metadata) -> None:
    """Raise a CheckpointError naming the first data file that is missing or too short."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name in sorted(needed):
        file = directory / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"The checkpoint file {file} is missing") from None
        except OSError as error:
            raise CheckpointError(f"Cannot read the checkpoint file {file}: {error}") from None
        if size < needed[name]:
            state = "empty" if size == 0 else f"truncated ({size} of {needed[name]} bytes)"
            raise CheckpointError(
                f"The checkpoint file {file} is {state}: the save or copy that wrote it "
                "did not finish"
            )


def check_entries(metadata: Metadata, sizes: Mapping[str, torch.Size], file: Path) -> None:
    """Every entry about to be read is in ``metadata`` with the size the loader expects."""
    problems = []
    for name, size in sizes.items():
        entry = metadata.state_dict_metadata.get(name)
        if entry is None:
            problems.append(f"{name!r} is missing")
        elif entry.size != size:
            problems.append(f"{name!r} has size {list(entry.size)}, not {list(size)}")
    if problems:
        raise CheckpointError(
            f"The checkpoint file {file} disagrees with the checkpoint's description "
            f"({len(problems)} entries): " + "; ".join(problems[:8])
        )


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The box ``[offsets, offsets + lengths)`` of ``tensor`` (a view)."""
    if len(offsets) != tensor.dim() or len(lengths) != tensor.dim():
        raise ValueError(f"a {tensor.dim()}-d tensor narrowed in {len(offsets)} dimensions")
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _refusal(error: BaseException) -> str:
    """What torch's weights-only unpickler refused, in one line (else the error's first)."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:
        lines = [line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()]
        if lines:
            return lines[0].split(". ", 1)[0][:300]
    return short(error)


class _Window(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of an open file, as a file of their own: the
    tensor decoder reads a storage straight into its tensor, with no copy of the item's
    bytes beside it (a load's peak memory stays one block, not two)."""

    def __init__(self, stream: IO[bytes], offset: int, length: int) -> None:
        self._stream, self._offset, self._length, self._position = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = min(max(0, base + position), self._length)
        return self._position

    def readinto(self, buffer: Any) -> int:
        wanted = min(len(memoryview(buffer)), self._length - self._position)
        if wanted <= 0:
            return 0
        self._stream.seek(self._offset + self._position)
        got = self._stream.readinto(memoryview(buffer)[:wanted])  # type: ignore[attr-defined]
        self._position += got or 0
        return got or 0


def _decode_tensor(data: bytes | IO[bytes], file: Path, name: str) -> torch.Tensor:
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        value = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as error:
        refusal = _refusal(error)
        if "Unsupported global" in refusal:  # a pickle that would call something: crafted
            raise UnsafeCheckpointError(
                f"The checkpoint file {file} holds, for entry {name!r}, a pickle that is not a "
                f"plain tensor; refused, nothing in it was run ({refusal})"
            ) from None
        raise CheckpointError(
            f"The checkpoint file {file} is damaged at entry {name!r} ({refusal})"
        ) from None
    if not isinstance(value, torch.Tensor):
        raise UnsafeCheckpointError(
            f"The checkpoint file {file} holds a {type(value).__name__} for entry {name!r}, "
            "not a tensor"
        )
    return value


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader, with metadata decoded by :func:`read_metadata` beforehand
    and tensor data only by ``torch.load(..., weights_only=True)``; anything else is refused.
    """

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__(directory)
        self._directory = Path(directory)
        self._metadata = metadata
        self._piece_sizes = {
            (name, tuple(chunk.offsets)): chunk.sizes
            for name, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
            for chunk in entry.chunks
        }

    # No **kwargs: DCP then never falls back to the (pickled) rank-local __{rank}.metadata.
    def read_metadata(self) -> Metadata:  # type: ignore[override]
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage = self._metadata.storage_data
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR and not isinstance(planner, SafeLoadPlanner):
                raise UnsafeCheckpointError(
                    f"The checkpoint in {self._directory} asks to unpickle a non-tensor entry "
                    f"{item.dest_index.fqn!r} through a planner that would run it; refused"
                )
            per_file.setdefault(storage[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            file = self._directory / name
            try:
                stream = open(file, "rb")  # noqa: SIM115 - closed by the with below
            except OSError as error:
                raise CheckpointError(f"Cannot read the checkpoint file {file}: {error}") from None
            with stream:
                for item in sorted(items, key=lambda i: storage[i.storage_index].offset):
                    self._read_item(stream, file, storage[item.storage_index], item, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(
        self, stream: IO[bytes], file: Path, info: Any, item: Any, planner: LoadPlanner
    ) -> None:
        name = item.storage_index.fqn
        if file.stat().st_size < info.offset + info.length:
            raise CheckpointError(f"The checkpoint file {file} is truncated (entry {name!r})")
        if item.type == LoadItemType.BYTE_IO:  # decoded weights-only (SafeLoadPlanner)
            stream.seek(info.offset)
            planner.load_bytes(item, io.BytesIO(stream.read(info.length)))
            return
        saved = _decode_tensor(_Window(stream, info.offset, info.length), file, name)
        expected = self._piece_sizes[(name, tuple(item.storage_index.offset))]
        if saved.size() != expected:
            raise CheckpointError(
                f"The checkpoint file {file} holds a tensor of size {list(saved.size())} for "
                f"entry {name!r}, not {list(expected)}"
            )
        try:
            piece = _narrow(saved, item.storage_offsets, item.lengths)
        except Exception as error:
            raise CheckpointError(
                f"The checkpoint file {file} holds a tensor of the wrong shape for entry "
                f"{name!r} ({short(error)})"
            ) from None
        target = planner.resolve_tensor(item).detach()
        if target.size() != piece.size():
            raise CheckpointError(
                f"The checkpoint file {file} holds {list(piece.size())} elements for entry "
                f"{name!r} where {list(target.size())} were expected"
            )
        target.copy_(piece)
        planner.commit_tensor(item, target)
