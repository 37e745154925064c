"""Stress the end of short multi-rank trainings: every strategy and Muon, many times, under
CPU load; count workers that do not exit cleanly (e.g. SIGABRT: "terminate called without
an active exception" at teardown).

    python benchmarks/stress_exit.py [--runs 100] [--world-size 2] [--load 2] [--readme]
                                     [--json PATH]

Each run starts ``--world-size`` fresh processes (``torch.multiprocessing.start_processes``,
gloo over a FileStore), shards the tiny GPT, trains 3 steps with one of the strategies and
optimizers in turn, then ``dist.barrier()`` and ``dist.destroy_process_group()``. ``--load``
busy processes run beside them the whole time. A run passes when every worker exits 0.

``--readme`` runs the README's example instead (``## Use``: 20 steps, no barrier before
``destroy_process_group``) under ``torchrun --standalone``; a run passes when torchrun
exits 0 and no worker printed "terminate called".
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import multiprocessing
import os
import re
import subprocess
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

CASES = list(itertools.product(("full", "grad_op", "no_shard"), ("adamw", "muon")))
README = Path(__file__).resolve().parents[1] / "README.md"
CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _worker(rank: int, world_size: int, store_path: str, strategy: str, optimizer: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if optimizer == "muon":
        groups = gs.muon_groups(model, {"lr": 0.02}, {"lr": 1e-3})
        sharded = gs.shard(model, groups, unit=Block, strategy=strategy)
        opt: torch.optim.Optimizer = gs.optim.Muon(sharded.optimizer_groups())
    else:
        sharded = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, strategy=strategy)
        opt = torch.optim.AdamW(sharded.optimizer_groups(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        size = (2, CONFIG.block_size + 1)
        tokens = torch.randint(0, CONFIG.vocab_size, size, generator=generator)
        sharded(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def run_once(world_size: int, strategy: str, optimizer: str) -> dict[str, Any]:
    """One short training; each worker's exit code (negative: killed by that signal)."""
    with tempfile.TemporaryDirectory(prefix="groupshard-stress-") as tmp:
        context = mp.start_processes(
            _worker, args=(world_size, os.path.join(tmp, "store"), strategy, optimizer),
            nprocs=world_size, start_method="spawn", join=False,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(p.exitcode is not None for p in context.processes):
                break
            time.sleep(0.05)
        for process in context.processes:
            if process.exitcode is None:
                process.kill()
                process.join()
        codes = [p.exitcode for p in context.processes]
    return {"strategy": strategy, "optimizer": optimizer, "exit_codes": codes}


def readme_example() -> str:
    """The first python block under the README's ``## Use``."""
    text = README.read_text()
    block = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
    match = block.search(text, text.index("\n## Use\n"))
    if match is None:
        raise ValueError(f"no python block under '## Use' in {README}")
    return match.group(1)


def run_readme_once(world_size: int, script: str) -> dict[str, Any]:
    """The README's example under torchrun; its exit code and whether a worker aborted."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world_size), script]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    aborted = "terminate called" in result.stdout + result.stderr
    return {"case": "readme", "exit_codes": [result.returncode], "aborted": aborted}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the runs")
    parser.add_argument("--readme", action="store_true", help="run the README's example")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args(argv)
    load = [
        multiprocessing.get_context("spawn").Process(target=_busy, args=(24 * 3600,))
        for _ in range(args.load)
    ]
    for process in load:
        process.start()
    results = []
    script = Path(tempfile.mkdtemp(prefix="groupshard-stress-")) / "example.py"
    script.write_text(readme_example())
    try:
        for index in range(args.runs):
            strategy, optimizer = CASES[index % len(CASES)]
            if args.readme:
                result = run_readme_once(args.world_size, str(script))
            else:
                result = run_once(args.world_size, strategy, optimizer)
            results.append(result)
            if any(code != 0 for code in result["exit_codes"]):
                print(f"run {index}: {result}", flush=True)
    finally:
        for process in load:
            process.kill()
    failed = [r for r in results if any(code != 0 for code in r["exit_codes"])]
    print(f"{len(results)} runs, {len(failed)} with a worker that did not exit 0")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "failed": len(failed)}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
