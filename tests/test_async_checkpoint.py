"""Asynchronous checkpoints (issue 44). torch's idiom: ``dcp.async_save`` of
``get_state_dict(model, optimizer)`` on a sharded model stages each rank's pieces into CPU
memory before it returns, so the optimizer steps taken while the write runs never reach the
folder; the folder then loads exactly into groupshard (at the same and another world size)
and into FSDP2. groupshard's own ``gs.checkpoint.async_save``: the same, with a handle whose
``result()`` raises the write's error on every rank."""

from __future__ import annotations

import errno
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import groupshard as gs
from groupshard import comm
from groupshard.checkpoint import background
from test_checkpoint import RESUME_AT, batches, train
from test_torch_state_dict import VectorOffsetGPT, _other_system, _plain_state

from dist_pool import RankPool
from helpers import UNITS, max_difference, three_groups

STEPS_DURING_WRITE = 3


def sharded(rank: int, world_size: int, seed: int = 0):
    """The test model (its offset a vector, as FSDP2 takes no scalar parameter), sharded."""
    torch.manual_seed(seed)
    model = VectorOffsetGPT()
    model = gs.shard(model, three_groups(model, 1e-2), unit=UNITS)
    return model, torch.optim.AdamW(model.optimizer_groups(), lr=3e-3)


def _whole_state(model, optimizer) -> tuple[dict, dict]:
    """Every parameter and optimizer state tensor, whole, by name (collective)."""
    return gs.full_state_dict(model), gs.optim_state_dict(model, optimizer)["state"]


def _difference(found: tuple[dict, dict], expected: tuple[dict, dict]) -> float:
    (model_found, optim_found), (model_expected, optim_expected) = found, expected
    difference = max_difference(model_found, model_expected)
    assert optim_found.keys() == optim_expected.keys()
    for fqn, keys in optim_expected.items():
        for key, value in keys.items():
            found_value = torch.as_tensor(optim_found[fqn][key]).float()
            difference = max(difference, (found_value - torch.as_tensor(value)).abs().max().item())
    return difference


def async_save_case(rank: int, world_size: int, path: str) -> dict[str, float]:
    """Train, ``dcp.async_save`` on a gloo group of its own, train on while it writes, wait;
    then load the folder back with torch's idiom into a model seeded otherwise: how far what
    was loaded is from the state at the call, and how far the live model moved meanwhile."""
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:RESUME_AT], rank, world_size)
    at_save = _whole_state(model, optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    writer_group = dist.new_group(backend="gloo")  # the write's collectives: not training's
    future = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=path,
                            process_group=writer_group)  # fmt: skip
    steps = batches()[RESUME_AT : RESUME_AT + STEPS_DURING_WRITE]
    train(model, optimizer, steps, rank, world_size)  # in place, while the write runs
    moved = _difference(_whole_state(model, optimizer), at_save)
    future.result()
    loaded, loaded_optimizer = sharded(rank, world_size, seed=7)
    gs.checkpoint.load(path, loaded, loaded_optimizer)
    return {"loaded": _difference(_whole_state(loaded, loaded_optimizer), at_save),
            "moved during the write": moved}  # fmt: skip


def load_case(rank: int, world_size: int, path: str) -> tuple[dict, dict]:
    model, optimizer = sharded(rank, world_size, seed=7)
    gs.checkpoint.load(path, model, optimizer)
    return _whole_state(model, optimizer)


def fsdp2_load_case(rank: int, world_size: int, path: str) -> tuple[dict, dict]:
    """FSDP2 loads the folder with torch's idiom: its whole model and optimizer state."""
    model, optimizer = _other_system("fsdp2", seed=7)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    return _plain_state(model, optimizer, no_dist=False)


def test_torchs_async_save_stages_the_state_at_the_call_and_loads_anywhere(run_ranks, tmp_path):
    path = str(tmp_path / "async")
    for result in run_ranks(2, async_save_case, path):
        assert result["moved during the write"] > 1e-3, result  # the steps changed the state
        assert result["loaded"] == 0.0, result  # the folder holds the state at the call
    expected = run_ranks(2, load_case, path)[0]
    assert _difference(run_ranks(3, load_case, path)[0], expected) == 0.0  # another world
    fsdp2 = run_ranks(2, fsdp2_load_case, path)[0]
    assert _difference(fsdp2, expected) == 0.0  # FSDP2 reads what groupshard wrote



def gs_async_case(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """gs.checkpoint.async_save: two saves in a row (the second waits for the first), steps
    taken while they write, the folder loaded back; then a write that finds the device
    full: its error from result() on every rank, the previous checkpoint intact."""
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:RESUME_AT], rank, world_size)
    first = gs.checkpoint.async_save(path, model, optimizer, extra={"step": RESUME_AT})
    staging = {name: buffer.data_ptr() for name, buffer in background._staging[model].items()}
    train(model, optimizer, batches()[RESUME_AT : RESUME_AT + 1], rank, world_size)
    at_second = _whole_state(model, optimizer)
    second = gs.checkpoint.async_save(path, model, optimizer, extra={"step": RESUME_AT + 1})
    first_done = first.done()  # the second save waited for it
    # the same CPU buffers staged both: memory does not grow from one save to the next
    reused = staging == {n: b.data_ptr() for n, b in background._staging[model].items()}
    steps = batches()[RESUME_AT + 1 : RESUME_AT + 1 + STEPS_DURING_WRITE]
    train(model, optimizer, steps, rank, world_size)
    second.result()
    first.result()
    loaded, loaded_optimizer = sharded(rank, world_size, seed=7)
    extra = gs.checkpoint.load(path, loaded, loaded_optimizer)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with mock.patch.object(gs.checkpoint.folders, "write_meta", side_effect=full):
        failing = gs.checkpoint.async_save(path, model, optimizer, extra={"step": 99})
        try:
            failing.result()
            error = "no error"
        except gs.checkpoint.NoSpaceError as caught:
            error = f"{type(caught).__name__}: {caught}"
    denied = PermissionError(errno.EACCES, "Permission denied")  # the folder cannot be put
    with mock.patch.object(gs.checkpoint.folders, "replace", side_effect=denied):
        try:
            gs.checkpoint.async_save(path, model, optimizer, extra={"step": 98}).result()
            unwritable = "no error"
        except RuntimeError as caught:
            unwritable = f"{type(caught).__name__}: {caught}"
    return {
        "first done": first_done, "reused": reused and len(staging) > 0,
        "step": extra["step"], "error": error,
        "unwritable": unwritable,
        "loaded": _difference(_whole_state(loaded, loaded_optimizer), at_second),
        "kept": gs.checkpoint.read_extra(path)["step"],
    }  # fmt: skip


def test_gs_async_save_writes_in_the_background_and_says_when_it_fails(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    for result in run_ranks(2, gs_async_case, path):
        assert result["first done"] and result["step"] == RESUME_AT + 1, result
        assert result["reused"], result
        assert result["loaded"] == 0.0, result  # the state at the second call, exactly
        assert result["error"].startswith("NoSpaceError: "), result  # on every rank
        assert result["unwritable"].startswith(
            f"RuntimeError: Saving the checkpoint {path!r} failed on some rank; the previous "
            "checkpoint there (if any) is intact. Rank 0: "
        ), result
        assert "Permission denied" in result["unwritable"], result
        assert result["kept"] == RESUME_AT + 1, result  # the previous checkpoint stands


def writer_timeout_case(rank: int, world_size: int) -> list:
    default = comm.writer_group(comm.resolve_ranks(None))  # the same ranks, another timeout
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=17))
    writer = comm.writer_group(comm.resolve_ranks(group))
    return [
        comm.group_timeout(group), comm.group_timeout(writer.group), writer.group is group,
        comm.group_timeout(default.group) == comm.group_timeout(dist.group.WORLD),
    ]  # fmt: skip


def test_the_background_writes_group_waits_as_long_as_the_trainings(run_ranks):
    """A write whose peer died fails within the training group's timeout, not torch's
    default 30 minutes (the writer thread would hold the process that long): one writer
    group per training group's ranks and timeout."""
    for result in run_ranks(2, writer_timeout_case):
        assert result == [timedelta(seconds=17), timedelta(seconds=17), False, True], result


def _hang(markers: str, rank: int) -> None:
    """Say this rank has reached the moment, then wait there to be killed."""
    Path(markers, str(rank)).touch()
    time.sleep(600)


def killed_write_case(rank: int, world_size: int, path: str, moment: str, markers: str) -> None:
    """A checkpoint saved at step RESUME_AT, one more step, then an asynchronous save that
    stops at ``moment`` until the test SIGKILLs every rank: while staging; in the background
    write, once the data files are written; or midway through putting the folder in place
    (the previous one moved aside, the new one not yet moved in). Rank 0 leaves both states
    whole in ``markers``/states.pt, for the test to compare the folder with."""
    from groupshard.checkpoint import background, folders

    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:RESUME_AT], rank, world_size)
    gs.checkpoint.save(path, model, optimizer, extra={"step": RESUME_AT})
    before = gs.full_state_dict(model)
    train(model, optimizer, batches()[RESUME_AT : RESUME_AT + 1], rank, world_size)
    after = gs.full_state_dict(model)
    if rank == 0:
        torch.save({"before": before, "after": after}, os.path.join(markers, "states.pt"))
    write_data = folders.FileWriter.write_data

    def written_then_hang(self, plan, planner):
        future = write_data(self, plan, planner)
        future.wait()
        _hang(markers, rank)

    def moved_aside_then_hang(temporary, path, serial):
        os.replace(path, path.with_name(f"{path.name}{folders._PREVIOUS}{serial:06d}-killed"))
        _hang(markers, rank)

    stop = {
        "staging": (background, "_stage", lambda *args: _hang(markers, rank)),
        "data written": (folders.FileWriter, "write_data", written_then_hang),
        "folder moved aside": (folders, "replace", moved_aside_then_hang),
    }
    with mock.patch.object(*stop[moment]):
        handle = gs.checkpoint.async_save(path, model, optimizer, extra={"step": RESUME_AT + 1})
        train(model, optimizer, batches()[RESUME_AT + 1 : RESUME_AT + 2], rank, world_size)
        handle.result()


@pytest.mark.parametrize(
    "moment, hanging_ranks, survivor",
    [
        ("staging", ["0", "1"], "before"),
        ("data written", ["0", "1"], "before"),
        ("folder moved aside", ["0"], "after"),  # the new folder is complete: it is newest
    ],
    ids=["staging", "data-written", "folder-moved-aside"],
)
def test_every_rank_killed_during_an_async_save_leaves_one_whole_checkpoint(
    tmp_path, moment, hanging_ranks, survivor
):
    """SIGKILL of every rank at a moment of gs.checkpoint.async_save: the folder then loads
    (here in one process) as exactly one of the two checkpoints, never a mix, never an
    error: the previous one until the new one is complete, then the new one."""
    path, markers = str(tmp_path / "ckpt"), tmp_path / "markers"
    markers.mkdir()
    pool = RankPool(2)
    try:
        pool.submit(killed_write_case, path, moment, str(markers))
        deadline = time.monotonic() + 120
        while sorted(p.name for p in markers.iterdir() if p.name != "states.pt") != hanging_ranks:
            assert time.monotonic() < deadline, f"no rank reached {moment!r}"
            time.sleep(0.05)
    finally:
        pool.close()  # SIGKILL, every rank at once
    states = torch.load(markers / "states.pt", weights_only=True)
    converted = tmp_path / "converted.pt"
    gs.checkpoint.to_torch_save(path, converted)
    loaded = torch.load(converted, weights_only=True)
    expected = states[survivor]
    assert loaded["extra"]["step"] == RESUME_AT + (survivor == "after")
    assert loaded["model"].keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(loaded["model"][name], value), name
