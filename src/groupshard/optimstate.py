"""torch.optim's state-dict format, built from per-parameter state (pure: no communication).

Shared by the state-dict functions (``statedict``), the ZeRO optimizer (``zero``) and the
checkpoint conversion (``checkpoint.conversion``), which all describe an optimizer by
its parameters' names, group by group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def plain_optimizer_state(
    groups: list[tuple[Sequence[str], dict[str, Any]]], per_fqn: Mapping[str, dict[str, Any]]
) -> dict[str, Any]:
    """torch.optim's state-dict format from ``(listed FQNs, hyperparameters)`` per group and
    each parameter's state: parameters are numbered across groups in the listed order, as
    a torch optimizer built with those groups numbers them; ones without state are left out.
    """
    result: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    for listed, hyperparameters in groups:
        indices = list(range(index, index + len(listed)))
        for position, fqn in zip(indices, listed, strict=True):
            if per_fqn.get(fqn):
                result["state"][position] = per_fqn[fqn]
        result["param_groups"].append({**hyperparameters, "params": indices})
        index += len(indices)
    return result
