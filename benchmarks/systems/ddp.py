"""DDP: every rank holds the whole model and optimizer, gradients all-reduced."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from optimizers import adamw, decay_groups, muon_groups, torch_muon
from torch import nn

from .base import System


@dataclass(frozen=True)
class DDP(System):
    """``DistributedDataParallel`` with AdamW, or (``muon``) torch.optim.Muon + AdamW: every
    rank orthogonalizes every matrix, the replicated baseline of the Muon rows."""

    prepares_blocks = True

    def build(self, base: nn.Module) -> tuple[nn.Module, Any]:
        from torch.nn.parallel import DistributedDataParallel

        model = self.prepare_blocks(copy.deepcopy(base))
        wrapped = DistributedDataParallel(model)
        return wrapped, torch_muon(muon_groups(model)) if self.muon else adamw(decay_groups(model))
