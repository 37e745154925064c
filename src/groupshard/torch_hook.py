"""Teach torch's state-dict API about sharded models when torch loads it, not before.

``torch.distributed.checkpoint.state_dict`` (``get_state_dict``, ``set_state_dict`` and
their model and optimizer variants) knows FSDP, DDP and DTensors, and has no extension
point for other sharded models: without help it takes a rank's flat optimizer shards
for replicated tensors. ``groupshard.checkpoint.torch_api`` wraps four of its functions
for groupshard's models and optimizers (others pass through unchanged). Importing that
module costs most of a second, so this hook waits for torch's module to be imported (by
the user's script, when it wants the API) and wraps it then; if it is already loaded,
at once. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

TARGET = "torch.distributed.checkpoint.state_dict"


def _wrap(module: ModuleType) -> None:
    from groupshard.checkpoint.torch_api import wrap_torch_state_dict

    wrap_torch_state_dict(module)


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _wrap(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once: the real finders find the module
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _WrappingLoader(spec.loader)
        return spec


def install() -> None:
    """Wrap torch's state-dict API now if torch has loaded it, else when it does."""
    if TARGET in sys.modules:
        _wrap(sys.modules[TARGET])
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
