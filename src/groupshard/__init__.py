"""groupshard: sharded data parallelism with optimizer parameter groups as first class.

The public names are imported on first use (PEP 562), so that ``groupshard --help`` and
argument errors answer without importing torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if "torch" in sys.modules:  # else groupshard.comm does, when a model or optimizer is built
    from groupshard.early_imports import import_early

    import_early()  # before init_process_group: groupshard/early_imports.py says why

from groupshard import torch_hook

# torch's get_state_dict / set_state_dict learn groupshard's models once torch loads them
torch_hook.install()

if TYPE_CHECKING:
    from groupshard import checkpoint, optim
    from groupshard.api import ShardedModule, shard, shard_optimizer
    from groupshard.full_state import (
        full_state_dict,
        load_full_state_dict,
        load_optim_state_dict,
        optim_state_dict,
    )
    from groupshard.groups import decay_groups, groups_by
    from groupshard.norms import (
        clip_grad_norm_,
        clip_grad_norm_per_group_,
        grad_norms,
        norm_report,
        param_norms,
    )
    from groupshard.optim.muon_groups import muon_groups
    from groupshard.precision import MixedPrecision
    from groupshard.regroup import regroup
    from groupshard.safetensors_io import save_safetensors
    from groupshard.scaler import GradScaler
    from groupshard.zero import ZeroRedundancyOptimizer

_SUBPACKAGES = ("checkpoint", "optim")
_HOMES = {
    "ShardedModule": "api",
    "shard": "api",
    "shard_optimizer": "api",
    "decay_groups": "groups",
    "groups_by": "groups",
    "muon_groups": "optim.muon_groups",
    "MixedPrecision": "precision",
    "regroup": "regroup",
    "GradScaler": "scaler",
    "save_safetensors": "safetensors_io",
    "clip_grad_norm_": "norms",
    "clip_grad_norm_per_group_": "norms",
    "grad_norms": "norms",
    "norm_report": "norms",
    "param_norms": "norms",
    "full_state_dict": "full_state",
    "load_full_state_dict": "full_state",
    "load_optim_state_dict": "full_state",
    "optim_state_dict": "full_state",
    "ZeroRedundancyOptimizer": "zero",
}


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _HOMES:
        value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "GradScaler",
    "MixedPrecision",
    "ShardedModule",
    "ZeroRedundancyOptimizer",
    "checkpoint",
    "clip_grad_norm_",
    "clip_grad_norm_per_group_",
    "decay_groups",
    "full_state_dict",
    "grad_norms",
    "groups_by",
    "load_full_state_dict",
    "load_optim_state_dict",
    "muon_groups",
    "norm_report",
    "optim",
    "optim_state_dict",
    "param_norms",
    "regroup",
    "save_safetensors",
    "shard",
    "shard_optimizer",
]
__version__ = "0.1.0"
