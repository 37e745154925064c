"""torch's ZeroRedundancyOptimizer + DDP: optimizer state sharded, whole tensors per rank."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from optimizers import LR, MUON_LR, MUON_WEIGHT_DECAY, Optimizers, decay_groups, muon_groups, plain
from torch import nn

from .base import System


def _zero_adamw(decay: dict[str, Any], no_decay: dict[str, Any]) -> Any:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optimizer = ZeroRedundancyOptimizer(
        decay["params"], torch.optim.AdamW, lr=LR, weight_decay=0.1, parameters_as_bucket_view=True
    )
    optimizer.add_param_group(no_decay)  # its constructor takes one group
    return optimizer


@dataclass(frozen=True)
class TorchZero(System):
    """torch's ZeroRedundancyOptimizer with AdamW under DDP; with ``muon``, one with
    torch.optim.Muon (whole matrices per rank, by its greedy partition) and another with
    AdamW for the rest (also ZeRO-sharded)."""

    def build(self, base: nn.Module) -> tuple[nn.Module, Any]:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = copy.deepcopy(base)
        if not self.muon:
            optimizer = _zero_adamw(*decay_groups(model))
            return DistributedDataParallel(model), optimizer
        muon, decay, no_decay = map(plain, muon_groups(model))
        muon_optimizer = ZeroRedundancyOptimizer(
            muon["params"], torch.optim.Muon, lr=MUON_LR, weight_decay=MUON_WEIGHT_DECAY,
            parameters_as_bucket_view=True,
        )  # fmt: skip
        optimizer = Optimizers(muon_optimizer, _zero_adamw(decay, no_decay))
        return DistributedDataParallel(model), optimizer
