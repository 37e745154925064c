"""Bytes per step of hybrid sharding (HSDP 2x2) against full sharding over 4 ranks.

    python benchmarks/hybrid.py [--models 4m 30m] [--json benchmarks/results-hybrid-bytes.json]

World size 4 over gloo (``benchmarks/run.py``'s models, one thread per rank), strategy
``full`` with ``Block`` units and AdamW: once sharded over all 4 ranks, once on a
``("replicate", "shard")`` mesh of 2 x 2. groupshard's ``comm`` functions are patched for one
training step (after a first one that records the units' order) to add up, per group (the
shard group, the replicate group, the whole world), the bytes each rank sends with the ideal
(ring) algorithm of each collective: (N-1)/N of the gathered or scattered buffer, twice that
for an all-reduce. The formulas they are compared with, P the unsharded parameter bytes:

- full over N ranks (ZeRO-3): 3 x P x (N-1)/N, all of it over every link;
- HSDP, R replicas of S ranks: 3 x P x (S-1)/S within the shard group (gathers and the
  reduce-scatter) and 2 x P/S x (R-1)/R across the replicas (the all-reduce of the shard).

groupshard's root unit stays gathered from the end of forward into backward (as FSDP2's), so
its parameters are gathered once, not twice: the counted bytes are below the formula by
(N-1)/N (or (S-1)/S) of the root's bytes, shown in the table.

The modeled step time is communication only, bandwidth bound (no latency, no overlap), for a
typical node: 8 GPUs joined at 400 GB/s each, 50 GB/s per GPU to other nodes. Full sharding
over n nodes runs rings over all 8n GPUs, whose slowest hops cross nodes: 3 x P x (N-1)/N at
50 GB/s. HSDP with one replica per node: 3 x P x 7/8 at 400 GB/s, plus 2 x P/8 x (n-1)/n at
50 GB/s. It is applied to the measured models (fp32) and to 7B parameters in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # benchmarks/run.py: models, batches, init, spawning the ranks

import groupshard as gs
from groupshard import comm
from groupshard.cli.model import GPT, Block
from groupshard.mesh import MESH_DIM_NAMES

WORLD = 4
LAYOUTS = {"full over 4": None, "HSDP 2x2": (2, 2)}
FACTORS = {"all_gather": (1.0, 0), "reduce_scatter_mean": (1.0, 1), "all_reduce_mean": (2.0, 0),
           "all_reduce_sum": (2.0, 0), "all_reduce_max": (2.0, 0)}  # fmt: skip
"""Per comm function: bytes sent per byte of its buffer x (N-1)/N, and the buffer's index."""
NODE = {"gpus": 8, "within_gb_s": 400.0, "across_gb_s": 50.0}
NODE_COUNTS = (2, 16, 128)


def _counting(sent: Counter[str], groups: dict[int, str], world: int = WORLD) -> dict[str, Any]:
    def counting(name: str) -> Any:
        original = getattr(comm, name)
        factor, which = FACTORS[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ranks = next(a for a in (*args, *kwargs.values()) if isinstance(a, comm.Ranks))
            if not ranks.is_local:
                tensor = args[which]
                kind = "world" if ranks.size == world else groups[id(ranks.group)]
                sent[f"{kind} {name}"] += (
                    factor * tensor.numel() * tensor.element_size() * (ranks.size - 1) / ranks.size
                )
            return original(*args, **kwargs)

        return wrapper

    return {name: counting(name) for name in FACTORS}


def _measure(model_name: str, shape: tuple[int, int] | None) -> dict[str, Any]:
    """One step's bytes sent by this rank, per group and collective; the parameter bytes."""
    from unittest import mock

    config, batch = bench.MODELS[model_name]
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIM_NAMES) if shape else None
    model = gs.shard(GPT(config), unit=Block, mesh=mesh)
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1e-4)
    rank = dist.get_rank()
    inputs = torch.randint(0, config.vocab_size, (batch, config.block_size + 1),
                           generator=torch.Generator().manual_seed(rank))  # fmt: skip
    groups = {} if mesh is None else {id(mesh.get_group(d)): d for d in MESH_DIM_NAMES}
    sent: Counter[str] = Counter()
    for counted in (False, True):  # the first step records the order units run in
        with mock.patch.multiple(comm, **_counting(sent if counted else Counter(), groups)):
            model(inputs[:, :-1], inputs[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()
    storages = model.groupshard.storages
    root = model.groupshard.runtime.units[0]
    return {
        "sent": dict(sent),
        "parameter_bytes": sum(s.local.numel() * s.local.element_size() for s in storages)
        * model.groupshard.mesh.shard.size,
        "root_bytes": sum(s.local.numel() * s.local.element_size() for s in root.storages)
        * model.groupshard.mesh.shard.size,
        "parameters": model.num_unsharded_parameters(),
    }


def _worker(rank: int, args: argparse.Namespace, store_path: str, result_path: str) -> None:
    bench._init(rank, WORLD, store_path, "cpu")
    results = {
        model: {layout: _measure(model, shape) for layout, shape in LAYOUTS.items()}
        for model in args.models
    }
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def formulas(parameter_bytes: float, replicas: int, shard_size: int) -> dict[str, float]:
    """Bytes each rank sends per step: within its shard group and across the replicas."""
    within = 3 * parameter_bytes * (shard_size - 1) / shard_size
    across = 2 * parameter_bytes / shard_size * (replicas - 1) / replicas
    return {"within": within, "across": across}


def modeled_ms(parameter_bytes: float, nodes: int) -> dict[str, float]:
    """Communication milliseconds per step on ``nodes`` typical nodes (``NODE``)."""
    gpus = NODE["gpus"]
    world = gpus * nodes
    full = 3 * parameter_bytes * (world - 1) / world / (NODE["across_gb_s"] * 1e9)
    hybrid = formulas(parameter_bytes, nodes, gpus)
    hsdp = hybrid["within"] / (NODE["within_gb_s"] * 1e9) + hybrid["across"] / (
        NODE["across_gb_s"] * 1e9
    )
    return {"full": 1e3 * full, "hsdp": 1e3 * hsdp}


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's counts beside the formulas, and the modeled step times."""
    rows, model_rows = [], []
    for model, layouts in per_rank[0].items():
        for layout, measured in layouts.items():
            replicas, shard_size = LAYOUTS[layout] or (1, WORLD)
            sent = measured["sent"]
            within = sum(v for k, v in sent.items() if k.startswith("shard ") or
                         (replicas == 1 and k.startswith("world ") and "max" not in k))  # fmt: skip
            across = sum(v for k, v in sent.items() if k.startswith("replicate "))
            other = sum(sent.values()) - within - across
            expected = formulas(measured["parameter_bytes"], replicas, shard_size)
            root_kept = measured["root_bytes"] * (shard_size - 1) / shard_size
            rows.append({
                "model": model, "layout": layout, "parameters": measured["parameters"],
                "parameter_bytes": measured["parameter_bytes"], "within": within,
                "across": across, "other": other, "formula_within": expected["within"],
                "formula_across": expected["across"], "root_not_regathered": root_kept,
                "same_on_every_rank": all(r[model][layout]["sent"] == sent for r in per_rank),
            })  # fmt: skip
        parameter_bytes = layouts["full over 4"]["parameter_bytes"]
        modeled = {str(n): modeled_ms(parameter_bytes, n) for n in NODE_COUNTS}
        model_rows.append({"model": f"{model} (fp32)", "parameter_bytes": parameter_bytes,
                           **modeled})  # fmt: skip
    seven_b = 7e9 * 2
    model_rows.append({"model": "7B (bf16)", "parameter_bytes": seven_b,
                       **{str(n): modeled_ms(seven_b, n) for n in NODE_COUNTS}})  # fmt: skip
    return {"measured": rows, "modeled": model_rows, "node": NODE, "node_counts": NODE_COUNTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["4m", "30m"], choices=sorted(bench.MODELS))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = summarize(bench.spawn_ranks(_worker, args, WORLD))
    for row in report["measured"]:
        mib = {key: row[key] / 2**20 for key in
               ("within", "formula_within", "across", "formula_across")}  # fmt: skip
        print(f"{row['model']:>4} {row['layout']:<12} within {mib['within']:9.2f} MiB "
              f"(formula {mib['formula_within']:9.2f}), across {mib['across']:8.2f} MiB "
              f"(formula {mib['formula_across']:8.2f})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
