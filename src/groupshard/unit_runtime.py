"""One unit: its module, its storages, and where its parameters are registered."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from functools import cached_property

import torch
from torch import nn

from groupshard.gradients import ORIGINAL_ATTR
from groupshard.piece_params import hold_piece
from groupshard.precision import MixedPrecision
from groupshard.storage import FlatStorage


class UnitRuntime:
    """A unit's module and storages, and every place its parameters are registered."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        storages: Sequence[FlatStorage],
        places: dict[str, list[tuple[nn.Module, str]]],
        originals: dict[str, nn.Parameter],
        policy: MixedPrecision | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.storages = list(storages)
        self.places = places  # FQN -> [(module, attribute)], every registration
        self.originals = originals  # FQN -> the user's parameter object
        for fqn, original in originals.items():
            setattr(original, ORIGINAL_ATTR, fqn)  # an optimizer step refuses it
        self.policy = policy

    @property
    def label(self) -> str:
        """The unit's name for messages (the root has none)."""
        return self.name or "<root>"

    def storages_to_gather(self) -> list[FlatStorage]:
        """Storages not gathered, or gathered before a shard was written."""
        return [s for s in self.storages if not s.is_current]

    @property
    def needs_gather(self) -> bool:
        return bool(self.storages_to_gather())

    @property
    def is_gathered(self) -> bool:
        """Whether any of its storages holds unsharded buffers now."""
        return any(s.is_unsharded for s in self.storages)

    @cached_property
    def unsharded_bytes(self) -> int:
        return sum(
            (s.layout.trainable_unsharded_numel + s.layout.frozen_unsharded_numel)
            * s.unsharded_trainable.element_size()
            for s in self.storages
            if not s.aliases_local
        )

    def replace_storage(self, index: int, storage: FlatStorage) -> None:
        """Make ``storage`` the unit's storage ``index`` (``gs.regroup`` re-lays it out)."""
        self.storages[index] = storage
        self.__dict__.pop("unsharded_bytes", None)

    def reshard(self) -> None:
        """Free the gathered buffers; the parameters' names show this rank's pieces."""
        for storage in self.storages:
            storage.reshard()
        self.install_local_pieces()

    def install_local_pieces(self) -> None:
        """Point every registration of the unit's parameters at the user's parameter
        object holding this rank's piece (``FlatStorage.local_pieces``), as FSDP1's
        ``use_orig_params``: outside forward, ``module.weight`` is never stale; a piece that
        is not the whole parameter refuses to be computed on (``piece_params``)."""
        for storage in self.storages:
            for fqn, piece in storage.local_pieces.items():
                original = self.originals[fqn]
                hold_piece(original, fqn, piece, storage.whole_shapes[fqn])
                for module, attr in self.places[fqn]:
                    module.__dict__[attr] = original

    def install_views(self, track_use: bool) -> None:
        """Point every registration of the unit's parameters at the unsharded views;
        with ``track_use``, note which of them the coming backward reaches."""
        for storage in self.storages:
            # Views made with grad enabled are never leaves, so requires_grad_(False) on
            # one (which cannot freeze a view) raises instead of silently doing nothing.
            with torch.enable_grad() if not torch.is_inference_mode_enabled() else nullcontext():
                views = storage.param_views(track_use)
            for fqn, view in views.items():
                for module, attr in self.places[fqn]:
                    module.__dict__[attr] = view
