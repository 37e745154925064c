"""The errors a checkpoint raises when it cannot be read, so callers can catch just them."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing a file, damaged, inconsistent or not ours; the message names
    the file. Raised on every rank of a load, never as DCP's ``CheckpointException``
    (a ``BaseException`` that ``except Exception`` misses)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something that decoding it would run (a pickled object other
    than DCP's metadata types, a non-tensor payload): it is refused, nothing is run."""
