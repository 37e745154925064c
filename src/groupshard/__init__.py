"""groupshard: sharded data parallelism with optimizer parameter groups as first class."""

from groupshard import checkpoint, optim
from groupshard.api import ShardedModule, shard, shard_optimizer
from groupshard.groups import decay_groups, groups_by
from groupshard.norms import (
    clip_grad_norm_,
    clip_grad_norm_per_group_,
    grad_norms,
    norm_report,
    param_norms,
)
from groupshard.statedict import (
    full_state_dict,
    load_full_state_dict,
    load_optim_state_dict,
    optim_state_dict,
)
from groupshard.zero import ZeroRedundancyOptimizer

__all__ = [
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
    "norm_report",
    "optim",
    "optim_state_dict",
    "param_norms",
    "shard",
    "shard_optimizer",
]
__version__ = "0.1.0"
