"""The cross-rank agreement at the end of a synced backward: one small all-reduce.

It carries (1) which parameters had a gradient in this backward on any rank (a parameter
used on any rank has a gradient, as in DDP; the others are left alone by the next
optimizer step, see ``gradients``), and (2) a hash of each order this step's collectives
followed on this rank (units' forward order, backward order, the order gradients arrived
in): a rank whose units ran in another order would have gathered or reduced other
parameters' data in collectives of matching sizes, silently; now every rank raises.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from groupshard import comm
from groupshard.storage import FlatStorage


def agree_on_gradients_and_order(
    storages: Sequence[FlatStorage], orders: Mapping[str, Sequence[str]], async_op: bool
) -> comm.Pending | None:
    """Start the all-reduce of the used flags and order hashes; its ``wait()`` hands each
    storage the combined flags and raises a RuntimeError if an order differs between
    ranks. With ``async_op`` it runs behind the gradient reductions already started."""
    storages = [s for s in storages if s.layout.trainable_buffers]
    if not storages:
        return None
    flags = [storage.gradients.take_used() for storage in storages]
    agreement = [_agreement_bytes(order) for order in orders.values()]
    combined = torch.tensor(
        [f for per_storage in flags for f in per_storage]
        + [b for per_order in agreement for b in per_order],
        dtype=torch.uint8,
        device=storages[0].local.device,
    )

    def apply() -> None:
        values = combined.cpu()
        offset = 0
        for storage, per_storage in zip(storages, flags, strict=True):
            storage.gradients.add_used(values[offset : offset + len(per_storage)].bool().tolist())
            offset += len(per_storage)
        for (kind, order), per_order in zip(orders.items(), agreement, strict=True):
            reduced = values[offset : offset + len(per_order)].tolist()
            offset += len(per_order)
            if not _agreed(reduced):
                raise RuntimeError(
                    f"The {kind} differs between ranks (this rank: {_shortened(order)}): "
                    "groupshard's collectives follow it, so the ranks exchanged other "
                    "parameters' data. Run the same units in the same order on every "
                    "rank (keep rank-dependent branches inside a unit)."
                )

    # over the whole world: under hybrid sharding the replicas must skip the same parameters
    return comm.all_reduce_max(combined, storages[0].world, async_op, apply)


def _agreement_bytes(order: Sequence[str]) -> list[int]:
    """8 bytes of a hash of ``order`` and their complements (255 - byte): after an
    all-reduce of maxima, every byte plus its complement is 255 exactly when every rank
    had the same hash (max(b) + max(255 - b) = 255 + max(b) - min(b))."""
    digest = hashlib.blake2b("\0".join(order).encode(), digest_size=8).digest()
    return [*digest, *(255 - b for b in digest)]


def _agreed(reduced: Sequence[int]) -> bool:
    half = len(reduced) // 2
    return all(a + b == 255 for a, b in zip(reduced[:half], reduced[half:], strict=True))


def _shortened(order: Sequence[str], shown: int = 6) -> str:
    names = ", ".join(order[:shown])
    return f"[{names}{', ...' if len(order) > shown else ''}]"
