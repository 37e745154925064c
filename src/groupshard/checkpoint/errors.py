"""The errors a checkpoint raises when it cannot be read or saved, so callers can catch just
them."""

from __future__ import annotations

import errno
import os


class CheckpointError(ValueError):
    """A checkpoint is missing a file, damaged, inconsistent or not ours; the message names
    the file. Raised on every rank of a load, never as DCP's ``CheckpointException``
    (a ``BaseException`` that ``except Exception`` misses)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something that decoding it would run (a pickled object other
    than DCP's metadata types, a non-tensor payload): it is refused, nothing is run."""


class NoSpaceError(OSError, RuntimeError):
    """A save found no space left on the device (errno ENOSPC, or EDQUOT: over a quota).

    Raised on every rank of the save, with the previous checkpoint intact. ``folder`` is
    where the checkpoint goes, ``needed`` about the bytes it takes (the previous one's size,
    or its tensors' if it is the first) and ``free`` the bytes free there now, after the
    failed attempt was removed. An OSError with errno ENOSPC, and a RuntimeError as any
    other failed save.
    """

    def __init__(self, path: str, needed: int, free: int) -> None:
        self.path, self.needed, self.free = str(path), needed, free
        self.folder = os.path.dirname(self.path) or "."
        super().__init__(
            errno.ENOSPC,
            f"no space left on device in {self.folder} to save the checkpoint {self.path}: it "
            f"needs about {needed:,} bytes, {free:,} are free; the previous checkpoint there "
            "(if any) is intact",
        )

    def __reduce__(self) -> tuple[type[NoSpaceError], tuple[str, int, int]]:
        return type(self), (self.path, self.needed, self.free)

    def __str__(self) -> str:
        return str(self.strerror)
