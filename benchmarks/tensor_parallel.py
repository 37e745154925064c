"""groupshard + tensor parallelism against FSDP2 + tensor parallelism on one (dp, tp) mesh.

    python benchmarks/tensor_parallel.py [--dim 1024] [--layers 2] [--rounds 3]
        [--device cpu|cuda] [--out benchmarks/results-tp-llama-1024.json]

World size 4 as a 2 x 2 ``("dp", "tp")`` mesh (gloo on CPU, one thread per rank; NCCL with
one GPU per rank under ``--device cuda``). The model is the tests' Llama
(``tests/tp_llama.py``) at a real block width: d=1024, 16 heads, an MLP of 2816, under
torchtitan's tensor-parallel plan with sequence parallelism. The systems, from the same
weights, on the same batches:

- FSDP2 + TP: ``fully_shard(block, mesh=mesh["dp"])`` per block, then the root (torchtitan);
- groupshard full / grad_op + TP: ``gs.shard(model, groups, unit=Block, mesh=mesh["dp"])``.

AdamW with two groups (decay on matrices). Each round steps every system in turn
(interleaved, so the machine's drift hits all alike); reported per system: the median step
time over all rounds and its ratio to FSDP2 + TP, the collectives of one warm step as
torch.profiler records them (``c10d::`` ops, tp's included), this rank's parameter,
gradient and optimizer-state bytes (CPU), or the peak of CUDA memory allocated in a step
(``--device cuda``), and the largest difference of the final weights from FSDP2 + TP's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' Llama
import run as bench  # benchmarks/run.py: process start-up, profiled collectives

import groupshard as gs
from tp_llama import Block, Llama, LlamaConfig, parallelize_llama

WORLD = 4
SYSTEMS = ("FSDP2 + TP", "groupshard full + TP", "groupshard grad_op + TP")


def _build(name: str, plain: Llama, mesh: Any, device: torch.device) -> tuple[Any, Any]:
    """``name``'s model (a copy of ``plain``, parallelized and sharded) and its AdamW."""
    model = parallelize_llama(copy.deepcopy(plain).to(device), mesh["tp"], True)
    if name == "FSDP2 + TP":
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(gs.decay_groups(model, 0.1), lr=1e-4)
    strategy = name.split()[1]
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, strategy=strategy,
                     mesh=mesh["dp"])  # fmt: skip
    return model, torch.optim.AdamW(model.optimizer_groups(), lr=1e-4)


def _step(model: Any, optimizer: Any, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _state_bytes(model: Any, optimizer: Any) -> int:
    """This rank's parameter, gradient and optimizer-state bytes (local pieces)."""

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    state = [local(v) for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]  # fmt: skip
    return sum(t.numel() * t.element_size() for t in (*params, *grads, *state))


def _weights(name: str, model: Any) -> dict[str, torch.Tensor]:
    if name == "FSDP2 + TP":
        options = StateDictOptions(full_state_dict=True)
        return {n: t.cpu() for n, t in get_model_state_dict(model, options=options).items()}
    return {n: t.cpu() for n, t in gs.full_state_dict(model).items()}


def _worker(rank: int, args: argparse.Namespace, store_path: str, result_path: str) -> None:
    bench._init(rank, WORLD, store_path, args.device)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    config = _config(args)
    torch.manual_seed(0)
    plain = Llama(config)
    built = {name: _build(name, plain, mesh, device) for name in SYSTEMS}
    generator = torch.Generator().manual_seed(1)
    steps = args.rounds * args.steps + 2
    batches = [torch.randint(0, config.vocab, (2 * args.batch, config.seq + 1), generator=generator)
               for _ in range(steps)]  # fmt: skip
    dp = mesh["dp"].get_local_rank()
    mine = [b[dp * args.batch : (dp + 1) * args.batch].to(device) for b in batches]
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    rows: dict[str, dict[str, Any]] = {name: {} for name in SYSTEMS}
    for name, (model, optimizer) in built.items():  # a warm-up step, then one profiled
        _step(model, optimizer, mine[0])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, optimizer, mine[1])
        events = bench._c10d_events(prof)
        ops: dict[str, int] = {}
        for event in events:
            ops[event.name] = ops.get(event.name, 0) + 1
        rows[name].update(collectives=len(events), ops=ops)
        rows[name]["state_bytes"] = _state_bytes(model, optimizer)
    for round_index in range(args.rounds):
        for name, (model, optimizer) in built.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            for step in range(args.steps):
                dist.barrier()
                started = bench._now()
                _step(model, optimizer, mine[2 + round_index * args.steps + step])
                times[name].append(bench._now() - started)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device)
                rows[name]["peak_cuda_bytes"] = max(rows[name].get("peak_cuda_bytes", 0), peak)
    reference = _weights(SYSTEMS[0], built[SYSTEMS[0]][0])
    for name, (model, _) in built.items():
        final = _weights(name, model)
        rows[name]["max_diff_vs_fsdp2"] = max(
            (final[n].float() - reference[n].float()).abs().max().item() for n in reference
        )
        rows[name]["step_s"] = times[name]
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    per_rank = bench.spawn_ranks(_worker, args, WORLD)
    rows = {}
    for name in SYSTEMS:
        # a step ends when its slowest rank does: the median over steps of the slowest rank
        slowest = [max(r[name]["step_s"][i] for r in per_rank)
                   for i in range(len(per_rank[0][name]["step_s"]))]  # fmt: skip
        rows[name] = {
            "ms_per_step": 1000 * statistics.median(slowest),
            "collectives_per_step": per_rank[0][name]["collectives"],
            "ops": per_rank[0][name]["ops"],
            "state_mb_per_rank": max(r[name]["state_bytes"] for r in per_rank) / 2**20,
            "max_diff_vs_fsdp2": max(r[name]["max_diff_vs_fsdp2"] for r in per_rank),
        }
        if "peak_cuda_bytes" in per_rank[0][name]:
            rows[name]["peak_cuda_mb"] = max(r[name]["peak_cuda_bytes"] for r in per_rank) / 2**20
    for row in rows.values():
        row["vs_fsdp2_tp"] = row["ms_per_step"] / rows[SYSTEMS[0]]["ms_per_step"]
    parameters = sum(p.numel() for p in Llama(_config(args)).parameters())
    return {"kind": "tensor-parallel", "args": vars(args), "parameters": parameters,
            "world_size": WORLD, "mesh": [2, 2], "device": args.device,
            "torch": torch.__version__, "rows": rows,
            "when": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip


def _config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(vocab=args.vocab, dim=args.dim, heads=args.dim // 64,
                       hidden=args.hidden, layers=args.layers, seq=args.seq)  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    print(f"Llama, {report['parameters'] / 1e6:.1f}M parameters, mesh dp 2 x tp 2, "
          f"{report['device']}")  # fmt: skip
    print(f"{'system':26} {'ms/step':>8} {'/ FSDP2+TP':>10} {'collectives':>11} "
          f"{'state MB/rank':>13} {'max diff':>9}")  # fmt: skip
    for name, row in report["rows"].items():
        print(f"{name:26} {row['ms_per_step']:8.0f} {row['vs_fsdp2_tp']:10.2f} "
              f"{row['collectives_per_step']:11d} {row['state_mb_per_rank']:13.1f} "
              f"{row['max_diff_vs_fsdp2']:9.1e}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per dp rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per system and round")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", help="write the report (JSON) here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < WORLD:
        parser.error(f"--device cuda needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = run(args)
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
