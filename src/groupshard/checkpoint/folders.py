"""Where a checkpoint lives on disk: its description file, atomic replacement, leftovers.

A save writes ``<path>.tmp-<serial>-<id>`` and then swaps it in for ``path`` (moving the
previous checkpoint to ``<path>.old-<serial>-<id>`` and deleting it afterwards). A
crash can leave such folders behind; a checkpoint is complete when its description
file (``groupshard.json``, written last and atomically) is there. The description
records a save counter, ``serial``, so the newest complete checkpoint is found by
content, never by the order of random folder names; a finished save removes the
leftovers.

A write that fails for want of space raises the OSError itself (``FileWriter``), so that
``save`` can say so (:class:`NoSpaceError`) rather than pass on torch's "unexpected pos".
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from groupshard.checkpoint.errors import CheckpointError

META_FILE = "groupshard.json"
FORMAT = "groupshard-checkpoint-2"
FIRST_FORMAT = "groupshard-checkpoint-1"  # every entry 1-D: read by ``convert`` only
_TEMPORARY, _PREVIOUS = ".tmp-", ".old-"
# What every description holds (the loader relies on them); "serial" is absent in older ones.
_REQUIRED = {"params": dict, "buffers": dict, "extra": dict, "extra_tensors": dict}
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full device, a full quota


def read_meta(directory: Path) -> dict[str, Any]:
    """The description of the checkpoint in ``directory``; CheckpointError if unreadable."""
    file = directory / META_FILE
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"The checkpoint file {file} is missing") from None
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError included
        raise CheckpointError(f"The checkpoint file {file} is damaged ({error})") from None
    if isinstance(meta, dict) and meta.get("format") == FIRST_FORMAT:
        raise CheckpointError(
            f"{file} describes a checkpoint in groupshard's first layout (every tensor 1-D), "
            "which this version reads only to convert it: python -m groupshard.checkpoint "
            f"convert {directory} NEW_FOLDER"
        )
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{file} does not describe a {FORMAT} checkpoint (format {found!r})")
    for key, kind in _REQUIRED.items():
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"The checkpoint file {file} is damaged (no valid {key!r})")
    serial = meta.setdefault("serial", 0)
    if not isinstance(serial, int) or isinstance(serial, bool):
        raise CheckpointError(f"The checkpoint file {file} is damaged (no valid 'serial')")
    return meta


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Write the description last and atomically: once it is there, the checkpoint is complete."""
    partial = directory / f"{META_FILE}.partial"
    with open(partial, "w", encoding="utf-8") as stream:
        json.dump(meta, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(partial, directory / META_FILE)


def _leftovers(path: Path) -> list[Path]:
    prefixes = (f"{path.name}{_TEMPORARY}", f"{path.name}{_PREVIOUS}")
    try:
        names = os.listdir(path.parent)
    except FileNotFoundError:
        return []
    return sorted(path.parent / name for name in names if name.startswith(prefixes))


def _complete(path: Path) -> list[tuple[tuple[int, bool, str], Path, dict[str, Any] | None]]:
    """Each folder at ``path`` or left by an interrupted save there that has a description,
    with its sort key (newest last) and description (None if unreadable)."""
    found = []
    for folder in [path, *_leftovers(path)]:
        if not (folder / META_FILE).is_file():
            continue
        try:
            meta: dict[str, Any] | None = read_meta(folder)
        except CheckpointError:
            meta = None
        serial = -1 if meta is None else meta["serial"]
        found.append(((serial, folder == path, folder.name), folder, meta))
    return found


def newest(path: Path) -> tuple[Path, dict[str, Any] | None]:
    """The newest complete checkpoint saved at ``path`` (it may be a leftover of a save that
    was interrupted after writing it), and its description; or ``path`` and None if it is
    a folder written by another system with torch's idiom (DCP metadata, no description).

    FileNotFoundError if there is none; CheckpointError if ``path``'s description is damaged.
    """
    found = _complete(path)
    if not found and (path / ".metadata").is_file():
        return path, None
    if any(folder == path and meta is None for _, folder, meta in found):
        read_meta(path)  # raises, naming the damage
    readable = [(key, folder, meta) for key, folder, meta in found if meta is not None]
    if not readable:
        raise FileNotFoundError(
            f"No checkpoint at {str(path)!r} (neither {META_FILE} nor DCP's .metadata)"
        )
    _, folder, meta = max(readable, key=lambda entry: entry[0])
    assert meta is not None
    return folder, meta


def next_serial(path: Path) -> int:
    """The save counter for the next checkpoint at ``path``: after every complete one."""
    return 1 + max([0, *(key[0] for key, _, _ in _complete(path))])


def temporary_name(path: Path, serial: int) -> Path:
    return path.with_name(f"{path.name}{_TEMPORARY}{serial:06d}-{uuid.uuid4().hex[:8]}")


def replace(temporary: Path, path: Path, serial: int) -> None:
    """Put the finished checkpoint at ``path``, then delete the previous one and every
    leftover of interrupted saves (all older than it)."""
    if path.exists():
        previous = path.with_name(f"{path.name}{_PREVIOUS}{serial:06d}-{uuid.uuid4().hex[:8]}")
        os.replace(path, previous)
    os.replace(temporary, path)
    for leftover in _leftovers(path):
        shutil.rmtree(leftover, ignore_errors=True)


def size(path: Path) -> int:
    """The bytes of the newest complete checkpoint at ``path`` (0 if there is none)."""
    try:
        folder, _ = newest(path)
        return sum(file.stat().st_size for file in folder.iterdir() if file.is_file())
    except (OSError, CheckpointError):
        return 0


def free_bytes(folder: Path) -> int:
    """The bytes this user may still write on ``folder``'s device."""
    return shutil.disk_usage(folder).free


def os_error_in(error: BaseException | None) -> OSError | None:
    """The OSError (with an errno) that ``error`` is or was raised from, if any. torch.save
    reports a failed write as a RuntimeError ("unexpected pos ..."), the OSError only as its
    ``__context__``."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def no_space(error: BaseException | None) -> bool:
    """Whether ``error`` is, or was raised from, a write that found no space left."""
    found = os_error_in(error)
    return found is not None and found.errno in NO_SPACE


@contextmanager
def _os_errors_kept() -> Iterator[None]:
    try:
        yield
    except Exception as error:
        found = os_error_in(error)
        if found is None or found is error:
            raise
        raise OSError(found.errno, found.strerror) from error


class FileWriter(FileSystemWriter):
    """DCP's file writer, with two changes:

    - a write that fails raises its OSError (errno and all), not torch's RuntimeError
      around it: DCP hands each rank's failure to the others pickled, which keeps an
      OSError's errno but drops a RuntimeError's ``__context__``;
    - ``aliases`` (name to name of a written non-tensor entry) are recorded in the
      metadata as entries of their own whose bytes are their twin's: any DCP reader
      reads them as it reads any entry, from the same place in the same file.
    """

    def __init__(self, path: str | os.PathLike, aliases: Mapping[str, str] | None = None):
        super().__init__(path)
        self.aliases = dict(aliases or {})

    def write_data(self, plan: Any, planner: Any) -> Any:
        with _os_errors_kept():
            return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        written = {r.index.fqn: r for ranks_results in results for r in ranks_results}
        twins = []
        for alias, name in self.aliases.items():
            twin = written[name]
            metadata.state_dict_metadata[alias] = metadata.state_dict_metadata[name]
            twins.append(WriteResult(MetadataIndex(alias), twin.size_in_bytes, twin.storage_data))
        with _os_errors_kept():
            super().finish(metadata, [*results, twins])
