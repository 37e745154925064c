"""Asynchronous checkpoints: how long training is blocked, against a synchronous save.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/async_checkpoint.py [--model 30m|gpt2|tiny]
                                                                       [--rounds 3] [--out FILE]

World size 2, gloo on the CPU, one thread per rank, the models of ``benchmarks/checkpoint.py``
(``gpt2``: GPT-2 124M's shapes; ``30m``: ``run.py``'s), trained one AdamW step so the
optimizer has state. Rows, interleaved within each round in an order that rotates:

- **fsdp2 dcp.save** / **fsdp2 dcp.async_save**: FSDP2 (``fully_shard`` per block, then the
  model) with torch's idiom, ``dcp.async_save(..., process_group=<a gloo group>)``;
- **groupshard gs.checkpoint.save** / **groupshard gs.checkpoint.async_save**;
- **groupshard dcp.async_save**: torch's idiom on the groupshard model.

Per call: ``blocked_s``, wall seconds from the call to its return (what the training loop
waits; the whole save for the synchronous rows), ``total_s``, from the call until the
checkpoint is complete (``result()``), both between barriers on every rank; the peak RSS
above the RSS before the call, up to completion. The folder is then loaded into a model
seeded otherwise and compared (max difference 0.0 expected). JSON per row: medians over
rounds of the slowest rank's seconds, the most peak over rounds and ranks, the ratios to the
synchronous save of the same system, and this rank's shard + optimizer-state bytes, for
scale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from checkpoint import (
    CONFIGS,
    FSDP2,
    build,
    full_state,
    held_bytes,
    init_worker,
    load,
    model_and_tokens,
    rotating_rounds,
    train_one_step,
)
from construction import _trim, peak_and_held, reset_peak, rss
from torch.distributed.checkpoint.state_dict import get_state_dict

import groupshard as gs

WORLD_SIZE = 2
ROWS = (
    "fsdp2 dcp.save",
    "fsdp2 dcp.async_save",
    "groupshard gs.checkpoint.save",
    "groupshard gs.checkpoint.async_save",
    "groupshard dcp.async_save",
)
SYNCHRONOUS = {row: "fsdp2 dcp.save" if row.startswith("fsdp2") else
               "groupshard gs.checkpoint.save" for row in ROWS}  # fmt: skip


def _system(row: str) -> str:
    """checkpoint.py's row whose model and loading this row uses."""
    if row.startswith("fsdp2"):
        return FSDP2
    return "groupshard gs.checkpoint" if "gs.checkpoint" in row else "groupshard torch idiom"


def start_save(
    row: str, folder: str, model: Any, optimizer: Any, writer: Any
) -> Callable[[], None]:
    """Start ``row``'s save; return what waits for its completion."""
    if row.endswith("gs.checkpoint.save"):
        gs.checkpoint.save(folder, model, optimizer)
        return lambda: None
    if row.endswith("gs.checkpoint.async_save"):
        return gs.checkpoint.async_save(folder, model, optimizer).result
    msd, osd = get_state_dict(model, optimizer)
    if row.endswith("dcp.save"):
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
        return lambda: None
    future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=folder,
                            process_group=writer)  # fmt: skip
    return future.result


def one_row(row: str, config: Any, tokens: torch.Tensor, folder: str, writer: Any) -> dict:
    system = _system(row)
    model, optimizer = build(system, config, seed=0)
    train_one_step(model, optimizer, tokens)
    _trim()
    before = rss()
    reset_peak()
    dist.barrier()
    started = time.perf_counter()
    wait = start_save(row, folder, model, optimizer, writer)
    blocked = time.perf_counter() - started
    wait()
    dist.barrier()
    total = time.perf_counter() - started
    peak, _ = peak_and_held()
    other, other_optimizer = build(system, config, seed=1)
    train_one_step(other, other_optimizer, tokens)
    load(system, folder, other, other_optimizer)
    a, b = full_state(system, model), full_state(system, other)
    difference = max((a[n].float() - b[n].float()).abs().max().item() for n in a)
    return {"blocked_s": blocked, "total_s": total, "peak_above_start": peak - before,
            "max_difference": difference,
            "held_bytes": held_bytes(system, model, optimizer)}  # fmt: skip


def _worker(rank: int, model_name: str, rounds: int, store: str, folder: str, out: str) -> None:
    init_worker(rank, store)
    writer = dist.new_group(backend="gloo")  # dcp.async_save's own group, as torch asks
    config, tokens = model_and_tokens(model_name, rank)
    per_round = rotating_rounds(
        ROWS, rounds, folder, lambda row, path: one_row(row, config, tokens, path, writer)
    )
    Path(f"{out}.{rank}").write_text(json.dumps({"rank": rank, "rounds": per_round}))
    dist.destroy_process_group()


def summary(ranks: list[dict[str, Any]], row: str, rounds: int) -> dict[str, Any]:
    def values(key: str, r: int) -> list[float]:
        return [rank["rounds"][r]["rows"][row][key] for rank in ranks]

    return {
        "blocked_s": statistics.median(max(values("blocked_s", r)) for r in range(rounds)),
        "total_s": statistics.median(max(values("total_s", r)) for r in range(rounds)),
        "peak_above_start": max(max(values("peak_above_start", r)) for r in range(rounds)),
        "max_difference": max(max(values("max_difference", r)) for r in range(rounds)),
        "held_bytes_per_rank": values("held_bytes", 0),
        "per_round": [[rank["rounds"][r]["rows"][row] for rank in ranks] for r in range(rounds)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="30m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the report (JSON) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="groupshard-async-") as tmp:
        raw = os.path.join(tmp, "raw")
        mp.start_processes(
            _worker, args=(args.model, args.rounds, os.path.join(tmp, "store"),
                           os.path.join(tmp, "folders"), raw),
            nprocs=WORLD_SIZE, start_method="spawn",
        )  # fmt: skip
        ranks = [json.loads(Path(f"{raw}.{r}").read_text()) for r in range(WORLD_SIZE)]
    rows = {row: summary(ranks, row, args.rounds) for row in ROWS}
    for row, values in rows.items():
        synchronous = rows[SYNCHRONOUS[row]]
        values["blocked_vs_sync"] = values["blocked_s"] / synchronous["total_s"]
        values["total_vs_sync"] = values["total_s"] / synchronous["total_s"]
    report = {"kind": "async-checkpoint", "model": args.model, "world_size": WORLD_SIZE,
              "rounds": args.rounds, "torch": torch.__version__, "rows": rows,
              "when": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    print(f"{args.model}, world {WORLD_SIZE}, {args.rounds} rounds")
    print(f"{'row':<38} {'blocked s':>9} {'total s':>8} {'blocked/sync':>12} "
          f"{'total/sync':>10} {'peak MiB':>9} {'max diff':>8}")  # fmt: skip
    for name, row in rows.items():
        print(f"{name:<38} {row['blocked_s']:9.2f} {row['total_s']:8.2f} "
              f"{row['blocked_vs_sync']:12.2f} {row['total_vs_sync']:10.2f} "
              f"{row['peak_above_start'] / 2**20:9.1f} {row['max_difference']:8.1e}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
