"""Choose the units (submodules sharded as one piece) and give each parameter an owner.

Pure: walks the module tree only. The root is always a unit and takes every
parameter that no other unit claims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

UnitSpec = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[nn.Module], bool] | None


@dataclass(frozen=True)
class UnitPlan:
    """The units of a model and which one stores each parameter.

    Note:
        A parameter registered in several modules (tied weights) is owned by the
        smallest unit that contains all of them, and stored once.
    """

    names: tuple[str, ...]  # module names, pre-order; "" is the root
    parents: dict[str, str | None]
    owner: dict[str, str]  # parameter FQN -> unit name
    registrations: dict[str, tuple[tuple[str, str], ...]]  # FQN -> ((module name, attr), ...)


def _unit_predicate(unit: UnitSpec) -> Callable[[nn.Module], bool]:
    if unit is None:
        return lambda module: False
    if isinstance(unit, type):
        if not issubclass(unit, nn.Module):
            raise TypeError(f"Expects unit to be an nn.Module subclass but got {unit!r}")
        return lambda module: isinstance(module, unit)
    if isinstance(unit, (tuple, list, set, frozenset)):
        classes = tuple(unit)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"Expects unit classes to be nn.Module subclasses but got {bad!r}")
        return lambda module: isinstance(module, classes)
    if callable(unit):
        return unit
    raise TypeError(
        "Expects unit to be a module class, a tuple of classes, a predicate or None, "
        f"but got {unit!r}"
    )


def enclosing_unit(module_name: str, unit_names: set[str]) -> str:
    """Nearest ancestor-or-self of ``module_name`` that is a unit."""
    parts = module_name.split(".") if module_name else []
    for length in range(len(parts), 0, -1):
        candidate = ".".join(parts[:length])
        if candidate in unit_names:
            return candidate
    return ""


def _ancestry(unit_name: str, parents: dict[str, str | None]) -> list[str]:
    chain: list[str] = []
    current: str | None = unit_name
    while current is not None:
        chain.append(current)
        current = parents[current]
    return chain[::-1]


def plan_units(model: nn.Module, unit: UnitSpec) -> UnitPlan:
    """Find the units of ``model`` and assign every parameter to one of them."""
    is_unit = _unit_predicate(unit)
    names = [""] + [name for name, module in model.named_modules() if name and is_unit(module)]
    unit_names = set(names)
    parents: dict[str, str | None] = {"": None}
    for name in names[1:]:
        parents[name] = enclosing_unit(name.rpartition(".")[0], unit_names)
    canonical = {id(param): fqn for fqn, param in model.named_parameters()}
    registrations: dict[str, list[tuple[str, str]]] = {fqn: [] for fqn in canonical.values()}
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            registrations[canonical[id(param)]].append((module_name, attr))
    owner: dict[str, str] = {}
    for fqn, places in registrations.items():
        chains = [_ancestry(enclosing_unit(m, unit_names), parents) for m, _ in places]
        common = chains[0]
        for chain in chains[1:]:
            length = 0
            while length < min(len(common), len(chain)) and common[length] == chain[length]:
                length += 1
            common = common[:length]
        owner[fqn] = common[-1]
    return UnitPlan(
        tuple(names),
        parents,
        owner,
        {fqn: tuple(places) for fqn, places in registrations.items()},
    )
