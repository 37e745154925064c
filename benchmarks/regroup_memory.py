"""Memory and time of ``gs.regroup`` on the 30M GPT (``run.py``'s ``30m``), world 2, ``full``.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/regroup_memory.py [--model 30m] [--out FILE]

(``--model tiny``: the suite's smoke test; its peaks are allocator noise, not a measurement.)

Each rank shards the model with its last block frozen, trains one AdamW step (so every
trainable shard has ``exp_avg`` and ``exp_avg_sq``), zeroes the gradients, returns freed
memory to the system (``malloc_trim``), resets its peak RSS (``/proc/self/clear_refs``) and
calls ``gs.regroup`` twice: first unfreezing the last block into a new group (one unit
re-laid out), then moving every bias into a group of its own (every unit re-laid out).
For each call it records the peak RSS above the RSS before it, and the seconds. With
``MALLOC_MMAP_THRESHOLD_`` small, freed tensors go back to the system at once, so the peak
is what the call held at its most, not the allocator's cache.

The bound the call is meant to keep (docs/regroup.md): the shards, plus one unit's unsharded
parameters and optimizer state. The JSON records each unit's fp32 parameter bytes (the largest
is the root: the tied embedding and ``wpe``) and this rank's shards and state beside the
peaks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from construction import _trim, peak_and_held, reset_peak, rss
from run import MODELS

import groupshard as gs
from groupshard.cli.model import GPT, Block

HERE = Path(__file__).resolve().parent
WORLD_SIZE = 2


def _groups(model: torch.nn.Module, names: list[str], stage: int) -> list[dict[str, Any]]:
    """stage 0: decay / no decay without the last block; 1: the last block in a group of
    its own; 2: every bias in a group of its own too."""
    last = f"blocks.{len(model.blocks) - 1}."
    block = [n for n in names if n.startswith(last)] if stage >= 1 else []
    biases = [n for n in names if n.endswith(".bias")] if stage >= 2 else []
    rest = [n for n in names if not n.startswith(last) and n not in biases]
    lists = [
        ([n for n in rest if not _vector(n)], {"weight_decay": 0.1}),
        ([n for n in rest if _vector(n)], {"weight_decay": 0.0}),
    ]
    if stage >= 1:
        lists.append(([n for n in block if n not in biases], {"lr": 1e-4}))
    if stage >= 2:
        lists.append((biases, {"weight_decay": 0.0, "lr": 3e-4}))
    return [{"params": [model.get_parameter(n) for n in ns], **o} for ns, o in lists]


def _vector(name: str) -> bool:
    return name.endswith(".bias") or ".ln_" in name or name.startswith("ln_f.")


def _measure(call: Any) -> dict[str, float]:
    _trim()
    before = rss()
    reset_peak()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    peak, _ = peak_and_held()
    return {"peak_above_before": peak - before, "seconds": seconds}


def _worker(rank: int, model_name: str, store_path: str, result: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    config, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(config)
    names = [n for n, _ in model.named_parameters()]
    for param in model.blocks[-1].parameters():
        param.requires_grad_(False)
    sharded = gs.shard(model, _groups(model, names, 0), unit=Block, strategy="full")
    opt = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-4)
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1))
    sharded(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad()
    shard_bytes = sum(s.local.numel() * s.local.element_size() for s in sharded.groupshard.storages)
    state_bytes = sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    unit_numels = {
        unit.label: sum(slot.numel for st in unit.storages for b in st.layout.buffers
                        for slot in b.params)
        for unit in sharded.groupshard.runtime.units
    }  # fmt: skip
    calls = {
        "unfreeze the last block (1 unit re-laid out)": 1,
        "move every bias to a new group (every unit re-laid out)": 2,
    }
    measured = {
        label: _measure(lambda s=stage: gs.regroup(sharded, opt, _groups(sharded, names, s)))
        for label, stage in calls.items()
    }
    # the regrouped model still trains
    sharded(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    report = {
        "rank": rank,
        "shards_bytes": shard_bytes,
        "optimizer_state_bytes": state_bytes,
        "unit_params_bytes": {name: 4 * numel for name, numel in unit_numels.items()},
        "calls": measured,
    }
    Path(f"{result}.{rank}").write_text(json.dumps(report))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="30m")
    parser.add_argument("--out", help="default: benchmarks/results-<model>-regroup.json")
    args = parser.parse_args()
    out = args.out or str(HERE / f"results-{args.model}-regroup.json")
    with tempfile.TemporaryDirectory() as folder:
        result = os.path.join(folder, "result")
        mp.start_processes(_worker, args=(args.model, os.path.join(folder, "store"), result),
                           nprocs=WORLD_SIZE, start_method="spawn")  # fmt: skip
        ranks = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(WORLD_SIZE)]
    report = {
        "kind": "regroup-memory",
        "model": args.model,
        "world_size": WORLD_SIZE,
        "strategy": "full",
        "optimizer": "AdamW",
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"),
        "torch": torch.__version__,
        "ranks": ranks,
    }
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    for entry in ranks:
        for label, call in entry["calls"].items():
            print(f"rank {entry['rank']}: {label}: peak +{call['peak_above_before'] / 2**20:.1f} "
                  f"MiB in {call['seconds']:.2f} s")  # fmt: skip
    largest = max(ranks[0]["unit_params_bytes"].values())
    print(f"largest unit's parameters: {largest / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
