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


def _threads() -> dict[str, str]:
    """This process's threads: native id -> native name (pt_gloo_runloop, gloo_tcp_loop, ...)."""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                threads[tid] = comm.read().strip()
        except FileNotFoundError:  # ended while listed
            pass
    return threads


def destroy_case(rank: int, world_size: int, strategy: str, optimizer_name: str) -> dict:
    """The threads the new group started, those of them still running right after
    ``destroy_process_group`` returns, and any other thread the training started that is
    still running then (by native id, so that threads of earlier cases that end meanwhile
    in this pooled rank cannot hide or fake one)."""
    before = _threads()
    group = dist.new_group(list(range(world_size)), backend="gloo")
    group_threads = set(_threads()) - set(before)
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
    return {
        "group_threads": len(group_threads),
        "left": {tid: after[tid] for tid in group_threads & set(after)},
        "started": {tid: name for tid, name in after.items() if tid not in before},
        "error": error,
    }


@pytest.mark.parametrize(("strategy", "optimizer_name"), [("full", "adamw"), ("grad_op", "muon")])
def test_destroy_process_group_joins_its_threads(run_ranks, strategy, optimizer_name):
    for result in run_ranks(2, destroy_case, strategy, optimizer_name):
        assert result["group_threads"] == 3, result  # gloo's 2 workers and its device loop
        assert result["left"] == {} and result["started"] == {}, result
        assert "destroy_process_group" in result["error"]


FIRST_MODEL_SCRIPT = """
import gc, sys, weakref
gc.disable()  # the collector runs when it will: off, a cycle it would free stays
door, order = sys.argv[2:]
if order == "groupshard first":  # as isort orders them
    import groupshard as gs
import torch
import torch.distributed as dist
from torch import nn
import groupshard as gs

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
def train():
    group = dist.new_group([0], backend="gloo")
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    if door == "shard":
        model = gs.shard(model, gs.decay_groups(model, 0.1), unit=nn.Linear, process_group=group)
        opt = torch.optim.AdamW(model.optimizer_groups(), lr=1e-3)
    else:
        opt = gs.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=group)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    dist.destroy_process_group(group)
    return weakref.ref(group)
print("group alive after destroy:", train()() is not None)
"""


@pytest.mark.parametrize(
    ("door", "order"), [("shard", "groupshard first"), ("zero", "torch first")]
)
def test_the_first_model_of_a_process_keeps_no_frame_alive(tmp_path, door, order):
    """Issue 51: the first gs.shard or optimizer of a process imported torch._dynamo, whose
    torch.fx.wrap leaves a reference cycle holding every calling frame; the frame that held
    a group kept it, and gloo's threads, past destroy_process_group until the garbage
    collector ran (the suite's teardown test failed about one run in four)."""
    _assert_group_gone_after_destroy(tmp_path, FIRST_MODEL_SCRIPT, door, order)


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
    modules imported later (torch._dynamo, which torch's optimizers import) must not keep
    the default group alive past destroy_process_group."""
    _assert_group_gone_after_destroy(tmp_path, SCRIPT)


def _assert_group_gone_after_destroy(tmp_path, source: str, *args: str) -> None:
    """Run ``source`` as a script of one rank (its port, then ``args``): it must exit 0 and
    print that its group is gone after destroy_process_group."""
    script = tmp_path / "script.py"
    script.write_text(source)
    (port,) = free_ports(1)
    result = subprocess.run(
        [sys.executable, str(script), str(port), *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
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


EXIT_SCRIPT = """
import atexit, os, sys
import torch
import torch.distributed as dist
import groupshard as gs
from groupshard import comm
from groupshard.cli.model import GPT, Block, GPTConfig

port, rank, world_size, ending = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def gloo_threads():
    names = (open(f"/proc/self/task/{task}/comm").read() for task in os.listdir("/proc/self/task"))
    return sum("gloo" in name for name in names)  # pt_gloo_runloop, gloo_tcp_loop
# registered before gs.shard registers groupshard's handler, so it runs after it
atexit.register(lambda: print("at exit:", gloo_threads(), dist.is_initialized(), flush=True))
dist.init_process_group(
    "gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=world_size
)
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, strategy="full")
model = model.to("cpu:0")  # as the Hugging Face Trainer and Lightning move it
opt = torch.optim.AdamW(model.optimizer_groups(), lr=1e-3)
tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))
model(tokens[:, :-1], tokens[:, 1:]).backward()
opt.step()
if ending == "raises":
    raise RuntimeError("the script failed")
if ending == "in_flight":
    started = comm.all_reduce_mean(torch.ones(4), comm.resolve_ranks(), async_op=True)
print("trained with gloo threads:", gloo_threads(), flush=True)
# the model, the optimizer and the process group stay alive: the script ends here
"""


def _run_exit_script(tmp_path, world_size: int, ending: str) -> list[subprocess.CompletedProcess]:
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    (port,) = free_ports(1)
    command = [sys.executable, str(script), str(port)]
    ranks = [
        subprocess.Popen(
            [*command, str(rank), str(world_size), ending],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    results = []
    for process in ranks:
        try:
            stdout, stderr = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for each in ranks:
                each.kill()
            raise
        code = process.returncode
        results.append(subprocess.CompletedProcess(process.args, code, stdout, stderr))
    return results


def _at_exit(result: subprocess.CompletedProcess) -> tuple[int, bool]:
    """The gloo threads still running when the script's exit handler ran, and whether the
    default process group was still initialised."""
    line = next(line for line in result.stdout.splitlines() if line.startswith("at exit:"))
    threads, initialized = line.split()[2:]
    return int(threads), initialized == "True"


def test_a_script_that_ends_without_destroying_the_group_joins_gloo_threads_at_exit(tmp_path):
    """Issue 46: a script (or a Trainer) that leaves the process group alive has groupshard
    destroy it at exit, while Python still runs, so that no gloo thread outlives into the
    interpreter's shutdown (where one releasing a tensor aborts the process)."""
    for result in _run_exit_script(tmp_path, 2, "ends"):
        assert result.returncode == 0, result.stderr
        assert "trained with gloo threads: 3" in result.stdout, result.stdout
        assert _at_exit(result) == (0, False), result.stdout


@pytest.mark.parametrize("ending", ["raises", "in_flight"])
def test_the_group_is_left_alone_at_exit_after_an_error_or_with_a_collective_in_flight(
    tmp_path, ending
):
    """Destroying the group joins its threads; one waiting for a peer that never comes
    would hang the exit of a failed rank until the collective's timeout: left to torch."""
    for result in _run_exit_script(tmp_path, 2, ending):
        assert (result.returncode != 0) == (ending == "raises"), result.stderr
        threads, initialized = _at_exit(result)
        assert initialized and threads > 0, result.stdout
