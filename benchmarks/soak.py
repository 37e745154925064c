"""A soak: train for many steps and watch each rank's resident memory, open file
descriptors and threads; after warm-up they must stay flat.

    python benchmarks/soak.py [--steps 5000 | --seconds S] [--every 100] [--warmup 200]
                              [--world-size 2] [--strategy full] [--optimizer adamw|muon]
                              [--json PATH]

Each rank (fresh processes, gloo over a FileStore) shards the tiny GPT and trains with
random batches, with a gs.checkpoint save every ``--save-every`` steps (checkpoints open
files and threads too). Every ``--every`` steps it samples its RSS (/proc/self/status),
open descriptors (/proc/self/fd) and threads. The bounds after warm-up: descriptors and
threads unchanged, RSS grown by at most ``--rss-bound-mb`` (allocator noise); the script
exits 1 when one is passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import groupshard as gs
from groupshard.cli.model import GPT, Block, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def sample() -> dict[str, int]:
    """This process's resident memory (bytes), open descriptors and threads."""
    status = Path("/proc/self/status").read_text()
    rss = re.search(r"VmRSS:\s+(\d+) kB", status)
    threads = re.search(r"Threads:\s+(\d+)", status)
    return {
        "rss": int(rss.group(1)) * 1024 if rss else 0,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(threads.group(1)) if threads else 0,
    }


def _worker(rank: int, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), args.world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=args.world_size,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if args.optimizer == "muon":
        groups = gs.muon_groups(model, {"lr": 0.02}, {"lr": 1e-3})
        model = gs.shard(model, groups, unit=Block, strategy=args.strategy)
        optimizer: torch.optim.Optimizer = gs.optim.Muon(model.optimizer_groups())
    else:
        groups = gs.decay_groups(model, 0.1)
        model = gs.shard(model, groups, unit=Block, strategy=args.strategy)
        optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    samples: list[dict[str, Any]] = []
    end = time.monotonic() + args.seconds if args.seconds else None
    step = 0
    while (end is None and step < args.steps) or (end is not None and time.monotonic() < end):
        size = (4, CONFIG.block_size + 1)
        tokens = torch.randint(0, CONFIG.vocab_size, size, generator=generator)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        gs.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if args.save_every and step % args.save_every == 0:
            gs.checkpoint.save(os.path.join(tmp, "checkpoint"), model, optimizer)
        if step % args.every == 0:
            samples.append({"step": step, **sample()})
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(samples))
    dist.barrier()
    dist.destroy_process_group()


def growth(samples: list[dict[str, Any]], warmup: int) -> dict[str, int]:
    """How far each measure rose above its value at the end of warm-up."""
    settled = [s for s in samples if s["step"] >= warmup]
    if not settled:
        raise ValueError(f"no sample after the warm-up of {warmup} steps; train longer")
    first = settled[0]
    return {key: max(s[key] for s in settled) - first[key] for key in ("rss", "fds", "threads")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="groupshard-soak-") as tmp:
        mp.start_processes(
            _worker, args=(args, tmp), nprocs=args.world_size, start_method="spawn"
        )
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world_size)]
    grown = [growth(samples, args.warmup) for samples in ranks]
    bound = int(args.rss_bound_mb * 2**20)
    failures = [
        f"rank {rank}: {key} grew by {value} after warm-up"
        for rank, per_rank in enumerate(grown)
        for key, value in per_rank.items()
        if value > (bound if key == "rss" else 0)
    ]
    return {"ranks": ranks, "growth": grown, "rss_bound_bytes": bound, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--seconds", type=float, help="train this long instead of --steps")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=500, help="0: no checkpoints")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategy", choices=("full", "grad_op", "no_shard"), default="full")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--rss-bound-mb", type=float, default=8.0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    report = run(args)
    for rank, grown in enumerate(report["growth"]):
        last = report["ranks"][rank][-1]
        print(
            f"rank {rank}: {last['step']} steps, RSS {last['rss'] / 2**20:.1f} MiB "
            f"(+{grown['rss'] / 2**20:.2f} MiB after warm-up), {last['fds']} descriptors "
            f"(+{grown['fds']}), {last['threads']} threads (+{grown['threads']})"
        )
    for failure in report["failures"]:
        print(f"NOT flat: {failure}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
