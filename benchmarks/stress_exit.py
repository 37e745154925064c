"""Stress the end of short multi-rank trainings: count jobs in which a worker aborts at exit
(SIGABRT: "terminate called without an active exception") or does not exit.

    python benchmarks/stress_exit.py [--runs 50] [--jobs 2] [--system groupshard ddp]
                                     [--ending trainer|destroy] [--load 0] [--readme]
                                     [--json PATH]

Each run is one job: ``torchrun --standalone --nproc-per-node 2`` of a short training, as
a user launches one. ``--jobs`` of them start at once and share the cores (two at a time on
2 cores: a CI machine running two jobs). ``--system groupshard`` builds the tiny GPT, shards
it with one of the strategies and trains AdamW or Muon in turn, after moving it with
``.to("cpu:0")`` as the Hugging Face Trainer and Lightning do; ``--system ddp`` trains the
same model in ``DistributedDataParallel``, to compare. Each trains 3 steps, saves a
checkpoint (``gs.checkpoint.save``; DDP: ``dcp.save`` of ``get_state_dict``) and keeps its
model and optimizer in the module's globals, as a script does. ``--ending trainer`` then
exits with the process group alive, as those trainers leave it; ``--ending destroy`` calls
``dist.barrier()`` and ``dist.destroy_process_group()`` first. ``--load`` busy processes
run beside the jobs the whole time. A run passes when torchrun exits 0 within 120 s and no
worker printed "terminate called".

``--readme`` runs the README's example instead (``## Use``: 20 steps, then
``destroy_process_group`` without a barrier).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"
CASES = list(itertools.product(("full", "grad_op", "no_shard"), ("adamw", "muon")))
DEADLINE_S = 120


def train(
    system: str, strategy: str, optimizer: str, ending: str, folder: str
) -> tuple[Any, Any]:
    """One torchrun worker's short training and checkpoint; returns its model and optimizer."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel

    import groupshard as gs
    from groupshard.cli.model import GPT, Block, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT(config)
    if system == "ddp":
        model = DistributedDataParallel(model.to("cpu:0"))
        opt = torch.optim.AdamW(gs.decay_groups(model.module, 0.1), lr=1e-3)
    elif optimizer == "muon":
        groups = gs.muon_groups(model, {"lr": 0.02}, {"lr": 1e-3})
        model = gs.shard(model, groups, unit=Block, strategy=strategy).to("cpu:0")
        opt = gs.optim.Muon(model.optimizer_groups())
    else:
        model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, strategy=strategy)
        model = model.to("cpu:0")
        opt = torch.optim.AdamW(model.optimizer_groups(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        shape = (2, config.block_size + 1)
        tokens = torch.randint(0, config.vocab_size, shape, generator=generator)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    if system == "ddp":
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    else:
        gs.checkpoint.save(folder, model, opt)
    if ending == "destroy":
        dist.barrier()
        dist.destroy_process_group()
    return model, opt


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _torchrun(script: str, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", script, *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def run_jobs(jobs: list[tuple[dict[str, str], list[str]]]) -> list[dict[str, Any]]:
    """Start every ``(case, torchrun arguments)`` job at once; wait for all of them."""
    started = [(case, _torchrun(*args)) for case, args in jobs]
    results = []
    for case, process in started:
        try:
            output, _ = process.communicate(timeout=DEADLINE_S)
            hung = False
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            hung = True
        aborted = "terminate called" in output or "Signal 6 (SIGABRT)" in output
        tail = output[-2000:] if process.returncode else ""
        results.append({**case, "exit_code": process.returncode, "aborted": aborted,
                        "hung": hung, "tail": tail})  # fmt: skip
    return results


def readme_example() -> str:
    """The first python block under the README's ``## Use``."""
    text = README.read_text()
    block = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
    match = block.search(text, text.index("\n## Use\n"))
    if match is None:
        raise ValueError(f"no python block under '## Use' in {README}")
    return match.group(1)


def summary(results: list[dict[str, Any]], system: str) -> dict[str, Any]:
    """Runs, aborts, hangs and other failures of one system."""
    mine = [r for r in results if r["system"] == system]
    return {"system": system, "runs": len(mine),
            "aborted": sum(r["aborted"] for r in mine), "hung": sum(r["hung"] for r in mine),
            "failed": sum(r["exit_code"] != 0 or r["aborted"] for r in mine)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each system")
    parser.add_argument("--jobs", type=int, default=2, help="runs started at once")
    parser.add_argument("--system", nargs="+", default=["groupshard", "ddp"],
                        choices=["groupshard", "ddp"])  # fmt: skip
    parser.add_argument("--ending", choices=["trainer", "destroy"], default="trainer")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the jobs")
    parser.add_argument("--readme", action="store_true", help="run the README's example")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # a torchrun worker: its case
    args = parser.parse_args(argv)
    if args.job:
        global KEPT  # as a script's globals: alive until the interpreter shuts down
        KEPT = train(**json.loads(args.job))
        return 0
    folder = Path(tempfile.mkdtemp(prefix="groupshard-stress-"))
    if args.readme:
        example = folder / "example.py"
        example.write_text(readme_example())
        systems = ["readme"]
        jobs = [({"system": "readme"}, [str(example)]) for _ in range(args.runs)]
    else:
        systems = args.system
        # the systems interleaved, so both see the same machine over the whole run
        jobs = []
        for index in range(args.runs):
            strategy, optimizer = CASES[index % len(CASES)]
            for system in systems:
                checkpoint = str(folder / f"checkpoint-{len(jobs)}")
                case = {"system": system, "strategy": strategy, "optimizer": optimizer,
                        "ending": args.ending, "folder": checkpoint}  # fmt: skip
                jobs.append((case, [__file__, "--job", json.dumps(case)]))
    load = [
        multiprocessing.get_context("spawn").Process(target=_busy, args=(24 * 3600,))
        for _ in range(args.load)
    ]
    for process in load:
        process.start()
    results: list[dict[str, Any]] = []
    try:
        for start in range(0, len(jobs), args.jobs):
            for result in run_jobs(jobs[start : start + args.jobs]):
                results.append(result)
                if result["exit_code"] != 0 or result["aborted"]:
                    print(f"run {len(results)}: {result}", flush=True)
    finally:
        for process in load:
            process.kill()
        shutil.rmtree(folder, ignore_errors=True)
    table = [summary(results, system) for system in systems]
    for row in table:
        print(f"{row['system']}: {row['runs']} runs, {row['aborted']} aborted, "
              f"{row['hung']} hung, {row['failed']} failed")  # fmt: skip
    if args.json:
        payload = {"jobs": args.jobs, "ending": args.ending, "load": args.load,
                   "summary": table, "runs": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return 1 if any(row["failed"] for row in table) else 0


if __name__ == "__main__":
    sys.exit(main())
