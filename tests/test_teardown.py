"""Destroying the process group ends its threads while a sharded model and its optimizer
still exist (issue 27: otherwise a gloo worker could outlive the interpreter's shutdown and
abort the process with "terminate called without an active exception")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import groupshard as gs
from groupshard.cli.model import GPT, Block

from helpers import TINY, free_ports, global_batches


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def destroy_case(rank: int, world_size: int, strategy: str, optimizer_name: str) -> dict:
    before = _threads()
    group = dist.new_group(list(range(world_size)), backend="gloo")
    with_group = _threads()
    torch.manual_seed(0)
    model = GPT(TINY)
    if optimizer_name == "muon":
        groups = gs.muon_groups(model, {"lr": 0.02}, {"lr": 1e-3})
    else:
        groups = gs.decay_groups(model, 0.1)
    sharded = gs.shard(model, groups, unit=Block, strategy=strategy, process_group=group)
    optimizer = (
        gs.optim.Muon(sharded.optimizer_groups())
        if optimizer_name == "muon"
        else torch.optim.AdamW(sharded.optimizer_groups(), lr=1e-3)
    )
    for inputs, targets in global_batches(2, world_size):
        sharded(inputs[rank::world_size], targets[rank::world_size]).backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group(group)
    del group  # as a script's own reference would go: the model must not hold it
    after = _threads()
    try:
        gs.full_state_dict(sharded)
        error = ""
    except RuntimeError as raised:
        error = str(raised)
    return {"before": before, "with_group": with_group, "after": after, "error": error}


@pytest.mark.parametrize(("strategy", "optimizer_name"), [("full", "adamw"), ("grad_op", "muon")])
def test_destroy_process_group_joins_its_threads(run_ranks, strategy, optimizer_name):
    for result in run_ranks(2, destroy_case, strategy, optimizer_name):
        assert result["with_group"] > result["before"]  # the group's own gloo threads
        assert result["after"] == result["before"], result
        assert "destroy_process_group" in result["error"]


SCRIPT = """
import gc, os, sys, weakref
import torch
import torch.distributed as dist
from torch import nn
import groupshard as gs

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
model = gs.shard(model, gs.decay_groups(model, 0.1), unit=nn.Linear, strategy="full")
opt = torch.optim.AdamW(model.optimizer_groups(), lr=1e-3)
model(torch.randn(4, 8)).sum().backward()
opt.step()
group = weakref.ref(dist.group.WORLD)
dist.destroy_process_group()
gc.collect()
print("group alive after destroy:", group() is not None)
"""


def test_readme_order_destroy_ends_the_default_group(tmp_path):
    """The README's order (torch, then groupshard, then init_process_group): torch's own
    modules imported later (torch._dynamo, by gs.shard's hooks) must not keep the default
    group alive past destroy_process_group."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    (port,) = free_ports(1)
    result = subprocess.run(
        [sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "group alive after destroy: False" in result.stdout, result.stdout + result.stderr


def dropped_case(rank: int, world_size: int, strategy: str) -> tuple[bool, bool]:
    """A sharded model and its optimizer, trained a step and dropped, are freed: nothing
    keeps them (a gradient hook holding the runtime strongly, on the C++ side where the
    garbage collector cannot see it, kept every sharded model alive)."""
    import gc
    import weakref

    def build_and_train() -> tuple[weakref.ref, weakref.ref]:
        torch.manual_seed(0)
        model = GPT(TINY)
        model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, strategy=strategy)
        optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1e-3)
        inputs, targets = global_batches(1, world_size)[0]
        model(inputs[rank::world_size], targets[rank::world_size]).backward()
        optimizer.step()
        optimizer.zero_grad()
        return weakref.ref(model), weakref.ref(model.groupshard.storages[0].local)

    model, shards = build_and_train()
    gc.collect()
    return model() is None, shards() is None


@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_a_dropped_sharded_model_is_freed(run_ranks, strategy):
    for freed_model, freed_shards in run_ranks(2, dropped_case, strategy):
        assert freed_model and freed_shards
