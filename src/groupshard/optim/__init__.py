"""Layer-wise optimizers that work on groupshard shards and on plain parameters alike.

Each needs per-parameter norms; on shards they come from the segment map with one
all-reduce per ``step()`` for all groups, so results do not change when sharding is
switched on or off. Exclusions are expressed with groups: ``trust_ratio=False``
(LAMB, LARS, LARC) or ``agc=False`` (AGC) in a group's dict.

``Muon`` orthogonalizes whole matrices: each matrix of a shard gets one owner rank
(balanced by Newton-Schulz cost), two all-to-alls per step move the pieces there and
the results back; groups with ``use_muon=False`` are stepped as ``torch.optim.AdamW``.
"""

from groupshard.optim.agc import AGC, adaptive_clip_grad_
from groupshard.optim.lamb import LAMB
from groupshard.optim.larc import LARC
from groupshard.optim.lars import LARS
from groupshard.optim.muon import Muon, merge_state_dicts, split_state_dict
from groupshard.optim.whole import WholeParamOptimizer

__all__ = [
    "AGC",
    "LAMB",
    "LARC",
    "LARS",
    "Muon",
    "WholeParamOptimizer",
    "adaptive_clip_grad_",
    "merge_state_dicts",
    "split_state_dict",
]
