"""What one rank's setup and first step cost as the world grows, by simulation: torch's
``fake`` process-group backend lets one process play rank 0 of a world of any size
(collectives do nothing), so what grows with the world size is our own work.

    python benchmarks/scale.py [--models gpt 7b] [--out benchmarks/results-scale.json]
    python benchmarks/scale.py --plot   # the PNG from the JSON

Layouts: 1-D worlds of 8 ... 32,768 ranks and HSDP meshes of R replicas x 8 (``full``,
``Block``/decoder-layer units). Models, built on the meta device: groupshard's GPT of 46M
parameters (12 blocks of d 512, vocab 16384, two param groups) and a 7B Llama shape (32
blocks of d 4096, MLP 11008, vocab 32000). Each (model, layout, part) runs in a fresh
process; peak RSS above the RSS before the part (the meta model built):

- **shard**: ``gs.shard`` (the shards initialized from the meta model);
- **adamw step**: forward, backward and ``AdamW.step`` on 1 x 64 tokens (46M only; 7B's
  shards and AdamW state at world 8 alone would be 11 GB); the bytes this rank sends in
  that step, counted in groupshard's ``comm`` functions (benchmarks/hybrid.py's counting),
  beside the layout's formula;
- **regroup**: ``gs.regroup`` to three groups after that step (46M);
- **save plan**: a ``gs.checkpoint`` save's entries and DCP's local plan (this rank's
  part of a save, without writing; DCP's coordinator then gathers every rank's plan);
- **muon** / **whole**: ``gs.optim.Muon`` / ``gs.optim.WholeParamOptimizer`` (Adafactor)
  construction and first step (46M);
- **fsdp2**: ``fully_shard`` on every block and the root, then ``to_empty`` (its shards
  allocated) at the same layout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORLDS = (8, 64, 512, 4096, 32768)
REPLICAS = (16, 256, 2048)  # x 8
MODELS = {
    "gpt": {"vocab_size": 16384, "block_size": 1024, "n_layer": 12, "n_head": 8, "n_embd": 512},
    "7b": {"vocab": 32000, "hidden": 4096, "layers": 32, "heads": 32, "mlp": 11008},
}
PARTS = {"gpt": ("shard", "muon", "whole", "fsdp2"), "7b": ("shard", "fsdp2")}
TOKENS = 64


def layouts() -> list[tuple[int, int]]:
    """(replicas, shard size): 1-D worlds as (1, N), then HSDP meshes R x 8."""
    return [(1, world) for world in WORLDS] + [(replicas, 8) for replicas in REPLICAS]


def build(model: str) -> tuple[Any, type]:
    """The meta model and its unit class."""
    import torch

    with torch.device("meta"):
        if model == "gpt":
            from groupshard.cli.model import GPT, Block, GPTConfig

            return GPT(GPTConfig(**MODELS["gpt"])), Block
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        shape = MODELS["7b"]
        config = LlamaConfig(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"],
            intermediate_size=shape["mlp"], num_hidden_layers=shape["layers"],
            num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
        )  # fmt: skip
        return LlamaForCausalLM(config), LlamaDecoderLayer


def measure(model_name: str, replicas: int, shard_size: int, part: str) -> dict[str, Any]:
    """One part at one layout, as rank 0 of the fake world: seconds and peak RSS above the
    start of each step of it."""
    import torch
    import torch.distributed as dist
    from construction import _trim, peak_and_held, reset_peak, rss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import groupshard as gs
    from groupshard.mesh import MESH_DIM_NAMES

    torch.set_num_threads(1)
    world = replicas * shard_size
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    shape = (replicas, shard_size) if replicas > 1 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIM_NAMES) if shape else None
    model, unit = build(model_name)
    result: dict[str, Any] = {}

    def timed(name: str, function: Any) -> Any:
        _trim()
        before = rss()
        reset_peak()
        started = time.perf_counter()
        value = function()
        result[f"{name}_s"] = time.perf_counter() - started
        result[f"{name}_peak_mib"] = (peak_and_held()[0] - before) / 2**20
        return value

    if part == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        def fsdp2() -> None:
            for module in model.modules():
                if isinstance(module, unit):
                    fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.to_empty(device="cpu")

        timed("shard", fsdp2)
        return result
    groups = gs.muon_groups(model) if part == "muon" else gs.decay_groups(model, 0.1)
    init = initialize if model_name == "7b" else None  # GPT: its own reset_parameters
    sharded = timed(
        "shard", lambda: gs.shard(model, groups, unit=unit, mesh=mesh, param_init_fn=init)
    )
    if part == "shard":
        timed("save_plan", lambda: _save_plan(sharded))
        if model_name == "gpt":
            _adamw_step(sharded, timed, result)
        return result
    if part == "muon":
        optimizer = timed("construction", lambda: gs.optim.Muon(sharded.optimizer_groups()))
    else:
        optimizer = timed("construction", lambda: gs.optim.WholeParamOptimizer(
            sharded.optimizer_groups(), torch.optim.Adafactor, lr=1e-2))  # fmt: skip
    _forward_backward(sharded)
    timed("first_step", optimizer.step)
    return result


def initialize(module: Any) -> None:
    """A meta-built module's own parameters and buffers, filled with constants (Llama's
    norms have no ``reset_parameters``, and drawing 7B random numbers takes a minute on
    one core whatever the world size): what grows with the world is measured, not the
    random generator."""
    import torch

    with torch.no_grad():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            tensor.fill_(0.01)


def _forward_backward(model: Any) -> None:
    import torch

    ids = torch.randint(0, 1000, (1, TOKENS + 1))
    model(ids[:, :-1], ids[:, 1:]).backward()


def _adamw_step(model: Any, timed: Any, result: dict[str, Any]) -> None:
    """The first AdamW step, its bytes counted; then ``gs.regroup`` to three groups."""
    from unittest import mock

    import torch
    from hybrid import _counting

    import groupshard as gs
    from groupshard import comm

    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1e-4)
    mesh = model.groupshard.mesh
    groups = {}
    if mesh.replicate.size > 1:
        groups = {id(mesh.shard.group): "shard", id(mesh.replicate.group): "replicate"}
    sent: Counter[str] = Counter()

    def step() -> None:
        with mock.patch.multiple(comm, **_counting(sent, groups, world=mesh.world.size)):
            _forward_backward(model)
            optimizer.step()
            optimizer.zero_grad()

    timed("adamw_step", step)
    storages = model.groupshard.storages
    result["sent_bytes"] = dict(sent)
    result["parameter_bytes"] = mesh.shard.size * sum(
        s.local.numel() * s.local.element_size() for s in storages
    )
    root = model.groupshard.runtime.units[0]
    result["root_bytes"] = mesh.shard.size * sum(
        s.local.numel() * s.local.element_size() for s in root.storages
    )
    originals = model.groupshard.original_params
    embeddings = [p for name, p in originals.items() if "wte" in name or "wpe" in name]
    rest = [p for p in originals.values() if all(p is not e for e in embeddings)]
    new_groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        {"params": embeddings, "weight_decay": 0.0, "lr": 1e-5},
    ]
    timed("regroup", lambda: gs.regroup(model, optimizer, new_groups))


def _save_plan(model: Any) -> None:
    """This rank's part of a gs.checkpoint save, without writing: its entries and DCP's
    local plan."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from groupshard.checkpoint.entries import dcp_value, model_entries
    from groupshard.checkpoint.pieces import holder_of

    holder = holder_of(model, None, "save")
    entries, _ = model_entries(holder, loading=False)
    state_dict = {name: dcp_value(entry) for name, entry in entries.items()}
    planner = DefaultSavePlanner(flatten_state_dict=False)
    planner.set_up_planner(state_dict, is_coordinator=False)
    planner.create_local_plan()


def run_part(model: str, replicas: int, shard_size: int, part: str) -> dict[str, Any]:
    """``measure`` in a fresh process; its result, or its error's last line."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import scale; "
        f"print(json.dumps(scale.measure({model!r}, {replicas}, {shard_size}, {part!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def formula_bytes(parameter_bytes: float, root_bytes: float, replicas: int, shard: int) -> float:
    """What the layout sends per step per rank (benchmarks/hybrid.py's formulas), less the
    root's second gather (it stays gathered from forward into backward)."""
    from hybrid import formulas

    expected = formulas(parameter_bytes, replicas, shard)
    return expected["within"] + expected["across"] - root_bytes * (shard - 1) / shard


def plot(report: dict[str, Any], path: Path) -> None:
    """Seconds and peak RSS of ``gs.shard``, FSDP2's ``fully_shard`` and Muon's first step
    against the world size, log-log; 1-D worlds (circles) and HSDP meshes (squares)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, suffix, title in ((axes[0], "_s", "seconds"),
                                (axes[1], "_peak_mib", "peak RSS above start (MiB)")):  # fmt: skip
        for (model, part, step), label in SERIES.items():
            for hsdp, marker in ((False, "o"), (True, "s")):
                points = [
                    (row["world"], row[part][step + suffix])
                    for row in report["rows"]
                    if row["model"] == model and (row["replicas"] > 1) == hsdp
                    and step + suffix in row.get(part, {})
                ]
                if points:
                    layout = "HSDP R x 8" if hsdp else "1-D"
                    worlds, values = zip(*points, strict=True)
                    axis.plot(worlds, values, marker=marker, label=f"{model} {label}, {layout}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("world size (ranks)")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


SERIES = {
    ("gpt", "shard", "shard"): "gs.shard",
    ("gpt", "fsdp2", "shard"): "FSDP2 fully_shard",
    ("gpt", "muon", "first_step"): "Muon first step",
    ("7b", "shard", "shard"): "gs.shard",
    ("7b", "fsdp2", "shard"): "FSDP2 fully_shard",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="*", help="e.g. 1x8 2048x8 (default: all)")
    parser.add_argument("--out", default=str(HERE / "results-scale.json"))
    parser.add_argument("--plot", action="store_true", help="only draw the PNG from --out")
    args = parser.parse_args()
    out = Path(args.out)
    if args.plot:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return
    chosen = layouts()
    if args.layouts:
        chosen = [tuple(int(n) for n in text.split("x")) for text in args.layouts]
    rows = []
    for model in args.models:
        for replicas, shard_size in chosen:
            row: dict[str, Any] = {"model": model, "replicas": replicas,
                                   "shard_size": shard_size, "world": replicas * shard_size}
            for part in PARTS[model]:
                row[part] = run_part(model, replicas, shard_size, part)
            shard = row["shard"]
            if "parameter_bytes" in shard:
                shard["formula_bytes"] = formula_bytes(
                    shard["parameter_bytes"], shard["root_bytes"], replicas, shard_size
                )
            print(json.dumps(row), flush=True)
            rows.append(row)
    import torch

    if out.exists():  # rows of the models not measured now are kept
        kept = [r for r in json.loads(out.read_text())["rows"] if r["model"] not in args.models]
        rows = kept + rows
    report = {"kind": "scale", "torch": torch.__version__, "models": MODELS, "rows": rows}
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
