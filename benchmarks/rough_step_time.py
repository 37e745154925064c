"""A first, rough step-time comparison: groupshard "full" against FSDP2 ``fully_shard``.

Same model, same two param groups (decay / no decay), same AdamW, world size 2,
gloo on CPU, one thread per rank; the two systems are timed interleaved, round by
round, so machine noise hits both alike. Not the project benchmark (see the issue
on benchmarks): no memory or collective accounting here.

    python benchmarks/rough_step_time.py [--layers 4 --width 256 --seq 128 --batch 8]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

import groupshard as gs
from groupshard.model import GPT, Block, GPTConfig


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    started = time.perf_counter()
    model(batch[:, :-1], batch[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - started


def _worker(rank: int, args: argparse.Namespace, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    torch.manual_seed(0)
    config = GPTConfig(256, args.seq, args.layers, 8, args.width)
    base = GPT(config)
    fsdp_model = copy.deepcopy(base)
    for block in fsdp_model.blocks:
        fully_shard(block)
    fully_shard(fsdp_model)
    fsdp_opt = torch.optim.AdamW(gs.decay_groups(fsdp_model, 0.1), lr=1e-4)
    ours = gs.shard(base, gs.decay_groups(base, 0.1), unit=Block, strategy="full")
    ours_opt = torch.optim.AdamW(ours.optimizer_groups(), lr=1e-4)
    batch = torch.randint(0, 256, (args.batch, args.seq + 1))
    times: dict[str, list[float]] = {"groupshard full": [], "FSDP2": []}
    for round_index in range(args.warmup + args.rounds):
        for name, model, opt in (
            ("groupshard full", ours, ours_opt),
            ("FSDP2", fsdp_model, fsdp_opt),
        ):
            dist.barrier()
            elapsed = _step(model, opt, batch)
            if round_index >= args.warmup:
                times[name].append(elapsed)
    if rank == 0:
        parameters = sum(p.numel() for p in GPT(config).parameters())
        print(
            f"model: {parameters / 1e6:.1f}M parameters, {args.layers} blocks, d={args.width}, "
            f"2 x {args.batch} x {args.seq} tokens/step, world size 2, gloo, 1 thread/rank"
        )
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        for name, median in medians.items():
            print(
                f"{name:16s} median {median:7.1f} ms/step  ratio to FSDP2 "
                f"{median / medians['FSDP2']:.2f}"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(args, os.path.join(tmp, "store")), nprocs=2, start_method="spawn"
        )


if __name__ == "__main__":
    main()
