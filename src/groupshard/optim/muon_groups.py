"""The usual param groups for Muon: hidden matrices to Muon, everything else to AdamW."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from groupshard.groups import NORM_MODULES, groups_by, owning_modules

HEAD_NAMES = ("lm_head", "head", "output", "output_layer", "classifier")
"""Module names (the last part of a module's name) taken for a model's output layer."""


def muon_groups(
    model: nn.Module,
    muon: Mapping[str, Any] | None = None,
    adamw: Mapping[str, Any] | None = None,
    *,
    embeddings_to_muon: bool = False,
    head_to_muon: bool = False,
    head_names: Iterable[str] = HEAD_NAMES,
    flatten_conv: bool = False,
    rule: Callable[[str, nn.Parameter], bool | None] | None = None,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    """The usual Muon preset: hidden matrices to Muon, everything else to AdamW.

    Muon gets the trainable 2-D weights (and, with ``flatten_conv``, conv weights) except
    embeddings and the output head; AdamW gets biases, norm weights, other vectors and
    scalars, embeddings (weights of ``nn.Embedding``, also where tied to a head) and the
    head (weights of a module named like an output layer: ``head_names``).

    Args:
        model: the unsharded module.
        muon: hyperparameters of the Muon group (e.g. ``{"lr": 0.02}``).
        adamw: hyperparameters of the AdamW group (e.g. ``{"lr": 3e-4, "betas": (0.9,
            0.95)}``).
        embeddings_to_muon, head_to_muon: send embeddings / the head to Muon instead.
        head_names: module names taken for the output layer.
        flatten_conv: send weights with more than 2 dimensions to Muon (reshaped to
            ``(out, in * k * k)``; the Muon group gets ``flatten_conv=True``).
        rule: ``rule(name, param)`` -> True (Muon), False (AdamW) or None (the above)
            decides first.
        verbose: print a line per group.

    Returns:
        ``[{"params": hidden, "use_muon": True, **muon}, {"params": rest, "use_muon":
        False, **adamw}]``, ready for ``gs.shard``, ``gs.ZeroRedundancyOptimizer`` and
        ``gs.optim.Muon`` (either group may be empty).
    """
    heads = set(head_names)
    embeddings: set[int] = set()
    head: set[int] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                embeddings.add(id(param))
            if module_name.rpartition(".")[2] in heads:
                head.add(id(param))
    owners = owning_modules(model)

    def kind(name: str, param: nn.Parameter) -> str:
        decision = rule(name, param) if rule is not None else None
        if decision is not None:
            return "muon" if decision else "adamw"
        if param.ndim < 2 or (param.ndim > 2 and not flatten_conv):
            return "adamw"
        if isinstance(owners[id(param)], NORM_MODULES):
            return "adamw"
        if id(param) in embeddings and not embeddings_to_muon:
            return "adamw"
        if id(param) in head and not head_to_muon:
            return "adamw"
        return "muon"

    muon_options: dict[str, Any] = {**(muon or {}), "use_muon": True}
    if flatten_conv:
        muon_options.setdefault("flatten_conv", True)
    options = {"muon": muon_options, "adamw": {**(adamw or {}), "use_muon": False}}
    return groups_by(model, kind, options, verbose=verbose)
