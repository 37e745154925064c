"""The demo: train a small GPT on the Python standard library's source, sharded over ranks.

Run ``python -m groupshard.demo`` (2 processes on this machine over gloo), or under
``torchrun --nproc-per-node N -m groupshard.demo`` (one worker per process).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import groupshard as gs
from groupshard import comm
from groupshard.model import GPT, Block, GPTConfig


def stdlib_corpus(max_bytes: int = 2_000_000) -> torch.Tensor:
    """Bytes of the standard library's own ``.py`` files: text every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m groupshard.demo", description=__doc__)
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--strategy", choices=["full", "grad_op", "no_shard"], default="full")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.steps < 1 or args.batch_size < 1:
        parser.error("--nproc, --steps and --batch-size must be positive")
    return args


def train(args: argparse.Namespace) -> None:
    """One worker's training loop; the process group is already initialised."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    torch.manual_seed(args.seed)
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
    model = GPT(config).to(device)
    groups = gs.decay_groups(model, weight_decay=0.1, verbose=rank == 0)
    model = gs.shard(model, groups, unit=Block, strategy=args.strategy)
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=args.lr, betas=(0.9, 0.95))
    data = stdlib_corpus().to(device)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    ranks = comm.resolve_ranks()
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(
            0, len(data) - config.block_size - 1, (args.batch_size,), generator=generator
        )
        window = torch.stack([data[s : s + config.block_size + 1] for s in starts])
        loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % 5 == 0 or step == args.steps:
            mean_loss = loss.detach().clone()
            comm.all_reduce_mean(mean_loss, ranks)
            if rank == 0:
                elapsed = time.perf_counter() - started
                print(f"step {step:4d}  loss {mean_loss.item():.4f}  {elapsed:6.1f} s", flush=True)
    if rank == 0:
        print(f"done: {args.steps} steps, strategy {args.strategy!r}, {world_size} ranks")


def _spawned_worker(rank: int, args: argparse.Namespace, store_path: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    store = dist.FileStore(store_path, args.nproc)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=args.nproc,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.cuda = False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        args.cuda = torch.cuda.is_available()
        if args.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if args.cuda else "gloo")
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory(prefix="groupshard-demo-") as tmp:
        mp.start_processes(
            _spawned_worker,
            args=(args, os.path.join(tmp, "store")),
            nprocs=args.nproc,
            start_method="spawn",
        )


if __name__ == "__main__":
    main()
