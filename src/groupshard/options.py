"""The options of ``gs.shard`` that decide how units run: one frozen dataclass, checked
once, and compared across ranks (every rank must run the same collectives)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

STRATEGIES = ("full", "grad_op", "no_shard")
FIRST_BUCKET_BYTES = 2**20
"""The default limit of a backward's first gradient bucket: DDP's
(``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)."""
BUCKET_BYTES = 25 * 2**20
"""The default gradient bucket and gather window: DDP's ``bucket_cap_mb``."""


@dataclass(frozen=True)
class ShardOptions:
    """How a sharded model gathers and reduces (see ``gs.shard`` for each field)."""

    strategy: str = "full"  # "full" (ZeRO-3), "grad_op" (ZeRO-2) or "no_shard" (DDP-like)
    reduce_bucket_bytes: int = BUCKET_BYTES  # gradients wait for this many bytes
    first_bucket_bytes: int = FIRST_BUCKET_BYTES  # ... in a backward's first bucket
    prefetch_bytes: int = BUCKET_BYTES  # units gathered together in one window
    overlap: bool = True  # collectives asynchronous, waited for as late as possible
    sync_module_states: bool = True  # rank 0's parameters and buffers broadcast first

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Expects strategy in {STRATEGIES} but got strategy={self.strategy!r}")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"Expects overlap to be a bool but got {self.overlap!r}")
        sizes = (self.reduce_bucket_bytes, self.first_bucket_bytes, self.prefetch_bytes)
        if min(sizes) < 0:
            raise ValueError(
                "Expects reduce_bucket_bytes, first_bucket_bytes, prefetch_bytes >= 0 but got "
                f"reduce_bucket_bytes={sizes[0]}, first_bucket_bytes={sizes[1]}, "
                f"prefetch_bytes={sizes[2]}"
            )

    @property
    def first_bucket_limit(self) -> int:
        """The first bucket's limit: ``first_bucket_bytes``, at most a whole bucket."""
        return min(self.first_bucket_bytes, self.reduce_bucket_bytes)

    @property
    def gathers_in_windows(self) -> bool:
        """Whether units are gathered together with the units that run next."""
        return self.strategy != "no_shard"

    def signature(self) -> dict[str, Any]:
        """The fields by name, for the cross-rank comparison."""
        return dataclasses.asdict(self)
