"""The package's layers (README "Layout of the code"): no module imports one above its
layer, and no import circle; read from the source, nothing imported or run."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "groupshard"
LAYERS = {
    "pure": ["layout", "groups", "units", "options", "precision", "writes", "schedulers"],
    "communication": ["early_imports", "comm", "mesh"],
    "storage": ["tensor_parallel", "segments", "flatten", "gradients", "storage"],
    "runtime": [
        "piece_params", "unit_runtime", "gathers", "buckets", "end_of_backward", "guards",
        "runtime",
    ],
    "model": ["sharding", "materialize", "norms", "scaler", "safetensors_io", "full_state"],
    "front-ends": ["api", "regroup", "optim", "zero", "checkpoint", "torch_hook"],
    "integrations": ["integrations"],
    "command line": ["cli", "__init__", "__main__"],
}
LEVEL = {name: level for level, names in enumerate(LAYERS.values()) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """groupshard modules imported anywhere in the file (functions included), by name:
    ``from groupshard.a import b`` is module ``a.b`` where that is a module, else ``a``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "groupshard" or node.module.startswith("groupshard."):
                package = node.module.removeprefix("groupshard").removeprefix(".")
                for alias in node.names:
                    name = f"{package}.{alias.name}" if package else alias.name
                    found.add(name if name in modules else package)
        elif isinstance(node, ast.Import):
            found.update(
                alias.name.removeprefix("groupshard.")
                for alias in node.names
                if alias.name.startswith("groupshard.")
            )
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    names = set(modules)
    return {name: _imports(path, names) & names - {name} for name, path in modules.items()}


def _top(module: str) -> str:
    return module.split(".")[0]


def test_every_module_has_a_layer():
    assert sorted({_top(m) for m in _graph()} - set(LEVEL)) == []


def test_no_import_runs_up_a_layer():
    upward = [
        f"{module} -> {imported}"
        for module, imports in _graph().items()
        for imported in imports
        if LEVEL[_top(imported)] > LEVEL[_top(module)]
    ]
    assert upward == []


def test_no_import_circle():
    graph = _graph()
    visiting: list[str] = []
    done: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        if module in visiting:
            circles.append([*visiting[visiting.index(module) :], module])
            return
        if module in done:
            return
        visiting.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert circles == []
