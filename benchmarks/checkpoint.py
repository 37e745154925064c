"""Checkpoint save and load: seconds, CPU seconds and peak RSS, groupshard beside FSDP2.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/checkpoint.py [--model 30m|gpt2|tiny]
                                                                 [--rounds 3] [--out FILE]

(``--model tiny``: the suite's smoke test; its numbers are noise, not a measurement.
``gpt2`` is GPT-2 124M's shapes, ``GPTConfig(vocab_size=50257, block_size=1024,
n_layer=12, n_head=12, n_embd=768)``, built with this project's GPT from
``groupshard.cli.model``, not Hugging Face's module; ``30m`` is ``run.py``'s.)

World size 2, gloo on the CPU, one thread per rank. Three rows, each built afresh in every
round (``torch.manual_seed(0)``, ``GPT(config)``), trained one AdamW step (lr 3e-4, the
groups of ``gs.decay_groups(model, weight_decay=0.1)``) on a random batch (2 x block_size
tokens; ``tiny``: ``run.py``'s batch) so the optimizer has state, then saved; a second
model built with another seed and trained one step the same way is then loaded from the
folder:

- **fsdp2 torch idiom**: ``fully_shard`` on every block, then on the model; saved with
  ``get_state_dict`` + ``dcp.save``, loaded with ``get_state_dict`` + ``dcp.load`` +
  ``set_state_dict`` (torch's documented idiom).
- **groupshard torch idiom**: ``gs.shard(..., unit=Block, strategy="full")``, AdamW over
  ``model.optimizer_groups()``, saved and loaded exactly as the row above (torch's
  functions work on groupshard models).
- **groupshard gs.checkpoint**: the same model, ``gs.checkpoint.save`` / ``gs.checkpoint.load``.

The rows run interleaved within each round, in an order that rotates from round to round.
Each call (the whole save; the whole load, getting the state dict included) is measured on
every rank: wall seconds between two barriers (so both ranks are timed over the whole
collective), CPU seconds (``time.process_time``), and the peak RSS above the RSS just
before the call (after ``malloc_trim`` and a reset of the peak, ``/proc/self/clear_refs``).
With ``MALLOC_MMAP_THRESHOLD_`` small, freed tensors go back to the system at once, so the
peak is what the call held at its most, not the allocator's cache. After the load the two
models' full state dicts are compared (the max difference must be 0.0), and the folder's
bytes on disk are recorded, with this rank's shards + optimizer state bytes and the
largest unit's full fp32 parameter bytes (the root: the tied ``wte`` / ``lm_head`` and
``wpe``), for scale.

JSON per row: medians over rounds of the slowest rank's seconds and of the ranks' mean CPU
seconds, the most peak above start over rounds and ranks, and every raw value per round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
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
from construction import _die_with_parent, _trim, largest_unit_bytes, peak_and_held, reset_peak, rss
from run import MODELS
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import groupshard as gs
from groupshard.cli.model import GPT, Block, GPTConfig

HERE = Path(__file__).resolve().parent
WORLD_SIZE = 2
LR = 3e-4
WEIGHT_DECAY = 0.1
GPT2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
CONFIGS: dict[str, tuple[GPTConfig, int]] = {
    "30m": (MODELS["30m"][0], 2),
    "gpt2": (GPT2, 2),
    "tiny": MODELS["tiny"],
}
FSDP2 = "fsdp2 torch idiom"
GS_TORCH = "groupshard torch idiom"
GS_CHECKPOINT = "groupshard gs.checkpoint"
ROWS = (FSDP2, GS_TORCH, GS_CHECKPOINT)
RATIOS = {
    "groupshard torch idiom / fsdp2 save": (GS_TORCH, "save_s"),
    "groupshard torch idiom / fsdp2 load": (GS_TORCH, "load_s"),
    "gs.checkpoint / fsdp2 save": (GS_CHECKPOINT, "save_s"),
    "gs.checkpoint / fsdp2 load": (GS_CHECKPOINT, "load_s"),
}

Model = Any
Optimizer = torch.optim.Optimizer


# --- the rows -------------------------------------------------------------------------------


def build(row: str, config: GPTConfig, seed: int) -> tuple[Model, Optimizer]:
    torch.manual_seed(seed)
    model = GPT(config)
    if row == FSDP2:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(gs.decay_groups(model, WEIGHT_DECAY), lr=LR)
    groups = gs.decay_groups(model, weight_decay=WEIGHT_DECAY)
    sharded = gs.shard(model, groups, unit=Block, strategy="full")
    return sharded, torch.optim.AdamW(sharded.optimizer_groups(), lr=LR)


def train_one_step(model: Model, optimizer: Optimizer, tokens: torch.Tensor) -> None:
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def save(row: str, folder: str, model: Model, optimizer: Optimizer) -> None:
    if row == GS_CHECKPOINT:
        gs.checkpoint.save(folder, model, optimizer)
        return
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)


def load(row: str, folder: str, model: Model, optimizer: Optimizer) -> None:
    if row == GS_CHECKPOINT:
        gs.checkpoint.load(folder, model, optimizer)
        return
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip


def full_state(row: str, model: Model) -> dict[str, torch.Tensor]:
    if row == FSDP2:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return gs.full_state_dict(model)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise AssertionError(f"the loaded model's names differ: {sorted(set(a) ^ set(b))[:5]}")
    return max((x.float() - b[name].float()).abs().max().item() for name, x in a.items())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(row: str, model: Model, optimizer: Optimizer) -> int:
    """This rank's parameter shards and optimizer state, in bytes."""
    if row == FSDP2:
        shards = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    else:
        shards = sum(s.local.numel() * s.local.element_size() for s in model.groupshard.storages)
    state = sum(
        _local(v).numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return shards + state


def folder_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


# --- measuring ------------------------------------------------------------------------------


def measure(call: Callable[[], None]) -> dict[str, float]:
    """Seconds between two barriers, CPU seconds and the peak RSS above the RSS before."""
    _trim()
    before = rss()
    reset_peak()
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    call()
    dist.barrier()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    peak, _ = peak_and_held()
    return {"s": seconds, "cpu_s": cpu_seconds, "peak_above_start": peak - before}


def one_row(row: str, config: GPTConfig, tokens: torch.Tensor, folder: str) -> dict[str, Any]:
    model, optimizer = build(row, config, seed=0)
    train_one_step(model, optimizer, tokens)
    saved = measure(lambda: save(row, folder, model, optimizer))
    size = folder_bytes(folder)
    other, other_optimizer = build(row, config, seed=1)
    train_one_step(other, other_optimizer, tokens)
    loaded = measure(lambda: load(row, folder, other, other_optimizer))
    difference = max_difference(full_state(row, model), full_state(row, other))
    result = {f"save_{k}": v for k, v in saved.items()}
    result.update({f"load_{k}": v for k, v in loaded.items()})
    result.update(folder_bytes=size, max_difference=difference,
                  held_bytes=held_bytes(row, model, optimizer))  # fmt: skip
    return result


def init_worker(rank: int, store: str) -> None:
    """A benchmark rank: one thread, gloo over a file store, ended with its parent."""
    _die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=900),
    )  # fmt: skip


def model_and_tokens(model_name: str, rank: int) -> tuple[GPTConfig, torch.Tensor]:
    """The model's config and this rank's batch of tokens."""
    config, batch = CONFIGS[model_name]
    generator = torch.Generator().manual_seed(1 + rank)
    shape = (batch, config.block_size + 1)
    return config, torch.randint(0, config.vocab_size, shape, generator=generator)


def rotating_rounds(
    rows: tuple[str, ...], rounds: int, folder: str, measure_row: Callable[[str, str], dict]
) -> list[dict[str, Any]]:
    """``measure_row(row, its folder)`` for every row in every round, interleaved in an
    order that rotates from round to round; each round's folders removed after it."""
    per_round = []
    for r in range(rounds):
        order = [rows[(r + i) % len(rows)] for i in range(len(rows))]
        measured = {}
        for row in order:
            measured[row] = measure_row(row, os.path.join(folder, f"round-{r}",
                                                          row.replace(" ", "-")))  # fmt: skip
        per_round.append({"order": order, "rows": measured})
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(folder, f"round-{r}"), ignore_errors=True)
        dist.barrier()
    return per_round


def _worker(rank: int, model_name: str, rounds: int, store: str, folder: str, out: str) -> None:
    init_worker(rank, store)
    config, tokens = model_and_tokens(model_name, rank)
    per_round = rotating_rounds(
        ROWS, rounds, folder, lambda row, path: one_row(row, config, tokens, path)
    )
    Path(f"{out}.{rank}").write_text(json.dumps({"rank": rank, "rounds": per_round}))
    dist.destroy_process_group()


# --- the report -----------------------------------------------------------------------------


def summary(ranks: list[dict[str, Any]], row: str, rounds: int) -> dict[str, Any]:
    def values(key: str, r: int) -> list[float]:
        return [rank["rounds"][r]["rows"][row][key] for rank in ranks]

    result: dict[str, Any] = {}
    for call in ("save", "load"):
        result[f"{call}_s"] = statistics.median(max(values(f"{call}_s", r)) for r in range(rounds))
        result[f"{call}_cpu_s"] = statistics.median(
            statistics.mean(values(f"{call}_cpu_s", r)) for r in range(rounds)
        )
        result[f"{call}_peak_above_start"] = max(
            max(values(f"{call}_peak_above_start", r)) for r in range(rounds)
        )
    result["folder_bytes"] = max(max(values("folder_bytes", r)) for r in range(rounds))
    result["max_difference"] = max(max(values("max_difference", r)) for r in range(rounds))
    result["held_bytes_per_rank"] = values("held_bytes", 0)
    result["per_round"] = [
        {"order": ranks[0]["rounds"][r]["order"].index(row),
         "ranks": [rank["rounds"][r]["rows"][row] for rank in ranks]}
        for r in range(rounds)
    ]  # fmt: skip
    return result


def print_table(report: dict[str, Any]) -> None:
    fsdp2 = report["rows"][FSDP2]
    print(f"{report['model']}, world {WORLD_SIZE}, {report['rounds']} rounds; largest unit "
          f"{report['largest_unit_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    print(f"{'row':<26} {'save s':>7} {'load s':>7} {'save cpu':>8} {'load cpu':>8} "
          f"{'save MiB':>8} {'load MiB':>8} {'x save':>6} {'x load':>6} "
          f"{'max diff':>8}")  # fmt: skip
    for name, row in report["rows"].items():
        print(f"{name:<26} {row['save_s']:7.2f} {row['load_s']:7.2f} {row['save_cpu_s']:8.2f} "
              f"{row['load_cpu_s']:8.2f} {row['save_peak_above_start'] / 2**20:8.1f} "
              f"{row['load_peak_above_start'] / 2**20:8.1f} "
              f"{row['save_s'] / fsdp2['save_s']:6.2f} {row['load_s'] / fsdp2['load_s']:6.2f} "
              f"{row['max_difference']:8.1e}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="30m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="default: benchmarks/results-<model>-checkpoint.json")
    args = parser.parse_args()
    out = args.out or str(HERE / f"results-{args.model}-checkpoint.json")
    with tempfile.TemporaryDirectory() as folder:
        result = os.path.join(folder, "result")
        checkpoints = os.path.join(folder, "checkpoints")
        os.makedirs(checkpoints)
        mp.start_processes(
            _worker,
            args=(args.model, args.rounds, os.path.join(folder, "store"), checkpoints, result),
            nprocs=WORLD_SIZE,
            start_method="spawn",
        )
        ranks = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(WORLD_SIZE)]
    rows = {row: summary(ranks, row, args.rounds) for row in ROWS}
    report = {
        "kind": "checkpoint",
        "model": args.model,
        "world_size": WORLD_SIZE,
        "rounds": args.rounds,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"),
        "torch": torch.__version__,
        "largest_unit_bytes": largest_unit_bytes(CONFIGS[args.model][0]),
        "rows": rows,
        "ratios": {name: rows[r][key] / rows[FSDP2][key] for name, (r, key) in RATIOS.items()},
    }
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)


if __name__ == "__main__":
    main()
