"""groupshard: sharded data parallelism with optimizer parameter groups as first class."""

from groupshard.api import ShardedModule, full_state_dict, shard, shard_optimizer
from groupshard.groups import decay_groups, groups_by

__all__ = [
    "ShardedModule",
    "decay_groups",
    "full_state_dict",
    "groups_by",
    "shard",
    "shard_optimizer",
]
__version__ = "0.1.0"
