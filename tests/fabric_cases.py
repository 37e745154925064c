"""Cases of tests/test_fabric_integration.py, each run under torchrun (2 processes, gloo on
the CPU) as a user runs Lightning Fabric's loop:

    torchrun --standalone --nproc-per-node 2 tests/fabric_cases.py FOLDER [CASE...]

(every case when none is named) in FOLDER; rank 0 writes what the tests check to
FOLDER/result.json, per case its result or its traceback. Each case runs the same loop
under GroupShardStrategy and under Fabric's strategy="ddp".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

import groupshard as gs
from groupshard.cli.model import GPT, Block, GPTConfig
from groupshard.integrations.fabric import GroupShardStrategy

from helpers import max_difference, run_cases, weights

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
SAMPLES = 32  # 4 optimizer steps at world 2, batch 2, accumulation 2
BATCH = 2
ACCUMULATION = 2
CLIP = 0.05  # small enough that every step clips
SAVE_AFTER = 2  # optimizer steps


def build_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CONFIG)


def grouped_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Two param groups, as a user writes them on the unsharded model."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-2
    )


def fabric_for(strategy: Any, **options: Any) -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, **options)
    fabric.launch()
    return fabric


def loader(fabric: L.Fabric) -> DataLoader:
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, CONFIG.vocab_size, (SAMPLES, CONFIG.block_size), generator=generator)
    data = TensorDataset(ids, torch.roll(ids, -1, dims=1))
    return fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH))


def train(
    fabric: L.Fabric,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    start: int = 0,
    stop: int | None = None,
) -> list[float]:
    """Fabric's documented loop from optimizer step ``start`` to ``stop``: accumulation
    without gradient sync, clipping by norm, a per-step schedule; the losses."""
    losses = []
    for index, (ids, targets) in enumerate(loader(fabric)):
        step, micro = divmod(index, ACCUMULATION)
        if step < start or (stop is not None and step >= stop):
            continue
        accumulating = micro < ACCUMULATION - 1
        with fabric.no_backward_sync(model, enabled=accumulating):
            logits = model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            fabric.backward(loss / ACCUMULATION)
        losses.append(loss.item())
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
    return losses


def set_up(fabric: L.Fabric, model: torch.nn.Module) -> tuple[Any, Any, Any]:
    optimizer = grouped_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    return model, optimizer, scheduler




def fit_case(folder: str) -> dict[str, Any]:
    """fabric.setup with two param groups, accumulation, clipping, a schedule: equal to
    DDP; fabric.save midway and a run resumed from it equal to the whole run; DDP's
    fabric.save file continued under GroupShardStrategy; the same folder at world 1 (the
    test's second launch)."""
    fabric = fabric_for(GroupShardStrategy(unit=Block))
    model, optimizer, scheduler = set_up(fabric, build_model())
    sharded = isinstance(model.module, gs.ShardedModule)
    groups = [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups]
    train(fabric, model, optimizer, scheduler, stop=SAVE_AFTER)
    path = os.path.join(folder, "sharded")
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2})
    losses = train(fabric, model, optimizer, scheduler, start=SAVE_AFTER)
    whole = weights(model)
    if fabric.global_rank == 0:
        torch.save(whole, os.path.join(folder, "whole.pt"))

    resumed, optimizer, scheduler = set_up(fabric, build_model(seed=5))
    state = {"model": resumed, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    remainder = fabric.load(path, state)
    resumed_losses = train(fabric, resumed, optimizer, scheduler, start=state["step"])

    ddp = fabric_for("ddp")
    reference, ddp_optimizer, ddp_scheduler = set_up(ddp, build_model())
    train(ddp, reference, ddp_optimizer, ddp_scheduler, stop=SAVE_AFTER)
    ddp_file = os.path.join(folder, "ddp.pt")
    ddp_state = {"model": reference, "optimizer": ddp_optimizer, "scheduler": ddp_scheduler}
    ddp.save(ddp_file, {**ddp_state, "step": 2})
    reference_losses = train(ddp, reference, ddp_optimizer, ddp_scheduler, start=SAVE_AFTER)

    from_ddp, optimizer, scheduler = set_up(fabric, build_model(seed=5))
    state = {"model": from_ddp, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    fabric.load(ddp_file, state)
    train(fabric, from_ddp, optimizer, scheduler, start=state["step"])
    return {
        "sharded": sharded,
        "groups": groups,
        "losses": [losses, reference_losses, resumed_losses],
        "difference": max_difference(whole, weights(reference)),
        "resumed": max_difference(weights(resumed), whole),
        "remainder": sorted(remainder),
        "files": sorted(os.listdir(path)),
        "from_ddp": max_difference(weights(from_ddp), weights(reference)),
        "keys_equal": list(whole) == list(weights(reference)),
    }


def world_one_case(folder: str) -> dict[str, Any]:
    """(At world 1, by the test's second launch.) The folder fit_case saved at world 2,
    loaded and trained on to the end in one process: equal to the world-2 whole run."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=GroupShardStrategy(unit=Block))
    fabric.launch()
    model, optimizer, scheduler = set_up(fabric, build_model(seed=5))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    fabric.load(os.path.join(folder, "..", "fit", "sharded"), state)
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, CONFIG.vocab_size, (SAMPLES, CONFIG.block_size), generator=generator)
    targets = torch.roll(ids, -1, dims=1)
    # one process takes both ranks' micro-batches of a step (DistributedSampler: i % 2)
    for step in range(state["step"], SAMPLES // (BATCH * 2 * ACCUMULATION)):
        for micro in range(ACCUMULATION):
            first = (step * ACCUMULATION + micro) * BATCH * 2
            rows = [first + 2 * i + rank for rank in range(2) for i in range(BATCH)]
            logits = model(ids[rows])
            loss = F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten())
            fabric.backward(loss / ACCUMULATION)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    whole = torch.load(os.path.join(folder, "..", "fit", "whole.pt"), weights_only=True)
    return {"difference": max_difference(weights(model), whole)}


def setup_module_case(folder: str) -> dict[str, Any]:
    """fabric.setup_module, then an optimizer on model.parameters() and
    fabric.setup_optimizers (one group): equal to DDP, as is a model sharded by gs.shard
    beforehand with an optimizer over its groups; an optimizer with two groups built before
    setup_module is refused with the way to keep them."""
    results: dict[str, Any] = {}
    for name, strategy in (("sharded", GroupShardStrategy(unit=Block)), ("ddp", "ddp")):
        fabric = fabric_for(strategy)
        model = fabric.setup_module(build_model())
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-2))
        train(fabric, model, optimizer, None)
        results[name] = weights(model)
    # a model the user sharded with gs.shard, and an optimizer over its groups
    fabric = fabric_for(GroupShardStrategy())
    sharded = gs.shard(build_model(), unit=Block)
    model = fabric.setup_module(sharded)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-2))
    train(fabric, model, optimizer, None)
    results["own"] = weights(model)
    fabric = fabric_for(GroupShardStrategy(unit=Block))
    plain = build_model()
    grouped = grouped_optimizer(plain)
    fabric.setup_module(plain)
    try:
        fabric.setup_optimizers(grouped)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "difference": max_difference(results["sharded"], results["ddp"]),
        "own": max_difference(results["own"], results["ddp"]),
        "refused": refused,
    }


class CastGPT(torch.nn.Module):
    """The reference of bf16-mixed under DDP: the same casts as gs.MixedPrecision's (every
    unit computes with half copies of the fp32 weights), under Fabric's autocast too."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = build_model(), dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cast = {name: p.to(self.dtype) for name, p in self.model.named_parameters()}
        return torch.func.functional_call(self.model, cast, (ids,))


def cast_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name.removeprefix("model."): value for name, value in weights(model).items()}


def precision_case(folder: str) -> dict[str, Any]:
    """precision='bf16-mixed' (and '16-mixed' through Fabric's own plugin, as on a GPU):
    Fabric's autocast over units computing in the half dtype with fp32 shards; equal to
    DDP computing with the same casts; the loss in fp32 as under DDP; fp16 scaled by a
    gs.GradScaler."""
    results: dict[str, Any] = {}
    for name, dtype, options in (
        ("bf16", torch.bfloat16, {"precision": "bf16-mixed"}),
        ("fp16", torch.float16, {"plugins": [MixedPrecision("16-mixed", "cpu")]}),
    ):
        fabric = fabric_for(GroupShardStrategy(unit=Block), **options)
        model, optimizer, scheduler = set_up(fabric, build_model())
        logits = model(next(iter(loader(fabric)))[0])
        losses = train(fabric, model, optimizer, scheduler)
        if name == "fp16":  # a plugin (and its scaler) serves one Fabric
            options = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
        ddp = fabric_for("ddp", **options)
        reference, ddp_optimizer, ddp_scheduler = set_up(ddp, CastGPT(dtype))
        reference_losses = train(ddp, reference, ddp_optimizer, ddp_scheduler)
        fp32 = fabric_for("ddp")
        plain, plain_optimizer, plain_scheduler = set_up(fp32, build_model())
        train(fp32, plain, plain_optimizer, plain_scheduler)
        policies = {
            (str(unit.policy.param_dtype), str(unit.policy.reduce_dtype))
            for unit in model.module.groupshard.runtime.units
        }
        scaler = fabric.strategy.precision.scaler
        results[name] = {
            "policies": sorted(policies),
            "shard_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "logits_dtype": str(logits.dtype),
            "losses": [losses, reference_losses],
            "difference": max_difference(weights(model), cast_weights(reference)),
            "difference_to_fp32": max_difference(weights(model), weights(plain)),
            "scaler": None if scaler is None else type(scaler).__name__,
        }
    return results


def empty_init_case(folder: str) -> dict[str, Any]:
    """fabric.init_module(empty_init=True) builds on the meta device; fabric.setup
    materializes unit by unit; fabric.load then restores the saved run exactly."""
    fabric = fabric_for(GroupShardStrategy(unit=Block))
    model, optimizer, scheduler = set_up(fabric, build_model())
    train(fabric, model, optimizer, scheduler, stop=1)
    path = os.path.join(folder, "saved")
    fabric.save(path, {"model": model, "optimizer": optimizer})
    with fabric.init_module(empty_init=True):
        empty = GPT(CONFIG)
    on_meta = all(p.is_meta for p in empty.parameters())
    empty, optimizer = fabric.setup(empty, grouped_optimizer(empty))
    fabric.load(path, {"model": empty, "optimizer": optimizer})
    return {"on_meta": on_meta, "difference": max_difference(weights(empty), weights(model))}


def refusals_case(folder: str) -> dict[str, Any]:
    """What GroupShardStrategy cannot do raises, naming what to do instead, on every rank."""
    fabric = fabric_for(GroupShardStrategy(unit=Block))
    model, optimizer, _ = set_up(fabric, build_model())
    path = os.path.join(folder, "refusals")
    fresh = build_model()
    two_optimizers = [torch.optim.SGD(fresh.parameters(), lr=0.1) for _ in range(2)]
    attempts: dict[str, Callable[[], Any]] = {
        "two_optimizers": lambda: fabric.setup(fresh, *two_optimizers),
        "filter": lambda: fabric.save(path, {"model": model}, filter={"model": lambda k, v: True}),
        "unstorable": lambda: fabric.save(path, {"model": model, "fn": print}),
        "no_model": lambda: fabric.save(path, {"optimizer": optimizer}),
        "load_without_state": lambda: fabric.load(path),
        "unpickle": lambda: fabric.load(path, {"model": model}, weights_only=False),
        "sharded_twice": lambda: fabric.setup(model.module, optimizer.optimizer),
    }
    refused = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            refused[name] = ""
        except (ValueError, TypeError) as error:
            refused[name] = f"{type(error).__name__}: {error}"
    fabric.save(path, {"model": model})
    try:
        fabric.load(path, {"model": model, "optimizer": optimizer})
        refused["strict"] = ""
    except KeyError as error:
        refused["strict"] = str(error)
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer}, strict=False)
    ddp = fabric_for("ddp")
    try:
        ddp.setup(model.module)
        refused["ddp_of_sharded"] = ""
    except TypeError as error:
        refused["ddp_of_sharded"] = str(error)
    return {"refused": refused, "remainder": remainder}


CASES = {
    "fit": fit_case,
    "setup_module": setup_module_case,
    "precision": precision_case,
    "empty_init": empty_init_case,
    "refusals": refusals_case,
    "world_one": world_one_case,
}


if __name__ == "__main__":
    run_cases(CASES, [name for name in CASES if name != "world_one"])
