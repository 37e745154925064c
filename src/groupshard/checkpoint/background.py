"""Asynchronous checkpoints: training goes on while a checkpoint is written.

``async_save`` plans the save as ``save`` does (collective over the model's ranks), copies
this rank's pieces into CPU staging buffers (pinned where the shards live on a GPU; kept
per model and reused from one save to the next, so memory does not grow) and returns an
:class:`AsyncSave` handle. A thread then writes the staged copies into a temporary folder
and puts it in place, as ``save`` does, with its collectives on a gloo group of the same
ranks (``comm.writer_group``), never on the training's. The optimizer steps taken
meanwhile change the live tensors, not the staged ones. ``handle.result()`` waits and
raises the write's error, the same on every rank; a second save of the model first waits
for the one in flight. A process killed mid-write leaves the previous checkpoint in place
(the folder is replaced only once complete).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import weakref
from typing import Any

import torch
from torch import nn

from groupshard import comm
from groupshard.checkpoint.planner import Piece
from groupshard.checkpoint.sharded import PlannedSave, plan_save, write_save

_staging: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
"""Per model, its CPU staging buffers by entry name (reused while shapes hold)."""
_in_flight: weakref.WeakKeyDictionary[nn.Module, AsyncSave] = weakref.WeakKeyDictionary()
"""Per model, its save being written."""


class AsyncSave:
    """A checkpoint being written in the background (``gs.checkpoint.async_save``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _start(self, planned: PlannedSave, writer: comm.Ranks) -> None:
        def write() -> None:
            try:
                write_save(planned, writer)
            except BaseException as error:  # raised alike on every rank: result() re-raises
                self._error = error

        self._thread = threading.Thread(target=write, name="groupshard-checkpoint-writer")
        self._thread.start()

    def wait(self) -> None:
        """Wait for the write to finish, without raising its error."""
        if self._thread is not None:
            self._thread.join()

    def done(self) -> bool:
        """Whether the write has finished (written, or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> None:
        """Wait for the write; raise its error (every rank raises alike: a NoSpaceError
        when the device is full, else a RuntimeError naming the first failed rank), the
        previous checkpoint intact then. A TimeoutError if it is still writing after
        ``timeout`` seconds."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"The checkpoint {self.path} is still being written")
        if self._error is not None:
            raise self._error


def async_save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> AsyncSave:
    """Start saving a checkpoint of ``model`` (and ``optimizer``, and ``extra``) to ``path``
    as ``gs.checkpoint.save`` does, and return once this rank's part is copied into CPU
    memory: training may change the model and optimizer at once. Collective: every rank
    calls it. Wait with ``handle.result()`` (before ``dist.destroy_process_group()``:
    the write's collectives need the group); ``gs.checkpoint.load(path)`` reads the folder,
    ``extra`` included."""
    previous = _in_flight.get(model)
    if previous is not None:
        previous.wait()  # its error is its result()'s
    planned = plan_save(path, model, optimizer, extra)
    writer = comm.writer_group(planned.ranks)  # collective the first time, then cached
    staged = dataclasses.replace(planned, entries=_stage(model, planned.entries))
    handle = AsyncSave(path)
    handle._start(staged, writer)
    _in_flight[model] = handle
    return handle


@torch.no_grad()
def _stage(model: nn.Module, entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` with each piece's elements copied into this model's staging buffers
    (made, or remade where a shape changed); plain values copied."""
    buffers = _staging.setdefault(model, {})
    staged: dict[str, Any] = {}
    on_gpu = False
    for name, entry in entries.items():
        if not isinstance(entry, Piece):
            staged[name] = copy.deepcopy(entry)
            continue
        data = entry.data
        buffer = buffers.get(name)
        if buffer is None or buffer.shape != data.shape or buffer.dtype != data.dtype:
            pin = data.is_cuda
            buffer = torch.empty(data.shape, dtype=data.dtype, device="cpu", pin_memory=pin)
            buffers[name] = buffer
        buffer.copy_(data, non_blocking=data.is_cuda)
        on_gpu = on_gpu or data.is_cuda
        staged[name] = dataclasses.replace(entry, data=buffer)
    if on_gpu:  # the copies are in flight on the current stream
        torch.cuda.current_stream().synchronize()
    for name in set(buffers) - set(entries):  # entries gone (a regrouped optimizer)
        del buffers[name]
    return staged
