"""Optimizers of whole parameters on shards: ``gs.optim.WholeParamOptimizer`` beside DDP and FSDP2.

    python benchmarks/whole_param.py [--world-size 2] [--rounds 8] [--warmup 2] [--json PATH]

The 4.2M-parameter GPT of ``benchmarks/run.py`` (``--model 4m``), two param groups (decay
/ no decay), gloo, one thread per rank. For torch.optim.Adafactor and pytorch-optimizer's
SOAP (``max_precondition_dim=1024``: the 4096-token embedding dimension is left
unpreconditioned, as SOAP does with dimensions above it), these systems:

- ``DDP + X``: every rank steps every parameter with X (the ranks' work is the same);
- ``groupshard full + WholeParamOptimizer(X)``: ``gs.shard(..., strategy="full")``; each
  parameter's update on one owner rank (cost-balanced), two all-to-alls per step; for
  Adafactor also with ``cost="measured"`` (owners balanced by timed steps);
- ``FSDP2 + X``: ``fully_shard`` per Block and root, X straight on the DTensors (recorded
  whether it runs, and how far its parameters end from DDP's).

The systems run interleaved in one process group: each round runs one training step of
every system (forward, backward, optimizer step, zero_grad), the order rotated each round.
Per step: the optimizer step's wall time (a barrier before it, rank 0's clock), its CPU
time (``time.process_time``: all threads of the rank's process, compute and gloo's), and
the whole training step's wall time (forward, backward and optimizer step, between
barriers).
Reported: medians over the rounds after warm-up, the optimizer step over DDP's (the median
of the per-round ratios too), the slowest rank's computation alone (its inner optimizers'
own steps, without the exchange: the step if communication were free) over DDP's step,
the owners' balance (max / mean cost per rank), optimizer state bytes per rank, and each
row's largest parameter difference from DDP's after the run.

Output: a table, and a JSON file (default ``benchmarks/results-4m-whole-param-ws<N>.json``),
from which ``benchmarks/tables.py`` renders the README's table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run as bench
from optimizers import decay_groups

import groupshard as gs
from groupshard.cli.model import GPT, Block

SOAP_DIM = 1024
TARGETS = {2: 0.6, 4: 0.35}  # optimizer step / DDP's, the issue's
BALANCE_TARGET = 1.1


SOAP_FREQUENCY = 10  # its precondition_frequency (default)


def soap_cost(shape: tuple[int, ...]) -> float:
    """SOAP's work per step with ``max_precondition_dim``: projecting the gradient and the
    update onto each preconditioned dimension's basis (``numel * d``), one QR per such
    dimension every ``precondition_frequency`` steps (``d ** 3``), the element-wise rest."""
    dims = [d for d in shape if d <= SOAP_DIM] if len(shape) > 1 else []
    numel = math.prod(shape)
    return float(numel * (1 + 2 * sum(dims)) + sum(d**3 for d in dims) / SOAP_FREQUENCY)


def optimizer_classes() -> dict[str, tuple[type, dict[str, Any], Any]]:
    from pytorch_optimizer import SOAP

    return {
        "Adafactor": (torch.optim.Adafactor, {"lr": 1e-2}, None),
        "SOAP": (
            SOAP,
            {"lr": 3e-3, "max_precondition_dim": SOAP_DIM,
             "precondition_frequency": SOAP_FREQUENCY},
            soap_cost,
        ),
    }


KINDS = {  # per optimizer, the systems it runs on
    "Adafactor": ("DDP", "groupshard", "groupshard measured", "FSDP2"),
    "SOAP": ("DDP", "groupshard", "FSDP2"),
}


def build(kind: str, name: str, base: nn.Module) -> tuple[nn.Module, Any]:
    cls, options, cost = optimizer_classes()[name]
    model = copy.deepcopy(base)
    if kind == "DDP":
        return DistributedDataParallel(model), cls(decay_groups(model), **options)
    if kind.startswith("groupshard"):
        sharded = gs.shard(model, decay_groups(model), unit=Block, strategy="full")
        groups = sharded.optimizer_groups()
        cost = "measured" if kind == "groupshard measured" else cost
        return sharded, gs.optim.WholeParamOptimizer(groups, cls, cost=cost, **options)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, cls(decay_groups(model), **options)


def row_name(kind: str, name: str) -> str:
    return {
        "DDP": f"DDP + {name}",
        "groupshard": f"groupshard full + WholeParamOptimizer({name})",
        "groupshard measured": f'groupshard full + WholeParamOptimizer({name}, cost="measured")',
        "FSDP2": f"FSDP2 + {name}",
    }[kind]


def full_params(kind: str, model: Any) -> dict[str, torch.Tensor]:
    if kind.startswith("groupshard"):
        return {k: v.float() for k, v in gs.full_state_dict(model).items()}
    if kind == "DDP":
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in an optimizer state value (a DTensor's local shard)."""
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.numel() * local.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def state_bytes(optimizer: Any) -> int:
    states = [optimizer.state]
    if isinstance(optimizer, gs.optim.WholeParamOptimizer):
        states.append(optimizer._whole_optimizer.state)
    return sum(tensor_bytes(state) for states_ in states for state in states_.values())


def one_step(model: Any, optimizer: Any, tokens: torch.Tensor) -> tuple[float, float, float]:
    """Forward, backward, then the optimizer step timed: (optimizer step wall s, its CPU s,
    the whole step's wall s: forward, backward and optimizer step, from a barrier)."""
    dist.barrier()
    started = time.perf_counter()
    logits_loss = model(tokens[:, :-1], tokens[:, 1:])
    loss = logits_loss[1] if isinstance(logits_loss, tuple) else logits_loss
    loss.backward()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    optimizer.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    dist.barrier()
    whole = time.perf_counter() - started
    optimizer.zero_grad()
    return wall, cpu, whole


def _worker(rank: int, args: argparse.Namespace, store_path: str, result_path: str) -> None:
    bench._init(rank, args.world_size, store_path, "cpu")
    config, _ = bench.MODELS["4m"]
    batch = args.batch
    torch.manual_seed(0)
    base = GPT(config)
    rows: dict[str, dict[str, Any]] = {}
    built: dict[str, tuple[str, Any, Any]] = {}
    for name in optimizer_classes():
        for kind in KINDS[name]:
            model, optimizer = build(kind, name, base)
            built[row_name(kind, name)] = (kind, model, optimizer)
            rows[row_name(kind, name)] = {"optimizer": name, "kind": kind, "wall_ms": [],
                                          "cpu_ms": [], "step_ms": [], "error": None}  # fmt: skip
    compute: dict[str, list[float] | None] = {name: None for name in built}
    names = list(built)
    steps = args.warmup + args.rounds
    batches = bench._batches(config, batch, args.world_size, steps)
    for index in range(steps):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            kind, model, optimizer = built[name]
            row = rows[name]
            if row["error"] is not None:
                continue
            tokens = batches[index][rank * batch : (rank + 1) * batch]
            if compute[name] is None:  # a WholeParamOptimizer builds its inner ones at step 1
                compute[name] = _time_inner_steps(optimizer)
            try:
                wall, cpu, whole = one_step(model, optimizer, tokens)
            except Exception as error:  # FSDP2 + an optimizer that cannot take DTensors
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                continue
            inner = compute[name]
            if index >= args.warmup:
                row["wall_ms"].append(wall * 1e3)
                row["cpu_ms"].append(cpu * 1e3)
                row["step_ms"].append(whole * 1e3)
                if inner is not None:
                    row.setdefault("compute_ms", []).append(sum(inner) * 1e3)
            if inner is not None:
                inner.clear()
    for name in names:
        kind, model, optimizer = built[name]
        row = rows[name]
        row["state_bytes"] = state_bytes(optimizer)
        if isinstance(optimizer, gs.optim.WholeParamOptimizer):
            reports = optimizer.ownership()
            costs = [r.cost_per_rank for r in reports]
            row["cost_per_rank"] = [sum(c) for c in zip(*costs, strict=True)]
            row["exchange_bytes_per_step"] = sum(r.bytes_per_step for r in reports)
        if row["error"] is None:
            ddp = full_params("DDP", built[row_name("DDP", row["optimizer"])][1])
            ours = full_params(kind, model)
            row["max_difference_vs_ddp"] = max(
                (ours[k].float() - ddp[k].float()).abs().max().item() for k in ddp
            )
    gathered: list[Any] = [None] * args.world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def _time_inner_steps(optimizer: Any) -> list[float] | None:
    """For a WholeParamOptimizer: a list that collects the seconds of its inner optimizers'
    own steps (the owners' whole-parameter update and the shard groups': the computation,
    without the exchange), by wrapping their ``step``; None for any other optimizer."""
    if not isinstance(optimizer, gs.optim.WholeParamOptimizer):
        return None
    if optimizer._whole_optimizer is None:
        return None  # not built yet
    seconds: list[float] = []
    for inner in optimizer._inners():
        step = inner.step

        def timed(*args: Any, step: Any = step, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - started)

        inner.step = timed
    return seconds


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def report(args: argparse.Namespace, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    first = per_rank[0]
    rows: dict[str, dict[str, Any]] = {}
    for name, row in first.items():
        cpu = [statistics.median(r[name]["cpu_ms"]) for r in per_rank if r[name]["cpu_ms"]]
        rows[name] = {
            "optimizer": row["optimizer"], "kind": row["kind"], "error": row["error"],
            "wall_ms_rounds": row["wall_ms"], "optimizer_ms": _median(row["wall_ms"]),
            "step_ms": _median(row["step_ms"]),
            "cpu_ms_per_rank": cpu, "cpu_ms": max(cpu) if cpu else None,
            "state_bytes_per_rank": [r[name]["state_bytes"] for r in per_rank],
            "max_difference_vs_ddp": row.get("max_difference_vs_ddp"),
        }  # fmt: skip
        compute = [statistics.median(r[name]["compute_ms"]) for r in per_rank
                   if r[name].get("compute_ms")]  # fmt: skip
        if compute:  # the slowest rank's computation: the step if the exchange were free
            rows[name]["compute_ms_per_rank"] = compute
            rows[name]["compute_ms"] = max(compute)
        if "cost_per_rank" in row:
            costs = row["cost_per_rank"]
            rows[name]["balance"] = max(costs) / (sum(costs) / len(costs))
            rows[name]["exchange_bytes_per_rank"] = [
                r[name]["exchange_bytes_per_step"] for r in per_rank
            ]
    for row in rows.values():
        ddp = rows[row_name("DDP", row["optimizer"])]
        if row["optimizer_ms"] is None or row is ddp:
            continue
        row["ratio_to_ddp"] = row["optimizer_ms"] / ddp["optimizer_ms"]
        pairs = zip(row["wall_ms_rounds"], ddp["wall_ms_rounds"], strict=False)
        row["ratio_to_ddp_paired"] = statistics.median(a / b for a, b in pairs)
        row["cpu_ratio_to_ddp"] = row["cpu_ms"] / ddp["cpu_ms"]
        row["step_ratio_to_ddp"] = row["step_ms"] / ddp["step_ms"]
        if "compute_ms" in row:
            row["compute_ratio_to_ddp"] = row["compute_ms"] / ddp["optimizer_ms"]
        row["state_ratio_to_ddp"] = max(row["state_bytes_per_rank"]) / max(
            ddp["state_bytes_per_rank"]
        )
    return {
        "kind": "whole-param", "model": "4m", "world_size": args.world_size,
        "batch_per_rank": args.batch, "rounds": args.rounds, "warmup": args.warmup,
        "torch": torch.__version__, "cpus": os.cpu_count(),
        "target_ratio": TARGETS.get(args.world_size), "balance_target": BALANCE_TARGET,
        "rows": rows,
    }  # fmt: skip


def print_report(result: dict[str, Any]) -> None:
    print(f"world {result['world_size']}, {result['rounds']} rounds (optimizer step only)")
    print(f"{'system':52} {'opt ms':>8} {'cpu ms':>8} {'/DDP':>6} {'paired':>6} {'cpu/DDP':>7} "
          f"{'cmp/DDP':>7} {'step ms':>8} {'/DDP':>6} {'state MiB':>9} {'balance':>7} "
          f"{'diff':>8}")  # fmt: skip
    for name, row in result["rows"].items():
        if row["error"]:
            print(f"{name:52} fails: {row['error']}")
            continue

        def f(key: str, spec: str, row: dict[str, Any] = row) -> str:
            value = row.get(key)
            return format(value, spec) if value is not None else "-"

        state = max(row["state_bytes_per_rank"]) / 2**20
        print(f"{name:52} {f('optimizer_ms', '8.1f')} {f('cpu_ms', '8.1f')} "
              f"{f('ratio_to_ddp', '6.2f')} {f('ratio_to_ddp_paired', '6.2f')} "
              f"{f('cpu_ratio_to_ddp', '7.2f')} {f('compute_ratio_to_ddp', '7.2f')} "
              f"{f('step_ms', '8.1f')} {f('step_ratio_to_ddp', '6.2f')} "
              f"{state:9.2f} {f('balance', '7.3f')} "
              f"{f('max_difference_vs_ddp', '8.1e')}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--json", help="default: benchmarks/results-4m-whole-param-ws<N>.json")
    args = parser.parse_args(argv)
    path = args.json or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        f"results-4m-whole-param-ws{args.world_size}.json",
    )
    started = time.perf_counter()
    result = report(args, bench.spawn_ranks(_worker, args, args.world_size))
    result["wall_s"] = time.perf_counter() - started
    result["load_average"] = os.getloadavg()
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    print_report(result)
    print(f"results in {path} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
