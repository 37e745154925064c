"""torch.compile composes with a sharded model: each unit compiled before ``gs.shard``
(``unit.compile()``), the whole sharded model (``torch.compile(model)``) and the other forms
train as one process does (gloo ranks against one process, eager, on the global batch). The
hooks run as plain Python outside the compiled graphs: no graph holds groupshard's own code,
and nothing recompiles after the first step."""

from __future__ import annotations

import contextlib
import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import groupshard as gs

from helpers import BATCH_PER_RANK, UNITS, EdgeGPT, global_batches, max_difference, three_groups

STEPS = 3
BACKEND = "aot_eager"  # dynamo + AOTAutograd (a compiled backward), eager kernels: fast on CPU
PACKAGE = Path(gs.__file__).parent


def _hook_code_in_graphs(graphs: list[torch.fx.GraphModule]) -> list[str]:
    """Lines of the graphs' stack traces in groupshard's own code (the model in
    ``groupshard/cli`` aside): where dynamo traced a hook instead of running it."""
    found = []
    for graph in graphs:
        for node in graph.graph.nodes:
            for line in (node.meta.get("stack_trace") or "").splitlines():
                if f'"{PACKAGE}/' in line and f'"{PACKAGE / "cli"}/' not in line:
                    found.append(line.strip())
    return found


def _train(
    rank: int, world_size: int, strategy: str, form: str, backend: str, fullgraph: bool = False
) -> dict[str, Any]:
    """Three steps of the sharded model compiled as ``form`` and of one eager process."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs: list[torch.fx.GraphModule] = []

    def recording(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        graphs.append(graph)
        return torch._dynamo.lookup_backend(backend)(graph, inputs)

    options = {"backend": recording, "fullgraph": fullgraph}
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    units = [m for m in model.modules() if isinstance(m, UNITS)]
    if form == "units":  # nn.Module.compile: in place, before sharding
        for unit in units:
            unit.compile(**options)
    elif form == "wrapped units":  # torch.compile(unit) in its parent's place, the reference too
        for parent in (model, reference):
            parent.shift = torch.compile(parent.shift, **options)
            for index, block in enumerate(parent.blocks):
                parent.blocks[index] = torch.compile(block, **options)
    sharded = gs.shard(model, three_groups(model, head_lr=1e-3), unit=UNITS, strategy=strategy)
    run: nn.Module = sharded
    if form == "units after sharding":
        for unit in units:
            unit.compile(**options)
    elif form == "model":
        run = torch.compile(sharded, **options)
    elif form == "model in place":
        sharded.compile(**options)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    reference_optimizer = torch.optim.AdamW(three_groups(reference, head_lr=1e-3), lr=3e-3)
    compiled_after_first_step = 0
    settings = contextlib.ExitStack()
    if backend == "inductor":  # compile in this process: no pool of compile workers per rank
        settings.enter_context(torch._inductor.config.patch(compile_threads=1))
    try:
        for step, (inputs, targets) in enumerate(global_batches(STEPS, world_size)):
            local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
            # the hooks' state (gather windows, counters) changes every step: nothing it
            # touches may be guarded on
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                run(inputs[local], targets[local]).backward()
            reference(inputs, targets).backward()
            if step == 0:
                compiled_after_first_step = len(graphs)
            for opt in (optimizer, reference_optimizer):
                opt.step()
                opt.zero_grad()
    finally:
        settings.close()
        torch._dynamo.reset()
    return {
        "difference": max_difference(gs.full_state_dict(sharded), reference.state_dict()),
        "graphs": len(graphs),
        "new graphs after the first step": len(graphs) - compiled_after_first_step,
        "hook code in graphs": _hook_code_in_graphs(graphs),
        "graph breaks": [reason.splitlines()[0] for reason in counters["graph_break"]],
    }


def _forms(
    rank: int, world_size: int, strategy: str, forms: tuple[str, ...], backend: str
) -> dict[str, dict[str, Any]]:
    return {form: _train(rank, world_size, strategy, form, backend) for form in forms}


def _check(results: list[dict[str, dict[str, Any]]]) -> None:
    for result in results:
        for form, outcome in result.items():
            assert outcome["difference"] <= 1e-5, (form, outcome)
            assert outcome["graphs"] >= 2, (form, outcome)  # Block's and Shift's forwards
            assert outcome["new graphs after the first step"] == 0, (form, outcome)
            assert outcome["hook code in graphs"] == [], (form, outcome)
            if "units" in form:  # a unit's forward is one graph, its hooks outside it
                assert outcome["graph breaks"] == [], (form, outcome)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_units_compiled_before_sharding_and_whole_model_compiled_train_as_one_process(
    run_ranks, strategy, world_size
):
    _check(run_ranks(world_size, _forms, strategy, ("units", "model"), BACKEND, timeout=120))


def test_other_forms_train_as_one_process(run_ranks):
    """``torch.compile(unit)`` in the unit's place (which puts ``_orig_mod`` in the parameter
    names), each unit compiled after ``gs.shard``, and ``model.compile()`` in place."""
    forms = ("wrapped units", "units after sharding", "model in place")
    _check(run_ranks(2, _forms, "full", forms, BACKEND, timeout=120))


def _fullgraph(rank: int, world_size: int) -> dict[str, Any]:
    """fullgraph=True: each unit's forward is one graph (the hooks run outside it); the whole
    model cannot be one graph (the units' hooks are graph breaks inside it)."""
    per_unit = _train(rank, world_size, "full", "units", BACKEND, fullgraph=True)
    try:
        _train(rank, world_size, "full", "model", BACKEND, fullgraph=True)
    except torch._dynamo.exc.Unsupported as error:
        return {"units": per_unit, "model": str(error)}
    return {"units": per_unit, "model": "no error"}


def test_fullgraph_compiles_units_and_refuses_the_whole_model(run_ranks):
    for result in run_ranks(2, _fullgraph, timeout=120):
        _check([{"units": result["units"]}])
        assert "torch.compiler.disable" in result["model"], result["model"]


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None,
    reason="inductor on CPU needs a C++ compiler",
)
def test_inductor_trains_as_one_process(run_ranks):
    """The default backend, generated C++ kernels: a first compile takes about 40 s on 2 cores
    (then inductor's cache in /tmp serves it: a few seconds)."""
    _check(run_ranks(2, _forms, "full", ("units", "model"), "inductor", timeout=300))
