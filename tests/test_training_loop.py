"""A real training loop composes, at 2 ranks: activation checkpointing, bf16, two
micro-batches, torch's clip_grad_norm_, an LR scheduler, and a checkpoint saved and resumed
in the middle, equal to one process doing the same casts."""

from __future__ import annotations

import torch

import groupshard as gs
from test_activation_checkpointing import STYLES

from helpers import (
    BATCH_PER_RANK,
    EdgeGPT,
    emulated_cast_step,
    global_batches,
    max_difference,
    three_groups,
)

BF16 = gs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
MICRO_BATCHES, STEPS, RESUME_AT, MAX_NORM = 2, 4, 2, 0.05


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def _sharded(seed: int) -> tuple[gs.ShardedModule, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = EdgeGPT()
    units = STYLES["checkpoint inside the unit"](model)
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=units, mixed_precision=BF16)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    return sharded, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)


def _train(model, optimizer, scheduler, steps, rank, world_size) -> None:
    for inputs, targets in steps:
        for micro in range(MICRO_BATCHES):
            start = (micro * world_size + rank) * BATCH_PER_RANK
            local = slice(start, start + BATCH_PER_RANK)
            loss = model(inputs[local], targets[local]) / MICRO_BATCHES
            if micro < MICRO_BATCHES - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def _reference(world_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    master = EdgeGPT()
    STYLES["checkpoint inside the unit"](master)
    optimizer = torch.optim.AdamW(three_groups(master, 1e-3), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    chunks = MICRO_BATCHES * world_size
    for inputs, targets in global_batches(STEPS, chunks):
        per_chunk = list(zip(inputs.chunk(chunks), targets.chunk(chunks), strict=True))
        emulated_cast_step(master, per_chunk, torch.bfloat16)
        torch.nn.utils.clip_grad_norm_(master.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return master


def _loop_case(rank: int, world_size: int, path: str) -> float:
    steps = global_batches(STEPS, MICRO_BATCHES * world_size)
    model, optimizer, scheduler = _sharded(seed=0)
    _train(model, optimizer, scheduler, steps[:RESUME_AT], rank, world_size)
    gs.checkpoint.save(path, model, optimizer, extra={"scheduler": scheduler.state_dict()})
    del model, optimizer, scheduler
    model, optimizer, scheduler = _sharded(seed=7)  # other weights, overwritten by the load
    extra = gs.checkpoint.load(path, model, optimizer)
    scheduler.load_state_dict(extra["scheduler"])
    _train(model, optimizer, scheduler, steps[RESUME_AT:], rank, world_size)
    reference = _reference(world_size)
    return max_difference(gs.full_state_dict(model), reference.state_dict())


def test_checkpointing_bf16_accumulation_clipping_scheduler_and_resume_equal_one_process(
    run_ranks, tmp_path
):
    differences = run_ranks(2, _loop_case, str(tmp_path / "checkpoint"), timeout=240)
    assert max(differences) <= 1e-5, differences
