"""Layer-wise optimizers that work on groupshard shards and on plain parameters alike.

Each needs per-parameter norms; on shards they come from the segment map with one
all-reduce per ``step()`` for all groups, so results do not change when sharding is
switched on or off. Exclusions are expressed with groups: ``trust_ratio=False``
(LAMB, LARS, LARC) or ``agc=False`` (AGC) in a group's dict.
"""

from groupshard.optim.agc import AGC, adaptive_clip_grad_
from groupshard.optim.lamb import LAMB
from groupshard.optim.larc import LARC
from groupshard.optim.lars import LARS

__all__ = ["AGC", "LAMB", "LARC", "LARS", "adaptive_clip_grad_"]
