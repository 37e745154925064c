"""Lightning's Trainer over groupshard, beside strategy="ddp" and Lightning's FSDP2
(``ModelParallelStrategy``): step seconds, CPU seconds per step and peak RSS, world 2.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/lightning_trainer.py [--model gpt|tiny]
                                                                [--rounds 3] [--out FILE]

One unchanged LightningModule (``--model gpt``: groupshard's GPT, 4 blocks of d 768 and 12
heads, each block 28 MB in fp32 as GPT-2's, vocab 8192, 128 positions: 35M parameters;
``tiny``: the suite's smoke test, whose numbers are noise) with two param groups (AdamW,
lr 3e-4, weight decay 0.1 on matrices, none on vectors), trained by ``lightning.Trainer``
with the same options in every row (``accumulate_grad_batches=2``,
``gradient_clip_val=1.0``, 2 x 128 tokens per micro-batch per rank, ``accelerator="cpu"``:
gloo on these 2 cores, one thread per rank):

- **ddp**: ``strategy="ddp"`` (Lightning's DDP; no communication until the last
  micro-batch);
- **fsdp2**: ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` with
  ``fully_shard`` on every block and the inner model in ``configure_model`` (Lightning's FSDP2
  recipe; Lightning reduces every micro-batch's gradients under FSDP2);
- **groupshard**: ``GroupShardStrategy(unit=Block, strategy="full")``;
- **fabric-ddp**, **fabric-fsdp2**, **fabric-groupshard**: the same under Lightning Fabric's
  documented loop (``no_backward_sync`` for the first micro-batch, ``clip_gradients``):
  ``strategy="ddp"``; Fabric's ``ModelParallelStrategy`` with ``fully_shard`` on every block
  and the root as its ``parallelize_fn`` (the optimizer built on the DTensors, FSDP2's
  order); ``groupshard.integrations.fabric.GroupShardStrategy(unit=Block)`` (the optimizer's
  two groups given to ``fabric.setup``). Each is compared with the FSDP2 row of its kind.

Every (round, row) runs in two fresh processes, rows in an order that rotates from round
to round. A callback times each optimizer step (from its first micro-batch's
``on_train_batch_start`` to its last's ``on_train_batch_end``, wall and
``time.process_time``); the first step (warm-up) is left out. Peak RSS: above the RSS just
before ``fit`` (after ``malloc_trim`` and a reset of the peak). JSON per row as
benchmarks/trainer.py's (kind "trainer": the same table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from construction import _die_with_parent, _trim, peak_and_held, reset_peak, rss
from trainer import ACCUMULATION, BATCH, HERE, STEPS, WORLD_SIZE, measure, write_report

MODELS = {
    "gpt": {"n_layer": 4, "n_embd": 768, "n_head": 12, "vocab_size": 8192, "block_size": 128},
    "tiny": {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 32, "block_size": 8},
}
ROWS = ("ddp", "fsdp2", "groupshard", "fabric-ddp", "fabric-fsdp2", "fabric-groupshard")


def module_for(row: str, shape: dict[str, int]) -> Any:
    import lightning as L
    import torch.nn.functional as F

    from groupshard.cli.model import GPT, GPTConfig

    class LanguageModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(GPTConfig(**shape))

        def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
            ids, targets = batch
            return F.cross_entropy(self.model(ids).flatten(0, 1), targets.flatten())

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(decay_groups(self), lr=3e-4)

    class FullyShardedModel(LanguageModel):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)  # the root: training_step calls it

    return FullyShardedModel() if row == "fsdp2" else LanguageModel()


def strategy_for(row: str) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from groupshard.cli.model import Block
    from groupshard.integrations.lightning import GroupShardStrategy

    if row == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1)
    if row == "groupshard":
        return GroupShardStrategy(unit=Block, strategy="full")
    return "ddp"


def loader(shape: dict[str, int]) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    count = WORLD_SIZE * BATCH * ACCUMULATION * STEPS
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (count, shape["block_size"]), generator=generator)
    return DataLoader(TensorDataset(ids, torch.roll(ids, -1, dims=1)), batch_size=BATCH)


def step_timer() -> Any:
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.cpu_seconds: list[float] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            if trainer is not None:  # Fabric's rows call it themselves
                self.model = trainer.strategy.model  # what trains (teardown unwraps DDP)
            if index % ACCUMULATION == 0:
                self._start = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            index = args[-1]
            if index % ACCUMULATION == ACCUMULATION - 1:
                wall, cpu = self._start
                self.seconds.append(time.perf_counter() - wall)
                self.cpu_seconds.append(time.process_time() - cpu)

    return StepTimer()


def check_wrapping(row: str, trained: Any, module: Any) -> None:
    """Each row runs what it says: DDP, FSDP2's DTensors, or groupshard's shards unwrapped."""
    from torch.distributed.tensor import DTensor

    import groupshard as gs

    if row == "ddp":
        assert isinstance(trained, torch.nn.parallel.DistributedDataParallel)
    elif row == "fsdp2":
        assert any(isinstance(p, DTensor) for p in module.parameters()), row
    else:
        assert isinstance(module, gs.ShardedModule) and trained is module


def decay_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0}]


def fabric_strategy(row: str) -> Any:
    from lightning.fabric.strategies import ModelParallelStrategy

    from groupshard.cli.model import Block
    from groupshard.integrations.fabric import GroupShardStrategy

    def fully_shard_blocks(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])

    if row == "fabric-fsdp2":
        return ModelParallelStrategy(
            fully_shard_blocks, data_parallel_size=WORLD_SIZE, tensor_parallel_size=1
        )
    if row == "fabric-groupshard":
        return GroupShardStrategy(unit=Block, strategy="full")
    return "ddp"


def fabric_fit(row: str, shape: dict[str, int], timer: Any) -> tuple[Any, Any, int]:
    """Fabric's documented loop (the same options as the Trainer rows) under ``row``'s
    strategy, timed per optimizer step by ``timer``; the module as set up, the one that
    trains, and the parameter count."""
    import lightning as L
    import torch.nn.functional as F

    from groupshard.cli.model import GPT, GPTConfig

    fabric = L.Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=fabric_strategy(row))
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape))
    parameters = sum(p.numel() for p in model.parameters())
    if row == "fabric-fsdp2":  # FSDP2's order: shard, then build the optimizer on the DTensors
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(decay_groups(model), lr=3e-4))
    else:
        model, optimizer = fabric.setup(model, torch.optim.AdamW(decay_groups(model), lr=3e-4))
    data = fabric.setup_dataloaders(loader(shape))
    _trim()
    timer.before = rss()
    reset_peak()
    for index, (ids, targets) in enumerate(data):
        accumulating = index % ACCUMULATION < ACCUMULATION - 1
        if index % ACCUMULATION == 0:
            timer.on_train_batch_start(None, None, None, index)
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
            fabric.backward(loss / ACCUMULATION)
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            timer.on_train_batch_end(None, None, index)
    return model.module, model._forward_module, parameters


def _worker(rank: int, row: str, model: str, port: int, folder: str, out: str) -> None:
    _die_with_parent()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), GROUP_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import lightning as L

    shape = MODELS[model]
    timer = step_timer()
    if row.startswith("fabric-"):
        module, trained, parameters = fabric_fit(row, shape, timer)
        before = timer.before
        peak, _ = peak_and_held()
        check_wrapping(row.removeprefix("fabric-"), trained, module)
        _write_result(out, rank, timer, peak - before, parameters)
        return
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=strategy_for(row), max_epochs=1,
        accumulate_grad_batches=ACCUMULATION, gradient_clip_val=1.0, default_root_dir=folder,
        enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=False, callbacks=[timer],
    )  # fmt: skip
    module = module_for(row, shape)
    parameters = sum(p.numel() for p in module.parameters())
    data = loader(shape)
    _trim()
    before = rss()
    reset_peak()
    trainer.fit(module, data)
    peak, _ = peak_and_held()
    check_wrapping(row, timer.model, module)
    _write_result(out, rank, timer, peak - before, parameters)


def _write_result(out: str, rank: int, timer: Any, peak: int, parameters: int) -> None:
    result = {
        "step_s": statistics.median(timer.seconds[1:]),
        "cpu_s": statistics.median(timer.cpu_seconds[1:]),
        "peak_above_start": peak,
        "steps": len(timer.seconds),
        "parameters": parameters,
    }
    Path(f"{out}.{rank}").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    parser.add_argument("--out", help="default: benchmarks/results-<model>-lightning.json")
    args = parser.parse_args()
    # lightning imported once, by the server every row's workers fork from (each worker
    # importing it anew took seconds per row)
    rows = measure(_worker, args.rows, args.model, args.rounds, preload=("lightning",))
    out = args.out or str(HERE / f"results-{args.model}-lightning.json")
    write_report(
        out, rows, model=f"lightning {args.model}", shape=MODELS[args.model], rounds=args.rounds
    )


if __name__ == "__main__":
    main()
